"""Where a disaggregated request's prompt is computed: one decision per request, one place.

- `remote`: a prefill node computes the prompt, its KV crosses to the decode node, which decodes.
  The decode node's running streams never wait for a prompt; the request pays the hand-over.
- `local`: the decode node that will decode the request computes the prompt itself, as one engine
  would. No hand-over; but its running streams wait while it does (vLLM runs the prompt in the
  same steps as their tokens), and it is the prefill pool's compute left unused.

Three modes (`router.placement.mode`):
- `remote`: every prompt on a prefill node (pdserve 0.2's behaviour).
- `threshold`: prompts of at most `threshold_tokens` tokens local, longer ones remote.
- `adaptive` (default): estimate each side's time to first token from live state,
      local  = (Qd + L) / Rd
      remote = (Qp + L) / Rp + H
  where L is the prompt's length, Qd / Qp the prompt tokens the router has sent the decode node /
  the least-loaded prefill node to compute and not yet seen a token of, Rd / Rp their prefill
  rates in tokens/s (each engine's own prompt tokens per second of prompt compute, from its
  stats; another node's, or `assumed_prefill_tokens_per_s`, before it has any), and H the recent
  hand-over gap (prefill token to the decode node's first token, an exponential average of what
  the router measures). Local wins when it is no slower and the prompt would not stall the
  decode node's streams past `stall_budget_s`: a step holding the prompt takes about
  min(L, step cap) / Rd longer (`step cap`: the engines' `long_prefill_token_threshold`, 0 for
  none). The stall counts even on a node with no stream yet: the streams that start while it
  computes wait too. One exception: when the prefill pool is so backed up that the remote first
  token would come after `ttft_slo_s` and the local one before, the prompt stays local (reason
  `prefill_backlog`): one long step for the node's streams rather than a missed first token,
  and the decode node's compute helps a prefill pool too small for the traffic.
The router sees prompt lengths, not the engines' prefix caches: L is the whole prompt.
Decisions are counted in `pdserve_prefill_placements_total{where, reason}`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from router.nodes import Node

Where = Literal["remote", "local"]
REMOTE: Where = "remote"
LOCAL: Where = "local"
DECISIONS: dict[str, dict[str, Where]] = {
    "remote": {"mode": REMOTE},
    "threshold": {"short": LOCAL, "long": REMOTE},
    "adaptive": {
        "local_faster": LOCAL,
        "prefill_backlog": LOCAL,
        "remote_faster": REMOTE,
        "stall": REMOTE,
    },
}
"""Each mode's decisions, reason → where (the metric's label values). With no healthy prefill
node every mode computes locally; that is the prefill fallback, counted on its own."""

MIN_BUSY_S = 0.5
"""Prompt compute seconds a node needs behind its rate before the rate is trusted."""
HANDOVER_WEIGHT = 0.2
"""Weight of the newest measured hand-over gap in its running average."""


@dataclass(frozen=True)
class Decision:
    where: Where
    reason: str


@dataclass(frozen=True)
class Estimate:
    """What the adaptive rule compared (seconds), kept for the log and the tests."""

    local_ttft_s: float
    remote_ttft_s: float
    stall_s: float


def prefill_rate(node: Node) -> float | None:
    """Prompt tokens per second of prompt compute, from the node's engine stats; None until it
    has computed for `MIN_BUSY_S`."""
    stats = node.stats
    if stats.prompt_busy_seconds_total < MIN_BUSY_S or not stats.prompt_tokens_computed_total:
        return None
    return stats.prompt_tokens_computed_total / stats.prompt_busy_seconds_total


class Placement:
    def __init__(
        self,
        mode: str = "remote",
        threshold_tokens: int = 256,
        stall_budget_s: float = 0.15,
        assumed_prefill_tokens_per_s: float = 1000.0,
        initial_handover_s: float = 0.1,
        step_cap_tokens: int = 0,
        ttft_slo_s: float = 1.0,
    ) -> None:
        if mode not in DECISIONS:
            raise ValueError(f"unknown placement mode {mode!r}; known: {', '.join(DECISIONS)}")
        self.mode = mode
        self.threshold_tokens = threshold_tokens
        self.stall_budget_s = stall_budget_s
        self.assumed_rate = assumed_prefill_tokens_per_s
        self.handover_s = initial_handover_s
        self.step_cap_tokens = step_cap_tokens
        self.ttft_slo_s = ttft_slo_s

    @classmethod
    def from_config(cls, config, step_cap_tokens: int = 0) -> Placement:
        """From `router.placement` (pdserve.config.PlacementConfig)."""
        return cls(
            config.mode,
            config.threshold_tokens,
            config.stall_budget_s,
            config.assumed_prefill_tokens_per_s,
            step_cap_tokens=step_cap_tokens,
            ttft_slo_s=config.ttft_slo_s,
        )

    def observe_handover(self, seconds: float) -> None:
        self.handover_s += HANDOVER_WEIGHT * (seconds - self.handover_s)

    def decide(self, prompt_tokens: int, decode: Node, prefill: list[Node]) -> Decision:
        """Where to compute a prompt of `prompt_tokens` that `decode` will decode, given the
        healthy prefill nodes `prefill`."""
        if not prefill:
            return Decision(LOCAL, "no_prefill_node")
        if self.mode == "remote":
            return Decision(REMOTE, "mode")
        if self.mode == "threshold":
            if prompt_tokens <= self.threshold_tokens:
                return Decision(LOCAL, "short")
            return Decision(REMOTE, "long")
        estimate = self.estimate(prompt_tokens, decode, prefill)
        if estimate.local_ttft_s > estimate.remote_ttft_s:
            return Decision(REMOTE, "remote_faster")
        if estimate.stall_s <= self.stall_budget_s:
            return Decision(LOCAL, "local_faster")
        if estimate.remote_ttft_s > self.ttft_slo_s >= estimate.local_ttft_s:
            return Decision(LOCAL, "prefill_backlog")
        return Decision(REMOTE, "stall")

    def estimate(self, prompt_tokens: int, decode: Node, prefill: list[Node]) -> Estimate:
        target = min(prefill, key=lambda node: node.prefilling_tokens)
        known = [rate for rate in map(prefill_rate, [decode, *prefill]) if rate]
        fallback = sum(known) / len(known) if known else self.assumed_rate
        rate_d = prefill_rate(decode) or fallback
        rate_p = prefill_rate(target) or fallback
        per_step = min(prompt_tokens, self.step_cap_tokens or prompt_tokens)
        return Estimate(
            local_ttft_s=(decode.prefilling_tokens + prompt_tokens) / rate_d,
            remote_ttft_s=(target.prefilling_tokens + prompt_tokens) / rate_p + self.handover_s,
            stall_s=per_step / rate_d,
        )
