"""What vLLM's AsyncLLM yields for one step of one request, for engine actors run over an engine
that only answers (tests/sockets/test_router_leaves.py, tests/logic/test_leg_stop.py,
benchmarks/router_scale.py)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any


def step_output(
    token_id: int, text: str, finished: bool, handle: dict[str, Any] | None = None
) -> SimpleNamespace:
    """One sequence's one new token (`finish_reason` "length" on the last), as a `RequestOutput`
    in DELTA mode; `handle`: the KV connector's parameters on the finished output."""
    completion = SimpleNamespace(
        index=0,
        token_ids=[token_id],
        text=text,
        finish_reason="length" if finished else None,
        stop_reason=None,
        logprobs=None,
    )
    return SimpleNamespace(
        outputs=[completion],
        finished=finished,
        kv_transfer_params=handle,
        prompt_logprobs=None,
        num_cached_tokens=0,
    )
