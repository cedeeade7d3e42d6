"""KV transfer faults with real engines (float32): each ends in the failure policy's outcome in
time.

recompute: the decode engine computes the prefill itself and the tokens equal a plain run's;
fail: the request ends with an explicit error naming the reason. The producer's held blocks
return to zero. Engines: a producer (short lease, rate-limited sends so a transfer can be cut),
a second producer whose model folder has another name (handshake mismatch), and two consumers
(recompute, fail) that read the cluster secret from files (so a test can give one a wrong one).
"""

from __future__ import annotations

import asyncio
import socket
import time

import psutil
import pytest
import ray

from pdserve_core.engine.legs import Prefill
from pdserve_core.engine.types import KVLoadFailed
from tests.engines.harness import (
    SECRET,
    call,
    consumer,
    decode,
    disaggregated,
    generate,
    greedy,
    prefill,
    producer,
    rid,
    start_engines,
    tokens,
    wait_for,
)

LEASE_S = 4.0
TIMEOUT_S = 6.0
MAX_TOKENS = 10


@pytest.fixture(scope="module")
def secrets(tmp_path_factory):
    folder = tmp_path_factory.mktemp("secrets")
    files = {name: folder / name for name in ("d", "d_fail")}
    for path in files.values():
        path.write_text(SECRET)
    return files


@pytest.fixture(scope="module")
def engines(ray_session, default_model_dir, tmp_path_factory, secrets):
    renamed = tmp_path_factory.mktemp("models") / "SmolLM2-other-name"
    renamed.symlink_to(default_model_dir, target_is_directory=True)
    engines = start_engines(
        str(default_model_dir),
        {
            "p": producer(lease_s=LEASE_S, send_rate_limit_bytes_per_s=20e6),
            "d": consumer("recompute", timeout_s=TIMEOUT_S, secret_file=str(secrets["d"])),
            "d_fail": consumer("fail", timeout_s=TIMEOUT_S, secret_file=str(secrets["d_fail"])),
        },
    )
    other = start_engines(str(renamed), {"p_other": producer(lease_s=LEASE_S)})
    engines.actors.update(other.actors)
    yield engines
    engines.stop()


async def plain(engine, prompt):
    return tokens(await generate(engine, prompt, greedy(MAX_TOKENS), rid("plain")))


async def held_blocks(engine) -> int:
    return (await engine.stats.remote()).kv.gauges.blocks_held


async def failures(engine, reason: str) -> int:
    return (await engine.stats.remote()).kv.counters.failures.get(reason, 0)


async def assert_producer_drains(engine, within: float = LEASE_S + 10):
    """Every lease given out so far has ended (so a zero is not read before an offer even
    registered) and the producer holds no blocks."""
    leases_end = time.time() + LEASE_S

    async def drained():
        return time.time() > leases_end and await held_blocks(engine) == 0

    await wait_for(drained, within, "the producer's held blocks to return to zero")


def closed_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def wrong_port(handle):
    handle["remote_ports"] = [closed_port()]


async def check_recompute(engines, prompt, reason, producer_name="p", mutate=None):
    expected = await plain(engines[producer_name], prompt)
    before = await failures(engines["d"], reason)
    started = time.monotonic()
    result = await disaggregated(engines[producer_name], engines["d"], prompt, MAX_TOKENS, mutate)
    assert time.monotonic() - started < TIMEOUT_S + 20
    assert result.tokens == expected
    counters = (await engines["d"].stats.remote()).kv.counters
    assert counters.failures.get(reason, 0) == before + 1, counters


async def check_fail(engines, prompt, reason, producer_name="p", mutate=None):
    started = time.monotonic()
    with pytest.raises(KVLoadFailed) as failed:
        await disaggregated(engines[producer_name], engines["d_fail"], prompt, MAX_TOKENS, mutate)
    assert failed.value.reason == reason
    assert "KV transfer failed" in str(failed.value)
    assert time.monotonic() - started < TIMEOUT_S + 20


async def test_handle_pointing_at_a_wrong_port(engines, corpus):
    before = (await engines["d"].stats.remote()).handovers_recomputed_total
    await check_recompute(engines, corpus[40:340], "connect", mutate=wrong_port)
    after = await engines["d"].stats.remote()
    assert after.handovers_recomputed_total == before + 1
    assert "the pull failed (connect" in after.last_recompute
    await check_fail(engines, corpus[60:300], "connect", mutate=wrong_port)
    await assert_producer_drains(engines["p"])  # nobody pulled: the leases ran out


