"""Where a disaggregated request's prompt is computed: one decision per request, one place.

- `remote`: a prefill node computes the prompt, its KV crosses to the decode node, which decodes.
  The decode node's running streams never wait for a prompt; the request pays the hand-over.
- `local`: the decode node that will decode the request computes the prompt itself, as one engine
  would. No hand-over; but its running streams wait while it does (vLLM runs the prompt in the
  same steps as their tokens), and it is the prefill pool's compute left unused.

Three modes (`router.placement.mode`):
- `remote`: every prompt on a prefill node (pdserve 0.2's behaviour).
- `threshold`: prompts of at most `threshold_tokens` tokens not cached on the decode node local,
  longer ones remote.
- `adaptive` (default): remote while that meets the first-token target, local when it would not
  and local would do better without stalling the decode node. From live state,
      remote = (Qp + Lp) / Rp + H         local = (Qd + Ld) / Rd         stall = min(Ld, cap) / Rd
  where Lp / Ld are the prompt tokens each node would compute (below), Qp / Qd the prompt tokens the
  router has sent the prefill node it would use (router/decides/routing.py chooses it first) / the
  decode node to compute and not yet seen a token of, Rp / Rd their prefill rates in tokens/s (each
  engine's own prompt tokens per second of prompt compute over the last minute of its stats,
  `prefill_rate`; another node's, or `assumed_prefill_tokens_per_s`, before it has any), H the
  recent hand-over gap (prefill token to the decode node's first token, an exponential average of
  what the router measures), and cap the engines' `long_prefill_token_threshold` (0: none). The
  rule:
  0. the decode node holds the prompt's start in its prefix cache (a conversation's next turn:
     it decoded the last one), local ≤ remote and stall ≤ `stall_budget_s` → local
     (`cached_prefix`): only the new part is computed, where the history already is, and no KV
     crosses.
  1. remote ≤ `ttft_target_s` → remote (`remote_in_time`): the decode node's steps stay pure
     decode, which is what it is there for; the prefill pool's compute is used.
  2. otherwise (the prefill pool is backed up, typically behind a long prompt), local when local
     < remote and stall ≤ `stall_budget_s` (`prefill_backlog`): a short prompt does not wait for
     a long prompt's whole prefill. The stall counts even on a node with no stream yet: the
     streams that start while it computes wait too.
  3. otherwise remote (`stall`, or `remote_faster`).
  Before the rule, the spread: while no prompt of `long_prompt_tokens` or more has arrived for
  `spread_quiet_s`, there is nothing to split off, and a request runs whole on whichever of the
  pair holds more of its prompt, else has fewer requests open (`spread`, where the prompt is
  computed on the node that decodes it: local). Measured on two cores it did not beat one
  two-thread engine nor the split (results/bench/sweep-direct, results/bench/layouts/spread):
  each newcomer's prompt stalls the streams of the engine it joins, and a prompt shared by many
  requests draws them all to the node that holds it. The first long prompt ends the spread: it,
  and every request for `spread_quiet_s` after it, are placed by the rule above, so the long
  prompt stalls only the streams already on the node it runs on.
  Measured first with "local whenever it is no slower": short prompts all moved onto the decode
  node, whose one core then both prefilled and decoded, and the steady mix's capacity fell to
  0.6× the remote mode's (results/bench/sweep/README.md).
Lp and Ld: the prompt less the tokens that node is taken to hold in its prefix cache
(router/decides/prefixes.py, the router's record of what it sent where).
Decisions are counted in `pdserve_prefill_placements_total{where, reason}`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Literal

from router import clock
from router.decides.rates import Window
from router.links.nodes import Node

Where = Literal["remote", "local"]
REMOTE: Where = "remote"
LOCAL: Where = "local"
DECISIONS: dict[str, dict[str, Where]] = {
    "remote": {"mode": REMOTE},
    "threshold": {"short": LOCAL, "long": REMOTE},
    "adaptive": {
        "spread": LOCAL,
        "cached_prefix": LOCAL,
        "remote_in_time": REMOTE,
        "prefill_backlog": LOCAL,
        "remote_faster": REMOTE,
        "stall": REMOTE,
    },
}
"""Each mode's decisions, reason → where (the metric's label values). With no healthy prefill node
there is no decision to make: that is the prefill fallback (router/decides/routing.py), counted on
its own."""

RATE_WINDOW_S = 60.0
"""The span of recent health checks a node's prefill rate is measured over: recent enough to
follow a change of load or of prompt lengths, long enough to hold several prompts."""
MIN_BUSY_S = 0.5
"""Prompt compute seconds a node needs behind its rate before the rate is trusted."""
MIN_TOKENS_PER_PROMPT = 32
"""Mean prompt tokens a node must compute per request for its rate to be a prefill rate: a
decode node fed handed-over requests computes one prompt token each (the position after the
loaded KV), so its tokens per prompt-second measure step overhead, not prefill speed."""
HANDOVER_WEIGHT = 0.2
"""Weight of the newest measured hand-over gap in its running average."""


@dataclass(frozen=True)
class Estimate:
    """What the adaptive rule compares (seconds)."""

    local_ttft_s: float
    remote_ttft_s: float
    stall_s: float


@dataclass(frozen=True)
class Decision:
    where: Where
    reason: str
    estimate: Estimate | None = None
    """The adaptive rule's numbers (None in the other modes)."""


