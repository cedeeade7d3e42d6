"""The producer half of pdserve's KV connector: what a prefill engine does with finished KV.

vLLM builds the connector twice per engine (`pdserve_core.kv.connector.PDServeConnector`); on a
`kv_producer` (or `kv_both`) engine each instance holds one of these halves:

- `ProducerScheduler` (EngineCore process): when a request that asked for a remote decode
  finishes normally, `request_finished` keeps its blocks (vLLM delays freeing them), signs a
  lease over them and returns the handle that travels back in `kv_transfer_params`. The next
  step's metadata carries the offer to the workers.
- `ProducerWorker` (each worker process, next to the KV cache): starts the KV server on
  `register_kv_caches`, offers each finished prefill's blocks under its lease, and reports the
  offers that were read (or whose lease ended) as `finished_sending`, which lets vLLM free them.

A prefill that carries a `prefetch_key` is followed while it runs (progress.py): the scheduler
side tells the workers, step by step, which of its tokens and blocks the step writes
(`plan_writes`), and the worker marks each layer written as the forward goes, for the decode
node that streams them.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

from pdserve_core.kv.handle import KVHandle, prefetch_key, readers_of, wants_remote_decode
from pdserve_core.kv.settings import ConnectorSettings
from pdserve_core.kv.stats import KVGauges, TransferStats
from pdserve_core.kv.transport.plane import DataPlane
from pdserve_core.kv.wire import lease_token
from prefill_node.kv_server import KVServer
from prefill_node.leases import ProducerTable
from prefill_node.progress import StepWrite, WriteProgress

logger = logging.getLogger(__name__)


@dataclass
class SendSpec:
    """Scheduler → worker: keep these blocks for a consumer until the deadline."""

    block_ids: list[int]
    lease_deadline: float
    readers: int = 1


@dataclass
class _Followed:
    key: str
    block_ids: list[int]
    prompt_len: int


class ProducerScheduler:
    def __init__(self, settings: ConnectorSettings, engine_id: str, block_size: int = 16) -> None:
        self.settings = settings
        self.engine_id = engine_id
        self.block_size = block_size
        self.ports: tuple[int, ...] = ()
        self._send: dict[str, SendSpec] = {}
        self._followed: dict[str, _Followed] = {}
        """Request id -> its prefetch key, blocks so far and prompt length, while it prefills."""
        self._unfollow: dict[str, str] = {}
        """Prefetch key -> why its prefill will not complete (for the workers, next step)."""

    def plan_writes(self, scheduler_output: Any) -> dict[str, StepWrite]:
        """This step's writes of followed prefills, by prefetch key (see progress.py)."""
        writes: dict[str, StepWrite] = {}
        scheduled = scheduler_output.num_scheduled_tokens
        for new in scheduler_output.scheduled_new_reqs:
            extra = (new.sampling_params.extra_args or {}) if new.sampling_params else {}
            key = prefetch_key(extra.get("kv_transfer_params"))
            if key is None or not new.prompt_token_ids:
                continue
            followed = _Followed(key, list(new.block_ids[0]), len(new.prompt_token_ids))
            self._followed[new.req_id] = followed
            writes[key] = self._write(new.req_id, followed, new.num_computed_tokens, scheduled)
        cached = scheduler_output.scheduled_cached_reqs
        for index, request_id in enumerate(cached.req_ids):
            followed = self._followed.get(request_id)
            if followed is None:
                continue
            if request_id in cached.resumed_req_ids:  # preempted: its blocks were given away
                self._stop(request_id, "the prefill was preempted")
                continue
            new_blocks = cached.new_block_ids[index]
            if new_blocks:
                followed.block_ids += new_blocks[0]
            start = cached.num_computed_tokens[index]
            writes[followed.key] = self._write(request_id, followed, start, scheduled)
        for request_id in scheduler_output.preempted_req_ids or ():
            if request_id in self._followed:
                self._stop(request_id, "the prefill was preempted")
        return writes

    def _write(self, request_id: str, followed: _Followed, start: int, scheduled: dict):
        end = start + scheduled.get(request_id, 0)
        final = end >= followed.prompt_len
        if final:
            del self._followed[request_id]
        return StepWrite(request_id, list(followed.block_ids), start, end, self.block_size, final)

    def _stop(self, request_id: str, why: str) -> None:
        followed = self._followed.pop(request_id, None)
        if followed is not None:
            self._unfollow[followed.key] = why

    def take_unfollowed(self) -> dict[str, str]:
        unfollow, self._unfollow = self._unfollow, {}
        return unfollow

    def set_ports(self, ports: dict[int, int]) -> None:
        """The KV server port of each tensor-parallel rank (from the workers' handshake)."""
        self.ports = tuple(ports[rank] for rank in sorted(ports))
        logger.info("KV connector: workers serve KV on ports %s", self.ports)

    def request_finished(
        self, request: Any, block_ids: list[int], handed_over: bool
    ) -> tuple[bool, dict | None]:
        """Keep a remote-decode request's blocks under a lease when a decode follows
        (`handed_over`: it ended at its token budget, not stopped or aborted); returns (keep,
        handle)."""
        params = request.kv_transfer_params
        if request.request_id in self._followed:  # ended before its prompt did
            self._stop(request.request_id, "the prefill ended before its last prompt token")
        if not wants_remote_decode(params) or not handed_over or not block_ids:
            key = prefetch_key(params)
            if key is not None:
                self._unfollow.setdefault(key, "the prefill ended without a hand-over")
            return False, None
        deadline = time.time() + self.settings.lease_s
        readers = readers_of(params)
        self._send[request.request_id] = SendSpec(list(block_ids), deadline, readers)
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
                self.settings.read_secret(),
                self.engine_id,
                request.request_id,
                list(block_ids),
                deadline,
                readers,
            ),
            readers=readers,
            prefetch_key=prefetch_key(params) or "",
        )
        return True, handle.to_params()

    def take_offers(self) -> dict[str, SendSpec]:
        """This step's new offers, for the workers (each is shipped once)."""
        offers, self._send = self._send, {}
        return offers


