"""A concurrent batch through prefill -> KV transfer -> decode equals one engine's batch, in
float32 (bf16 greedy output on this CPU depends on batch composition; fp32 does not) — with the
KV loaded in the step that admits each request (`load: sync`, the default) and beside the steps
(`async`)."""

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
        {"p": producer(), "d": consumer(), "d_async": consumer(load="async"), "ref": plain()},
        kv_cache_gib=2,
    )
    yield engines
    engines.stop()


@pytest.mark.parametrize("decode", ["d", "d_async"])
async def test_concurrent_batch_matches_one_engine_in_float32(engines, corpus, decode):
    batch = [corpus[i * 37 : i * 37 + n] for i, n in enumerate(LENGTHS)]
    before = (await engines[decode].stats.remote()).kv.counters.transfers_received
    expected, got = await asyncio.gather(
        asyncio.gather(*(reference(engines["ref"], p, MAX_TOKENS) for p in batch)),
        asyncio.gather(
            *(disaggregated(engines["p"], engines[decode], p, MAX_TOKENS) for p in batch)
        ),
    )
    differ = [n for n, want, pd in zip(LENGTHS, expected, got, strict=True) if pd.tokens != want]
    assert not differ, f"prompt lengths whose tokens differ: {differ}"
    counters = (await engines[decode].stats.remote()).kv.counters
    assert not counters.failures, counters
    assert counters.transfers_received - before == len(batch), counters
