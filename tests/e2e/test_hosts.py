"""pdserve on a cluster of hosts: four network namespaces on this machine (the head with two
routers, a prefill host, two decode hosts), Ray started on each with the launcher file's own
commands and token auth, `pdserve serve --routers 2` on the head with
deploy/config/cluster-cpu.yaml, and the client on this machine. Every request's KV crosses the
prefill host's link to a decode host's.

The routers share the nodes: a conversation whose turns alternate between them goes back to the
decode host that holds it, as through one router; a router counts the other's streams from the
engines' reports and puts its own on the other decode host; and a router killed mid-stream costs
only its own stream, whose request the nodes end within seconds.

Then the links fail: a decode host's cable is pulled mid-stream (its streams continue on the
other decode host, the pool follows, and the host rejoins when its cable is back), the prefill
host's cable is pulled during a KV pull (the failure policy, within the pull's deadline), and a
decode host dies whole, then reboots and rejoins. Nothing may hang, no stream may lose or repeat
a token (float32: a resumed stream equals the uncut one), and no KV block stays held."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from dataclasses import dataclass, field

import httpx
import pytest

from pdserve.hosts.ray_hosts import restart_host
from tests.conftest import REPO
from tests.e2e.conftest import metric, samples
from tests.e2e.hosts import bring_up, can_make_hosts, tear_down, wait_for

pytestmark = pytest.mark.skipif(can_make_hosts() is not None, reason=str(can_make_hosts()))

PROMPT = "Write a long story about a lighthouse keeper who finds a map in a bottle."
SILENCE_BOUND_S = 8.0
"""A cut stream must continue within this (router.node_silence_s is 3 s; the rest is the
continuation's prefill on a loaded 2-core machine)."""


@pytest.fixture(scope="module")
def cluster(default_model_dir, emulated_hosts, tmp_path_factory):
    cluster = bring_up(emulated_hosts, tmp_path_factory.mktemp("hosts"), routers=2)
    yield cluster
    left = tear_down(cluster)
    assert left == [], f"engine processes left on the hosts: {left}"


@dataclass
class Stream:
    text: str = ""
    finish: str | None = None
    usage: dict = field(default_factory=dict)
    error: str | None = None
    arrivals: list[float] = field(default_factory=list)

    @property
    def longest_gap_s(self) -> float:
        gaps = [b - a for a, b in zip(self.arrivals, self.arrivals[1:], strict=False)]
        return max(gaps, default=0.0)


def stream(
    cluster, max_tokens: int, prompt: str = PROMPT, into: Stream | None = None, router: int = 0
) -> Stream:
    """A greedy streamed completion through `router`, read chunk by chunk (arrival times kept)."""
    out = into or Stream()
    body = {
        "model": cluster.server.model, "prompt": prompt, "max_tokens": max_tokens,
        "temperature": 0, "ignore_eos": True, "stream": True,
        "stream_options": {"include_usage": True},
    }  # fmt: skip
    url = f"{cluster.server.routers[router]['http']}/v1/completions"
    with httpx.stream("POST", url, json=body, headers=cluster.server.headers, timeout=180) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line.removeprefix("data: "))
            if "error" in chunk:
                out.error = chunk["error"]["message"]
            elif chunk.get("usage"):
                out.usage = chunk["usage"]
            for choice in chunk.get("choices", []):
                out.arrivals.append(time.monotonic())
                out.text += choice["text"]
                out.finish = choice.get("finish_reason") or out.finish
    return out


def nodes(cluster, pool: str) -> list[dict]:
    health = httpx.get(f"{cluster.server.url}/health", headers=cluster.server.headers, timeout=10)
    return health.json()["pools"][pool]["nodes"]


def healthy(cluster, pool: str) -> float:
    return metric(cluster.server, "pdserve_pool_nodes", pool=pool, state="healthy")


def total(cluster, name: str, **labels: str) -> float:
    """The sum of a family's samples with these labels, over every node."""
    return sum(
        sample.value
        for sample in samples(cluster.server)
        if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items())
    )


def start_streams(cluster, count: int, max_tokens: int) -> tuple[list[Stream], list]:
    """`count` streams, each started once the one before has its first tokens (so the router
    has seen its decode leg and places the next on another decode host)."""
    streams, threads = [], []
    for _ in range(count):
        streams.append(Stream())
        threads.append(
            threading.Thread(
                target=stream, args=(cluster, max_tokens), kwargs={"into": streams[-1]}
            )
        )
        threads[-1].start()
        wait_for(lambda: len(streams[-1].arrivals) >= 3, 120, "a stream flowing")
    return streams, threads