class ProducerWorker:
    def __init__(
        self,
        settings: ConnectorSettings,
        plane: DataPlane,
        stats: TransferStats,
        tp_rank: int,
        engine_id: str = "",
    ) -> None:
        self.table = ProducerTable()
        self.stats = stats
        self._lease_s = settings.lease_s
        self.progress = WriteProgress(plane.layout.num_layers, _device_event(plane))
        self._layer_index = {name: index for index, name in enumerate(plane.layer_names)}
        port = settings.port + tp_rank if settings.port else 0
        self.server = KVServer(
            plane,
            self.table,
            settings.read_secret,
            stats,
            settings.host,
            port,
            engine_id,
            settings.server_tls(),
            self.progress,
        )
        self.server.start()
        self._expired_reported = 0

    @property
    def port(self) -> int:
        return self.server.port

    def offer(self, offers: dict[str, SendSpec]) -> None:
        for request_id, spec in offers.items():
            self.table.offer(request_id, spec.block_ids, spec.lease_deadline, spec.readers)

    def begin_step(self, writes: dict[str, StepWrite], unfollow: dict[str, str]) -> None:
        """Before the forward: the followed prefills this step writes, and those that ended."""
        for key, why in unfollow.items():
            self.progress.fail(key, why)
        self.progress.begin_step(writes)

    def layer_written(self, layer_name: str) -> None:
        index = self._layer_index.get(layer_name)
        if index is not None:
            self.progress.layer_written(index)

    def step_done(self) -> None:
        self.progress.step_done()

    def give_back(self, request_id: str, lease_deadline: float) -> None:
        """The router will hand this request's KV to no decode node: free it now, not at the
        lease's end (`ProducerTable.abandon`)."""
        self.table.abandon(request_id, lease_deadline)
        logger.info("KV of %s given back by the router (no decode will read it)", request_id)

    def give_back_leg(self, leg_id: str) -> int:
        """The router stopped the prefill leg `leg_id` before its end: whatever the engine kept
        for it, or keeps a step later, goes now (`ProducerTable.abandon_leg`). Returns the
        offers freed now."""
        freed = self.table.abandon_leg(leg_id, time.time() + self._lease_s)
        if freed:
            logger.info("KV of prefill leg %s given back: the router stopped the leg", leg_id)
        return freed

    def finished_sending(self) -> set[str]:
        """Offers read to the end or expired: vLLM may free their blocks now."""
        done = self.table.collect_done()
        if self.table.leases_expired > self._expired_reported:
            self.stats.leases_expired(self.table.leases_expired - self._expired_reported)
            self._expired_reported = self.table.leases_expired
        return done

    def gauges(self) -> KVGauges:
        return KVGauges(
            blocks_held=self.table.blocks_held(), requests_held=self.table.requests_held()
        )

    def close(self) -> None:
        self.server.close()


def _device_event(plane: DataPlane):
    """Device caches are written asynchronously: a piece is read once an event recorded after its
    layer has passed. None on the CPU, where a written layer is written."""
    if all(layer.device.type == "cpu" for layer in plane.layers):
        return None
    import torch

    def recorded() -> Any:
        event = torch.cuda.Event()
        event.record()
        return event

    return recorded
