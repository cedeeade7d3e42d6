"""Dispatch, the retry policy and admission with fake nodes: placement across the seam, fallback,
retries, cancellation and deadlines (no Ray, no vLLM)."""

from __future__ import annotations

import asyncio
import time
from dataclasses import replace

import pytest

from pdserve_core.engine.types import OUTPUT_START_ARG
from router import clock
from router.decides import seam
from router.decides.admission import Admission
from router.decides.retry import RESTART, runs
from router.errors import (
    DeadlineExceeded,
    EngineFailed,
    InvalidRequest,
    KVTransferFailed,
    NodeFailed,
    Overloaded,
    PoolUnavailable,
)
from router.metrics import RouterMetrics
from router.service import RouterService
from tests.helpers.fake_nodes import (
    FakeNode,
    Routes,
    colocated,
    disaggregated,
    prepared,
    request_limits,
    retry_policy,
    sampling,
)

DEADLINE_S = 30.0


async def collect(dispatcher, request, policy=None, retried=None):
    out = []
    async for delta in runs(
        dispatcher,
        request,
        time.monotonic() + DEADLINE_S,
        policy or retry_policy(3),
        (retried if retried is not None else []).append,
    ):
        out.append(delta)
    return out


def tokens(deltas) -> list[int]:
    return [t for d in deltas if d is not RESTART for t in d.token_ids]


async def test_colocated_runs_the_whole_request_on_one_node():
    node = FakeNode("c0")
    got = await collect(colocated(node), prepared(max_tokens=3))
    assert tokens(got) == [100, 101, 102] and got[-1].finish_reason == "length"
    assert [c.method for c in node.calls] == ["generate"]


async def test_the_seam_prefill_gives_the_first_token_decode_the_rest():
    p, d = FakeNode("p0"), FakeNode("d0")
    got = await collect(disaggregated([p], [d]), prepared(max_tokens=4))
    assert tokens(got) == [100, 101, 102, 103]
    assert all(delta.handle is None for delta in got)  # the handle never leaves the router
    (prefill,), (decode,) = p.calls, d.calls
    assert prefill.method == "prefill" and decode.method == "decode"
    assert decode.prompt == prefill.prompt == [1, 2, 3, 4]
    first_tokens, handle = decode.leg.first_token_ids, decode.leg.handle
    assert first_tokens == [100] and handle == {"node": "p0", "request": prefill.request_id}


async def test_nodes_see_pdserves_own_ids_never_the_clients():
    """Two requests that carry the same client id (and a long one): each leg runs under an id the
    router made, unique per request, short enough for any KV handle."""
    p, d = FakeNode("p0"), FakeNode("d0")
    dispatcher = disaggregated([p], [d])
    client_id = "cmpl-" + "x" * 600
    first, second = prepared(max_tokens=3), prepared(max_tokens=3)
    first.request_id = second.request_id = client_id
    await collect(dispatcher, first)
    await collect(dispatcher, second)
    ids = [call.request_id for node in (p, d) for call in node.calls]
    assert len(ids) == 4 and len(set(ids)) == 4
    assert all("x" * 8 not in rid and len(rid) < 64 for rid in ids), ids
    assert {rid[:-2] for rid in ids} == {first.internal_id, second.internal_id}


async def test_kv_nobody_will_read_is_given_back_to_the_prefill_node():
    """The client leaves at its first token (before the decode leg starts), or the decode node
    dies before answering: the prefill node is asked to free the KV at once. A request that ran
    to its end gives nothing back (its decode node read the KV)."""
    p, d = FakeNode("p0"), FakeNode("d0")
    dispatcher = disaggregated([p], [d])
    stream = dispatcher.deltas(prepared(max_tokens=4), time.monotonic() + DEADLINE_S)
    first = await anext(stream)
    assert first.token_ids == [100]
    await stream.aclose()  # the client left
    await asyncio.sleep(0)
    assert p.given_back == [{"node": "p0", "request": p.calls[0].request_id}]
    assert not d.calls

    await collect(dispatcher, prepared(max_tokens=4))
    await asyncio.sleep(0)
    assert len(p.given_back) == 1  # read to the end: nothing to give back

    d.die_after = 0
    d1 = FakeNode("d1")
    dispatcher = disaggregated([p], [d, d1])
    got = await collect(dispatcher, prepared(max_tokens=4, stream=False))
    await asyncio.sleep(0)
    assert tokens([g for g in got if g is not RESTART])[-4:] == [100, 101, 102, 103]
    assert len(p.given_back) == 2  # the dead decode leg's KV, before the run again


