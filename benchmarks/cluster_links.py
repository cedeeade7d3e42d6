"""pdserve on four emulated hosts (`pdserve hosts`; root): the hand-over gap as the KV grows on a
shaped link, and how soon streams continue when a decode host's cable is pulled.

The cluster is the test suite's (tests/e2e/hosts.py: Ray from the launcher file's commands,
deploy/config/cluster-cpu.yaml, every prompt prefilled on the prefill host), in float32 by
default (--dtype): on a CPU without AVX-512 a one-thread bf16 engine prefills ~45 tokens/s, and
float32's KV is twice the bytes, which is what the link has to carry.
1. Hand-over gap (the router's `pdserve_handover_gap_seconds`: the prefill's end to the decode
   host's first token, which includes the KV pull) for prompts of --lengths tokens (random token
   ids, so no prefix cache helps), --per-length requests each, one at a time; with the prefill
   host's link shaped to --rate and unshaped.
2. --cuts times: two streams, one per decode host; the busier host's cable is pulled, and the
   longest pause of the streams (the resume) and the time until the host rejoins once its cable
   is back are recorded.
    python benchmarks/cluster_links.py [--rate 1gbit] [--per-length 3] [--cuts 4]
        [--transport tcp|nixl] [--prefetch-mib N]
Prints the figures and writes results/cluster_links.json.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tests.e2e.conftest import metric  # noqa: E402
from tests.e2e.hosts import bring_up, hosts_up, tear_down, wait_for  # noqa: E402
from tests.e2e.test_hosts import healthy, nodes, start_streams  # noqa: E402

GAP = "pdserve_handover_gap_seconds"


def handover_gap(cluster, length: int, rng: random.Random) -> float:
    """One request of `length` prompt tokens; its hand-over gap from the router's histogram."""
    before = metric(cluster.server, f"{GAP}_sum"), metric(cluster.server, f"{GAP}_count")
    prompt = [rng.randrange(1000, 40000) for _ in range(length)]
    body = {"model": cluster.server.model, "prompt": prompt, "max_tokens": 4, "temperature": 0,
            "ignore_eos": True}  # fmt: skip
    answer = httpx.post(f"{cluster.server.url}/v1/completions", json=body,
                        headers=cluster.server.headers, timeout=300)  # fmt: skip
    answer.raise_for_status()
    after = metric(cluster.server, f"{GAP}_sum"), metric(cluster.server, f"{GAP}_count")
    assert after[1] == before[1] + 1, "one hand-over per request"
    return after[0] - before[0]


def total(cluster, name: str, **labels: str) -> float:
    """A counter summed over every node of the router's /metrics."""
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"{cluster.server.url}/metrics", headers=cluster.server.headers).text
    return sum(sample.value for family in text_string_to_metric_families(text)
               for sample in family.samples
               if sample.name == name and all(sample.labels.get(k) == v
                                              for k, v in labels.items()))  # fmt: skip


def gaps(cluster, lengths: list[int], per_length: int, seed: int) -> dict[int, float]:
    """Median gaps per prompt length; `seed` makes prompts no earlier run sent (a decode node
    that has a prompt's blocks in its prefix cache pulls only the rest)."""
    rng = random.Random(seed)
    return {n: statistics.median(handover_gap(cluster, n, rng) for _ in range(per_length))
            for n in lengths}  # fmt: skip


def cut_once(cluster, host: str) -> dict:
    streams, threads = start_streams(cluster, 2, 200)
    cut_at = time.monotonic()
    cluster.hosts.cut(host)
    try:  # back as soon as the stream resumed: well within Ray's own bound (≈ 30 s)
        wait_for(lambda: healthy(cluster, "decode") == 1, 30, "the pool loses the cut host")
        left = time.monotonic() - cut_at
        wait_for(lambda: any(s.longest_gap_s > 1.0 for s in streams), 60, "a stream resumed")
    finally:
        cluster.hosts.restore(host)
    for thread in threads:
        thread.join(timeout=300)
    back = time.monotonic()
    wait_for(lambda: healthy(cluster, "decode") == 2, 120, "the host rejoins")
    rejoin = time.monotonic() - back
    wait_for(lambda: all(n["running"] == 0 for n in nodes(cluster, "decode")), 120, "idle")
    complete = all(s.error is None and s.usage.get("completion_tokens") == 200 for s in streams)
    return {"host": host, "pool_followed_s": left, "resumed_s": max(s.longest_gap_s for s in
            streams), "rejoined_s": rejoin, "streams_complete": complete}  # fmt: skip


