"""Default 1P1D server; interference traffic with a long prompt every LONG_EVERY s for SECS s;
py-spy records the decode node's worker and engine core throughout. Usage: stall_repro.py SECS LONG_EVERY RATE TAG"""
import json, subprocess, sys, tempfile, time, lzma
from pathlib import Path
import psutil
from pdserve.bench.compare import pdserve_server

secs, every, rate, tag = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4]
REPO = Path("/work/main"); OUT = Path(f"/tmp/batch/{tag}"); OUT.mkdir(exist_ok=True)

def procs():
    found = []
    for p in psutil.Process().children(recursive=True):
        try:
            name, cmd = p.name(), " ".join(p.cmdline())
            if "VLLM::Worker" in name + cmd or "VLLM::EngineCore" in name + cmd or "ray::" in name + cmd:
                found.append((p.pid, name, cmd[:60], p.cpu_affinity()))
        except psutil.Error:
            pass
    return found

with tempfile.TemporaryDirectory() as work:
    with pdserve_server(None, Path(work)) as url:
        ps = procs()
        print(json.dumps(ps), flush=True)
        spies = []
        for pid, name, cmd, aff in ps:
            spies.append(subprocess.Popen([str(REPO/".venv/bin/py-spy"), "record", "--pid", str(pid), "--rate", "100", "--threads", "--idle", "--nonblocking", "--format", "speedscope", "--output", str(OUT/f"spy-{pid}.json"), "--duration", str(int(secs) + 40)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        t0 = time.time()
        r = subprocess.run([str(REPO/".venv/bin/pdserve"), "bench", "run", "--url", url, "--workload", "interference", "--prompt-len", "64", "--output-len", "128", "--long-prompt-len", "1536", "--long-output-len", "16", "--long-every-s", every, "--rate", rate, "--duration-s", secs, "--out", str(OUT/"bench")], capture_output=True, text=True)
        print("bench rc", r.returncode, "t0", t0, flush=True)
        for s in spies: s.terminate()
        for s in spies: s.wait()
