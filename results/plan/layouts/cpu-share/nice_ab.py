"""A/B on one colocated server: bench at RATE with every process beside the engine at nice 0,
then reniced to 19 (router, Ray's processes, the actor), then back; ITL/TPOT p50 of each."""
import json, subprocess, sys, tempfile, os
from pathlib import Path
import psutil
from pdserve.bench.compare import pdserve_server

rate = sys.argv[1]
REPO = Path("/work/main")

def beside_engine(root):
    out = []
    for p in psutil.process_iter():
        try:
            name, cmd = p.name(), " ".join(p.cmdline())
        except psutil.Error:
            continue
        if "VLLM::Worker" in name or "VLLM::EngineCore" in name or "VLLM::" in cmd[:20]:
            continue
        if p.pid == os.getpid() or "bench" in cmd or p.username() != "root":
            continue
        if "ray" in cmd or "pdserve.cli serve" in cmd or name.startswith("ray::") or "gcs_server" in cmd or "raylet" in cmd:
            out.append(p)
    return out

def bench(url, label):
    subprocess.run([str(REPO/".venv/bin/pdserve"), "bench", "run", "--url", url, "--prompt-len", "128", "--output-len", "64", "--rate", rate, "--duration-s", "30", "--seed", "1", "--out", f"/tmp/cpu/ab-{label}"], check=True, capture_output=True)
    r = json.load(open(f"/tmp/cpu/ab-{label}/results.json")); run = list(r["runs"].values())[0]
    print(label, "itl p50 %.1f ms, tpot p50 %.1f ms, ttft p50 %.0f ms, goodput %.2f" % (run["itl_s"]["p50"]*1e3, run["tpot_s"]["p50"]*1e3, run["ttft_s"]["p50"]*1e3, run["goodput"]), flush=True)

with tempfile.TemporaryDirectory() as work:
    with pdserve_server(REPO / "deploy/config/local-cpu-colocated.yaml", Path(work)) as url:
        procs = beside_engine(None)
        print("reniced:", sorted({p.name() for p in procs}), flush=True)
        for round_ in (1, 2):
            for p in procs: p.nice(0)
            bench(url, f"nice0-{round_}")
            for p in procs: p.nice(19)
            bench(url, f"nice19-{round_}")
        for p in procs: p.nice(0)
