"""Who takes the engine's cores under steady load: every process's CPU seconds and context
switches (voluntary = it slept and woke; involuntary = it was preempted) over one bench run
(128 -> 64 at a fixed rate), grouped by what the process is.

Usage: wakeups.py SYSTEM RATE   (SYSTEM: vllm, colocated, split)
"""

import argparse
import json
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import psutil

from pdserve.bench.compare import pdserve_server, plain_vllm_server
from pdserve.serve import resolve_model
from pdserve_core.config import PDServeConfig

REPO = Path(__file__).resolve().parents[4]
KINDS = (
    "VLLM::Worker",
    "VLLM::EngineCore",
    "ray::",
    "raylet",
    "gcs_server",
    "dashboard",
    "log_monitor",
    "runtime_env",
    "monitor.py",
)


def kind(p):
    try:
        name, cmd = p.name(), " ".join(p.cmdline())
    except psutil.Error:
        return None
    if "bench run" in cmd:
        return None  # the client is not the server's
    if "pdserve.cli serve" in cmd or "pdserve serve" in cmd:
        return "router (pdserve serve)"
    if "api_server" in cmd or "vllm serve" in cmd:
        return "vLLM API server"
    for key in KINDS:
        if key in name or key in cmd:
            return key
    return name


def switches(pid):
    """Context switches summed over every thread of the process (/proc/PID/status counts the
    main thread's alone)."""
    vol = inv = 0
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            for line in (task / "status").read_text().splitlines():
                if line.startswith("voluntary_ctxt_switches"):
                    vol += int(line.split()[1])
                elif line.startswith("nonvoluntary_ctxt_switches"):
                    inv += int(line.split()[1])
        except OSError:
            pass
    return vol, inv


def snap():
    out = {}
    for p in psutil.process_iter():
        try:
            t = p.cpu_times()
            out[p.pid] = (kind(p), t.user + t.system, *switches(p.pid))
        except (psutil.Error, OSError):
            pass
    return out


def bench_run(url, rate, out):
    """`pdserve bench run`: 30 s of the steady mix (128 -> 64) at `rate`, its report in `out`."""
    command = [str(REPO / ".venv/bin/pdserve"), "bench", "run", "--url", url]
    command += ["--prompt-len", "128", "--output-len", "64", "--rate", str(rate)]
    command += ["--duration-s", "30", "--out", str(out)]
    subprocess.run(command, check=True, capture_output=True)


def measure(system, url, rate, out):
    before, t0 = snap(), time.monotonic()
    bench_run(url, rate, out)
    after, wall = snap(), time.monotonic() - t0
    use = defaultdict(lambda: [0.0, 0, 0])
    for pid, (k, cpu, vol, inv) in after.items():
        if k is None:
            continue
        b = before.get(pid, (k, 0.0, 0, 0))
        use[k][0] += cpu - b[1]
        use[k][1] += vol - b[2]
        use[k][2] += inv - b[3]
    summary = json.loads((out / "results.json").read_text())
    rows = {
        k: {
            "cores": round(v[0] / wall, 3),
            "wakeups_per_s": round(v[1] / wall, 1),
            "preempted_per_s": round(v[2] / wall, 1),
        }
        for k, v in sorted(use.items(), key=lambda kv: -kv[1][0])
        if v[0] / wall > 0.002 or v[1] / wall > 5
    }
    print(
        json.dumps(
            {
                "system": system,
                "rate": rate,
                "wall_s": round(wall, 1),
                "processes": rows,
                "results": summary,
            },
            indent=1,
        )
    )


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("system", choices=("vllm", "colocated", "split"))
    ap.add_argument("rate", type=float)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as work:
        out = Path(work) / "bench"
        if args.system == "vllm":
            model = resolve_model(PDServeConfig())
            with plain_vllm_server(model, model.name, Path(work)) as url:
                measure(args.system, url, args.rate, out)
        else:
            cfg = REPO / (
                "deploy/config/local-cpu-colocated.yaml"
                if args.system == "colocated"
                else "deploy/config/local-cpu.yaml"
            )
            with pdserve_server(cfg, Path(work)) as url:
                measure(args.system, url, args.rate, out)


if __name__ == "__main__":
    sys.exit(main())