async def test_one_token_is_the_prefill_nodes_alone():
    p, d = FakeNode("p0"), FakeNode("d0")
    dispatcher = disaggregated([p], [d])
    dispatcher.observer = routes = Routes()
    got = await collect(dispatcher, prepared(max_tokens=1))
    assert tokens(got) == [100] and [c.method for c in p.calls] == ["generate"]
    assert not d.calls
    assert [(r.legs(), r.reason) for r in routes.seen] == [([("prefill", "p0")], "one_token")]


async def test_a_first_token_that_ends_the_request_ends_it_there():
    p, d = FakeNode("p0", first_finishes=True), FakeNode("d0")
    got = await collect(disaggregated([p], [d]), prepared(max_tokens=8))
    assert tokens(got) == [100] and got[-1].finish_reason == "stop" and not d.calls


async def test_no_prefill_node_the_decode_node_prefills_or_503():
    p, d = FakeNode("p0"), FakeNode("d0")
    dispatcher = disaggregated([p], [d])
    dispatcher.observer = routes = Routes()
    dispatcher.prefill.nodes[0].healthy = False
    got = await collect(dispatcher, prepared(max_tokens=3))
    assert tokens(got) == [100, 101, 102] and [c.method for c in d.calls] == ["generate"]
    assert [r.reason for r in routes.seen] == ["no_prefill_node"] and not p.calls
    strict = disaggregated([FakeNode("p1")], [FakeNode("d1")], fallback=False)
    strict.prefill.nodes[0].healthy = False
    with pytest.raises(PoolUnavailable, match="prefill"):
        strict.check_available()
    with pytest.raises(PoolUnavailable, match="prefill"):
        await collect(strict, prepared())


async def test_a_prefill_node_dying_before_output_is_retried_on_another():
    dead, alive, d = FakeNode("p0", die_after=0), FakeNode("p1"), FakeNode("d0")
    dispatcher = disaggregated([dead, alive], [d])
    retried: list[NodeFailed] = []
    got = await collect(dispatcher, prepared(max_tokens=3), retried=retried)
    assert tokens(got) == [100, 101, 102]
    assert [e.pool for e in retried] == ["prefill"] and "p0" in retried[0].message
    assert not dispatcher.prefill.nodes[0].healthy  # out of the pool at once
    assert len(alive.calls) == 1


async def test_the_last_prefill_node_dying_falls_back_to_the_decode_node():
    p, d = FakeNode("p0", die_after=0), FakeNode("d0")
    got = await collect(disaggregated([p], [d]), prepared(max_tokens=3))
    assert tokens(got) == [100, 101, 102]
    assert [c.method for c in d.calls] == ["generate"]


async def test_a_cut_stream_continues_from_the_tokens_sent():
    """The decode node dies after two tokens reached the client: the request continues as
    prompt + those tokens (prefilled, handed over to the other decode node); the client sees
    every token once, and usage counts the original prompt."""
    p, d0, d1 = FakeNode("p0"), FakeNode("d0", die_after=1), FakeNode("d1")
    resumed: list[NodeFailed] = []
    out = []
    async for delta in runs(
        disaggregated([p], [d0, d1]),
        prepared(max_tokens=6),
        time.monotonic() + 30,
        retry_policy(3),
        print,
        resumed.append,
    ):
        out.append(delta)
    assert tokens(out) == [100, 101, 102, 103, 104, 105]
    assert [e.pool for e in resumed] == ["decode"]
    assert {d.num_prompt_tokens for d in out} == {4}
    continuation = p.calls[1]
    assert continuation.prompt == [1, 2, 3, 4, 100, 101]  # the tokens already sent
    assert [c.method for c in d1.calls] == ["decode"]
    # where the client's prompt ends rides with each leg: their text continues from there
    for call in (continuation, d1.calls[0]):
        assert call.params.extra_args[OUTPUT_START_ARG] == 4
    again = seam.continued(replace(prepared(), **_as_continued(continuation)), [102])
    assert again.sampling_params.extra_args[OUTPUT_START_ARG] == 4  # a second resume keeps it


