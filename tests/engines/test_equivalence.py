"""Prefill node -> KV transfer -> decode node gives the tokens of one plain engine.

Real vLLM CPU engines (SmolLM2-135M, float32, eager, prefix caching on) in Ray actors: a prefill
and a decode node over pdserve's TCP plane, a pair over NIXL (UCX on loopback between the two
engine processes, the decode node loading beside the steps: `load: async`), and a plain engine,
the one-engine reference, laid out as vLLM lays out a CPU engine (its model worker in a process
of its own; pdserve's run inside the EngineCore's process), so each comparison with it also
checks pdserve's layout against vLLM's. One set for the module; tests read counters as
differences. Exact comparisons run in float32: bf16 kernels differ between CPUs (oneDNN/AMX on
Intel), so bit-exact bf16 holds on one host and not another, and bf16 greedy output depends on
batch composition.
"""

from __future__ import annotations

import asyncio
import math
import time

import pytest
import ray

from pdserve_core.engine.legs import Prefill
from pdserve_core.engine.types import CACHE_SALT_ARG, OUTPUT_START_ARG
from pdserve_core.roofline.serving import CPU_BLOCK_TOKENS, CPU_CHUNK_TOKENS
from tests.engines.harness import (
    consumer,
    decode,
    disaggregated,
    generate,
    greedy,
    plain,
    prefill,
    producer,
    reference,
    rid,
    start_engines,
    tokens,
    wait_for,
)

BLOCK = CPU_BLOCK_TOKENS  # every engine here runs a CPU engine's default KV block
MAX_TOKENS = 16
# 1 token to near max_model_len (2048); block boundaries (k*32; k*128, vLLM's CPU default) and
# one past them; slices from the start of the corpus share prefixes with each other (prefix
# caching on both sides).
SHARED = [1, 2, 7, 32, 33, 64, 127, 128, 129, 255, 256, 257, 385, 513, 777, 1025, 1600, 2000]
FRESH = [(700, 5), (900, 129), (1100, 300), (1400, 641), (1800, 384), (300, 1500)]


@pytest.fixture(scope="module")
def engines(ray_session, default_model_dir):
    roles = {
        "p": producer(),
        "d": consumer(),
        "p_nixl": producer(transport="nixl"),
        "d_nixl": consumer(transport="nixl", load="async"),
        "ref": plain(),
    }
    engines = start_engines(str(default_model_dir), roles, worker_process=("ref",))
    yield engines
    engines.stop()


def test_the_reference_has_vllms_worker_process_and_the_nodes_none(engines):
    import psutil

    def workers(name: str) -> list:
        actor = psutil.Process(engines.infos[name].pid)
        return [p for p in actor.children(recursive=True) if p.name().startswith("VLLM::Worker")]

    assert len(workers("ref")) == 1
    assert [name for name in ("p", "d", "p_nixl", "d_nixl") if workers(name)] == []