async def test_expired_lease(engines, corpus):
    prompt = corpus[80:500]
    expected = await plain(engines["p"], prompt)
    expired_before = (await engines["p"].stats.remote()).kv.counters.leases_expired
    first = await prefill(engines["p"], prompt, MAX_TOKENS)
    handle = first[-1].handle

    async def lease_ended():
        stats = await engines["p"].stats.remote()
        return (
            time.time() > handle["lease_deadline"]
            and stats.kv.gauges.blocks_held == 0
            and stats.kv.counters.leases_expired > expired_before
        )

    await wait_for(lease_ended, LEASE_S + 10, "the lease to end and its blocks to be freed")
    before = await failures(engines["d"], "lease_expired")
    rest = await decode(engines["d"], prompt, greedy(MAX_TOKENS), tokens(first), handle)
    assert tokens(first) + tokens(rest) == expected
    assert await failures(engines["d"], "lease_expired") == before + 1


async def test_expired_lease_under_fail_policy(engines, corpus):
    def expired(handle):
        handle["lease_deadline"] = time.time() - 1

    await check_fail(engines, corpus[90:400], "lease_expired", mutate=expired)


async def test_wrong_secret(engines, corpus, secrets):
    for name in ("d", "d_fail"):
        secrets[name].write_text("not-the-cluster-secret")
    try:
        await check_recompute(engines, corpus[120:600], "auth")
        await check_fail(engines, corpus[130:450], "auth")
    finally:
        for name in ("d", "d_fail"):
            secrets[name].write_text(SECRET)
    await assert_producer_drains(engines["p"])


async def test_handshake_mismatch(engines, corpus):
    await check_recompute(engines, corpus[150:700], "handshake", producer_name="p_other")
    await check_fail(engines, corpus[160:420], "handshake", producer_name="p_other")
    await assert_producer_drains(engines["p_other"])


HOSTILE_HANDLES = {
    "infinite token count": {"remote_num_tokens": float("inf")},
    "token count as text": {"remote_num_tokens": "300"},
    "a host outside the cluster": {"remote_host": "10.255.255.1"},
    "negative block ids": {"remote_block_ids": [-1, -2]},
    "a million blocks": {"remote_block_ids": list(range(1_000_000))},
    "no lease deadline": {"lease_deadline": None},
}


async def test_hostile_handles_fail_one_request_never_an_engine(engines, corpus):
    """Handles no producer would write reach the consumer's connector: each fails its request
    under the policy (recompute: the right tokens anyway; fail: KVLoadFailed bad_handle), and
    both engines keep serving."""
    prompt = corpus[500:800]
    expected = await plain(engines["p"], prompt)
    for name, change in HOSTILE_HANDLES.items():
        before = await failures(engines["d"], "bad_handle")
        result = await disaggregated(engines["p"], engines["d"], prompt, MAX_TOKENS, _set(change))
        assert result.tokens == expected, name
        assert await failures(engines["d"], "bad_handle") == before + 1, name
        with pytest.raises(KVLoadFailed) as failed:
            await disaggregated(engines["p"], engines["d_fail"], prompt, MAX_TOKENS, _set(change))
        assert failed.value.reason == "bad_handle", name
    for name in ("p", "d", "d_fail"):
        assert await engines[name].check_health.remote(), f"engine {name} died"
    await assert_producer_drains(engines["p"])


async def test_a_decode_node_asked_to_act_as_producer_serves_the_request_as_itself(engines, corpus):
    from vllm import SamplingParams

    params = SamplingParams(
        temperature=0,
        max_tokens=MAX_TOKENS,
        ignore_eos=True,
        extra_args={"kv_transfer_params": {"do_remote_decode": True, "remote_readers": 3}},
    )
    prompt = corpus[900:1000]
    got = tokens(await generate(engines["d"], prompt, params, rid("as-producer")))
    assert got == await plain(engines["d"], prompt)
    assert await engines["d"].check_health.remote()


def _set(change: dict):
    def mutate(handle: dict) -> None:
        handle.update(change)

    return mutate


