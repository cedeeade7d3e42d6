"""pdserve's vLLM KV connector (v1 API), loaded out of tree:

    KVTransferConfig(kv_connector="PDServeConnector",
                     kv_connector_module_path="pdserve_core.kv.connector",
                     kv_role="kv_producer" | "kv_consumer" | "kv_both",
                     kv_load_failure_policy="recompute" | "fail",
                     kv_connector_extra_config={"secret": ..., "transport": "tcp", ...})

vLLM builds one instance per role: SCHEDULER (EngineCore process) and WORKER (each worker
process). Each instance holds the halves its `kv_role` asks for: the producer half lives with the
prefill node (`prefill_node/kv_producer.py`), the consumer half with the decode node
(`decode_node/kv_consumer.py`); `kv_both` holds both. The halves are looked up by name and
imported lazily (`halves.py`: `HALVES`, and the protocol each side keeps), like the data planes:
this shared package names both roles' modules but has no import of either, and a process loads
only the halves its role needs.
Transfers are pulled by the consumer: after the prefill finished, or (a prefetch) while it runs,
following it layer by layer — the producer's per-layer hooks (`save_kv_layer`, `wait_for_save`)
mark what the forward has written (prefill_node/progress.py). The consumer's load hooks have
nothing to do: a request's KV is in place before its first forward.

No hook may raise into vLLM: an exception in a scheduler hook would end the EngineCore, and
with it every request on the engine. Each hook catches what its half raises, logs it, and fails
only the request concerned (a pull that cannot be planned is reported failed, so vLLM applies
`kv_load_failure_policy`).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorHandshakeMetadata,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats
from vllm.v1.request import RequestStatus

from pdserve_core.kv.halves import (
    CONTRACTS,
    HALVES,
    ConsumerScheduler,
    ConsumerWorker,
    ProducerScheduler,
    ProducerWorker,
)
from pdserve_core.kv.layout import describe
from pdserve_core.kv.settings import ConnectorSettings
from pdserve_core.kv.stats import KVCounters, KVGauges, TransferStats, is_empty, merge_snapshots
from pdserve_core.kv.transport import plane_class

logger = logging.getLogger(__name__)

ROLE_HALVES = {
    "kv_producer": ("producer",),
    "kv_consumer": ("consumer",),
    "kv_both": ("producer", "consumer"),
}


def _half(name: str, side: str, *args: Any) -> Any:
    """The `side` of half `name`, built with `args`; it must keep the half's contract."""
    built = HALVES[name].load(side)(*args)
    contract = CONTRACTS[(name, side)]
    if not isinstance(built, contract):
        raise TypeError(f"{type(built).__name__} does not keep {contract.__name__}'s contract")
    return built


@dataclass
class PDServeMetadata(KVConnectorMetadata):
    """One step's work for the workers: blocks to offer and followed prefills this step writes
    or that ended (producer), pulls to start (consumer)."""

    send: dict[str, Any] = field(default_factory=dict)
    recv: dict[str, Any] = field(default_factory=dict)
    write: dict[str, Any] = field(default_factory=dict)
    unfollow: dict[str, str] = field(default_factory=dict)


@dataclass
class PDServeHandshake(KVConnectorHandshakeMetadata):
    """What a worker tells its scheduler after registering its caches: where it serves KV."""

    port: int
    tp_rank: int


@dataclass
class PDServeKVStats(KVConnectorStats):
    """vLLM-facing wrapper: `data` is one `TransferStats.snapshot`, possibly aggregated."""

    data: dict[str, Any] = field(default_factory=dict)

    def reset(self) -> None:
        self.data = {}

    def is_empty(self) -> bool:
        return is_empty(self.data)

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        self.data = merge_snapshots(self.data, other.data)
        return self

    def reduce(self) -> dict[str, int | float]:
        if not self.data:
            return {}
        counters = KVCounters(**self.data["counters"])
        summary = {k: v for k, v in vars(counters).items() if k != "failures"}
        summary.update({f"failures_{k}": v for k, v in counters.failures.items()})
        return {**summary, **self.data["gauges"]}


