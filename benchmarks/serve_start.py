"""How long `pdserve serve` takes to serve, and where the time goes, for two source trees side by
side (a commit against the one before it).

    git worktree add /tmp/pdserve-before HEAD~1
    python benchmarks/serve_start.py --trees before=/tmp/pdserve-before after=. \
        --layouts 1p1d colocated-2 --rounds 3 --out results/bench/serve-start

Each round starts every layout from every tree, one server at a time, the trees' order reversed
from one round to the next. A server runs its tree's code (`PYTHONPATH`, which Ray hands to the
engines' and the routers' processes), with this venv's packages. For each start: the seconds
from launch to the ready file; when Ray, the engines and the routers got there (read from the
server's log, against the launch's wall clock); one greedy answer (the same text is required
of every tree); the seconds SIGTERM takes, and that no process of the server's is left.
Prints, and writes to OUT/results.json and OUT/results.md, each start and each tree's median.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path

import httpx
import psutil

LAYOUTS = {
    "1p1d": (),  # the defaults: 1P1D, one router
    "colocated-2": ("--set", "mode=colocated", "--routers", "2"),
    "1p1d-2": ("--routers", "2"),
}
"""Layout name -> `pdserve serve` arguments."""

MARKS = {
    "ray": r"started a local Ray",
    "engines": r"engine \S+ up in",  # the last engine's line
    "routers imported": r"router \d: .*(Triton is installed, but|vllm)",  # the first import log
    "ready": r"pdserve ready in",
}
"""Phase -> the log line that marks it (its last occurrence, the routers' first)."""
STAMP = re.compile(r"(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3})")
START_TIMEOUT_S = 300


def _marks(log: str, launched: float) -> dict[str, float]:
    """Each phase's second after the launch, from the log lines' own time stamps."""
    found: dict[str, float] = {}
    for line in log.splitlines():
        stamp = STAMP.search(line)
        if not stamp:
            continue
        at = datetime.strptime(stamp.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp() - launched
        for mark, pattern in MARKS.items():
            if re.search(pattern, line) and not (mark == "routers imported" and mark in found):
                found[mark] = round(at, 2)
    return found


def start_once(tree: Path, layout: str, work: Path) -> dict:
    ready, log_path = work / "ready.json", work / "serve.log"
    command = [sys.executable, "-m", "pdserve.cli", "serve", "--port", "0", "--grpc-port", "0"]
    command += ["--ready-file", str(ready), *LAYOUTS[layout]]
    env = dict(os.environ, PYTHONPATH=str(tree), VLLM_RPC_BASE_PATH=str(work))
    launched_wall, launched = time.time(), time.monotonic()
    with log_path.open("w") as log:
        process = subprocess.Popen(
            command, cwd=tree, env=env, stdout=log, stderr=subprocess.STDOUT, process_group=0
        )
    try:
        deadline = launched + START_TIMEOUT_S
        while not (ready.exists() and ready.read_text()):
            if process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"{tree} {layout}: no start; {log_path.read_text()[-3000:]}")
            time.sleep(0.05)
        ready_s = time.monotonic() - launched
        url = json.loads(ready.read_text())["http"]
        model = httpx.get(f"{url}/v1/models", timeout=30).json()["data"][0]["id"]
        body = {"model": model, "prompt": "The capital of France is", "max_tokens": 16}
        answer = httpx.post(f"{url}/v1/completions", json={**body, "temperature": 0}, timeout=120)
        answer.raise_for_status()
        text = answer.json()["choices"][0]["text"]
    finally:
        alive = process.poll() is None
        tree_processes = psutil.Process(process.pid).children(recursive=True) if alive else []
        stopping = time.monotonic()
        process.send_signal(signal.SIGTERM)
        code = process.wait(timeout=120)
        stop_s = time.monotonic() - stopping
        _, alive = psutil.wait_procs(tree_processes, timeout=60)
        for left in alive:
            left.kill()
    return {
        "ready_s": round(ready_s, 2),
        "marks": _marks(log_path.read_text(), launched_wall),
        "text": text,
        "stop_s": round(stop_s, 2),
        "exit": code,
        "left": len(alive),
    }


def _median(starts: list[dict], key: str) -> float | None:
    values = [s[key] if key == "ready_s" else s["marks"].get(key) for s in starts]
    values = [v for v in values if v is not None]
    return round(statistics.median(values), 2) if values else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trees", nargs="+", required=True, help="NAME=PATH, two or more")
    parser.add_argument("--layouts", nargs="+", default=["1p1d", "colocated-2"], choices=LAYOUTS)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    trees = dict(item.split("=", 1) for item in args.trees)
    trees = {name: Path(path).resolve() for name, path in trees.items()}
    starts: list[dict] = []
    for round_ in range(args.rounds):
        order = list(trees) if round_ % 2 == 0 else list(reversed(trees))
        for layout in args.layouts:
            for name in order:
                work = Path(tempfile.mkdtemp(prefix=f"serve-start-{name}-"))
                start = {"round": round_, "layout": layout, "tree": name}
                start.update(start_once(trees[name], layout, work))
                starts.append(start)
                print(json.dumps(start), flush=True)
    rows = []
    for layout in args.layouts:
        texts = {s["text"] for s in starts if s["layout"] == layout}
        for name in trees:
            mine = [s for s in starts if s["layout"] == layout and s["tree"] == name]
            rows.append(
                {
                    "layout": layout,
                    "tree": name,
                    "starts": len(mine),
                    "ready_s": _median(mine, "ready_s"),
                    **{mark: _median(mine, mark) for mark in MARKS},
                    "stop_s": round(statistics.median(s["stop_s"] for s in mine), 2),
                    "clean": all(s["exit"] == 0 and s["left"] == 0 for s in mine),
                    "same_text": len(texts) == 1,
                }
            )
    header = ["layout", "tree", "starts", "ready_s", *MARKS, "stop_s", "clean", "same_text"]
    table = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    table += ["| " + " | ".join(str(row[h]) for h in header) + " |" for row in rows]
    print("\n".join(table))
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "results.json").write_text(json.dumps({"starts": starts, "medians": rows}))
        medians = "Medians (seconds after the launch; phases from the server's log):\n\n"
        (args.out / "results.md").write_text(medians + "\n".join(table) + "\n")


if __name__ == "__main__":
    main()
