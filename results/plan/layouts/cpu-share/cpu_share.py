"""Where a serving system's CPU goes under steady load: every process's CPU seconds during one
bench run (128 -> 64 at a fixed rate), grouped by what it is. Usage: cpu_share.py SYSTEM RATE"""
import json, subprocess, sys, tempfile, time
from collections import defaultdict
from pathlib import Path
import psutil
from pdserve.bench.compare import pdserve_server, plain_vllm_server
from pdserve.serve import resolve_model
from pdserve_core.config import PDServeConfig

system, rate = sys.argv[1], float(sys.argv[2])
REPO = Path("/work/main")

def kind(p):
    try:
        name, cmd = p.name(), " ".join(p.cmdline())
    except psutil.Error:
        return None
    if "bench run" in cmd: return "bench client"
    if "pdserve.cli serve" in cmd: return "router (pdserve serve)"
    if "api_server" in cmd: return "vLLM API server"
    for key in ("VLLM::Worker", "VLLM::EngineCore", "ray::", "raylet", "gcs_server", "dashboard", "log_monitor", "runtime_env", "monitor.py"):
        if key in name or key in cmd: return key
    return name

def snap():
    out = {}
    for p in psutil.process_iter():
        try:
            t = p.cpu_times(); out[p.pid] = (kind(p), t.user + t.system)
        except psutil.Error:
            pass
    return out

def measure(url):
    before, t0 = snap(), time.monotonic()
    subprocess.run([str(REPO/".venv/bin/pdserve"), "bench", "run", "--url", url, "--prompt-len", "128", "--output-len", "64", "--rate", str(rate), "--duration-s", "30", "--out", f"/tmp/cpu/{system}"], check=True, capture_output=True)
    after, wall = snap(), time.monotonic() - t0
    use = defaultdict(float)
    for pid, (k, t) in after.items():
        if k is None: continue
        use[k] += t - before.get(pid, (k, 0.0))[1]
    print(json.dumps({"system": system, "rate": rate, "wall_s": wall, "cores_used": {k: round(v / wall, 3) for k, v in sorted(use.items(), key=lambda kv: -kv[1]) if v / wall > 0.005}}, indent=1))

with tempfile.TemporaryDirectory() as work:
    if system == "vllm":
        model = resolve_model(PDServeConfig())
        with plain_vllm_server(model, model.name, Path(work)) as url:
            measure(url)
    else:
        cfg = REPO / ("deploy/config/local-cpu-colocated.yaml" if system == "colocated" else "deploy/config/local-cpu.yaml")
        with pdserve_server(cfg, Path(work)) as url:
            measure(url)
