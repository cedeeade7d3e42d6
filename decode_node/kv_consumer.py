"""The consumer half of pdserve's KV connector: how a decode engine loads a prefill's KV.

vLLM builds the connector twice per engine (`pdserve_core.kv.connector.PDServeConnector`); on a
`kv_consumer` (or `kv_both`) engine each instance holds one of these halves:

- `ConsumerScheduler` (EngineCore process): a request that arrives with a handle in
  `kv_transfer_params` is matched for the prompt tokens the producer computed that are not
  already cached here (`get_num_new_matched_tokens`); vLLM allocates blocks for them and
  `update_state_after_alloc` pairs those local blocks with the producer's and queues the pull for
  the workers. A handle whose blocks are all cached here is only given back, so the producer
  frees them at once.
- `ConsumerWorker` (each worker process): runs the pulls on a small thread pool into the fresh
  blocks. How the request waits for them is the `load` setting:
  - `sync` (default): vLLM schedules the request in the same step, and `start_load_kv` (called
    before that step's forward) waits for its pull, so the request decodes in the step that
    admitted it — the hand-over costs the pull, not extra steps. A sync match leaves the last
    prompt token to compute (a step must compute something). A failed pull reports its blocks in
    `get_block_ids_with_load_errors`.
  - `async`: the request waits in WAITING_FOR_REMOTE_KVS while the pull runs beside the steps
    (nothing else touches its blocks); the next step's `transfer_results` report it finished or
    failed, and vLLM schedules it one step later.
  On a failure vLLM applies `kv_load_failure_policy`: `recompute` computes the prefill here, `fail`
  ends the request with finish reason "error" (the decode node turns that into `KVLoadFailed`).
- Prefetch: when the router names this node as a request's decode node before its prefill ends,
  `ConsumerWorker.prefetch` follows the prefill and stages its KV as it is written (staging.py);
  the request's pull is then a local copy from the staged blocks, and a release at the producer.
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from decode_node.kv_client import KVClient
from decode_node.staging import StagedKV, Staging
from pdserve_core.kv.handle import (
    REMOTE_PREFILL,
    HandleError,
    KVHandle,
    prefetch_key,
    produced_tokens,
    wants_remote_prefill,
)
from pdserve_core.kv.settings import ConnectorSettings
from pdserve_core.kv.stats import TransferStats
from pdserve_core.kv.transport.plane import DataPlane
from pdserve_core.kv.wire import TransferError

logger = logging.getLogger(__name__)

PULL_THREADS = 4
PREFETCH_THREADS = 8
"""Prefills followed at once per worker (each waits on its prefill for most of its life)."""
FOLLOW_S = 120.0
"""The longest one prefetch follows its prefill (queueing and compute together)."""


@dataclass
class RecvSpec:
    """Scheduler → worker: pull these producer blocks into these local blocks."""

    params: dict[str, Any]
    """The handle as it arrived (kv_transfer_params)."""
    remote_block_ids: list[int]
    local_block_ids: list[int]
    release_only: bool = False
    """Nothing to load (all cached here): only tell the producer to free its blocks now."""
    sync: bool = False
    """Loaded before the forward of the step that schedules the request (`load: sync`)."""
    cached_blocks: int = 0
    """Blocks of the handle this engine had in its own prefix cache: not pulled."""


class ConsumerScheduler:
    def __init__(self, settings: ConnectorSettings, block_size: int) -> None:
        self.settings = settings
        self.block_size = block_size
        self.sync = settings.load == "sync"
        self._recv: dict[str, RecvSpec] = {}
        self._receiving: set[str] = set()
        self._local_hits: dict[str, int] = {}
        """Prompt tokens found in this engine's own cache at the last match (block-aligned)."""

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
        produced = produced_tokens(params, request.num_prompt_tokens)
        # sync: vLLM computes what is not matched in the same step, and a step must compute at
        # least one token; async: it recomputes the last token itself once the load is in
        usable = request.num_prompt_tokens - 1 if self.sync else request.num_prompt_tokens
        remaining = min(produced, usable) - num_computed_tokens
        self._local_hits[request.request_id] = num_computed_tokens
        return (remaining, not self.sync) if remaining > 0 else (0, False)

    def _fresh_blocks(self, request: Any, blocks: Any, num_external: int) -> tuple[int, list]:
        """(index of the first, ids of) the local blocks the external tokens go into: after the
        blocks of the local cache hit, up to the block holding the last external token."""
        local_hit = self._local_hits.pop(request.request_id, 0)
        first = local_hit // self.block_size
        end = -(-(local_hit + num_external) // self.block_size)
        return first, list(blocks.get_block_ids()[0][first:end])

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        params = request.kv_transfer_params
        if not wants_remote_prefill(params):
            return
        params[REMOTE_PREFILL] = False  # one pull per request, even if called again
        if num_external_tokens <= 0:
            hit = self._local_hits.pop(request.request_id, 0)
            self._release_unneeded(request.request_id, params, hit // self.block_size)
            return
        cached, fresh = self._fresh_blocks(request, blocks, num_external_tokens)
        try:
            handle = KVHandle.from_params(params, self.settings.peer_hosts)
            remote = list(handle.block_ids[cached : cached + len(fresh)])
            if len(remote) != len(fresh):
                raise HandleError(
                    f"handle holds {len(handle.block_ids)} blocks; {cached + len(fresh)} needed"
                )
        except HandleError as error:
            logger.warning("request %s: %s", request.request_id, error)
            remote = []
        spec = RecvSpec(dict(params), remote, fresh, sync=self.sync, cached_blocks=cached)
        self._recv[request.request_id] = spec
        if not self.sync:
            self._receiving.add(request.request_id)

    def _release_unneeded(self, request_id: str, params: dict, cached_blocks: int = 0) -> None:
        """Everything was cached here (`cached_blocks` of it), or the request ended before its
        pull: let the producer free its blocks instead of waiting for the lease (the request
        is not waiting for KV, so vLLM hears nothing of this)."""
        try:
            KVHandle.from_params(params, self.settings.peer_hosts)
        except HandleError:
            return
        spec = RecvSpec(dict(params), [], [], release_only=True, cached_blocks=cached_blocks)
        self._recv[f"release:{request_id}"] = spec

    def failed_pull(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        """A pull that must fail (something went wrong before it could be planned): the worker
        reports it failed, so vLLM applies the failure policy instead of waiting forever (or,
        sync, computing from blocks nothing wrote)."""
        params = request.kv_transfer_params
        try:
            _, local = self._fresh_blocks(request, blocks, num_external_tokens)
        except Exception:
            local = list(blocks.get_block_ids()[0])
        spec = RecvSpec(dict(params) if isinstance(params, dict) else {}, [], local, sync=self.sync)
        self._recv[request.request_id] = spec
        if not self.sync:
            self._receiving.add(request.request_id)

    def is_receiving(self, request_id: str) -> bool:
        """A pull still writes into this request's blocks (free them when it ends)."""
        return request_id in self._receiving

    def request_finished(self, request: Any) -> None:
        """A request that ended before its pull was planned (aborted: its client left) gives its
        handle back, so the producer frees the blocks now rather than when the lease ends."""
        self._local_hits.pop(request.request_id, None)
        params = request.kv_transfer_params
        if wants_remote_prefill(params):
            params[REMOTE_PREFILL] = False
            self._release_unneeded(request.request_id, params)

    def take_pulls(self) -> dict[str, RecvSpec]:
        pulls, self._recv = self._recv, {}
        return pulls

    def pulls_ended(self, request_ids: set[str]) -> None:
        self._receiving -= request_ids


class ConsumerWorker:
    def __init__(
        self, settings: ConnectorSettings, plane: DataPlane, stats: TransferStats, tp_rank: int
    ) -> None:
        self.settings = settings
        self.stats = stats
        self.tp_rank = tp_rank
        self.client = KVClient(plane, settings.read_secret, settings.client_tls())
        self.plane = plane
        self._pool = ThreadPoolExecutor(PULL_THREADS, thread_name_prefix="pdserve-kv-pull")
        self._prefetches = ThreadPoolExecutor(PREFETCH_THREADS, thread_name_prefix="pdserve-ahead")
        self.staging = Staging(settings.prefetch_mib << 20, settings.lease_s)
        self._lock = threading.Lock()
        self._received: set[str] = set()
        self._failed: set[str] = set()
        self._load_errors: set[int] = set()

    def start(self, pulls: dict[str, RecvSpec]) -> None:
        """Start this step's pulls; return once the sync ones have ended (their requests run in
        this step's forward)."""
        waiting = []
        for request_id, spec in pulls.items():
            if spec.release_only:
                self.stats.blocks(0, spec.cached_blocks)
                self._pool.submit(self._release, spec)
                continue
            self.stats.started()
            if spec.sync:
                waiting.append((spec, self._pool.submit(self._transfer, request_id, spec)))
            else:
                self._pool.submit(self._pull, request_id, spec)
        for spec, done in waiting:
            if not done.result():  # _transfer never raises
                self._load_errors.update(spec.local_block_ids)

    def prefetch(self, key: str, host: str, ports: list[int], num_tokens: int, block_size: int):
        """Follow the prefill `key` names on `host` and stage its KV (see staging.py). False when
        this worker will not: prefetch off or out of room, a plane that cannot follow, a host
        handles may not name, or a malformed ask."""
        plane, settings = self.plane, self.settings
        if not plane.follows or prefetch_key({"prefetch_key": key}) is None:
            return False
        if settings.peer_hosts is not None and host not in settings.peer_hosts:
            return False
        if self.tp_rank >= len(ports) or not 0 < num_tokens <= 1 << 24 or block_size < 1:
            return False
        capacity = -(-num_tokens // block_size) + 1
        layout = plane.layout
        staged = self.staging.reserve(key, layout.num_layers, capacity, layout.block_bytes)
        if staged is None:
            return False
        self._prefetches.submit(self._follow, (host, int(ports[self.tp_rank])), staged)
        return True

    def _follow(self, peer: tuple[str, int], staged: StagedKV) -> None:
        started = time.monotonic()
        try:
            moved, seconds = self.client.follow(peer, staged, started + FOLLOW_S)
            self.stats.transfer("received", moved, seconds)
        except Exception as error:  # the request pulls as it would have without a prefetch
            staged.fail(str(error))
            if self.staging.take(staged.key) is not None:
                self.stats.prefetch(used=False)
            logger.info("prefetch %s… from %s:%d ended: %s", staged.key[:8], *peer, error)

    def _from_staging(self, spec: RecvSpec, handle: KVHandle, deadline: float) -> int | None:
        """Serve a pull from its prefetch, when there is a complete one for this handle: bytes
        copied, or None (then the request pulls)."""
        staged = self.staging.take(handle.prefetch_key) if handle.prefetch_key else None
        if staged is None:
            return None
        staged.ended.wait(max(0.0, deadline - time.monotonic()))
        places = staged.places(handle.request_id, handle.block_ids, spec.remote_block_ids)
        if places is None:
            self.stats.prefetch(used=False)
            running = not staged.ended.is_set()
            why = staged.error or ("still running" if running else "not the handle's")
            staged.drop(why)
            logger.info("prefetch of %s not used (%s): pulling", handle.request_id, why)
            return None
        copied = staged.copy_into(self.plane.layers, places, spec.local_block_ids)
        self.stats.prefetch(used=True)
        self._pool.submit(self._release, spec, False)  # the lease: one completed read
        return copied

    def _release(self, spec: RecvSpec, unread: bool = True) -> None:
        """Tell the producer this handle's read is complete (no blocks moved): `unread`, every
        block was cached here; else they came with a prefetch."""
        try:
            handle = KVHandle.from_params(spec.params, self.settings.peer_hosts)
            deadline = time.monotonic() + min(self.settings.timeout_s, 5.0)
            self.client.pull(handle, [], [], self.tp_rank, deadline)
            if unread:
                self.stats.released()
        except (TransferError, HandleError) as error:  # the lease will free them instead
            logger.info("could not release unneeded KV at the producer: %s", error)

    def _pull(self, request_id: str, spec: RecvSpec) -> None:
        """An async pull: its end is reported in the next `results`."""
        failed = not self._transfer(request_id, spec)
        with self._lock:
            self._received.add(request_id)
            if failed:
                self._failed.add(request_id)

    def _transfer(self, request_id: str, spec: RecvSpec) -> bool:
        """Pull one request's blocks; False (the reason counted and logged) when it failed."""
        started = time.monotonic()
        try:
            if not spec.remote_block_ids:
                raise TransferError("bad_handle", "the request's kv_transfer_params are not usable")
            handle = KVHandle.from_params(spec.params, self.settings.peer_hosts)
            lease_left = handle.lease_deadline - time.time()
            if lease_left <= 0:
                raise TransferError("lease_expired", f"lease ended {-lease_left:.1f} s ago")
            deadline = started + min(self.settings.timeout_s, lease_left)
            if self._from_staging(spec, handle, deadline) is None:
                moved = self.client.pull(
                    handle, spec.remote_block_ids, spec.local_block_ids, self.tp_rank, deadline
                )
                self.stats.transfer("received", moved, time.monotonic() - started)
            self.stats.blocks(len(spec.local_block_ids), spec.cached_blocks)
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
        return not failed

    def load_errors(self) -> set[int]:
        """Local blocks of sync pulls that failed since the last call."""
        errors, self._load_errors = self._load_errors, set()
        return errors

    def results(self) -> tuple[set[str], set[str]]:
        """Pulls that ended since the last call: (all ended, of which failed)."""
        with self._lock:
            received, failed = self._received, self._failed
            self._received, self._failed = set(), set()
        return received, failed

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._prefetches.shutdown(wait=False, cancel_futures=True)
