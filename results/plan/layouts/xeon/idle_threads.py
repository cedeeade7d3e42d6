import os, sys, tempfile, time
from collections import defaultdict
from pathlib import Path
import psutil
from pdserve.bench.compare import pdserve_server
cfg = sys.argv[1] if len(sys.argv) > 1 else None
def procs():
    out = {}
    for p in psutil.process_iter():
        try: cmd = " ".join(p.cmdline())
        except psutil.Error: continue
        if "api_server" in cmd or cmd.startswith("ray::") or "pdserve.cli serve" in cmd or "VLLM::" in cmd or "VLLM" in p.name(): out[p.pid] = (p.name() + " " + cmd)[:40]
    return out
def snap(ps):
    out = {}
    for pid, k in ps.items():
        try: tids = os.listdir(f"/proc/{pid}/task")
        except FileNotFoundError: continue
        for tid in tids:
            try:
                comm = open(f"/proc/{pid}/task/{tid}/comm").read().strip()
                st = dict(l.split(":\t") for l in open(f"/proc/{pid}/task/{tid}/status").read().splitlines() if ":\t" in l)
                out[(k, pid, comm, tid)] = int(st["voluntary_ctxt_switches"]) + int(st["nonvoluntary_ctxt_switches"])
            except (FileNotFoundError, ProcessLookupError): pass
    return out
with tempfile.TemporaryDirectory() as work:
    from pdserve.bench.compare import plain_vllm_server
    from pdserve.serve import resolve_model
    from pdserve_core.config import PDServeConfig
    model = resolve_model(PDServeConfig())
    ctx = plain_vllm_server(model, model.name, Path(work)) if cfg == "vllm" else pdserve_server(Path(cfg) if cfg else None, Path(work))
    with ctx as url:
        time.sleep(8)
        ps = procs(); a = snap(ps); time.sleep(10); b = snap(ps)
        rows = sorted(((v - a.get(k, v)) / 10, k) for k, v in b.items())
        from collections import Counter
        agg = defaultdict(lambda: [0, 0.0])
        for r, k in rows:
            a_ = agg[(k[0], k[1], k[2])]; a_[0] += 1; a_[1] += r
        for (n, pid, comm), (cnt, r) in sorted(agg.items(), key=lambda kv: -kv[1][1])[:14]:
            print(f"{r:8.1f}/s  {cnt:3d} threads  {n:40s} pid {pid} {comm}")
