"""TTFT over turns >= 2 pooled over the four rounds, per system (the rounds' records), of this
folder or of the folder named: `python pooled.py [FOLDER]`."""

import json
import lzma
import statistics
import sys
from pathlib import Path

here = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).parent
pooled: dict[str, list[float]] = {}
for folder in sorted(here.glob("colocated*")):
    with lzma.open(folder / "records.jsonl.xz", "rt") as records:
        for line in records:
            record = json.loads(line)
            if record["kind"] != "turn1" and record["token_times_s"]:
                ttft = record["token_times_s"][0] - record["sent_s"]
                pooled.setdefault(record["run"], []).append(ttft * 1000)
for system, ttfts in sorted(pooled.items()):
    ttfts.sort()
    p90 = ttfts[int(0.9 * len(ttfts))]
    p50 = statistics.median(ttfts)
    print(f"{system}: {len(ttfts)} later turns, TTFT p50 {p50:.0f} ms, p90 {p90:.0f} ms")
