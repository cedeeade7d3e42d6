"""From per-request records to the report's figures: percentiles, throughput, goodput.

Definitions (the same as vLLM's `bench serve`):
- TTFT: send to the first streamed token;
- inter-token latency (ITL): the gap between consecutive streamed chunks, per token (a chunk
  carrying k tokens counts k gaps of gap/k);
- TPOT: per request, (end-to-end latency - TTFT) / (output tokens - 1);
- goodput: requests per second that finished and met both the TTFT SLO and the TPOT SLO.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

PERCENTILES = (50, 90, 99)


@dataclass
class RequestRecord:
    index: int
    kind: str
    prompt_tokens: int
    sent_s: float
    """Send time, seconds from the run's start."""
    token_times_s: list[float] = field(default_factory=list)
    """Arrival time of each streamed chunk with text, seconds from the run's start."""
    token_counts: list[int] = field(default_factory=list)
    """Tokens in each of those chunks."""
    output_tokens: int = 0
    end_s: float | None = None
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None and self.end_s is not None and self.output_tokens > 0

    @property
    def ttft(self) -> float | None:
        return self.token_times_s[0] - self.sent_s if self.token_times_s else None

    @property
    def e2e(self) -> float | None:
        return None if self.end_s is None else self.end_s - self.sent_s

    @property
    def tpot(self) -> float | None:
        if not self.ok or self.output_tokens < 2 or self.ttft is None:
            return None
        return (self.e2e - self.ttft) / (self.output_tokens - 1)

    def itls(self) -> list[tuple[float, float]]:
        """(time, inter-token latency) for every token after the first."""
        gaps = []
        for i in range(1, len(self.token_times_s)):
            count = max(1, self.token_counts[i])
            gap = (self.token_times_s[i] - self.token_times_s[i - 1]) / count
            gaps.extend((self.token_times_s[i], gap) for _ in range(count))
        return gaps


def percentile(values: Sequence[float], q: float) -> float | None:
    """The q-th percentile with linear interpolation between closest ranks (numpy's default)."""
    if not values:
        return None
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100
    low, high = math.floor(rank), math.ceil(rank)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def distribution(values: Sequence[float]) -> dict[str, float | None]:
    summary: dict[str, float | None] = {f"p{q}": percentile(values, q) for q in PERCENTILES}
    summary["mean"] = sum(values) / len(values) if values else None
    summary["max"] = max(values) if values else None
    return summary


def goodput(
    records: Sequence[RequestRecord], duration_s: float, ttft_slo_s: float, tpot_slo_s: float
) -> float:
    """Requests per second that met both SLOs (a one-token request has no TPOT to miss)."""
    good = sum(
        1
        for r in records
        if r.ok
        and r.ttft is not None
        and r.ttft <= ttft_slo_s
        and (r.tpot is None or r.tpot <= tpot_slo_s)
    )
    return good / duration_s if duration_s > 0 else 0.0


def summarize(
    records: Sequence[RequestRecord], duration_s: float, ttft_slo_s: float, tpot_slo_s: float
) -> dict:
    """The figures of one run. `steady` latencies exclude the interference workload's long
    prompts (whose own TTFT is long by design); `all` includes every request."""
    ok = [r for r in records if r.ok]
    steady = [r for r in ok if r.kind == "steady"]
    output = sum(r.output_tokens for r in ok)
    return {
        "requests": len(records),
        "completed": len(ok),
        "errors": len(records) - len(ok),
        "error_samples": sorted({r.error for r in records if r.error})[:5],
        "duration_s": duration_s,
        "request_throughput": len(ok) / duration_s if duration_s else 0.0,
        "output_tokens_per_s": output / duration_s if duration_s else 0.0,
        "goodput": goodput(steady, duration_s, ttft_slo_s, tpot_slo_s),
        "goodput_slo": {"ttft_s": ttft_slo_s, "tpot_s": tpot_slo_s},
        "ttft_s": distribution([r.ttft for r in steady if r.ttft is not None]),
        "itl_s": distribution([gap for r in steady for _, gap in r.itls()]),
        "tpot_s": distribution([r.tpot for r in steady if r.tpot is not None]),
        "e2e_s": distribution([r.e2e for r in steady if r.e2e is not None]),
        "long_prompt_ttft_s": distribution(
            [r.ttft for r in ok if r.kind == "long" and r.ttft is not None]
        ),
    }