async def test_a_step_is_timed_with_its_forward_pass(engines, corpus):
    """The step times an engine records (prefill rates, utilization and calibrations are made of
    them) hold the step's forward pass with the worker inside the EngineCore, as with a worker
    process: the step that computes a 1,500-token prompt takes many decode steps' time. (vLLM's
    own one-process executor runs the pass before the span it times: both would read as the
    sampling alone.)"""
    node = engines["d"]  # in the EngineCore's process
    seen = (await node.step_records.remote())["steps_seen"]
    await generate(node, corpus[-1500:], greedy(8), rid("timed"))
    records = await node.step_records.remote(seen)
    steps = records["records"]
    prompt = sum(s[5] for s in steps if s[0] > 0)  # in chunks
    decode = sorted(s[5] for s in steps if s[0] == 0 and s[2] > 0)
    assert decode and prompt > 5 * decode[len(decode) // 2], (prompt, decode)
    # a CPU decode engine's default chunk: the prompt's steps end one after another; a prefill
    # engine keeps vLLM's own
    assert records["max_num_batched_tokens"] == CPU_CHUNK_TOKENS
    chunks = [s[0] for s in steps if s[0] > 0]
    assert len(chunks) >= 2 and max(chunks) <= CPU_CHUNK_TOKENS, chunks
    prefill = await engines["p"].step_records.remote()
    assert prefill["max_num_batched_tokens"] > CPU_CHUNK_TOKENS
    # and every CPU engine, whatever its role, its default KV block: a prefill engine's blocks
    # line up with a decode engine's
    assert {info.block_size for info in engines.infos.values()} == {CPU_BLOCK_TOKENS}


async def test_the_first_request_with_logprobs_finds_the_sampler_compiled(engines, corpus):
    """vLLM compiles its sampler's logprob kernel the first time a request asks for logprobs,
    inside that step, every stream on the engine waiting (2.3 s on a 2-core Xeon with inductor's
    cache warm, 11 s cold); the engine actor compiles it at start instead
    (pdserve_core/engine/worker.py). So on a fresh engine that request's steps take their usual
    tens of milliseconds, and none is a stall. The module's first test: no request has reached
    `ref` before it."""
    from vllm import SamplingParams

    ref = engines["ref"]
    before = await ref.stats.remote()
    assert before.busy_steps_total == 0, "a request reached `ref` before this test"
    params = SamplingParams(temperature=0, max_tokens=4, logprobs=2, prompt_logprobs=1)
    deltas = await generate(ref, corpus[:40], params, rid("logprobs"))
    assert sum(len(d.logprobs or []) for d in deltas) == 4 and deltas[0].prompt_logprobs
    after = await ref.stats.remote()
    assert after.stalls_total == 0, after
    assert after.busy_seconds_total < 1.0, f"{after.busy_steps_total} steps took {after}"


def prompts(corpus):
    cases = [(f"prefix-{n}", corpus[:n]) for n in SHARED]
    cases += [(f"fresh-{start}+{n}", corpus[start : start + n]) for start, n in FRESH]
    return cases


async def test_greedy_tokens_match_one_engine_prompt_by_prompt(engines, corpus, kv_bytes_per_token):
    mismatches, checked = [], 0
    block_bytes = BLOCK * kv_bytes_per_token
    for name, prompt in prompts(corpus):
        before = await engines["d"].stats.remote()
        result, expected = await asyncio.gather(  # one request on each engine at a time
            disaggregated(engines["p"], engines["d"], prompt, MAX_TOKENS),
            reference(engines["ref"], prompt, MAX_TOKENS),
        )
        checked += 1
        if result.tokens != expected:
            mismatches.append((name, result.tokens, expected))

        prompt_total = before.prompt_tokens_total + len(prompt) + 1

        async def recorded(prompt_total=prompt_total):
            after = await engines["d"].stats.remote()
            return after if after.prompt_tokens_total >= prompt_total else None

        # the step that reports a pull finished carries its byte count, and comes before the
        # step that schedules the request (whose prompt tokens we wait for)
        after = await wait_for(recorded, 10, f"D's stats for {name}")
        shipped = after.kv.counters.bytes_received - before.kv.counters.bytes_received
        loaded = after.prompt_tokens_transferred_total - before.prompt_tokens_transferred_total
        computed = after.prompt_tokens_computed_total - before.prompt_tokens_computed_total
        # bytes = KV bytes/token x tokens loaded, rounded up to whole blocks
        assert shipped == math.ceil(shipped / block_bytes) * block_bytes, name
        assert loaded * kv_bytes_per_token <= shipped < (loaded + BLOCK) * kv_bytes_per_token, name
        # the decode engine computed only the producer's token, never the prompt
        assert computed == 1, (name, computed)
        if name.startswith("fresh"):
            assert loaded == len(prompt), name
    assert checked == 24
    assert not mismatches, f"{len(mismatches)} of {checked} differ: {mismatches[:3]}"


WIDE = (
    "Complete this sentence with emojis: I love coding 🚀",
    "天空是什么颜色？请用中文回答。",
    "日本の首都はどこですか？日本語で答えてください。",
)
"""Prompts whose greedy answers are emoji or CJK: characters of several byte-level tokens."""


async def test_text_across_the_seam_is_one_engines_whatever_byte_a_token_ends_on(
    engines, tokenizer
):
    """The decode leg (prompt + the prefill's token) and a resumed request (prompt + the tokens
    sent) give the text one engine streams, even where the tokens already sent end halfway
    through a character — the engine's own detokenizer, primed with such a prompt, would emit
    the whole prompt's text with the next character (pdserve_core/engine/text.py)."""
    partial = 0
    for words in WIDE:
        prompt = tokenizer(words).input_ids
        expected = await generate(engines["ref"], prompt, greedy(12), rid("ref"))
        assert all(len(d.token_ids) == 1 for d in expected)
        text = [d.text for d in expected]
        partial += sum(piece == "" for piece in text[:3])
        first = await prefill(engines["p"], prompt, 12)
        rest = await decode(engines["d"], prompt, greedy(12), tokens(first), first[-1].handle)
        assert tokens(first + rest) == tokens(expected)
        assert "".join(d.text for d in first + rest) == "".join(text), words
        for sent in (1, 2):  # a stream resumed after `sent` tokens, on the plain engine
            params = greedy(12 - sent)
            params.extra_args = {OUTPUT_START_ARG: len(prompt)}
            resumed_prompt = prompt + tokens(expected)[:sent]
            resumed = await generate(engines["ref"], resumed_prompt, params, rid("resumed"))
            assert "".join(d.text for d in resumed) == "".join(text[sent:]), (words, sent)
    assert partial > 0  # some token did end mid-character: the case the test is for


LENGTHS = [3, 100, 128, 129, 257, 300, 385, 512, 700, 1000, 1300, 1700]
BATCH_MAX_TOKENS = 12


@pytest.mark.parametrize("prefill, decode", [("p", "d"), ("p_nixl", "d_nixl")])
async def test_concurrent_batch_matches_one_engine_in_float32(engines, corpus, prefill, decode):
    """A concurrent batch through the pair equals one engine's batch: with the KV loaded in the
    step that admits each request (`load: sync`, the default) over the TCP plane, and beside
    the steps (`async`) over NIXL. (How a pull waits is the same code whatever plane moves the
    bytes.)"""
    batch = [corpus[i * 37 : i * 37 + n] for i, n in enumerate(LENGTHS)]
    before = (await engines[decode].stats.remote()).kv.counters.transfers_received
    expected, got = await asyncio.gather(
        asyncio.gather(*(reference(engines["ref"], p, BATCH_MAX_TOKENS) for p in batch)),
        asyncio.gather(
            *(disaggregated(engines[prefill], engines[decode], p, BATCH_MAX_TOKENS) for p in batch)
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
        got, expected = await asyncio.gather(
            disaggregated(engines["p_nixl"], engines["d_nixl"], prompt, BATCH_MAX_TOKENS),
            reference(engines["ref"], prompt, BATCH_MAX_TOKENS),
        )
        if got.tokens != expected:
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


async def test_a_prefill_leg_stopped_as_its_kv_was_kept_gives_it_back_at_once(engines, corpus):
    """The router stops a prefill leg (its client left) an instant after vLLM finished the
    prefill and kept the KV for a decode: the router never gets the handle, so the prefill node
    itself gives back what its engine kept for that leg — within seconds, not when the lease
    ends (30 s here). The leg's stream is held at its last delta (Ray's backpressure: one unread
    object pauses the node's generator there), then cancelled as the router would."""
    lease_s = 30.0
    for name in ("p", "p_nixl"):
        node = engines[name]

        async def held(node=node) -> int:
            return (await node.stats.remote()).kv.gauges.blocks_held

        async def none_held(node=node) -> bool:
            return await held(node) == 0

        await wait_for(none_held, 15, f"{name} to hold no KV before the leg")
        leg = Prefill(rid("stopped"), corpus[1000:1400], greedy(MAX_TOKENS))
        stream = node.stream.options(
            num_returns="streaming", _generator_backpressure_num_objects=1
        ).remote(leg)
        kept = await wait_for(held, 60, f"{name} to keep the prefill's KV for a decode")
        assert kept == math.ceil(400 / BLOCK)
        ray.cancel(stream)
        stopped = time.monotonic()
        await wait_for(none_held, lease_s, f"{name} to free the stopped leg's KV")
        freed_s = time.monotonic() - stopped
        assert freed_s < 10 < lease_s, (name, freed_s)
        print(f"{name}: the stopped leg's {kept} blocks freed {freed_s:.2f} s after the stop")
        assert (await node.stats.remote()).kv.counters.leases_expired == 0, name


@pytest.mark.parametrize("name", ["ref", "d"])
async def test_a_seeded_prompt_split_across_steps_samples_as_if_whole(engines, corpus, name):
    """Three seeded prompts of 1,500 tokens at once pass any CPU engine's step (256 tokens on
    pdserve's that decode, vLLM's 2,048 on others), so the engine splits at least one across
    steps and drops the token it samples on each part but the last.
    vLLM then rewinds its seeded generator by CUDA's counter, which a CPU generator does not
    have: unmended, the EngineCore dies here. Each sample must also be the one it gets alone
    (another salt: computed afresh, in one step), whether vLLM's worker runs in a process of its
    own (`ref`) or inside the EngineCore's (`d`, pdserve's layout)."""
    from vllm import SamplingParams

    def seeded(seed: int, salt: str) -> SamplingParams:
        extra = {CACHE_SALT_ARG: f"{name}-{salt}"}
        return SamplingParams(
            temperature=1.0, seed=seed, max_tokens=8, ignore_eos=True, extra_args=extra
        )

    node = engines[name]
    seen = (await node.step_records.remote())["steps_seen"]
    batch = [corpus[300 + 400 * i : 1800 + 400 * i] for i in range(3)]
    together = await asyncio.gather(
        *(generate(node, p, seeded(7 + i, "together"), rid("seeded")) for i, p in enumerate(batch))
    )
    steps = (await node.step_records.remote(seen))["records"]
    assert any(s[0] % 1500 for s in steps), f"no prompt was split: {[s[0] for s in steps]}"
    alone = [
        await generate(node, p, seeded(7 + i, "alone"), rid("seeded")) for i, p in enumerate(batch)
    ]
    assert [tokens(d) for d in together] == [tokens(d) for d in alone]
    assert all(len(tokens(d)) == 8 for d in alone)


async def test_nothing_is_left_held_after_the_requests(engines):
    for name, sent in (("p", 22 + len(LENGTHS)), ("p_nixl", 6 + len(LENGTHS))):

        async def drained(name=name):
            stats = await engines[name].stats.remote()
            return stats.kv.gauges.blocks_held == 0 and stats.kv_cache_usage == 0.0

        await wait_for(drained, 15, f"{name} to free every held block")
        stats = await engines[name].stats.remote()
        assert stats.kv.counters.transfers_sent >= sent, (name, stats.kv.counters)
        assert stats.kv.counters.leases_expired == 0, name