async def test_kv_that_never_crosses_is_counted_and_named_though_nothing_failed(engines, corpus):
    """A handle the decode engine ignores (as a proxy that drops `do_remote_prefill` leaves
    it): the answer is right and no pull fails, so only the hand-over check sees that the KV
    never crossed — it counts the hand-over as recomputed and names the transport and the peer
    (what /health, the log line and the PdserveKVNotCrossing alert show)."""
    prompt = corpus[700:1100]
    before = await engines["d"].stats.remote()

    def ignored(handle):
        handle["do_remote_prefill"] = False

    result = await disaggregated(engines["p"], engines["d"], prompt, MAX_TOKENS, ignored)
    assert result.tokens == await plain(engines["p"], prompt)
    after = await engines["d"].stats.remote()
    assert after.kv.counters.failures == before.kv.counters.failures
    assert after.kv.counters.transfers_received == before.kv.counters.transfers_received
    assert after.handovers_total == before.handovers_total + 1
    assert after.handovers_recomputed_total == before.handovers_recomputed_total + 1
    port = result.handle["remote_ports"][0]
    assert "KV transport tcp" in after.last_recompute
    assert f"127.0.0.1:[{port}]" in after.last_recompute
    good = await disaggregated(engines["p"], engines["d"], corpus[1200:1500], MAX_TOKENS)
    assert good.tokens == await plain(engines["p"], corpus[1200:1500])
    last = await engines["d"].stats.remote()
    assert last.handovers_total == after.handovers_total + 1
    assert last.handovers_recomputed_total == after.handovers_recomputed_total, last.last_recompute
    await assert_producer_drains(engines["p"])


async def test_an_engine_error_of_its_own_is_passed_on_not_taken_for_a_failed_pull(engines, corpus):
    """vLLM ends a request with an error of its own, too: a regex of an unassigned code point
    (U+BBA58, found by the fuzzing tier's requests) leaves its grammar no token to allow, and it
    rejects the one it sampled (one engine's answer: the error; vLLM's server makes it a 500).
    A decode leg that ends so passes the error on, as one engine does, under either policy: no
    pull failed, so it is not named a KV failure (the client was told the KV did not cross)."""
    from vllm import SamplingParams
    from vllm.sampling_params import StructuredOutputsParams

    params = SamplingParams(
        temperature=0, max_tokens=8, structured_outputs=StructuredOutputsParams(regex="\U000bba58")
    )
    prompt = corpus[1500:1540]
    whole = await generate(engines["p"], prompt, params, rid("plain"))
    assert whole[-1].finish_reason == "error"  # one engine's answer: what the legs must give
    for name in ("d", "d_fail"):
        before = await engines[name].stats.remote()
        first = await call(engines["p"], Prefill(rid("prefill"), prompt, params, False))
        deltas = await decode(engines[name], prompt, params, [], first[-1].handle)
        assert deltas[-1].finish_reason == "error", (name, deltas[-1])
        assert tokens(deltas) == tokens(whole)
        after = await engines[name].stats.remote()
        assert after.kv.counters.failures == before.kv.counters.failures
    await assert_producer_drains(engines["p"])


async def test_producer_killed_mid_transfer(engines, corpus):
    """Last: kills the producer. ~44 MB at 20 MB/s leaves two seconds to cut the transfer."""
    prompt = corpus[200:2100]
    expected = await plain(engines["p"], prompt)
    before = await failures(engines["d"], "connection_reset")
    first = await prefill(engines["p"], prompt, MAX_TOKENS)
    handle = first[-1].handle
    decoding = asyncio.ensure_future(
        decode(engines["d"], prompt, greedy(MAX_TOKENS), tokens(first), handle)
    )
    (port,) = handle["remote_ports"]

    async def pulling():
        """A consumer connected to the producer's KV server (seen on the wire: a sync pull holds
        the decode engine's step, so its stats say nothing until the pull has ended)."""
        return any(
            c.status == psutil.CONN_ESTABLISHED and c.laddr and c.laddr.port == port
            for c in psutil.net_connections(kind="tcp4")
        )

    await wait_for(pulling, 60, "the decode engine to start pulling")
    ray.kill(engines["p"], no_restart=True)
    started = time.monotonic()
    rest = await asyncio.wait_for(decoding, TIMEOUT_S + 60)
    assert tokens(first) + tokens(rest) == expected
    assert time.monotonic() - started < TIMEOUT_S + 60
    assert await failures(engines["d"], "connection_reset") == before + 1
