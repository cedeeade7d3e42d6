"""Traffic that comes back: multi-turn conversations, each turn the whole history again.

Each conversation starts with a system prompt every conversation shares, then alternates a user
message and the model's answer: turn t sends the system prompt, every earlier message and
answer (the answers' own token ids, as the server returned them) and the new message, then the
client thinks before the next turn. Prompts are token ids on /v1/completions (exact lengths, no
tokenizer on the client), outputs forced to `output_tokens` with `ignore_eos`.

`pdserve bench multiturn` runs the same conversations against pdserve (prefix-aware routing),
pdserve with `router.prefix_aware` off, and plain vLLM (prefix caching on, its default) on the
same cores, and reports TTFT per turn, over turns >= 2, inter-token latency, and (pdserve) what
crossed between the pools: placements, KV bytes received, hand-over blocks received or already
cached.
"""

from __future__ import annotations

import asyncio
import random
import time
from dataclasses import dataclass
from typing import Any

import httpx

from pdserve.bench.client import stream_into
from pdserve.bench.stats import RequestRecord, percentile
from pdserve.bench.workload import TOKEN_RANGE

SYSTEMS = ("pdserve", "blind", "vllm")
"""pdserve as configured (prefix-aware), pdserve with `router.prefix_aware=false`, plain vLLM."""


@dataclass(frozen=True)
class Conversations:
    conversations: int = 12
    turns: int = 6
    system_tokens: int = 128
    """The system prompt every conversation starts with."""
    message_tokens: int = 128
    """Each user message (about 96 words)."""
    output_tokens: int = 64
    think_s: float = 2.0
    """The client's pause between an answer's end and its next message."""
    start_every_s: float = 1.0
    """Conversations start this far apart."""
    seed: int = 0

    def messages(self) -> tuple[list[int], list[list[list[int]]]]:
        """The shared system prompt and each conversation's user messages."""
        rng = random.Random(self.seed)

        def tokens(n: int) -> list[int]:
            return [rng.randrange(*TOKEN_RANGE) for _ in range(n)]

        system = tokens(self.system_tokens)
        return system, [
            [tokens(self.message_tokens) for _ in range(self.turns)]
            for _ in range(self.conversations)
        ]


async def _turn(
    http: httpx.AsyncClient, prompt: list[int], model: str, max_tokens: int, start: float,
    record: RequestRecord, timeout_s: float,
) -> list[int]:  # fmt: skip
    """One streamed turn; the answer's token ids (empty on an error, which `record` says)."""
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
        "return_token_ids": True,
    }
    answer: list[int] = []

    def take_ids(event: dict) -> None:
        for choice in event.get("choices") or ():
            answer.extend(choice.get("token_ids") or [])

    await stream_into(http, body, record, start, timeout_s, take_ids)
    if record.error is None and len(answer) != record.output_tokens:
        record.error = f"{len(answer)} token ids returned for {record.output_tokens} tokens"
    return answer if record.error is None else []


async def run_conversations(
    url: str,
    workload: Conversations,
    model: str,
    timeout_s: float = 300.0,
    transport: httpx.AsyncBaseTransport | None = None,
) -> list[RequestRecord]:
    """Every conversation to its last turn (or its first failed turn); one record per turn,
    `kind` "turn<t>", index conversation × turns + t. `transport`: httpx's, for tests."""
    system, messages = workload.messages()
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
    records: list[RequestRecord] = []
    client = httpx.AsyncClient(base_url=url, timeout=timeout_s, limits=limits, transport=transport)
    async with client as http:
        start = time.monotonic()

        async def converse(index: int) -> None:
            await asyncio.sleep(max(0.0, start + index * workload.start_every_s - time.monotonic()))
            history = list(system)
            for turn, message in enumerate(messages[index]):
                prompt = history + message
                record = RequestRecord(
                    index * workload.turns + turn,
                    f"turn{turn + 1}",
                    len(prompt),
                    time.monotonic() - start,
                )
                records.append(record)
                answer = await _turn(
                    http, prompt, model, workload.output_tokens, start, record, timeout_s
                )
                if not answer:
                    return
                history = prompt + answer
                await asyncio.sleep(workload.think_s)

        await asyncio.gather(*(converse(i) for i in range(workload.conversations)))
    return sorted(records, key=lambda r: r.index)


def summary(records: list[RequestRecord], turns: int) -> dict[str, Any]:
    """TTFT p50 per turn; TTFT p50 / p90 over turns >= 2 and over all; ITL p50 / p99."""

    def ttfts(kinds: set[str]) -> list[float]:
        return [r.ttft for r in records if r.ok and r.kind in kinds and r.ttft is not None]

    later = {f"turn{t}" for t in range(2, turns + 1)}
    every = later | {"turn1"}
    itls = [gap for r in records if r.ok for _, gap in r.itls()]
    return {
        "requests": len(records),
        "errors": sum(1 for r in records if not r.ok),
        "first_errors": sorted({r.error for r in records if r.error})[:3],
        "ttft_p50_by_turn_s": [percentile(ttfts({f"turn{t}"}), 50) for t in range(1, turns + 1)],
        "ttft_p50_later_s": percentile(ttfts(later), 50),
        "ttft_p90_later_s": percentile(ttfts(later), 90),
        "ttft_p50_s": percentile(ttfts(every), 50),
        "ttft_p90_s": percentile(ttfts(every), 90),
        "itl_p50_s": percentile(itls, 50),
        "itl_p99_s": percentile(itls, 99),
        "mean_prompt_tokens_later": (
            sum(r.prompt_tokens for r in records if r.kind in later)
            / max(1, sum(1 for r in records if r.kind in later))
        ),
    }


