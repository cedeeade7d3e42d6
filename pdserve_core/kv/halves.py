"""The contract between pdserve's connector (connector.py) and its two halves.

The producer half lives with the prefill node (`prefill_node/kv_producer.py`), the consumer half
with the decode node (`decode_node/kv_consumer.py`); this package names their modules but never
imports them (a process loads only the halves its `kv_role` needs), so what the connector may
call on each side is written here, as protocols the halves' classes satisfy
(tests/logic/test_kv_halves.py checks that they do). Each half has a scheduler side (in the
EngineCore process) and a worker side (in each model worker, holding the data plane: on a CPU
the EngineCore's own process unless `engine.cpu_worker_process`, on GPUs a process per rank).
vLLM builds the two as separate instances either way; they share nothing but the metadata
vLLM hands from one to the other.
"""

from __future__ import annotations

import importlib
from typing import Any, NamedTuple, Protocol, runtime_checkable

from pdserve_core.kv.stats import KVGauges


@runtime_checkable
class ProducerScheduler(Protocol):
    """Leases a finished prefill's blocks and plans the writes followed prefills make."""

    def plan_writes(self, scheduler_output: Any) -> dict[str, Any]: ...
    def take_unfollowed(self) -> dict[str, str]: ...
    def set_ports(self, ports: dict[int, int]) -> None: ...
    def request_finished(
        self, request: Any, block_ids: list[int], handed_over: bool
    ) -> tuple[bool, dict | None]: ...
    def take_offers(self) -> dict[str, Any]: ...


@runtime_checkable
class ProducerWorker(Protocol):
    """Serves the leased blocks to consumers (its KV server, over the data plane)."""

    @property
    def port(self) -> int: ...
    def offer(self, offers: dict[str, Any]) -> None: ...
    def begin_step(self, writes: dict[str, Any], unfollow: dict[str, str]) -> None: ...
    def layer_written(self, layer_name: str) -> None: ...
    def step_done(self) -> None: ...
    def give_back(self, request_id: str, lease_deadline: float) -> None: ...
    def give_back_leg(self, leg_id: str) -> int: ...
    def finished_sending(self) -> set[str]: ...
    def gauges(self) -> KVGauges: ...
    def close(self) -> None: ...


@runtime_checkable
class ConsumerScheduler(Protocol):
    """Matches a request's handle against the local cache and plans its pull."""

    def get_num_new_matched_tokens(
        self, request: Any, num_computed_tokens: int
    ) -> tuple[int, bool]: ...
    def update_state_after_alloc(
        self, request: Any, blocks: Any, num_external_tokens: int
    ) -> None: ...
    def failed_pull(self, request: Any, blocks: Any, num_external_tokens: int) -> None: ...
    def is_receiving(self, request_id: str) -> bool: ...
    def request_finished(self, request: Any) -> None: ...
    def take_pulls(self) -> dict[str, Any]: ...
    def pulls_ended(self, request_ids: set[str]) -> None: ...


@runtime_checkable
class ConsumerWorker(Protocol):
    """Runs the pulls (and prefetches) into this worker's cache."""

    def start(self, pulls: dict[str, Any]) -> None: ...
    def prefetch(
        self, key: str, host: str, ports: list[int], num_tokens: int, block_size: int
    ) -> bool: ...
    def load_errors(self) -> set[int]: ...
    def results(self) -> tuple[set[str], set[str]]: ...
    def close(self) -> None: ...


class Half(NamedTuple):
    """Where one half lives: its module and the class of each side."""

    module: str
    scheduler: str
    worker: str

    def load(self, side: str) -> type:
        """The class of `side` ("scheduler" or "worker"), imported now."""
        return getattr(importlib.import_module(self.module), getattr(self, side))


HALVES = {
    "producer": Half("prefill_node.kv_producer", "ProducerScheduler", "ProducerWorker"),
    "consumer": Half("decode_node.kv_consumer", "ConsumerScheduler", "ConsumerWorker"),
}
CONTRACTS = {
    ("producer", "scheduler"): ProducerScheduler,
    ("producer", "worker"): ProducerWorker,
    ("consumer", "scheduler"): ConsumerScheduler,
    ("consumer", "worker"): ConsumerWorker,
}
"""Each side of each half -> the protocol its class satisfies."""
