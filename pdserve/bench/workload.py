"""What a benchmark sends and when: request shapes (prompt and output lengths) and arrivals.

Prompts are token ids (the completions API takes them as they are), so lengths are exact and no
tokenizer is needed on the client; outputs are forced to `max_tokens` with `ignore_eos`.
Workloads:
- fixed: every request has the same prompt and output length;
- random: lengths drawn uniformly within ranges;
- interference: a steady stream of short-prompt, long-output requests (the decode-heavy traffic
  whose inter-token latency suffers) plus a long prompt every `long_every_s` seconds (the
  prefill that, colocated, stalls every running decode).
Arrivals: Poisson at a rate, a fixed rate, or none (a fixed concurrency sends back to back).
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Literal

TOKEN_RANGE = (1000, 20000)
"""Token ids prompts are drawn from: ordinary vocabulary, no special tokens."""


@dataclass(frozen=True)
class RequestSpec:
    index: int
    prompt_token_ids: list[int]
    max_tokens: int
    kind: str = "steady"
    """"steady" or "long" (the interference workload's periodic long prompts)."""
    at_s: float | None = None
    """When to send it, seconds after the start (None: as soon as a slot is free)."""


@dataclass(frozen=True)
class Workload:
    name: Literal["fixed", "random", "interference"] = "fixed"
    prompt_len: int = 128
    output_len: int = 64
    prompt_range: tuple[int, int] = (32, 512)
    output_range: tuple[int, int] = (16, 128)
    long_prompt_len: int = 1536
    long_output_len: int = 16
    long_every_s: float = 10.0


def _prompt(rng: random.Random, length: int) -> list[int]:
    return [rng.randrange(*TOKEN_RANGE) for _ in range(length)]


def arrival_times(
    process: Literal["poisson", "fixed"], rate: float, count: int, rng: random.Random
) -> list[float]:
    """Send times (seconds from the start) of `count` requests at `rate` per second."""
    if rate <= 0:
        raise ValueError("the request rate must be positive")
    if process == "fixed":
        return [i / rate for i in range(count)]
    times, now = [], 0.0
    for _ in range(count):
        times.append(now)
        now += rng.expovariate(rate)
    return times


def build_requests(
    workload: Workload,
    count: int,
    arrivals: Literal["poisson", "fixed", "concurrency"],
    rate: float,
    seed: int = 0,
) -> list[RequestSpec]:
    """The `count` steady requests of a run (and, for interference, the long prompts that fall
    within the steady stream's span), sorted by send time."""
    rng = random.Random(seed)
    times: list[float | None] = (
        [None] * count
        if arrivals == "concurrency"
        else list(arrival_times(arrivals, rate, count, rng))
    )
    requests = []
    for index, at in enumerate(times):
        if workload.name == "random":
            prompt_len = rng.randint(*workload.prompt_range)
            output_len = rng.randint(*workload.output_range)
        else:
            prompt_len, output_len = workload.prompt_len, workload.output_len
        requests.append(RequestSpec(index, _prompt(rng, prompt_len), output_len, "steady", at))
    if workload.name == "interference":
        if arrivals == "concurrency":
            raise ValueError("the interference workload needs timed arrivals (poisson or fixed)")
        span = max(t for t in times if t is not None)
        at, index = workload.long_every_s / 2, count
        while at <= span:
            prompt = _prompt(rng, workload.long_prompt_len)
            requests.append(RequestSpec(index, prompt, workload.long_output_len, "long", at))
            at, index = at + workload.long_every_s, index + 1
        requests.sort(key=lambda r: r.at_s)
    return requests