def print_gaps(args, unshaped: dict, shaped: dict) -> None:
    print(f"hand-over gap (median of {args.per_length}), unshaped vs prefill link at {args.rate}:")
    for n in args.lengths:
        print(f"  {n:5d} tokens  {unshaped[n] * 1e3:7.1f} ms  {shaped[n] * 1e3:7.1f} ms")
    first, last = args.lengths[0], args.lengths[-1]
    print(f"  {last} / {first} tokens at {args.rate}: {shaped[last] / shaped[first]:.2f}x")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rate", default="1gbit")
    parser.add_argument("--lengths", type=int, nargs="+", default=[64, 256, 512, 1024, 1536, 1900])
    parser.add_argument("--per-length", type=int, default=3)
    parser.add_argument("--cuts", type=int, default=4)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument(
        "--prefetch-mib", type=int, help="kv_transfer.prefetch_mib (0: KV crosses after prefill)"
    )
    parser.add_argument(
        "--transport",
        default="tcp",
        choices=["tcp", "nixl"],
        help="kv_transfer.transport (nixl: UCX over TCP, so the KV crosses the shaped link)",
    )
    parser.add_argument("--out", default=str(REPO / "results/cluster_links.json"))
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="pdserve-cluster-links-") as work:
        kv = {} if args.prefetch_mib is None else {"prefetch_mib": args.prefetch_mib}
        if args.transport == "nixl":
            kv |= {"transport": "nixl", "ucx": {"TLS": "tcp"}}
        hosts = hosts_up()
        try:
            cluster = bring_up(hosts, Path(work), dtype=args.dtype, kv=kv)
        except BaseException:
            hosts.down()
            raise
        try:
            gaps(cluster, [64], 2, seed=0)  # warm-up
            unshaped = gaps(cluster, args.lengths, args.per_length, seed=1)
            cluster.hosts.shape("prefill", args.rate)
            shaped = gaps(cluster, args.lengths, args.per_length, seed=2)
            cluster.hosts.shape("prefill", None)
            found = {"rate": args.rate, "dtype": args.dtype, "prefetch_mib": args.prefetch_mib,
                     "transport": args.transport}  # fmt: skip
            found |= {"gap_unshaped_s": unshaped, "gap_shaped_s": shaped}
            found["prefetches"] = {outcome: total(cluster, "pdserve_kv_prefetches_total",
                                                  outcome=outcome)
                                   for outcome in ("used", "missed")}  # fmt: skip
            Path(args.out).write_text(json.dumps(found, indent=2))  # kept if the cuts fail
            print_gaps(args, unshaped, shaped)
            print(f"prefetches: {found['prefetches']}")
            cuts = [cut_once(cluster, f"decode{i % 2}") for i in range(args.cuts)]
        finally:
            tear_down(cluster)
            hosts.down()
    if not cuts:
        return
    resumed = sorted(c["resumed_s"] for c in cuts)
    print(f"decode host cut, {len(cuts)} times: resumed p50 {statistics.median(resumed):.2f} s, "
          f"max {resumed[-1]:.2f} s; rejoined max {max(c['rejoined_s'] for c in cuts):.2f} s; "
          f"all streams complete: {all(c['streams_complete'] for c in cuts)}")  # fmt: skip
    found["cuts"] = cuts
    Path(args.out).write_text(json.dumps(found, indent=2))
    print(f"written to {args.out}")


if __name__ == "__main__":
    main()
