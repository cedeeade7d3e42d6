"""One colocated pdserve server; 30 s of the steady mix (128 -> 64) at a fixed rate, run after run,
alternating the scheduling class of the EngineCore's gloo loop threads (SCHED_OTHER as they start,
SCHED_IDLE) with `chrt` from outside. Usage: idle_ab.py RATE PAIRS [CONFIG]"""

import json
import subprocess
import sys
import tempfile
from pathlib import Path

import psutil
from wakeups import REPO, bench_run  # this folder's

from pdserve.bench.compare import pdserve_server


def gloo_threads():
    for p in psutil.process_iter():
        try:
            if "VLLM::EngineCore" not in p.name():
                continue
        except psutil.Error:
            continue
        for task in Path(f"/proc/{p.pid}/task").iterdir():
            if (task / "comm").read_text().strip() == "gloo_tcp_loop":
                yield int(task.name)


def set_class(idle):
    tids = list(gloo_threads())
    for tid in tids:
        flag = ["--idle"] if idle else ["--other"]
        subprocess.run(["chrt", *flag, "-p", "0", str(tid)], check=True)
    return len(tids)


def bench(url, rate, out):
    bench_run(url, rate, out)
    run = json.loads((out / "results.json").read_text())["runs"]["run"]
    return {
        "goodput": round(run["goodput"], 3),
        "ttft_p50_ms": round(run["ttft_s"]["p50"] * 1e3, 1),
        "itl_p50_ms": round(run["itl_s"]["p50"] * 1e3, 1),
        "tpot_p50_ms": round(run["tpot_s"]["p50"] * 1e3, 1),
        "tpot_p90_ms": round(run["tpot_s"]["p90"] * 1e3, 1),
    }


def main():
    rate, pairs = float(sys.argv[1]), int(sys.argv[2])
    config = (
        Path(sys.argv[3]) if len(sys.argv) > 3 else REPO / "deploy/config/local-cpu-colocated.yaml"
    )
    with tempfile.TemporaryDirectory() as work, pdserve_server(config, Path(work)) as url:
        for i in range(pairs):
            for idle in (False, True) if i % 2 == 0 else (True, False):
                n = set_class(idle)
                row = {
                    "pair": i,
                    "gloo_threads": n,
                    "class": "idle" if idle else "other",
                    **bench(url, rate, Path(work) / f"run-{i}-{idle}"),
                }
                print(json.dumps(row), flush=True)


if __name__ == "__main__":
    sys.exit(main())