def test_each_pool_lives_on_its_hosts_and_kv_crosses_the_links(cluster):
    assert [cluster.node_host(n["pid"]) for n in nodes(cluster, "prefill")] == ["prefill"]
    decode_hosts = sorted(cluster.node_host(n["pid"]) for n in nodes(cluster, "decode"))
    assert decode_hosts == ["decode0", "decode1"]
    sent = total(cluster, "pdserve_kv_transfer_bytes_total", direction="sent")
    prefetched = total(cluster, "pdserve_kv_prefetches_total", outcome="used")
    left_prefill = cluster.link_bytes("prefill", "from")
    answers = [stream(cluster, 24, f"{PROMPT} Chapter {i}.") for i in range(4)]
    assert all(a.usage["completion_tokens"] == 24 and a.finish == "length" for a in answers)
    # each decode host followed its prefill across the link while it ran (a prefetch)
    wait_for(
        lambda: total(cluster, "pdserve_kv_prefetches_total", outcome="used") == prefetched + 4,
        10,
        "every request's KV prefetched",
    )
    moved = total(cluster, "pdserve_kv_transfer_bytes_total", direction="sent") - sent
    assert moved > 0
    assert cluster.link_bytes("prefill", "from") - left_prefill >= moved  # over the cable
    for name in ("pdserve-decode-0", "pdserve-decode-1"):  # both decode hosts pulled
        received = metric(
            cluster.server, "pdserve_kv_transfer_bytes_total", node=name, direction="received"
        )
        assert received > 0, name


def at_router(cluster, router: int, path: str) -> httpx.Response:
    url = f"{cluster.server.routers[router]['http']}{path}"
    return httpx.get(url, headers=cluster.server.headers, timeout=10)


def decode_legs(cluster, router: int) -> dict[str, float]:
    """The decode legs `router` has sent, per node."""
    return {
        sample.labels["node"]: sample.value
        for sample in samples(cluster.server, router)
        if sample.name == "pdserve_routing_decisions_total" and sample.labels["pool"] == "decode"
    }


def decode_nodes(cluster, router: int) -> list[dict]:
    """The decode nodes as `router`'s /health describes them."""
    return at_router(cluster, router, "/health").json()["pools"]["decode"]["nodes"]


def blocks_known(cluster, router: int) -> int:
    """The prompt blocks `router` takes the decode nodes to hold."""
    return sum(node["prefix_blocks_known"] for node in decode_nodes(cluster, router))


def converse(cluster, opening: str, routers: list[int]) -> list[tuple[int, str]]:
    """A conversation, turn i through router `routers[i]`, each turn's prompt the history so far
    and a new line; returns each turn's (cached prompt tokens, decode node). Before a turn that
    goes to the other router, that router has read the last turn's blocks from the nodes (what a
    person's time to reply gives it: a health check, one second)."""
    prompt, turns = opening, []
    for i, router in enumerate(routers):
        following = routers[i + 1] if i + 1 < len(routers) else router
        known = blocks_known(cluster, following)
        legs = decode_legs(cluster, router)
        body = {
            "model": cluster.server.model, "prompt": prompt, "max_tokens": 16, "temperature": 0,
            "ignore_eos": True,
        }  # fmt: skip
        url = f"{cluster.server.routers[router]['http']}/v1/completions"
        answer = httpx.post(url, json=body, headers=cluster.server.headers, timeout=120)
        assert answer.status_code == 200, answer.text
        usage = answer.json()["usage"]
        after = decode_legs(cluster, router)
        [node] = [name for name, count in after.items() if count != legs.get(name, 0)]
        turns.append(((usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0), node))
        prompt += answer.json()["choices"][0]["text"] + f"\nChapter {i + 2}."
        if following != router:
            read = lambda r=following, k=known: blocks_known(cluster, r) > k  # noqa: E731
            wait_for(read, 10, "the node's log read")
    return turns


def test_a_conversation_alternating_routers_finds_its_cache_as_through_one(cluster):
    history = " ".join([PROMPT] * 30)  # ~500 tokens: several blocks of history from turn 1
    one = converse(cluster, f"One. {history}", [0, 0, 0])
    alternating = converse(cluster, f"Two. {history}", [1, 0, 1])
    print(f"cached prompt tokens, decode node per turn: one router {one}, alternating "
          f"{alternating}")  # fmt: skip
    for turns in (one, alternating):  # back to the decode host that holds the conversation
        assert {node for _, node in turns} == {turns[0][1]}, turns
    cached_one = sum(cached for cached, _ in one[1:])
    cached_alternating = sum(cached for cached, _ in alternating[1:])
    assert cached_one > 0
    assert abs(cached_alternating - cached_one) <= 0.1 * cached_one


