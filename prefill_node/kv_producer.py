"""The producer half of pdserve's KV connector: what a prefill engine does with finished KV.

vLLM builds the connector twice per engine (`pdserve.kv.connector.PDServeConnector`); on a
`kv_producer` (or `kv_both`) engine each instance holds one of these halves:

- `ProducerScheduler` (EngineCore process): when a request that asked for a remote decode
  finishes normally, `request_finished` keeps its blocks (vLLM delays freeing them), signs a
  lease over them and returns the handle that travels back in `kv_transfer_params`. The next
  step's metadata carries the offer to the workers.
- `ProducerWorker` (each worker process, next to the KV cache): starts the KV server on
  `register_kv_caches`, offers each finished prefill's blocks under its lease, and reports the
  offers that were read (or whose lease ended) as `finished_sending`, which lets vLLM free them.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

from pdserve.kv.handle import KVHandle, readers_of, wants_remote_decode
from pdserve.kv.settings import ConnectorSettings
from pdserve.kv.stats import KVGauges, TransferStats
from pdserve.kv.transport.plane import DataPlane
from pdserve.kv.wire import lease_token
from prefill_node.kv_server import KVServer
from prefill_node.leases import ProducerTable

logger = logging.getLogger(__name__)


@dataclass
class SendSpec:
    """Scheduler → worker: keep these blocks for a consumer until the deadline."""

    block_ids: list[int]
    lease_deadline: float
    readers: int = 1


class ProducerScheduler:
    def __init__(self, settings: ConnectorSettings, engine_id: str) -> None:
        self.settings = settings
        self.engine_id = engine_id
        self.ports: tuple[int, ...] = ()
        self._send: dict[str, SendSpec] = {}

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
        if not wants_remote_decode(params) or not handed_over or not block_ids:
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
        )
        self.server.start()
        self._expired_reported = 0

    @property
    def port(self) -> int:
        return self.server.port

    def offer(self, offers: dict[str, SendSpec]) -> None:
        for request_id, spec in offers.items():
            self.table.offer(request_id, spec.block_ids, spec.lease_deadline, spec.readers)

    def give_back(self, request_id: str, lease_deadline: float) -> None:
        """The router will hand this request's KV to no decode node: free it now, not at the
        lease's end (`ProducerTable.abandon`)."""
        self.table.abandon(request_id, lease_deadline)
        logger.info("KV of %s given back by the router (no decode will read it)", request_id)

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
