"""The router's one retry policy: when a request whose node failed runs again, or continues.

- **Retried**: a run that ended in `NodeFailed` (the node's Ray actor died or became
  unreachable, or its engine died) while none of the request's output had reached the client. A
  streamed request has reached the client once its first token was sent; a non-streamed one only
  when the whole response is sent, so it is retried wherever its node failed, and the partial
  output is dropped. The whole request runs again through the dispatcher, which places it anew:
  the failed node has left its pool, so another node takes the run — or, with no prefill node
  left, the decode node prefills for itself; with no decode node left, a prefill node serves it.
- **Resumed** (`router.stream_resume`, on by default): a streamed request whose node failed
  after tokens reached the client continues from them — the prompt plus the tokens sent, placed
  anew like any request (prefilled on the prefill pool and handed over, or served whole by the
  one node left) — and the client sees one stream: no token twice, none missing, the usage of an
  uninterrupted run. Only requests whose sampling keeps no state beyond the token ids can
  continue (router/decides/seam.py, `resumable`); the others end with an explicit error.
- **How often**: at most `router.max_attempts` runs in all (default 3), resumes included.
- **Poison**: a request that was running on an engine when it died may be what killed it. A
  request whose runs saw `router.max_engine_deaths` engines die under them (default 2: the
  first death is given the benefit of the doubt) is not run again: it ends with an explicit
  error, so one bad request takes down at most that many engines, not one per attempt. Nodes
  that became unreachable or fell silent (a host or link down) do not count.
- **Counted**: `pdserve_request_retries_total{pool}` and `pdserve_stream_resumes_total{pool}`,
  labelled with the pool whose node failed; a request's latencies are observed once.
- **Not retried**: bad input, a deadline, a KV transfer that failed under the `fail` policy.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing
from dataclasses import dataclass, replace
from typing import Any

from pdserve_core.engine.types import TokenDelta
from router.decides import seam
from router.errors import EngineFailed, NodeFailed
from router.request import PreparedRequest

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class RetryPolicy:
    max_attempts: int
    """Runs a request may take in all (`router.max_attempts`)."""
    resume: bool
    """Continue cut streams from the tokens sent (`router.stream_resume`)."""
    max_engine_deaths: int
    """Engine deaths a request may be present at before it is refused, not run again
    (`router.max_engine_deaths`)."""

    def poisonous(self, deaths: int) -> bool:
        return deaths >= self.max_engine_deaths

    def retries(self, error: Exception, attempt: int, reached_client: bool) -> bool:
        """Whether run `attempt` (1-based), which ended in `error`, is followed by another."""
        return isinstance(error, NodeFailed) and not reached_client and attempt < self.max_attempts

    def resumes(self, error: Exception, attempt: int, prepared: PreparedRequest) -> bool:
        """Whether a stream cut by `error` after output continues from what was sent."""
        return (
            self.resume
            and isinstance(error, NodeFailed)
            and attempt < self.max_attempts
            and prepared.stream
            and seam.resumable(prepared.sampling_params)
        )


RESTART = object()
"""Yielded by `runs` when a run that had produced output starts over (non-streamed only)."""


async def runs(
    dispatcher: Any,
    prepared: PreparedRequest,
    deadline: float,
    policy: RetryPolicy,
    on_retry: Callable[[NodeFailed], None],
    on_resume: Callable[[NodeFailed], None] = lambda error: None,
) -> AsyncIterator[TokenDelta | object]:
    """The request's deltas under `policy`. Non-streamed, `RESTART` tells the caller to drop
    what it collected so far; streamed, a cut run continues where it was cut, or ends."""
    attempt, current, sent, done, deaths = 0, prepared, [], None, 0
    while True:
        attempt += 1
        try:
            async with aclosing(dispatcher.deltas(current, deadline)) as deltas:
                async for delta in deltas:
                    if current is not prepared:  # a continuation: report it as the original
                        delta = replace(
                            delta,
                            num_prompt_tokens=len(prepared.prompt_token_ids),
                            num_cached_tokens=None,
                        )
                    sent += delta.token_ids
                    done = delta.finish_reason
                    yield delta
            return
        except NodeFailed as error:
            if sent and done is not None:
                return  # the last token was out: the node failed on its way down
            deaths += error.died
            if policy.poisonous(deaths):
                logger.error(
                    "%s: %d engines died while running it; not run again (%s)",
                    prepared.log_id,
                    deaths,
                    error.message,
                )
                raise EngineFailed(
                    f"{deaths} engines died while running this request; it is not run again"
                ) from None
            if sent and policy.resumes(error, attempt, prepared):
                on_resume(error)
                logger.warning(
                    "%s: %s after %d tokens; continuing on another node",
                    prepared.log_id,
                    error.message,
                    len(sent),
                )
                current = seam.continued(prepared, list(sent))
                continue
            reached_client = bool(sent) and prepared.stream
            if not policy.retries(error, attempt, reached_client):
                raise
            on_retry(error)
            logger.warning(
                "%s: %s; running it again (attempt %d of %d)",
                prepared.log_id,
                error.message,
                attempt + 1,
                policy.max_attempts,
            )
            if sent:
                yield RESTART
                sent = []
