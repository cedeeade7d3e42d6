"""wakeups.py with two additions: the CPU steal the host saw during the run (/proc/stat) and
system `vllm-stats`, plain vLLM without `--disable-log-stats` (its stats on, as `vllm serve` runs
by default). Usage: wakeups2.py SYSTEM RATE [SECONDS]"""
import json, subprocess, sys, tempfile, time
from collections import defaultdict
from pathlib import Path
import psutil
from pdserve.bench.compare import pdserve_server, plain_vllm_server
from pdserve.serve import resolve_model
from pdserve_core.config import PDServeConfig

system, rate = sys.argv[1], float(sys.argv[2])
secs = sys.argv[3] if len(sys.argv) > 3 else "30"
REPO = Path("/work/main")

def kind(p):
    try:
        name, cmd = p.name(), " ".join(p.cmdline())
    except psutil.Error:
        return None
    if "bench run" in cmd: return "bench client"
    if "pdserve.cli serve" in cmd or "pdserve serve" in cmd: return "router"
    if "api_server" in cmd: return "vLLM API server"
    for key in ("VLLM::Worker", "VLLM::EngineCore", "ray::", "raylet", "gcs_server", "dashboard", "log_monitor", "runtime_env", "monitor.py"):
        if key in name or key in cmd: return key
    return name

def snap():
    out = {}
    for p in psutil.process_iter():
        try:
            t = p.cpu_times(); c = p.num_ctx_switches()
            th = sum(1 for _ in p.threads())
            out[p.pid] = (kind(p), t.user + t.system, c.voluntary, c.involuntary, th)
        except psutil.Error:
            pass
    return out

def steal():
    return {l.split()[0]: int(l.split()[8]) for l in open("/proc/stat") if l.startswith("cpu")}

def measure(url):
    st0 = steal()
    before, t0 = snap(), time.monotonic()
    r = subprocess.run([str(REPO/".venv/bin/pdserve"), "bench", "run", "--url", url, "--prompt-len", "128", "--output-len", "64", "--rate", str(rate), "--duration-s", secs, "--out", f"/tmp/cpu/{system}"], capture_output=True, text=True)
    after, wall = snap(), time.monotonic() - t0
    st1 = steal(); stolen = {k: round((st1[k]-st0[k])/100/wall, 4) for k in st1}
    use = defaultdict(lambda: [0.0, 0, 0, 0])
    for pid, (k, t, v, i, th) in after.items():
        if k is None: continue
        b = before.get(pid, (k, 0.0, 0, 0, 0))
        u = use[k]; u[0] += t - b[1]; u[1] += v - b[2]; u[2] += i - b[3]; u[3] += th
    rows = {k: {"cores": round(u[0]/wall, 3), "vol_cs_per_s": round(u[1]/wall), "invol_cs_per_s": round(u[2]/wall), "threads": u[3]} for k, u in sorted(use.items(), key=lambda kv: -kv[1][0]) if u[0]/wall > 0.002 or u[1]/wall > 20}
    summary = [l for l in r.stdout.splitlines() if "ITL" in l or "TTFT" in l or "TPOT" in l][:6]
    print(json.dumps({"system": system, "rate": rate, "wall_s": round(wall,1), "procs": rows, "bench": summary, "rc": r.returncode, "steal_share": stolen}, indent=1))

import pdserve.bench.compare as C
if system == "vllm-stats":
    _launch = C.launch
    def launch(command, *a, **k):
        return _launch([c for c in command if c != "--disable-log-stats"], *a, **k)
    C.launch = launch
with tempfile.TemporaryDirectory() as work:
    if system.startswith("vllm"):
        model = resolve_model(PDServeConfig())
        with C.plain_vllm_server(model, model.name, Path(work)) as url:
            measure(url)
    else:
        cfg = REPO / ("deploy/config/local-cpu-colocated.yaml" if system == "colocated" else "deploy/config/local-cpu.yaml")
        with pdserve_server(cfg, Path(work)) as url:
            measure(url)
