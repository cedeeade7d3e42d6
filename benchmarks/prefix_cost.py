"""What prefix-aware routing costs the router per request (router/decides/prefixes.py): hashing a
prompt's blocks, looking it up on each node, recording it and its answer — on one core, with
the record full (4096 blocks per node), for the sweep's and the multi-turn benchmark's prompts.

    python benchmarks/prefix_cost.py [--nodes 2] [--repeat 200]

Prints one row per (prompt tokens, block size): microseconds per request. Compare with the
router's whole overhead per request against plain vLLM (+17–22 ms TTFT in the sweep).
"""

from __future__ import annotations

import argparse
import random
import time
from types import SimpleNamespace

from router.decides.prefixes import NodePrefixes, Prefix


def per_request_us(tokens: int, block_size: int, nodes: int, repeat: int) -> float:
    rng = random.Random(0)
    infos = [SimpleNamespace(block_size=block_size, num_blocks=4096) for _ in range(nodes)]
    records = [NodePrefixes() for _ in range(nodes)]
    for info, record in zip(infos, records, strict=True):  # a full record: evictions happen
        while len(record) < 4096:
            record.record(info, Prefix([rng.randrange(49152) for _ in range(2048)]))
    prompts = [[rng.randrange(49152) for _ in range(tokens)] for _ in range(repeat)]
    answer = list(range(64))
    start = time.perf_counter()
    for prompt in prompts:  # what dispatch does for one request
        prefix = Prefix(prompt)
        held = [r.cached_tokens(i, prefix) for i, r in zip(infos, records, strict=True)]
        chosen = held.index(max(held))
        records[chosen].record(infos[chosen], prefix)
        records[chosen].record(infos[chosen], prefix.extended(answer))
    return (time.perf_counter() - start) / repeat * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, default=2, help="nodes looked up per request")
    parser.add_argument("--repeat", type=int, default=200, help="requests per row")
    args = parser.parse_args()
    print("| prompt tokens | block size | µs per request |")
    print("|---|---|---|")
    for tokens in (128, 832, 1536):
        for block_size in (32, 128):
            us = per_request_us(tokens, block_size, args.nodes, args.repeat)
            print(f"| {tokens} | {block_size} | {us:.0f} |")


if __name__ == "__main__":
    main()