def _as_continued(call) -> dict:
    return {"prompt_token_ids": call.prompt, "sampling_params": call.params}


async def test_a_stateful_stream_cut_midway_ends_with_an_explicit_error():
    """Its grammar / generator / penalty state cannot be rebuilt from token ids."""
    p, d0, d1 = FakeNode("p0"), FakeNode("d0", die_after=1), FakeNode("d1")
    with pytest.raises(NodeFailed, match="decode node d0"):
        await collect(disaggregated([p], [d0, d1]), prepared(max_tokens=5, stop=["x"]))
    assert not d1.calls


async def test_with_resume_off_a_cut_stream_ends_with_an_explicit_error():
    p, d0, d1 = FakeNode("p0"), FakeNode("d0", die_after=1), FakeNode("d1")
    policy = retry_policy(3, resume=False)
    with pytest.raises(NodeFailed, match="decode node d0"):
        await collect(disaggregated([p], [d0, d1]), prepared(max_tokens=5), policy)


async def test_no_decode_node_left_a_prefill_node_serves_whole_requests():
    p, d = FakeNode("p0"), FakeNode("d0")
    dispatcher = disaggregated([p], [d])
    dispatcher.observer = routes = Routes()
    dispatcher.decode.nodes[0].healthy = False
    dispatcher.check_available()  # not a 503: the prefill pool can serve
    got = await collect(dispatcher, prepared(max_tokens=3, stop=["x"]))
    assert tokens(got) == [100, 101, 102] and [c.method for c in p.calls] == ["generate"]
    assert [(r.legs(), r.reason) for r in routes.seen] == [([("prefill", "p0")], "no_decode_node")]
    dispatcher.prefill.nodes[0].healthy = False
    with pytest.raises(PoolUnavailable, match="either pool"):
        dispatcher.check_available()


async def test_a_collected_request_starts_over_without_duplicates():
    p, d0, d1 = FakeNode("p0"), FakeNode("d0", die_after=2), FakeNode("d1")
    got = await collect(disaggregated([p], [d0, d1]), prepared(max_tokens=5, stream=False))
    assert RESTART in got
    after_restart = got[got.index(RESTART) + 1 :]
    assert tokens(after_restart) == [100, 101, 102, 103, 104]


async def test_attempts_are_bounded_across_every_layer():
    """Three runs at most, whichever nodes fail (one policy, not one per layer)."""
    nodes = [FakeNode(f"d{i}", die_after=0) for i in range(5)]
    dispatcher = colocated(*nodes)
    retried = []
    policy = retry_policy(3, max_engine_deaths=10)  # not the poison rule: the attempts bound
    with pytest.raises(NodeFailed):
        await collect(dispatcher, prepared(stream=False), policy, retried)
    assert sum(len(n.calls) for n in nodes) == 3 and len(retried) == 2


async def test_a_request_two_engines_died_under_is_not_run_a_third_time():
    """It may be what kills them: after the second death it ends with an explicit error, and
    the third node never sees it. A stream cut once still continues."""
    nodes = [FakeNode(f"d{i}", die_after=1) for i in range(3)]
    retried = []
    with pytest.raises(EngineFailed, match="2 engines died while running this request"):
        await collect(colocated(*nodes), prepared(stream=False), retry_policy(3), retried)
    assert sorted(len(n.calls) for n in nodes) == [0, 1, 1] and len(retried) == 1
    got = await collect(colocated(FakeNode("e0", die_after=1), FakeNode("e1")), prepared())
    assert tokens(got) == [100, 101, 102, 103, 104]


async def test_unreachable_nodes_are_not_counted_as_deaths_it_caused():
    """A node that could not be reached (host or link down) says nothing about the request."""
    nodes = [FakeNode(f"d{i}", unreachable_after=1) for i in range(3)]
    policy = retry_policy(3, max_engine_deaths=1)
    with pytest.raises(NodeFailed, match="ActorUnavailableError"):  # the attempts ran out
        await collect(colocated(*nodes), prepared(stream=False), policy)
    assert [len(n.calls) for n in nodes] == [1, 1, 1]


async def test_a_failed_kv_pull_under_fail_is_an_explicit_error_not_a_retry():
    p, d = FakeNode("p0"), FakeNode("d0", kv_failure=True)
    retried = []
    with pytest.raises(KVTransferFailed, match="KV transfer failed"):
        await collect(disaggregated([p], [d]), prepared(stream=False), retried=retried)
    assert retried == [] and len(d.calls) == 1