LONG = 160
"""Tokens of a stream that must still run when its router is killed (seconds of decode)."""


def test_a_router_killed_mid_stream_costs_only_its_own_stream(cluster):
    reference = stream(cluster, LONG)
    # idle as both routers see it: router 1's figures of a node are up to a health check old,
    # and one from before the reference ended would count that stream as another router's
    wait_for(
        lambda: all(n["running"] == 0 for i in (0, 1) for n in decode_nodes(cluster, i)),
        30,
        "idle",
    )
    kept, cut = Stream(), Stream()

    def cut_short() -> None:
        try:
            stream(cluster, LONG, into=cut, router=1)
        except httpx.HTTPError as error:  # its router died: the connection ends unfinished
            cut.error = repr(error)

    threads = [
        threading.Thread(target=stream, args=(cluster, LONG), kwargs={"into": kept}),
        threading.Thread(target=cut_short),
    ]
    threads[0].start()
    wait_for(lambda: len(kept.arrivals) >= 3, 120, "router 0's stream flowing")
    (kept_on,) = [n["name"] for n in decode_nodes(cluster, 0) if n["outstanding"]]
    # router 1 counts router 0's stream from the engines' reports, on the node it runs on, so
    # it sends its own to the other decode host
    wait_for(
        lambda: (
            [(n["name"], n["elsewhere"]) for n in decode_nodes(cluster, 1) if n["elsewhere"]]
            == [(kept_on, 1)]
        ),
        10,
        "counted where it runs",
    )
    threads[1].start()
    wait_for(lambda: len(cut.arrivals) >= 3, 120, "router 1's stream flowing")
    hosts = [{n["name"] for n in decode_nodes(cluster, i) if n["outstanding"]} for i in (0, 1)]
    assert len(hosts[0]) == len(hosts[1]) == 1 and hosts[0] != hosts[1], hosts
    wait_for(lambda: sum(n["running"] for n in nodes(cluster, "decode")) == 2, 10, "both seen")
    pid = cluster.server.routers[1]["pid"]
    os.kill(pid, signal.SIGKILL)
    killed = time.monotonic()
    wait_for(
        lambda: sum(n["running"] for n in nodes(cluster, "decode")) <= 1,
        5,
        "the dead router's request ended on its decode host",
    )
    print(f"router killed: its request ended on the node within {time.monotonic() - killed:.1f} s")
    for thread in threads:
        thread.join(timeout=180)
    assert kept.error is None and kept.finish == "length" and kept.text == reference.text, kept
    assert cut.finish is None and len(cut.arrivals) < LONG, cut  # it ended with its router
    assert all(n["kv_blocks_held"] == 0 for n in nodes(cluster, "prefill"))
    # the keeper starts the router again on its port, and it serves
    wait_for(lambda: _answers(cluster, 1), 60, "router 1 back")
    assert stream(cluster, 8, router=1).usage["completion_tokens"] == 8


def _answers(cluster, router: int) -> bool:
    try:
        return at_router(cluster, router, "/health").status_code == 200
    except httpx.HTTPError:
        return False


def test_a_decode_hosts_cable_pulled_mid_stream_continues_on_the_other(cluster):
    reference = stream(cluster, 160)  # uncut, alone: what every stream below must equal
    assert reference.usage["completion_tokens"] == 160
    # the decode pool weighs a node's last reported running sequences too: until a health check
    # has seen the reference stream end, its host looks busy and may not get a stream below
    wait_for(lambda: all(n["running"] == 0 for n in nodes(cluster, "decode")), 30, "idle")
    streams, threads = start_streams(cluster, 2, 160)
    busy = {cluster.node_host(n["pid"]) for n in nodes(cluster, "decode") if n["outstanding"]}
    assert busy == {"decode0", "decode1"}  # one stream on each decode host
    resumes = metric(cluster.server, "pdserve_stream_resumes_total", pool="decode")
    cut_at = time.monotonic()
    cluster.hosts.cut("decode0")
    try:
        wait_for(lambda: healthy(cluster, "decode") == 1, 10, "the pool loses the cut host")
        left_s = time.monotonic() - cut_at
        wait_for(lambda: any(s.longest_gap_s > 1.0 for s in streams), 60, "a stream resumed")
    finally:  # back well within Ray's own bound (its node checks), so Ray never saw it dead
        cluster.hosts.restore("decode0")
    for thread in threads:
        thread.join(timeout=180)
    for s in streams:  # none lost or repeated a token: each equals the uncut stream
        assert s.error is None and s.finish == "length", s
        assert s.usage["completion_tokens"] == 160 and s.text == reference.text
    cut = max(streams, key=lambda s: s.longest_gap_s)
    print(f"decode host cut: pool followed in {left_s:.1f} s, stream resumed after "
          f"{cut.longest_gap_s:.1f} s")  # fmt: skip
    assert cut.longest_gap_s < SILENCE_BOUND_S
    assert metric(cluster.server, "pdserve_stream_resumes_total", pool="decode") == resumes + 1
    back = time.monotonic()
    wait_for(lambda: healthy(cluster, "decode") == 2, 60, "the host rejoins with its cable back")
    print(f"decode host rejoined {time.monotonic() - back:.1f} s after its cable came back")
    wait_for(
        lambda: all(n["running"] == 0 for n in nodes(cluster, "decode")),
        60,
        "the cut stream's request ends on the host that lost it",
    )
    again = stream(cluster, 16)  # and both hosts serve again
    assert again.usage["completion_tokens"] == 16


