"""pdserve's vLLM KV connector (v1 API), loaded out of tree:

    KVTransferConfig(kv_connector="PDServeConnector",
                     kv_connector_module_path="pdserve.kv.connector",
                     kv_role="kv_producer" | "kv_consumer",
                     kv_load_failure_policy="recompute" | "fail",
                     kv_connector_extra_config={"secret": ..., "transport": "tcp", ...})

vLLM builds one instance per role: SCHEDULER (EngineCore process) delegates to `SchedulerSide`,
WORKER (each worker process) to `WorkerSide`. Transfers are whole-request and pulled by the
consumer after the prefill finished, so the per-layer hooks have nothing to do.
"""

from __future__ import annotations

import logging
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorRole,
    KVConnectorTransferResults,
)

from pdserve.kv.scheduler_side import SchedulerSide
from pdserve.kv.settings import ConnectorSettings
from pdserve.kv.stats import PDServeKVStats
from pdserve.kv.worker_side import WorkerSide

logger = logging.getLogger(__name__)


class PDServeConnector(KVConnectorBase_V1):
    def __init__(self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any = None):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        config = vllm_config.kv_transfer_config
        settings = ConnectorSettings.from_extra(config.kv_connector_extra_config)
        self._scheduler: SchedulerSide | None = None
        self._worker: WorkerSide | None = None
        if role == KVConnectorRole.SCHEDULER:
            self._scheduler = SchedulerSide(settings, config.engine_id or "")
        else:
            self._worker = WorkerSide(settings, vllm_config, config.is_kv_producer)

    # ---- scheduler side ------------------------------------------------------------------------

    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        return self._scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request, blocks, num_external_tokens):
        self._scheduler.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output):
        return self._scheduler.build_connector_meta()

    def request_finished(self, request, block_ids):
        return self._scheduler.request_finished(request, block_ids)

    def update_connector_output(self, connector_output):
        self._scheduler.update_connector_output(connector_output)

    def set_xfer_handshake_metadata(self, metadata):
        self._scheduler.set_ports({rank: md.port for rank, md in metadata.items()})

    # ---- worker side ---------------------------------------------------------------------------

    def register_kv_caches(self, kv_caches):
        self._worker.register_kv_caches(kv_caches)

    def get_handshake_metadata(self):
        return self._worker.handshake()

    def start_load_kv(self, forward_context, **kwargs):
        self._worker.start_step(self._get_connector_metadata())

    def wait_for_layer_load(self, layer_name):
        """Nothing to wait for: whole requests are loaded before they are scheduled."""

    def save_kv_layer(self, layer_name, kv_layer, attn_metadata, **kwargs):
        """Nothing to save: the producer serves blocks from its cache after the prefill."""

    def wait_for_save(self):
        """Nothing to wait for (see save_kv_layer)."""

    def get_finished(self, finished_req_ids):
        results = self._worker.transfer_results()
        return results.finished_sending or None, results.finished_recving or None

    def get_transfer_results(self, finished_req_ids) -> KVConnectorTransferResults:
        return self._worker.transfer_results()

    def get_kv_connector_stats(self):
        return self._worker.connector_stats() if self._worker else None

    @classmethod
    def build_kv_connector_stats(cls, data=None):
        return PDServeKVStats(data=data or {})

    def shutdown(self):
        if self._worker is not None:
            self._worker.shutdown()