CROSSING = {
    "pdserve_kv_transfer_bytes_total": ("direction", "received"),
    "pdserve_kv_handover_blocks_total": ("outcome", None),
    "pdserve_node_prompt_tokens_total": ("source", None),
    "pdserve_prefix_expected_cached_tokens_total": ("pool", None),
    "pdserve_prefill_placements_total": ("reason", None),
}
"""Counters read from pdserve's /metrics before and after a run: name → (the label they are
summed by, the one value kept or None for all)."""


def crossing(text: str) -> dict[str, float]:
    """From /metrics text: each counter of `CROSSING` summed by its label, as "name/value"."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name not in CROSSING:
                continue
            label, keep = CROSSING[sample.name]
            value = sample.labels.get(label, "")
            if keep is not None and value != keep:
                continue
            if sample.name == "pdserve_node_prompt_tokens_total":
                value = f"{sample.labels.get('pool', '')}:{value}"
            key = f"{sample.name.removeprefix('pdserve_').removesuffix('_total')}/{value}"
            out[key] = out.get(key, 0.0) + sample.value
    return out


def difference(after: dict[str, float], before: dict[str, float]) -> dict[str, float]:
    return {key: value - before.get(key, 0.0) for key, value in after.items()}


def kv_bytes_per_token(dtype: str = "native") -> int:
    """KV cache bytes one token of the default model takes (keys and values, every layer), in
    `dtype` as this host's engines resolve it."""
    from pdserve_core.engine.dtype import resolve
    from pdserve_core.model_prep import prepare_default_model
    from pdserve_core.roofline.specs import load_model

    model = load_model(str(prepare_default_model()), resolve(dtype, gpu=False))
    return 2 * model.num_layers * model.num_kv_heads * model.head_dim * model.dtype_bytes


def text(results: dict) -> str:
    """The report: TTFT per turn and over turns >= 2, ITL, ratios, and what crossed."""
    settings, runs = results["settings"], results["runs"]
    turns = settings["turns"]
    lines = [
        "# pdserve bench multiturn",
        "",
        f"{settings['conversations']} conversations × {turns} turns: a shared "
        f"{settings['system_tokens']}-token system prompt, {settings['message_tokens']}-token "
        f"messages, {settings['output_tokens']}-token answers, {settings['think_s']} s think "
        f"time, a conversation starting every {settings['start_every_s']} s. {results['machine']}.",
        "",
        "| system | " + " | ".join(f"TTFT p50 t{t}" for t in range(1, turns + 1))
        + " | TTFT p50 t≥2 | TTFT p90 t≥2 | TTFT p90 all | ITL p50 | ITL p99 | errors |",
        "|---" * (turns + 7) + "|",
    ]  # fmt: skip
    for name, run in runs.items():
        cells = [_ms(v) for v in run["ttft_p50_by_turn_s"]]
        cells += [_ms(run[k]) for k in ("ttft_p50_later_s", "ttft_p90_later_s", "ttft_p90_s")]
        cells += [_ms(run["itl_p50_s"]), _ms(run["itl_p99_s"]), str(run["errors"])]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    for base in ("vllm", "blind"):
        if base not in runs or "pdserve" not in runs:
            continue
        ratios = [
            _ratio(runs["pdserve"][key], runs[base][key])
            for key in ("ttft_p50_later_s", "ttft_p90_later_s", "itl_p99_s")
        ]
        lines += [
            "",
            f"pdserve ÷ {base}: TTFT p50 t≥2 {ratios[0]}, TTFT p90 t≥2 {ratios[1]}, "
            f"ITL p99 {ratios[2]}.",
        ]
    for name, run in runs.items():
        crossed = run.get("crossing")
        if not crossed:
            continue
        placements = {
            k.split("/", 1)[1]: int(v)
            for k, v in crossed.items()
            if k.startswith("prefill_pl") and v
        }
        received = crossed.get("kv_transfer_bytes/received", 0.0)
        later = max(1, (turns - 1) * settings["conversations"])
        new_kv = settings["message_tokens"] * results.get("kv_bytes_per_token", 0)
        lines += [
            "",
            f"**{name}**: placements {placements}; KV received {received / 1e6:.1f} MB "
            f"({received / later / 1e6:.2f} MB per turn ≥ 2 if all were theirs; a new message's "
            f"KV is {new_kv / 1e6:.2f} MB); hand-over blocks received "
            f"{int(crossed.get('kv_handover_blocks/received', 0))}, already cached at the decode "
            f"node {int(crossed.get('kv_handover_blocks/cached', 0))}; cached prompt tokens "
            "found by the engines "
            + ", ".join(
                f"{k.split('/', 1)[1].split(':')[0]} {int(v)}"
                for k, v in crossed.items()
                if k.startswith("node_prompt_tokens/") and k.endswith(":cached")
            )
            + ", expected by the router "
            + ", ".join(
                f"{k.split('/', 1)[1]} {int(v)}"
                for k, v in crossed.items()
                if k.startswith("prefix_expected_cached_tokens/")
            )
            + ".",
        ]
    return "\n".join(lines) + "\n"


def _ms(value: float | None) -> str:
    return "–" if value is None else f"{value * 1e3:.0f} ms"


def _ratio(a: float | None, b: float | None) -> str:
    return "–" if not a or not b else f"{a / b:.2f}×"
