"""The router's one retry policy: when a request whose node failed runs again.

- **What is retried**: a run that ended in `NodeFailed` (the node's Ray actor died or became
  unreachable) while none of the request's output had reached the client. A streamed request
  has reached the client once its first token was sent; a non-streamed one only when the whole
  response is sent, so it is retried wherever its node failed, and the partial output is dropped.
- **How**: the whole request runs again through the dispatcher, which places it anew. The failed
  node has left its pool, so another node of the pool takes the run — or, with no prefill node
  left, the decode node prefills for itself (`router.prefill_fallback`).
- **How often**: at most `router.max_attempts` runs in all (default 3), whichever nodes failed.
- **Counted**: `pdserve_request_retries_total{pool}` once per retry, labelled with the pool whose
  node failed; a request's latencies are observed once, for the run that served it.
- **Not retried**: bad input, a deadline, a KV transfer that failed under the `fail` policy, and a
  failure after a streamed request's first token (the client gets an explicit error).
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing
from dataclasses import dataclass
from typing import Any

from pdserve.engine.types import TokenDelta
from router.errors import NodeFailed
from router.request import PreparedRequest

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class RetryPolicy:
    max_attempts: int
    """Runs a request may take in all (`router.max_attempts`)."""

    def retries(self, error: Exception, attempt: int, reached_client: bool) -> bool:
        """Whether run `attempt` (1-based), which ended in `error`, is followed by another."""
        return isinstance(error, NodeFailed) and not reached_client and attempt < self.max_attempts


RESTART = object()
"""Yielded by `runs` when a run that had produced output starts over (non-streamed only)."""


async def runs(
    dispatcher: Any,
    prepared: PreparedRequest,
    deadline: float,
    policy: RetryPolicy,
    on_retry: Callable[[NodeFailed], None],
) -> AsyncIterator[TokenDelta | object]:
    """The request's deltas under `policy`. Streamed, a run that yielded anything is never
    retried; non-streamed, `RESTART` tells the caller to drop what it collected so far."""
    attempt = 0
    while True:
        attempt += 1
        produced = False
        try:
            async with aclosing(dispatcher.deltas(prepared, deadline)) as deltas:
                async for delta in deltas:
                    produced = True
                    yield delta
            return
        except NodeFailed as error:
            reached_client = produced and prepared.stream
            if not policy.retries(error, attempt, reached_client):
                raise
            on_retry(error)
            logger.warning(
                "%s: %s; running it again (attempt %d of %d)",
                prepared.request_id,
                error.message,
                attempt + 1,
                policy.max_attempts,
            )
            if produced:
                yield RESTART