async def test_the_deadline_ends_the_request_and_cancels_it_on_the_node():
    node = FakeNode("c0", delay_s=0.2)
    dispatcher = colocated(node)
    started = time.monotonic()
    with pytest.raises(DeadlineExceeded):
        async for _ in runs(
            dispatcher, prepared(max_tokens=50), time.monotonic() + 0.5, retry_policy(3), print
        ):
            pass
    assert time.monotonic() - started < 2
    assert node.calls[0].cancelled
    assert dispatcher.pools["colocated"].nodes[0].outstanding == 0


async def test_a_caller_that_stops_listening_cancels_both_legs_counts_nothing_left():
    p, d = FakeNode("p0"), FakeNode("d0", delay_s=0.05)
    dispatcher = disaggregated([p], [d])
    stream = runs(
        dispatcher, prepared(max_tokens=20), time.monotonic() + 30, retry_policy(3), print
    )
    async for delta in stream:
        if delta.token_ids == [102]:
            break
    await stream.aclose()
    assert d.calls[0].cancelled and not p.calls[0].cancelled
    for pool in dispatcher.pools.values():
        assert pool.nodes[0].outstanding == 0 and pool.nodes[0].outstanding_prompt_tokens == 0


class Service(RouterService):
    """The router's service with the one request a face would have prepared."""

    def __init__(self, request, *args) -> None:
        super().__init__(*args)
        self.request = request

    async def take(self, request=None):
        return await self.open(request or self.request, "http")

    async def tokens(self, admitted) -> list[int]:
        """A whole request's tokens, dropped and gathered again if it starts over."""
        got: list[int] = []
        async for delta in self.deltas(admitted):
            got = [] if delta is RESTART else got + delta.token_ids
        return got


def service(dispatcher, request, limit: int = 1) -> Service:
    metrics = RouterMetrics(dispatcher.pools, dispatcher.mode, tpot_target_s=0.1)
    metrics.watch(dispatcher)
    return Service(
        request, dispatcher, metrics, Admission(limit), retry_policy(3), 30, request_limits()
    )


def outcome(svc: RouterService, kind: str) -> float:
    value = svc.metrics.registry.get_sample_value(
        "pdserve_requests_total", {"api": "http", "outcome": kind}
    )
    return value or 0.0


async def test_n_above_the_routers_bound_is_refused_and_gives_its_slot_back():
    """More sequences than one prefill's lease can serve never reach a node."""
    node = FakeNode("c0")
    svc = service(colocated(node), prepared(max_tokens=2, stream=False, n=129))
    with pytest.raises(InvalidRequest, match=r"n must be at most 128 \(router.max_n\), got 129"):
        await svc.take()
    assert svc.admission.outstanding == 0 and not node.calls
    assert outcome(svc, "invalid_request_error") == 1


@pytest.mark.parametrize(
    "asked, refused",
    [
        (dict(n=64, max_tokens=2049, logprobs=1), True),  # 262,272 entries: over 1 << 18
        (dict(n=64, max_tokens=2048, logprobs=1), False),  # 262,144: just within
        (dict(n=1, max_tokens=16, logprobs=-1), True),  # the whole vocabulary per token
        (dict(n=64, max_tokens=2049, logprob_token_ids=[7]), True),  # counted as logprobs=1
        (dict(n=64, max_tokens=2048, logprobs=1, stream=True), False),  # streamed: not held
    ],
)
async def test_a_non_streamed_response_too_large_to_hold_is_refused_before_it_runs(asked, refused):
    node = FakeNode("c0")
    svc = service(colocated(node), prepared(**{"stream": False, **asked}))
    if not refused:
        admitted = await svc.take()
        admitted.slot.release()
        return
    with pytest.raises(InvalidRequest, match=r"router.max_response_tokens\): stream it"):
        await svc.take()
    assert svc.admission.outstanding == 0 and not node.calls


