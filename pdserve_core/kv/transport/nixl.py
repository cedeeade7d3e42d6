"""NIXL data plane: the consumer READs the leased blocks straight out of the producer's KV cache.

Both sides register their paged KV cache with a NIXL agent (UCX backend) when the plane is
built; UCX then moves the bytes over whatever it finds between the two: RDMA (InfiniBand, RoCE),
NVLink or PCIe peer copies (`cuda_ipc`), shared memory or cross-memory attach on one host, TCP
elsewhere. `kv_transfer.ucx` narrows or tunes that choice (`UCX_TLS`, `UCX_NET_DEVICES`, ...).

The control conversation stays pdserve's (prefill_node/kv_server.py, decode_node/kv_client.py):
the consumer proves the cluster secret (over mutual TLS when the cluster has certificates), the
lease is claimed, and only then does this plane speak, on that same connection:
- the consumer's Handshake names the producer agent it has loaded already (`plane_fields`:
  `nixl_known_agent`);
- after an OK PullReply the producer sends a `NixlOffer`: its agent name, its agent metadata
  (UCX addresses and memory keys) when the consumer lacks it, the address of each layer's cache
  and its block ids in the consumer's order;
- the consumer pairs those blocks with its own, posts one READ for every run of blocks that is
  consecutive on both sides (every layer), and polls it to completion under the pull's deadline;
  then it sends PullDone as on every plane, and only that lets the producer's lease go.
NIXL's own metadata listener is never started: nothing but pdserve's authenticated channel hands
out the memory keys. A READ that fails or passes its deadline is cancelled and the producer's
agent forgotten (the next pull loads its metadata afresh).

The plane does not follow a running prefill (`follows` is False): a prefetch is refused and the
KV crosses after the prefill, in one READ.
"""

from __future__ import annotations

import importlib
import logging
import os
import select
import socket
import threading
import time
import uuid
from collections.abc import Mapping
from typing import Any

from pdserve_core.kv.layout import KVLayout
from pdserve_core.kv.transport.collective import wait_until
from pdserve_core.kv.transport.plane import DataPlane, paired_runs
from pdserve_core.kv.wire import ProtocolError, recv_message, send_message
from pdserve_proto.v1 import kv_transfer_pb2 as pb

logger = logging.getLogger(__name__)

MODULES = ("nixl_cu12", "nixl_cu13", "nixl")
"""Where NIXL's Python API may live: the CUDA-12 wheel, the CUDA-13 wheel, the meta package."""
UCX_DEFAULTS = {"TCP_TX_SEG_SIZE": "256k", "TCP_RX_SEG_SIZE": "256k"}
"""Set unless the environment or the config says otherwise: UCX's TCP transport moves large
blocks 1.3-1.6x faster with 256 KiB segments than with its 64 KiB default (measured on
loopback, 64 MiB)."""
UCX_GPU_DEFAULTS = {"CUDA_IPC_ENABLE_GET_ZCOPY": "y"}
"""Set as UCX_DEFAULTS are where the KV cache is on a GPU. The plane READs; UCX turns CUDA IPC
reads off where it finds no NVLink, and then stages GPU-to-GPU READs through host memory over
TCP. On one H200 (results/nixl_gpu) that moved 259 MiB at 2.2 GB/s; with CUDA IPC reads on, at
191 GB/s."""
MAX_METADATA_BYTES = 1 << 20
KNOWN_AGENT = "nixl_known_agent"
"""The Handshake's `plane_fields` entry naming the producer agent the consumer has loaded."""
PROGRESS_MS = 1
"""How often a producer progresses UCX while a consumer reads its blocks (and no more: no
thread spins between pulls)."""


def load_nixl() -> Any:
    """NIXL's Python module, or an ImportError that says what to install."""
    for name in MODULES:
        try:
            module = importlib.import_module(name)
        except ImportError:
            continue
        quiet = logging.getLogger("nixl")  # NIXL prints to stdout by default: ours goes to logs
        quiet.handlers.clear()
        quiet.propagate = True
        if not os.environ.get("NIXL_LOG_LEVEL"):
            quiet.setLevel(logging.WARNING)
        return module
    raise ImportError(
        "the nixl KV transport needs NIXL: pip install 'pdserve[cpu]' (or nixl-cu12 / nixl-cu13)"
    )


