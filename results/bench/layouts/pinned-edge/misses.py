"""Which half of DistServe's SLO each request missed, per run:
`python misses.py r*/records.jsonl.xz`."""

import collections
import json
import lzma
import sys

TTFT_S, TPOT_S = 1.0, 0.080

for path in sys.argv[1:]:
    runs = collections.defaultdict(collections.Counter)
    with lzma.open(path, "rt") as lines:
        for line in lines:
            record = json.loads(line)
            times = record["token_times_s"]
            if not times:
                runs[record["run"]]["no token"] += 1
                continue
            ttft = times[0] - record["sent_s"]
            tpot = (times[-1] - times[0]) / max(1, len(times) - 1)
            late, slow = ttft > TTFT_S, tpot > TPOT_S
            kind = {(0, 0): "within", (1, 0): "TTFT", (0, 1): "TPOT", (1, 1): "both"}
            runs[record["run"]][kind[late, slow]] += 1
    for run, counts in runs.items():
        print(path.split("/")[0], run, dict(sorted(counts.items())))
