"""Scheduler half of the connector (runs in vLLM's EngineCore process).

Producer: `request_finished` keeps a remote-decode request's blocks, queues them for the worker
to offer under a lease, and returns the handle. Consumer: a request that arrives with a handle
is matched for all its prompt tokens not already cached locally (`get_num_new_matched_tokens`),
its freshly allocated blocks are paired with the producer's (`update_state_after_alloc`), and
the pull is shipped to the worker in the next step's metadata. The worker reports each pull as
finished (or failed) and vLLM either continues from the loaded KV or recomputes/fails per
`kv_load_failure_policy`.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from vllm.v1.request import RequestStatus

from pdserve.kv.handle import (
    REMOTE_PREFILL,
    HandleError,
    KVHandle,
    wants_remote_decode,
    wants_remote_prefill,
)
from pdserve.kv.settings import ConnectorSettings, PDServeMetadata, RecvSpec, SendSpec
from pdserve.kv.wire import lease_token

logger = logging.getLogger(__name__)

_NORMAL_FINISH = (RequestStatus.FINISHED_LENGTH_CAPPED, RequestStatus.FINISHED_STOPPED)


class SchedulerSide:
    def __init__(self, settings: ConnectorSettings, engine_id: str) -> None:
        self.settings = settings
        self.engine_id = engine_id
        self.ports: tuple[int, ...] = ()
        self._send: dict[str, SendSpec] = {}
        self._recv: dict[str, RecvSpec] = {}
        self._receiving: set[str] = set()

    def set_ports(self, ports: dict[int, int]) -> None:
        self.ports = tuple(ports[rank] for rank in sorted(ports))
        logger.info("KV connector: workers listen on ports %s", self.ports)

    # ---- consumer ------------------------------------------------------------------------------

    def get_num_new_matched_tokens(
        self, request: Any, num_computed_tokens: int
    ) -> tuple[int, bool]:
        """The producer computed `remote_num_tokens` of this prompt; load what is not cached.

        Callers append the producer's sampled token to the prompt, so the loaded KV covers all
        but the last prompt token and the first local step is an ordinary decode step: exactly
        what a single engine computes after its prefill. Given the bare prompt instead, vLLM
        recomputes the last prompt token itself (correct, but not bit-identical in bf16)."""
        params = request.kv_transfer_params
        if not wants_remote_prefill(params):
            return 0, False
        try:
            produced = int(params.get("remote_num_tokens", request.num_prompt_tokens))
        except (TypeError, ValueError):
            produced = request.num_prompt_tokens
        remaining = min(produced, request.num_prompt_tokens) - num_computed_tokens
        return (remaining, True) if remaining > 0 else (0, False)

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        params = request.kv_transfer_params
        if not wants_remote_prefill(params):
            return
        params[REMOTE_PREFILL] = False  # one pull per request, even if called again
        if num_external_tokens <= 0:
            self._release_unneeded(request.request_id, params)
            return
        local_all = list(blocks.get_block_ids()[0])
        fresh = list(blocks.get_unhashed_block_ids())
        cached = len(local_all) - len(fresh)
        try:
            handle = KVHandle.from_params(params)
            remote = list(handle.block_ids[cached : cached + len(fresh)])
            if len(remote) != len(fresh):
                raise HandleError(
                    f"handle holds {len(handle.block_ids)} blocks; {cached + len(fresh)} needed"
                )
        except HandleError as error:
            logger.warning("request %s: %s", request.request_id, error)
            remote = []
        self._recv[request.request_id] = RecvSpec(dict(params), remote, fresh)
        self._receiving.add(request.request_id)

    def _release_unneeded(self, request_id: str, params: dict) -> None:
        """Everything was cached here: let the producer free its blocks instead of waiting for
        the lease (the request is not waiting for KV, so vLLM hears nothing of this)."""
        try:
            KVHandle.from_params(params)
        except HandleError:
            return
        self._recv[f"release:{request_id}"] = RecvSpec(dict(params), [], [], release_only=True)

    # ---- producer ------------------------------------------------------------------------------

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict | None]:
        if request.request_id in self._receiving:
            return True, None  # a pull still writes into these blocks: free them when it ends
        params = request.kv_transfer_params
        if not wants_remote_decode(params) or request.status not in _NORMAL_FINISH or not block_ids:
            return False, None
        deadline = time.time() + self.settings.lease_s
        self._send[request.request_id] = SendSpec(list(block_ids), deadline)
        handle = KVHandle(
            host=self.settings.public_host,
            ports=self.ports,
            request_id=request.request_id,
            block_ids=tuple(block_ids),
            num_tokens=request.num_prompt_tokens,
            lease_deadline=deadline,
            engine_id=self.engine_id,
            transport=self.settings.transport,
            lease_token=lease_token(
                self.settings.read_secret(), request.request_id, list(block_ids), deadline
            ),
        )
        return True, handle.to_params()

    # ---- every step ----------------------------------------------------------------------------

    def build_connector_meta(self) -> PDServeMetadata:
        meta = PDServeMetadata(send=self._send, recv=self._recv)
        self._send, self._recv = {}, {}
        return meta

    def update_connector_output(self, output: Any) -> None:
        self._receiving -= set(output.finished_recving or ())