def apply_ucx_env(ucx: Mapping[str, str], gpu: bool = False) -> dict[str, str]:
    """Put `ucx` (names without the UCX_ prefix) into this process's environment before UCX
    starts; pdserve's defaults (and, for a cache on a `gpu`, its GPU defaults) fill what neither
    the environment nor `ucx` sets. Returns what was set."""
    chosen = {}
    for name, value in (UCX_DEFAULTS | (UCX_GPU_DEFAULTS if gpu else {})).items():
        if f"UCX_{name}" not in os.environ:
            chosen[f"UCX_{name}"] = value
    for name, value in ucx.items():
        chosen[f"UCX_{name.removeprefix('UCX_')}"] = str(value)
    os.environ.update(chosen)
    return chosen


class NixlPlane(DataPlane):
    name = "nixl"

    def __init__(
        self,
        layout: KVLayout,
        kv_caches: dict[str, Any],
        rate_limit: float | None = None,
        ucx: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__(layout, kv_caches, rate_limit)
        if rate_limit:
            logger.warning("the nixl plane does not pace its READs: the send rate limit is unused")
        nixl = load_nixl()
        set_env = apply_ucx_env(ucx or {}, gpu=self.layers[0].device.type != "cpu")
        self.agent_name = f"pdserve-{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        config = nixl.nixl_agent_config(
            enable_prog_thread=False,  # NIXL's spins a core: an engine has one or two
            enable_listen_thread=False,
            backends=["UCX"],
            sync_mode=nixl.nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT,
        )
        self.agent = nixl.nixl_agent(self.agent_name, config)
        if "UCX" not in self.agent.backends:
            raise RuntimeError("NIXL loaded without its UCX backend: the nixl plane cannot move KV")
        first = self.layers[0]
        self.memory = "DRAM" if first.device.type == "cpu" else "VRAM"
        self.device_id = 0 if first.device.type == "cpu" else first.device.index or 0
        self.addresses = [layer.data_ptr() for layer in self.layers]
        span = first.shape[0] * layout.block_bytes
        regions = [(address, span, self.device_id, "") for address in self.addresses]
        self._registered = self.agent.register_memory(regions, self.memory)
        self._lock = threading.Lock()
        self._known: dict[tuple[str, int], str] = {}
        """Consumer: producer (host, port) -> the name of its agent loaded here."""
        logger.info(
            "NIXL agent %s: %d layers of %s registered (%d MiB each); UCX env %s",
            self.agent_name,
            len(self.layers),
            self.memory,
            span >> 20,
            set_env or "as inherited",
        )

    @classmethod
    def from_settings(cls, layout: KVLayout, kv_caches: dict[str, Any], settings: Any):
        return cls(layout, kv_caches, settings.send_rate_limit_bytes_per_s, settings.ucx)

    # ---- handshake ------------------------------------------------------------------------------

    def consumer_pairing(self, peer: tuple[str, int], local_host: str = "") -> dict[str, Any]:
        with self._lock:
            known = self._known.get(peer, "")
        return {"plane_fields": {KNOWN_AGENT: known.encode()}}

    def consumer_link(self, peer, pairing, local_host: str = "", deadline: float | None = None):
        return peer

    def producer_link(self, pairing, local_host: str = "", deadline: float | None = None):
        """True when the consumer must be sent this agent's metadata."""
        known = dict(pairing.get("plane_fields") or {}).get(KNOWN_AGENT, b"")
        return known != self.agent_name.encode()

    # ---- the bytes ------------------------------------------------------------------------------

    def send_blocks(self, conn: socket.socket, blocks: list[int], deadline: float, link: Any):
        """Offer the blocks, then drive this agent's progress until the consumer has read them
        and its PullDone is waiting on `conn` (the lease holds the blocks until then). Over RDMA
        or shared memory a READ needs nothing from this side; over UCX's TCP transport it is
        served by this progress."""
        conn.settimeout(max(0.01, deadline - time.monotonic()))
        offer = pb.NixlOffer(
            agent=self.agent_name,
            metadata=self.agent.get_agent_metadata() if link else b"",
            memory=self.memory,
            device_id=self.device_id,
            layer_addresses=self.addresses,
            block_ids=blocks,
        )
        send_message(conn, offer)
        waiting = select.poll()  # not select(): a vLLM process's descriptors pass 1024
        waiting.register(conn, select.POLLIN)
        while not waiting.poll(PROGRESS_MS):
            if time.monotonic() > deadline:
                raise TimeoutError("the consumer did not finish its NIXL READ in time")
            self.agent.get_new_notifs()  # progresses the UCX worker

    def recv_blocks(self, conn: socket.socket, blocks: list[int], deadline: float, link: Any):
        conn.settimeout(max(0.01, deadline - time.monotonic()))
        offer = recv_message(conn, pb.NixlOffer, MAX_METADATA_BYTES)
        if len(offer.block_ids) != len(blocks) or len(offer.layer_addresses) != len(self.layers):
            raise ProtocolError(
                f"NIXL offer of {len(offer.block_ids)} blocks x {len(offer.layer_addresses)} "
                f"layers; this pull wants {len(blocks)} x {len(self.layers)}"
            )
        if offer.memory not in ("DRAM", "VRAM"):
            raise ProtocolError(f"NIXL offer of unknown memory {offer.memory!r}")
        agent = self._load(link, offer)
        local, remote = self._descriptors(offer, blocks)
        try:
            self._read(agent, local, remote, offer.memory, deadline)
        except BaseException:
            self._forget(link, agent)
            raise

    def _load(self, peer: tuple[str, int], offer: pb.NixlOffer) -> str:
        with self._lock:
            known = self._known.get(peer)
            if known == offer.agent and not offer.metadata:
                return known
            if not offer.metadata:
                raise ProtocolError(f"NIXL agent {offer.agent!r} sent no metadata and is unknown")
            if known and known != offer.agent:
                self._drop_agent(known)  # the producer restarted: its old agent is gone
            name = self.agent.add_remote_agent(offer.metadata)
            name = name.decode() if isinstance(name, bytes) else name
            if name != offer.agent:
                self._drop_agent(name)
                raise ProtocolError(f"NIXL metadata names agent {name!r}, offer {offer.agent!r}")
            self._known[peer] = name
            return name

    def _forget(self, peer: tuple[str, int], agent: str) -> None:
        with self._lock:
            if self._known.get(peer) == agent:
                del self._known[peer]
                self._drop_agent(agent)

    def _drop_agent(self, agent: str) -> None:
        try:
            self.agent.remove_remote_agent(agent)
        except Exception as error:  # already gone
            logger.debug("removing NIXL agent %s: %r", agent, error)

    def _descriptors(self, offer: pb.NixlOffer, local_blocks: list[int]):
        """(local, remote) descriptor lists: one per layer per run consecutive on both sides."""
        size = self.layout.block_bytes
        runs = paired_runs(list(offer.block_ids), local_blocks)
        local_descs, remote_descs = [], []
        for here, there in zip(self.addresses, offer.layer_addresses, strict=True):
            for remote, local, count in runs:
                local_descs.append((here + local * size, count * size, self.device_id))
                remote_descs.append((there + remote * size, count * size, offer.device_id))
        return local_descs, remote_descs

    def _read(self, agent: str, local, remote, remote_memory: str, deadline: float) -> None:
        local_list = self.agent.get_xfer_descs(local, self.memory)
        remote_list = self.agent.get_xfer_descs(remote, remote_memory)
        handle = self.agent.initialize_xfer("READ", local_list, remote_list, agent)
        try:
            state = self.agent.transfer(handle)

            def done() -> bool:
                nonlocal state
                if state == "PROC":
                    state = self.agent.check_xfer_state(handle)
                if state == "ERR":
                    raise ConnectionError(f"NIXL READ from agent {agent} failed")
                return state == "DONE"

            wait_until(done, deadline)
        finally:
            try:
                self.agent.release_xfer_handle(handle)  # cancels a READ still in flight
            except Exception as error:
                logger.warning("NIXL READ from %s could not be released: %r", agent, error)

    def close(self) -> None:
        try:
            self.agent.deregister_memory(self._registered)
        except Exception as error:
            logger.debug("deregistering the NIXL plane's memory: %r", error)
