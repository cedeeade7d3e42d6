"""Worker half of the connector (runs in each vLLM worker process, next to the KV cache).

Producer: on `register_kv_caches` it starts the KV server; each step's metadata offers finished
prefills' blocks under their leases; `transfer_results` reports offers that were read or that
expired, and vLLM frees those blocks. Consumer: each step's metadata starts pulls on a small
thread pool (the target blocks belong to requests waiting for remote KV, so nothing else touches
them); finished and failed pulls are reported in the next `transfer_results`.
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorTransferResults

from pdserve.kv.handle import HandleError, KVHandle
from pdserve.kv.layout import describe
from pdserve.kv.lease import ProducerTable
from pdserve.kv.settings import ConnectorSettings, PDServeHandshake, PDServeMetadata, RecvSpec
from pdserve.kv.stats import PDServeKVStats, TransferStats
from pdserve.kv.transport import transport_class
from pdserve.kv.transport.base import TransferError

logger = logging.getLogger(__name__)

PULL_THREADS = 4


def _tp_rank_and_size() -> tuple[int, int]:
    try:
        from vllm.distributed.parallel_state import (
            get_tensor_model_parallel_world_size,
            get_tp_group,
        )

        return get_tp_group().rank_in_group, get_tensor_model_parallel_world_size()
    except (AssertionError, AttributeError, RuntimeError):
        return 0, 1


class WorkerSide:
    def __init__(self, settings: ConnectorSettings, vllm_config: Any, is_producer: bool) -> None:
        self.settings = settings
        self.vllm_config = vllm_config
        self.is_producer = is_producer
        self.stats = TransferStats()
        self.table = ProducerTable() if is_producer else None
        self.transport = None
        self.tp_rank, self.tp_size = _tp_rank_and_size()
        self._pool = ThreadPoolExecutor(PULL_THREADS, thread_name_prefix="pdserve-kv-pull")
        self._lock = threading.Lock()
        self._received: set[str] = set()
        self._failed: set[str] = set()
        self._expired_reported = 0

    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        model_config = self.vllm_config.model_config
        layout = describe(
            kv_caches,
            model=model_config.model.rstrip("/").rsplit("/", 1)[-1],
            block_size=self.vllm_config.cache_config.block_size,
            num_kv_heads=model_config.get_num_kv_heads(self.vllm_config.parallel_config),
            head_dim=model_config.get_head_size(),
            tp_rank=self.tp_rank,
            tp_size=self.tp_size,
            transport=self.settings.transport,
        )
        port = self.settings.port + self.tp_rank if self.settings.port else 0
        self.transport = transport_class(self.settings.transport)(
            layout,
            kv_caches,
            self.settings.read_secret,
            self.stats,
            self.settings.host,
            port,
            rate_limit=self.settings.send_rate_limit_bytes_per_s,
        )
        if self.is_producer:
            self.transport.start_server(self.table)
        logger.info(
            "KV connector worker: %d layers, %d B per block per layer, %s",
            layout.num_layers,
            layout.block_bytes,
            "serving" if self.is_producer else "pulling",
        )

    def handshake(self) -> PDServeHandshake | None:
        if self.transport is None:
            return None
        return PDServeHandshake(
            port=self.transport.port if self.is_producer else 0, tp_rank=self.tp_rank
        )

    def start_step(self, meta: PDServeMetadata) -> None:
        for request_id, spec in meta.send.items():
            self.table.offer(request_id, spec.block_ids, spec.lease_deadline)
        for request_id, spec in meta.recv.items():
            if spec.release_only:
                self._pool.submit(self._release, spec)
                continue
            self.stats.started()
            self._pool.submit(self._pull, request_id, spec)

    def _release(self, spec: RecvSpec) -> None:
        try:
            handle = KVHandle.from_params(spec.params)
            deadline = time.monotonic() + min(self.settings.timeout_s, 5.0)
            self.transport.pull(handle, [], [], self.tp_rank, deadline)
            self.stats.count("releases")
        except (TransferError, HandleError) as error:  # the lease will free them instead
            logger.info("could not release unneeded KV at the producer: %s", error)

    def _pull(self, request_id: str, spec: RecvSpec) -> None:
        started = time.monotonic()
        try:
            if not spec.remote_block_ids:
                raise TransferError("bad_handle", "the request's kv_transfer_params are not usable")
            handle = KVHandle.from_params(spec.params)
            lease_left = handle.lease_deadline - time.time()
            if lease_left <= 0:
                raise TransferError("lease_expired", f"lease ended {-lease_left:.1f} s ago")
            deadline = started + min(self.settings.timeout_s, lease_left)
            moved = self.transport.pull(
                handle, spec.remote_block_ids, spec.local_block_ids, self.tp_rank, deadline
            )
            self.stats.transfer("received", moved, time.monotonic() - started)
            failed = False
        except (TransferError, HandleError) as error:
            reason = getattr(error, "reason", "bad_handle")
            self.stats.failure(reason, request_id, str(error))
            logger.warning("KV pull for %s failed (%s): %s", request_id, reason, error)
            failed = True
        except Exception:  # never leave a request waiting for remote KV forever
            logger.exception("KV pull for %s crashed", request_id)
            self.stats.failure("connection_reset", request_id, "the pull crashed")
            failed = True
        finally:
            self.stats.ended()
        with self._lock:
            self._received.add(request_id)
            if failed:
                self._failed.add(request_id)

    def transfer_results(self) -> KVConnectorTransferResults:
        sent = self.table.collect_done() if self.table else set()
        if self.table and self.table.leases_expired > self._expired_reported:
            self.stats.count("leases_expired", self.table.leases_expired - self._expired_reported)
            self._expired_reported = self.table.leases_expired
        with self._lock:
            received, failed = self._received, self._failed
            self._received, self._failed = set(), set()
        return KVConnectorTransferResults(
            finished_sending=sent, finished_recving=received, failed_recving=failed
        )

    def connector_stats(self) -> PDServeKVStats | None:
        gauges = {}
        if self.table is not None:
            gauges = {
                "blocks_held": self.table.blocks_held(),
                "requests_held": self.table.requests_held(),
            }
        stats = PDServeKVStats(data=self.stats.snapshot(gauges))
        return None if stats.is_empty() and not self._gauges_changed(gauges) else stats

    def _gauges_changed(self, gauges: dict) -> bool:
        changed = gauges != getattr(self, "_last_gauges", None)
        self._last_gauges = gauges
        return changed

    def shutdown(self) -> None:
        if self.transport is not None:
            self.transport.close()
        self._pool.shutdown(wait=False, cancel_futures=True)
