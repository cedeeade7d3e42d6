"""A concurrent batch through prefill -> KV transfer -> decode equals one engine's batch, in
float32 (bf16 greedy output on this CPU depends on batch composition; fp32 does not) — with the
KV loaded in the step that admits each request (`load: sync`, the default) over the TCP plane,
and beside the steps (`async`) over NIXL (UCX on loopback between the two engine processes),
whose pair also goes prompt by prompt. (How a pull waits is the same code whatever plane moves
the bytes.)"""

from __future__ import annotations

import asyncio

import pytest

from tests.engines.harness import (
    consumer,
    disaggregated,
    plain,
    producer,
    reference,
    start_engines,
)

LENGTHS = [3, 100, 128, 129, 257, 300, 385, 512, 700, 1000, 1300, 1700]
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def engines(ray_session, default_model_dir):
    engines = start_engines(
        str(default_model_dir),
        {
            "p": producer(),
            "d": consumer(),
            "p_nixl": producer(transport="nixl"),
            "d_nixl": consumer(transport="nixl", load="async"),
            "ref": plain(),
        },
    )
    yield engines
    engines.stop()


@pytest.mark.parametrize("prefill, decode", [("p", "d"), ("p_nixl", "d_nixl")])
async def test_concurrent_batch_matches_one_engine_in_float32(engines, corpus, prefill, decode):
    batch = [corpus[i * 37 : i * 37 + n] for i, n in enumerate(LENGTHS)]
    before = (await engines[decode].stats.remote()).kv.counters.transfers_received
    expected, got = await asyncio.gather(
        asyncio.gather(*(reference(engines["ref"], p, MAX_TOKENS) for p in batch)),
        asyncio.gather(
            *(disaggregated(engines[prefill], engines[decode], p, MAX_TOKENS) for p in batch)
        ),
    )
    differ = [n for n, want, pd in zip(LENGTHS, expected, got, strict=True) if pd.tokens != want]
    assert not differ, f"prompt lengths whose tokens differ: {differ}"
    stats = await engines[decode].stats.remote()
    counters = stats.kv.counters
    assert not counters.failures, counters
    assert counters.transfers_received - before == len(batch), counters
    assert stats.handovers_recomputed_total == 0, stats.last_recompute


async def test_nixl_hands_over_prompt_by_prompt_as_one_engine(engines, corpus):
    """Sequential prompts across block boundaries, each KV READ by NIXL: tokens equal, one
    transfer per prompt and no failure (no recompute), the same bytes counted on both sides."""
    lengths = [1, 127, 128, 129, 700, 1600]
    before = await engines["d_nixl"].stats.remote()
    sent_before = (await engines["p_nixl"].stats.remote()).kv.counters.bytes_sent
    differ = []
    for n in lengths:
        prompt = corpus[1000 - n // 2 : 1000 - n // 2 + n]
        got = await disaggregated(engines["p_nixl"], engines["d_nixl"], prompt, MAX_TOKENS)
        if got.tokens != await reference(engines["ref"], prompt, MAX_TOKENS):
            differ.append(n)
    assert not differ, f"prompt lengths whose tokens differ over nixl: {differ}"
    after = await engines["d_nixl"].stats.remote()
    received = after.kv.counters.bytes_received - before.kv.counters.bytes_received
    assert after.kv.counters.transfers_received - before.kv.counters.transfers_received == 6
    assert not after.kv.counters.failures
    assert after.handovers_total - before.handovers_total == len(lengths)
    assert after.handovers_recomputed_total == 0, after.last_recompute
    sent = (await engines["p_nixl"].stats.remote()).kv.counters.bytes_sent - sent_before
    assert received == sent > 0