async def test_admission_holds_a_slot_per_request_and_always_gives_it_back():
    svc = service(colocated(FakeNode("c0", delay_s=0.01)), prepared(max_tokens=3, stream=False))
    first = await svc.take()
    with pytest.raises(Overloaded, match="retry later"):
        await svc.take()
    assert outcome(svc, "rate_limit_exceeded") == 1
    assert await svc.tokens(first) == [100, 101, 102] and svc.admission.outstanding == 0
    with pytest.raises(InvalidRequest):
        await svc.take(prepared(max_tokens=3, stream=False, n=129))
    assert outcome(svc, "invalid_request_error") == 1 and svc.admission.outstanding == 0
    assert outcome(svc, "success") == 1


async def test_a_stream_abandoned_by_its_client_releases_its_slot_and_counts_as_cancelled():
    svc = service(colocated(FakeNode("c0", delay_s=0.01)), prepared(max_tokens=10))
    request = await svc.take()
    stream = svc.deltas(request)
    await anext(stream)
    await stream.aclose()
    assert svc.admission.outstanding == 0 and outcome(svc, "cancelled") == 1
    slot = svc.admission.admit()
    slot.release()
    slot.release()  # idempotent
    assert svc.admission.outstanding == 0


async def test_service_counts_retries_by_the_pool_whose_node_failed():
    dispatcher = disaggregated([FakeNode("p0", die_after=0), FakeNode("p1")], [FakeNode("d0")])
    svc = service(dispatcher, prepared(max_tokens=3, stream=False))
    assert await svc.tokens(await svc.take()) == [100, 101, 102]
    retries = svc.metrics.registry.get_sample_value(
        "pdserve_request_retries_total", {"pool": "prefill"}
    )
    assert retries == 1


async def test_no_request_waits_past_its_deadline_even_when_the_node_never_answers():
    class Silent(FakeNode):
        async def stream(self, method, *args):
            await asyncio.Event().wait()
            yield  # pragma: no cover

    dispatcher = colocated(Silent("c0"))
    with pytest.raises(DeadlineExceeded):
        await asyncio.wait_for(collect_until(dispatcher, time.monotonic() + 0.3), timeout=5)


async def collect_until(dispatcher, deadline):
    async for _ in runs(dispatcher, prepared(), deadline, retry_policy(3), print):
        pass


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        ({}, seam.FIRST_ON_PREFILL),
        ({"seed": 7}, seam.FIRST_ON_PREFILL),  # greedy: the generator is never drawn from
        ({"logprobs": 2, "min_tokens": 3}, seam.FIRST_ON_PREFILL),  # assembled / counted
        ({"seed": 7, "temperature": 1.0}, seam.FIRST_ON_DECODE),
        ({"structured_outputs": object()}, seam.FIRST_ON_DECODE),
        ({"frequency_penalty": 1.5}, seam.FIRST_ON_DECODE),
        ({"presence_penalty": -0.5}, seam.FIRST_ON_DECODE),
        ({"bad_words": ["no"]}, seam.FIRST_ON_DECODE),
        ({"stop": [" Paris."]}, seam.FIRST_ON_DECODE),
        ({"n": 2}, seam.FIRST_ON_DECODE),
        ({"prompt_logprobs": 1}, seam.ONE_ENGINE),
    ],
)
def test_the_seam_policy_places_stateful_sampling_on_the_decode_node(overrides, expected):
    assert seam.placement(sampling(**overrides)) == expected


async def test_first_token_on_decode_the_prefill_only_computes_kv():
    p, d = FakeNode("p0"), FakeNode("d0")
    got = await collect(disaggregated([p], [d]), prepared(max_tokens=4, stop=["x"]))
    assert tokens(got) == [100, 101, 102, 103]  # all from the decode node; never the 999
    (prefill,), (decode,) = p.calls, d.calls
    assert (prefill.leg.sample_first, prefill.leg.readers) == (False, 1)  # not the client's; one
    first_tokens, handle = decode.leg.first_token_ids, decode.leg.handle
    assert first_tokens == [] and handle["request"] == prefill.request_id


async def test_n_sequences_share_one_prefill():
    p, d = FakeNode("p0"), FakeNode("d0")
    await collect(disaggregated([p], [d]), prepared(max_tokens=3, n=3))
    (call,) = p.calls
    assert (call.leg.sample_first, call.leg.readers) == (False, 3)  # a lease for three readers


async def test_prompt_logprobs_and_one_token_requests_run_on_one_engine():
    p, d = FakeNode("p0"), FakeNode("d0")
    await collect(disaggregated([p], [d]), prepared(max_tokens=3, prompt_logprobs=1))
    assert not p.calls and [c.method for c in d.calls] == ["generate"]
    await collect(disaggregated([p], [d]), prepared(max_tokens=1, stop=["x"]))
    assert [c.method for c in p.calls] == ["generate"]


