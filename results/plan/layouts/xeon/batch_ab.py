"""Run as `python batch_ab.py 8 30 4` (and 8 20 2 first). One colocated pdserve server; alternating phases of the steady mix at RATE, with the processes
beside the engine (everything in the server's tree but VLLM::Worker / VLLM::EngineCore) in
SCHED_OTHER or SCHED_BATCH. Usage: batch_ab.py RATE SECONDS ROUNDS"""
import json, os, re, subprocess, sys, tempfile, time
from collections import defaultdict
from pathlib import Path
import psutil
from pdserve.bench.compare import pdserve_server

rate, secs, rounds = float(sys.argv[1]), sys.argv[2], int(sys.argv[3])
REPO = Path("/work/main")
ENGINE = ("VLLM::Worker", "VLLM::EngineCore")

def server_tree():
    me = psutil.Process()
    out = []
    for child in me.children(recursive=True):
        try:
            out.append((child, child.name(), " ".join(child.cmdline())))
        except psutil.Error:
            pass
    return out

def set_policy(policy):
    n = 0
    for p, name, cmd in server_tree():
        if any(k in name or k in cmd for k in ENGINE) or "bench run" in cmd:
            continue
        try:
            for t in p.threads():
                try:
                    os.sched_setscheduler(t.id, policy, os.sched_param(0)); n += 1
                except OSError:
                    pass
        except psutil.Error:
            pass
    return n

def engine_invol():
    tot = 0
    for p, name, cmd in server_tree():
        if "VLLM::Worker" in name or "VLLM::Worker" in cmd:
            tot += p.num_ctx_switches().involuntary
    return tot

def run(url, tag, i):
    out = f"/tmp/batch/run-{tag}-{i}"
    c0, t0 = engine_invol(), time.monotonic()
    r = subprocess.run([str(REPO/".venv/bin/pdserve"), "bench", "run", "--url", url, "--prompt-len", "128", "--output-len", "64", "--rate", str(rate), "--duration-s", secs, "--seed", str(i), "--out", out], capture_output=True, text=True)
    inv = (engine_invol() - c0) / (time.monotonic() - t0)
    lines = [l for l in r.stdout.splitlines() if re.search("TTFT|TPOT|ITL", l)]
    return {"policy": tag, "round": i, "worker_invol_per_s": round(inv), "summary": lines, "rc": r.returncode, "stderr": r.stderr[-500:] if r.returncode else ""}

with tempfile.TemporaryDirectory() as work:
    with pdserve_server(REPO / "deploy/config/local-cpu-colocated.yaml", Path(work)) as url:
        results = []
        for i in range(rounds):
            order = [("other", os.SCHED_OTHER), ("batch", os.SCHED_BATCH)]
            if i % 2: order.reverse()
            for tag, pol in order:
                n = set_policy(pol)
                res = run(url, tag, i); res["threads_set"] = n
                print(json.dumps(res), flush=True); results.append(res)
        set_policy(os.SCHED_OTHER)
