"""Prefill node -> KV transfer -> decode node gives the tokens of one plain engine.

Real vLLM CPU engines (SmolLM2-135M, float32, eager, prefix caching on) in Ray actors,
pdserve's connector over TCP. Exact comparisons run in float32: bf16 kernels differ between
CPUs (oneDNN/AMX on Intel), so bit-exact bf16 holds on one host and not another.
"""

from __future__ import annotations

import math

import pytest

from pdserve_core.engine.types import OUTPUT_START_ARG
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

BLOCK = 128
MAX_TOKENS = 16
# 1 token to near max_model_len (2048); k*128 and k*128+1 boundaries; slices from the start of
# the corpus share prefixes with each other (prefix caching on both sides).
SHARED = [1, 2, 7, 64, 127, 128, 129, 255, 256, 257, 385, 513, 777, 1025, 1600, 2000]
FRESH = [(700, 5), (900, 129), (1100, 300), (1400, 641), (1800, 384), (300, 1500)]


@pytest.fixture(scope="module")
def engines(ray_session, default_model_dir):
    roles = {"p": producer(), "d": consumer(), "ref": plain()}
    engines = start_engines(str(default_model_dir), roles, kv_cache_gib=2)
    yield engines
    engines.stop()


def prompts(corpus):
    cases = [(f"prefix-{n}", corpus[:n]) for n in SHARED]
    cases += [(f"fresh-{start}+{n}", corpus[start : start + n]) for start, n in FRESH]
    return cases


async def test_greedy_tokens_match_one_engine_prompt_by_prompt(engines, corpus, kv_bytes_per_token):
    mismatches, checked = [], 0
    block_bytes = BLOCK * kv_bytes_per_token
    for name, prompt in prompts(corpus):
        before = await engines["d"].stats.remote()
        result = await disaggregated(engines["p"], engines["d"], prompt, MAX_TOKENS)
        expected = await reference(engines["ref"], prompt, MAX_TOKENS)
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
    assert checked == 22
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


async def test_nothing_is_left_held_after_the_requests(engines):
    async def drained():
        stats = await engines["p"].stats.remote()
        return stats.kv.gauges.blocks_held == 0 and stats.kv_cache_usage == 0.0

    await wait_for(drained, 15, "the producer to free every held block")
    stats = await engines["p"].stats.remote()
    assert stats.kv.counters.transfers_sent >= 22
    assert stats.kv.counters.leases_expired == 0