def _quietly(hook, *args) -> None:
    """A follow-up hook of the forward: a failure there costs a prefetch (its consumer pulls
    instead), never the step."""
    try:
        hook(*args)
    except Exception:
        logger.exception("KV connector: %s failed", getattr(hook, "__name__", hook))


def _tp_rank_and_size() -> tuple[int, int]:
    try:
        from vllm.distributed.parallel_state import (
            get_tensor_model_parallel_world_size,
            get_tp_group,
        )

        return get_tp_group().rank_in_group, get_tensor_model_parallel_world_size()
    except (AssertionError, AttributeError, RuntimeError):
        return 0, 1


class PDServeConnector(KVConnectorBase_V1):
    def __init__(self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any = None):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        config = vllm_config.kv_transfer_config
        self._settings = ConnectorSettings.from_extra(config.kv_connector_extra_config)
        self._halves = ROLE_HALVES[config.kv_role]
        self._vllm_config = vllm_config
        self.producer: ProducerScheduler | ProducerWorker | None = None
        """The producer half of this process's side (scheduler or worker), if its role has one."""
        self.consumer: ConsumerScheduler | ConsumerWorker | None = None
        self._stats: TransferStats | None = None
        self._last_gauges: dict | None = None
        self._begun: PDServeMetadata | None = None
        """The step metadata whose followed writes the producer was told of."""
        if role == KVConnectorRole.SCHEDULER:
            block_size = vllm_config.cache_config.block_size
            engine_id = config.engine_id or ""
            if "producer" in self._halves:
                self.producer = _half(
                    "producer", "scheduler", self._settings, engine_id, block_size
                )
            if "consumer" in self._halves:
                self.consumer = _half("consumer", "scheduler", self._settings, block_size)

    @property
    def settings(self) -> ConnectorSettings:
        return self._settings

    # ---- scheduler side ------------------------------------------------------------------------

    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        if self.consumer is None:
            return 0, False
        try:
            return self.consumer.get_num_new_matched_tokens(request, num_computed_tokens)
        except Exception:  # nothing loaded: the engine computes the prompt itself
            logger.exception("KV connector: matching %s failed", request.request_id)
            return 0, False

    def update_state_after_alloc(self, request, blocks, num_external_tokens):
        if self.consumer is None:
            return
        try:
            self.consumer.update_state_after_alloc(request, blocks, num_external_tokens)
        except Exception:  # the request waits for remote KV: it must hear that none comes
            logger.exception("KV connector: planning the pull of %s failed", request.request_id)
            if num_external_tokens > 0:
                self.consumer.failed_pull(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output):
        meta = PDServeMetadata(recv=self.consumer.take_pulls() if self.consumer else {})
        if self.producer is not None:
            meta.send = self.producer.take_offers()
            try:
                meta.write = self.producer.plan_writes(scheduler_output)
            except Exception:  # followers time out and pull instead
                logger.exception("KV connector: planning this step's followed writes failed")
            meta.unfollow = self.producer.take_unfollowed()
        return meta

    def request_finished(self, request, block_ids):
        try:
            if self.consumer is not None:
                if self.consumer.is_receiving(request.request_id):
                    return True, None  # a pull still writes into these blocks
                self.consumer.request_finished(request)
            if self.producer is None:
                return False, None
            # only a prefill cut at its one token is followed by a decode; one that stopped
            # (EOS, a stop token) has nothing to hand over, so its blocks go at once
            handed_over = request.status == RequestStatus.FINISHED_LENGTH_CAPPED
            return self.producer.request_finished(request, block_ids, handed_over)
        except Exception:
            logger.exception("KV connector: finishing %s failed", request.request_id)
            return False, None

    def update_connector_output(self, connector_output):
        if self.consumer is not None:
            self.consumer.pulls_ended(set(connector_output.finished_recving or ()))

    def set_xfer_handshake_metadata(self, metadata):
        if self.producer is not None:
            self.producer.set_ports({rank: md.port for rank, md in metadata.items()})

    # ---- worker side ---------------------------------------------------------------------------

    def register_kv_caches(self, kv_caches):
        vllm_config, settings = self._vllm_config, self._settings
        model_config = vllm_config.model_config
        tp_rank, tp_size = _tp_rank_and_size()
        layout = describe(
            kv_caches,
            model=model_config.model.rstrip("/").rsplit("/", 1)[-1],
            block_size=vllm_config.cache_config.block_size,
            num_kv_heads=model_config.get_num_kv_heads(vllm_config.parallel_config),
            head_dim=model_config.get_head_size(),
            tp_rank=tp_rank,
            tp_size=tp_size,
            transport=settings.transport,
        )
        plane = plane_class(settings.transport).from_settings(layout, kv_caches, settings)
        self._stats = TransferStats()
        self._tp_rank = tp_rank
        if "producer" in self._halves:
            engine_id = vllm_config.kv_transfer_config.engine_id or ""
            self.producer = _half(
                "producer", "worker", settings, plane, self._stats, tp_rank, engine_id
            )
        if "consumer" in self._halves:
            self.consumer = _half("consumer", "worker", settings, plane, self._stats, tp_rank)
        logger.info(
            "KV connector worker (%s): %d layers, %d B per block per layer",
            "+".join(self._halves),
            layout.num_layers,
            layout.block_bytes,
        )

    def get_handshake_metadata(self):
        if self._stats is None:
            return None
        port = self.producer.port if self.producer is not None else 0
        return PDServeHandshake(port=port, tp_rank=self._tp_rank)

    def start_load_kv(self, forward_context, **kwargs):
        meta = self._get_connector_metadata()
        if self.producer is not None:
            self.producer.offer(meta.send)
            self._begin_writes()
        if self.consumer is not None:
            self.consumer.start(meta.recv)  # pulls run on threads that catch everything

    def _begin_writes(self) -> None:
        """Tell the producer which followed prefills this step writes, once per step: before the
        forward's first layer is written. vLLM calls `start_load_kv` after the forward when the
        step loads nothing synchronously, so the first `save_kv_layer` may come first."""
        meta = self._get_connector_metadata()
        if self._begun is not meta:
            self._begun = meta
            _quietly(self.producer.begin_step, meta.write, meta.unfollow)

    def wait_for_layer_load(self, layer_name):
        """Nothing to wait for: a request's whole KV is loaded before its first forward (async:
        before it is scheduled; sync: in `start_load_kv`, before the step's forward)."""

    def save_kv_layer(self, layer_name, kv_layer, attn_metadata, **kwargs):
        """The forward wrote this layer: its pieces of followed prefills may go (nothing is
        copied; the KV server reads the cache)."""
        if self.producer is not None:
            self._begin_writes()
            _quietly(self.producer.layer_written, layer_name)

    def wait_for_save(self):
        """The forward is over (nothing to wait for: pieces are read from the cache): followed
        prefills whose prompt this step finished are complete."""
        if self.producer is not None:
            _quietly(self.producer.step_done)

    def get_finished(self, finished_req_ids):
        results = self.get_transfer_results(finished_req_ids)
        return results.finished_sending or None, results.finished_recving or None

    def get_transfer_results(self, finished_req_ids) -> KVConnectorTransferResults:
        sent = self.producer.finished_sending() if self.producer is not None else set()
        received, failed = self.consumer.results() if self.consumer is not None else (set(), set())
        return KVConnectorTransferResults(
            finished_sending=sent, finished_recving=received, failed_recving=failed
        )

    def get_block_ids_with_load_errors(self):
        return self.consumer.load_errors() if self.consumer is not None else set()

    def get_kv_connector_stats(self):
        if self._stats is None:
            return None
        gauges = self.producer.gauges() if self.producer is not None else KVGauges()
        snapshot = self._stats.snapshot(gauges)
        changed = snapshot["gauges"] != self._last_gauges
        self._last_gauges = snapshot["gauges"]
        if is_empty(snapshot) and not changed:
            return None
        return PDServeKVStats(data=snapshot)

    @classmethod
    def build_kv_connector_stats(cls, data=None):
        return PDServeKVStats(data=data or {})

    def shutdown(self):
        if self._stats is None:
            return  # the scheduler side runs nothing of its own
        for half in (self.producer, self.consumer):
            if half is not None:
                half.close()
