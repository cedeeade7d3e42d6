"""A prefill node: a Ray actor hosting vLLM whose KV connector plays the producer.

Life of a request here:
1. The router sends a `Prefill` leg (pdserve_core/engine/legs.py: request id, prompt, params,
   sample_first, readers, prefetch key). The node runs the prompt with `max_tokens=1` and asks
   its connector to keep the KV for `readers` remote decodes (`do_remote_decode`).
2. The engine computes the prompt's KV cache and samples one token. With `sample_first` (the
   router's seam policy, router/decides/seam.py) it samples with the client's parameters and the
   token streams back at once as the request's first (the client's time to first token is this
   node's); without, the parameters are the plainest that compute the KV, and the token is not the
   client's (the decode node samples the first token itself).
3. When the request finishes, the producer half of the connector (`kv_producer.py`) keeps its
   blocks under a lease and returns the handle (address, ports, request id, block ids, signed
   lease) with the last delta; the router hands it to a decode node.
4. The decode node pulls the blocks from this node's KV server (`kv_server.py`); the lease table
   (`leases.py`) frees them when the pull completes or when the lease ends.
5. A leg the router stops before its end (its client left, its deadline passed) never hands its
   handle over, yet vLLM may have finished the prefill and kept the KV an instant before the
   abort: the node gives back whatever the engine kept for that leg (`_give_back_leg`), so it
   is freed at once rather than when its lease ends.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing
from typing import Any

from pdserve_core.engine.actor import EngineActor
from pdserve_core.engine.legs import Prefill, leg_params
from pdserve_core.engine.types import TokenDelta
from pdserve_core.kv.handle import producer_params

logger = logging.getLogger(__name__)


def prefill_params(params: Any, sample_first: bool, readers: int, prefetch: str = "") -> Any:
    """Parameters for the prefill leg, keeping the KV for `readers` decodes (and followed under
    the `prefetch` key): the client's cut to the first token, or (not sampling for the client)
    the plainest that compute the KV."""
    kv = producer_params(readers, prefetch)
    if not sample_first:
        from vllm import SamplingParams

        # ignore_eos: it always ends at its budget, so its KV is always handed over
        plain = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True, detokenize=False)
        return leg_params(params, plain, kv)
    first = leg_params(params, kv_transfer_params=kv)
    first.max_tokens = 1
    first.min_tokens = min(params.min_tokens, 1)
    return first


class PrefillNode(EngineActor):
    ROLE = "prefill"

    def handler(self, leg: Any) -> Callable[[Any], AsyncIterator[TokenDelta]]:
        return self.prefill if type(leg) is Prefill else super().handler(leg)

    async def prefill(self, leg: Prefill) -> AsyncIterator[TokenDelta]:
        """The prompt's KV, kept for `leg.readers` decode legs, and one token (the request's
        first when `sample_first`); the last delta carries the KV handle. With a `prefetch` key,
        a decode node follows the prefill as it runs (prefill_node/progress.py)."""
        params = prefill_params(leg.params, leg.sample_first, leg.readers, leg.prefetch)
        run = self._run(leg.request_id, leg.prompt_token_ids, params)
        try:
            async with aclosing(run) as deltas:  # vLLM aborts the request first
                async for delta in deltas:
                    yield delta
        except (asyncio.CancelledError, GeneratorExit):  # the router stopped the leg
            self._aside_task(self._give_back_leg(leg.request_id))
            raise

    async def _give_back_leg(self, leg_id: str) -> None:
        """Have the workers abandon what the engine kept for the stopped leg `leg_id`, or
        keeps a step later (prefill_node/leases.py)."""
        engine = self._engine
        if engine is None:
            return
        try:  # the workers log what they freed
            await engine.collective_rpc("pdserve_give_back_leg", args=(leg_id,))
        except Exception as error:  # the engine may be gone: its KV went with it
            logger.warning("%s: giving back the KV of leg %s: %r", self._name, leg_id, error)

    async def end_follow(self, key: str) -> bool:
        """The prefill `key` names will not run here (its leg failed or was cancelled, maybe
        before this node had it): its follower stops waiting now, not at the follow's deadline."""
        if self._engine is None or not isinstance(key, str):
            return False
        ended = await self._engine.collective_rpc("pdserve_end_follow", args=(key,))
        return any(ended)

    async def give_back(self, handle: dict[str, Any]) -> bool:
        """The router will hand this prefill's KV (`handle`, as `prefill` returned it) to no
        decode node — its client left between the legs: free the blocks now rather than when
        the lease ends. False when there was nothing to free here."""
        request_id, deadline = handle.get("remote_request_id"), handle.get("lease_deadline")
        if self._engine is None or not isinstance(request_id, str):
            return False
        if not isinstance(deadline, (int, float)):
            return False
        freed = await self._engine.collective_rpc(
            "pdserve_give_back", args=(request_id, float(deadline))
        )
        return any(freed)
