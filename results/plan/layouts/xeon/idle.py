"""Idle CPU and wake-ups of pdserve's processes (default 1P1D), no traffic, 20 s."""
import json, os, sys, tempfile, time
from collections import defaultdict
from pathlib import Path
import psutil
from pdserve.bench.compare import pdserve_server
def kind(p):
    try: cmd = " ".join(p.cmdline()); name = p.name()
    except psutil.Error: return None
    if "pdserve.cli serve" in cmd: return "router"
    if cmd.startswith("ray::"): return "ray actors"
    if "VLLM::" in name or "VLLM::" in cmd: return "engines"
    for k in ("raylet", "gcs_server", "log_monitor"):
        if k in cmd: return "ray daemons"
    return None
def snap():
    out = {}
    for p in psutil.process_iter():
        k = kind(p)
        if k is None: continue
        try:
            t = p.cpu_times(); c = p.num_ctx_switches(); out[p.pid] = (k, t.user + t.system, c.voluntary)
        except psutil.Error: pass
    return out
with tempfile.TemporaryDirectory() as work:
    with pdserve_server(None, Path(work)) as url:
        time.sleep(10)
        a, t0 = snap(), time.monotonic(); time.sleep(20); b, wall = snap(), time.monotonic() - t0
        use = defaultdict(lambda: [0.0, 0])
        for pid, (k, t, v) in b.items():
            x = a.get(pid, (k, t, v)); use[k][0] += t - x[1]; use[k][1] += v - x[2]
        print(json.dumps({k: {"cpu_ms_per_s": round(1000 * u[0] / wall, 1), "wakeups_per_s": round(u[1] / wall)} for k, u in sorted(use.items())}))