def prefill_rate(node: Node) -> float | None:
    """Prompt tokens per second of prompt compute: over the node's last `RATE_WINDOW_S` of
    health checks (router/decides/rates.py, the windows the balance signal reads too), or over its
    engine's lifetime while that span holds less than `MIN_BUSY_S` of prompt compute; None until
    the engine has computed prompts for `MIN_BUSY_S`, or while its prompts are mostly one-token
    continuations."""
    window = Window.of(node.history, RATE_WINDOW_S)
    if window is not None and window.prompt_busy * window.seconds >= MIN_BUSY_S:
        tokens, busy, requests = window.prompt_tokens, window.prompt_busy, window.requests
    else:
        stats = node.stats
        tokens, busy = stats.prompt_tokens_computed_total, stats.prompt_busy_seconds_total
        requests = max(1, stats.requests_started_total)
        if busy < MIN_BUSY_S:
            return None
    if not tokens or (requests and tokens / requests < MIN_TOKENS_PER_PROMPT):
        return None
    return tokens / busy


class Placement:
    """The placement rule with its live inputs. `settings` is `router.placement` as configured
    (pdserve_core.config.PlacementConfig: `mode`, `threshold_tokens`, `stall_budget_s`,
    `ttft_target_s`, `assumed_prefill_tokens_per_s` — their defaults live there, once);
    `step_cap_tokens` is the engines' `long_prefill_token_threshold`."""

    def __init__(
        self, settings: Any, step_cap_tokens: int = 0, initial_handover_s: float = 0.1
    ) -> None:
        self.mode = settings.mode
        self.threshold_tokens = settings.threshold_tokens
        self.stall_budget_s = settings.stall_budget_s
        self.ttft_target_s = settings.ttft_target_s
        self.assumed_rate = settings.assumed_prefill_tokens_per_s
        self.step_cap_tokens = step_cap_tokens
        self.handover_s = initial_handover_s
        """The hand-over gap estimate (H), until and between measurements."""
        self.spread_quiet_s = getattr(settings, "spread_quiet_s", 0.0)
        self.long_prompt_tokens = getattr(settings, "long_prompt_tokens", 0)
        self.last_long_s = -math.inf
        """When the last prompt of `long_prompt_tokens` or more arrived."""

    def arrived(self, prompt_tokens: int) -> None:
        """A request arrived (every request, whatever its route): a long prompt ends the
        spread."""
        if self.long_prompt_tokens and prompt_tokens >= self.long_prompt_tokens:
            self.last_long_s = clock.now()

    def spread(
        self,
        prompt_tokens: int,
        decode: Node,
        prefill: Node,
        cached_decode: int = 0,
        cached_prefill: int = 0,
    ) -> Node | None:
        """The node of the pair that serves the request whole while nothing needs splitting
        (adaptive mode, no long prompt for `spread_quiet_s`); None: place it by the rule."""
        if self.mode != "adaptive" or not self.spread_quiet_s:
            return None
        if prompt_tokens >= self.long_prompt_tokens:
            return None
        if clock.now() - self.last_long_s < self.spread_quiet_s:
            return None
        if cached_decode != cached_prefill:
            return decode if cached_decode > cached_prefill else prefill
        return prefill if prefill.outstanding < decode.outstanding else decode

    def observe_handover(self, seconds: float) -> None:
        self.handover_s += HANDOVER_WEIGHT * (seconds - self.handover_s)

    def decide(
        self,
        prompt_tokens: int,
        decode: Node,
        prefill: Node,
        cached_decode: int = 0,
        cached_prefill: int = 0,
    ) -> Decision:
        """Where to compute a prompt of `prompt_tokens` that `decode` will decode: there, or on
        `prefill` (the prefill node the router would send it to). `cached_decode` /
        `cached_prefill`: its first tokens each node holds in its prefix cache."""
        if self.mode == "remote":
            return Decision(REMOTE, "mode")
        if self.mode == "threshold":
            if prompt_tokens - cached_decode <= self.threshold_tokens:
                return Decision(LOCAL, "short")
            return Decision(REMOTE, "long")
        estimate = self.estimate(prompt_tokens, decode, prefill, cached_decode, cached_prefill)
        local_in_budget = estimate.stall_s <= self.stall_budget_s
        if cached_decode and local_in_budget and estimate.local_ttft_s <= estimate.remote_ttft_s:
            return Decision(LOCAL, "cached_prefix", estimate)
        if estimate.remote_ttft_s <= self.ttft_target_s:
            return Decision(REMOTE, "remote_in_time", estimate)
        if estimate.local_ttft_s >= estimate.remote_ttft_s:
            return Decision(REMOTE, "remote_faster", estimate)
        if not local_in_budget:
            return Decision(REMOTE, "stall", estimate)
        return Decision(LOCAL, "prefill_backlog", estimate)

    def estimate(
        self,
        prompt_tokens: int,
        decode: Node,
        prefill: Node,
        cached_decode: int = 0,
        cached_prefill: int = 0,
    ) -> Estimate:
        """Both sides' time to first token and the stall, for this pair of nodes, each computing
        what it does not hold of the prompt. A node that has not measured its prefill rate
        borrows the other's, or the assumed one."""
        known = [rate for rate in map(prefill_rate, (decode, prefill)) if rate]
        fallback = sum(known) / len(known) if known else self.assumed_rate
        rate_d = prefill_rate(decode) or fallback
        rate_p = prefill_rate(prefill) or fallback
        local, remote = prompt_tokens - cached_decode, prompt_tokens - cached_prefill
        per_step = min(local, self.step_cap_tokens or local)
        return Estimate(
            local_ttft_s=(decode.prefilling_tokens + local) / rate_d,
            remote_ttft_s=(prefill.prefilling_tokens + remote) / rate_p + self.handover_s,
            stall_s=per_step / rate_d,
        )