async def test_a_prefill_that_fails_before_it_runs_ends_its_follow():
    """The prefill leg failed (or was cancelled) before vLLM had it: the prefill node is told its
    key will not run, so the decode node's follow ends now, not at the follow's deadline."""
    p, d = FakeNode("p0", die_after=0), FakeNode("d0")
    dispatcher = disaggregated([p], [d])
    prefill_node, decode_node = dispatcher.prefill.nodes[0], dispatcher.decode.nodes[0]
    prefill_node.info = replace(prefill_node.info, kv_host="127.9.0.1", kv_ports=(7100,))
    decode_node.info = replace(decode_node.info, prefetch=True)
    with pytest.raises(NodeFailed):
        async for _ in dispatcher.deltas(prepared(max_tokens=3), clock.now() + 30):
            pass
    for _ in range(10):
        await asyncio.sleep(0)
    assert [ask[0] for ask in d.prefetches] == p.ended_follows and len(p.ended_follows) == 1


def test_a_clients_request_id_is_logged_escaped():
    request = replace(prepared(), request_id="cmpl-1\nERROR forged line\x1b[2J" + "x" * 500)
    assert "\n" not in request.log_id and "\x1b" not in request.log_id
    assert len(request.log_id) < 150


async def test_a_decode_node_that_takes_prefetches_follows_the_prefill_under_one_key():
    """The prefill node serves KV and the decode node takes prefetches: the decode node is asked
    to follow the prefill (the prefill node's KV address, the prompt's size) under a fresh key,
    and the prefill leg carries the same key. Without either, nothing is asked."""
    p, d = FakeNode("p0"), FakeNode("d0")
    dispatcher = disaggregated([p], [d])
    prefill_node, decode_node = dispatcher.prefill.nodes[0], dispatcher.decode.nodes[0]
    await collect(dispatcher, prepared(max_tokens=3))
    assert d.prefetches == [] and p.calls[0].leg.prefetch == ""  # no key
    prefill_node.info = replace(prefill_node.info, kv_host="127.9.0.1", kv_ports=(7100, 7101))
    await collect(dispatcher, prepared(max_tokens=3))
    assert d.prefetches == []  # the decode node takes none
    decode_node.info = replace(decode_node.info, prefetch=True)
    for _ in range(2):
        await collect(dispatcher, prepared(max_tokens=3))
    await asyncio.sleep(0)
    keys = [ask[0] for ask in d.prefetches]
    assert [ask[1:] for ask in d.prefetches] == [("127.9.0.1", (7100, 7101), 4, 128)] * 2
    assert len(set(keys)) == 2 and all(len(key) == 32 for key in keys)
    assert [call.leg.prefetch for call in p.calls[2:]] == keys  # the prefill leg carries its key


def test_deltas_a_reader_fell_behind_on_are_joined_as_one():
    from pdserve_core.engine.types import TokenDelta, joinable, joined

    top = [(5, -0.1, 1, "a")]
    first = TokenDelta([5], "a", logprobs=[top], prompt_logprobs=[None, top], num_cached_tokens=16)
    middle = TokenDelta([6], "b", logprobs=[top])
    last = TokenDelta([7], "c", "stop", 7, 3, {"port": 1}, logprobs=[top], num_cached_tokens=0)
    assert joinable(first, middle) and joinable(middle, last)
    both = joined([first, middle, last])
    assert (both.token_ids, both.text, both.logprobs) == ([5, 6, 7], "abc", [top, top, top])
    assert (both.finish_reason, both.stop_reason, both.handle) == ("stop", 7, {"port": 1})
    assert (both.prompt_logprobs, both.num_cached_tokens, both.num_prompt_tokens) == (
        [None, top],
        16,
        3,
    )
    # never across sequences, past a sequence's end, or where logprobs would lose their tokens
    assert not joinable(first, replace(last, index=1))
    assert not joinable(replace(first, finish_reason="length"), last)
    assert not joinable(first, replace(last, logprobs=None))
    plain = TokenDelta([1], "x")
    assert joined([plain]) is plain
    assert joined([plain, TokenDelta([2], "y")]) == TokenDelta([1, 2], "xy")