def cut_the_prefill_host_mid_transfer(cluster, prompt: str) -> tuple[Stream, float, float]:
    """Stream `prompt` with the prefill host's link shaped so its KV takes seconds, pull that
    host's cable once KV is on the wire, put it back; returns (the stream, its seconds, the
    failures counted before). The stream must have ended."""
    failures = total(cluster, "pdserve_kv_transfer_failures_total")
    cluster.hosts.shape("prefill", "40mbit")  # the pull takes seconds: long enough to cut
    result = Stream()
    before = cluster.link_bytes("prefill", "from")
    thread = threading.Thread(target=stream, args=(cluster, 8, prompt), kwargs={"into": result})
    started = time.monotonic()
    try:
        thread.start()
        # the prompt's first token is back (the prefill has ended; on the tcp plane its KV,
        # streamed since the prefill began, is seconds from done at this rate) and KV is on the
        # wire
        wait_for(lambda: result.arrivals, 120, "the first token")
        wait_for(lambda: cluster.link_bytes("prefill", "from") - before > 4 << 20, 120, "KV")
        cluster.hosts.cut("prefill")
        thread.join(timeout=120)
    finally:
        cluster.hosts.restore("prefill")
        cluster.hosts.shape("prefill", None)
    assert not thread.is_alive()
    return result, time.monotonic() - started, failures


def test_the_prefill_hosts_cable_pulled_during_a_pull_recomputes_within_the_deadline(cluster):
    long_prompt = " ".join([PROMPT] * 60)  # ~1000 tokens: ~46 MB of float32 KV
    result, took, failures = cut_the_prefill_host_mid_transfer(cluster, long_prompt + " Again.")
    assert result.error is None and result.usage["completion_tokens"] == 8, result
    assert total(cluster, "pdserve_kv_transfer_failures_total") > failures
    print(f"prefill host cut mid-pull: request done in {took:.1f} s (kv timeout 10 s)")
    assert took < 10 + 30  # the pull's deadline, then the prompt recomputed on the decode host
    wait_for(lambda: healthy(cluster, "prefill") == 1, 60, "the prefill host rejoins")
    wait_for(
        lambda: all(n["kv_blocks_held"] == 0 for n in nodes(cluster, "prefill")),
        60,
        "the cut pull's blocks are released",
    )


def test_a_decode_host_that_dies_whole_loses_no_stream(cluster):
    reference = stream(cluster, 96)
    streams, threads = start_streams(cluster, 2, 96)
    assert cluster.hosts.kill("decode1") > 0  # every process of the host, at once
    for thread in threads:
        thread.join(timeout=180)
    for s in streams:
        assert s.error is None and s.finish == "length", s
        assert s.text == reference.text
    wait_for(lambda: healthy(cluster, "decode") == 1, 30, "the pool loses the dead host")
    assert stream(cluster, 8).usage["completion_tokens"] == 8  # served by the host left
    restarted = time.monotonic()
    restart_host(cluster.hosts, "decode1", REPO / "deploy/ray/pdserve-cluster.yaml")
    # Ray restarts the node's actor on its host; the router builds its engine; it rejoins
    wait_for(lambda: healthy(cluster, "decode") == 2, 240, "the restarted host rejoins")
    print(f"decode host rejoined {time.monotonic() - restarted:.0f} s after its restart")
    for _ in range(2):  # both decode hosts serve again
        assert stream(cluster, 8).usage["completion_tokens"] == 8
    wait_for(  # the dead host's unfinished pulls, if any, end with their leases
        lambda: all(n["kv_blocks_held"] == 0 for n in nodes(cluster, "prefill")),
        60,
        "no KV block held after every failure",
    )
