"""The nixl plane between two processes: a prefill node's KV server in its own process
(tests/helpers/nixl_peer.py), the decode node's client here, blocks READ over NIXL's UCX backend
on loopback from one registered CPU cache into the other, every byte compared."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest
import torch

from decode_node.kv_client import KVClient
from pdserve_core.kv.handle import KVHandle
from pdserve_core.kv.layout import describe
from pdserve_core.kv.settings import ConnectorSettings
from pdserve_core.kv.transport import plane_class
from pdserve_core.kv.transport.nixl import NixlPlane, apply_ucx_env
from pdserve_core.kv.wire import TransferError
from tests.conftest import REPO
from tests.helpers.kv_caches import cpu_caches

LAYERS, BLOCKS, HEADS, BLOCK_SIZE, HEAD_DIM = 4, 16, 3, 16, 64
PEER = REPO / "tests/helpers/nixl_peer.py"
BLOCK_BYTES = HEADS * BLOCK_SIZE * 2 * HEAD_DIM * 2


@pytest.fixture(scope="module", autouse=True)
def ucx_environment():
    """UCX's variables restored as they were once the module ends: a plane made here puts its
    settings into this process's environment (as it must before UCX starts), and engines that
    later tests start from this process would inherit them (an mlx5 device left there: no route
    on loopback, the engine fails to start)."""
    before = {name: value for name, value in os.environ.items() if name.startswith("UCX_")}
    yield
    for name in [name for name in os.environ if name.startswith("UCX_")]:
        del os.environ[name]
    os.environ.update(before)


def caches(seed: int | None) -> dict[str, torch.Tensor]:
    return cpu_caches(LAYERS, BLOCKS, HEADS, BLOCK_SIZE, HEAD_DIM, seed)


def plane(kv, **ucx) -> NixlPlane:
    layout = describe(kv, "smol", BLOCK_SIZE, HEADS, HEAD_DIM, 0, 1, "nixl")
    return NixlPlane(layout, kv, ucx=ucx)


def handle(port: int, request: str, blocks: list[int]) -> KVHandle:
    return KVHandle("127.0.0.1", (port,), request, tuple(blocks), 5, time.time() + 60, "e", "nixl")


class Peer:
    """The producer process and its commands."""

    def __init__(self, **env: str) -> None:
        self.process = subprocess.Popen(
            [sys.executable, str(PEER)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env={**os.environ, **env},
        )
        line = self.process.stdout.readline()
        assert line.startswith("PORT "), f"the peer said {line!r}"
        self.port = int(line.split()[1])

    def say(self, *words) -> str:
        self.process.stdin.write(" ".join(str(w) for w in words) + "\n")
        self.process.stdin.flush()
        return self.process.stdout.readline().strip()

    def offer(self, request: str, blocks: list[int], lease_s: float = 60) -> None:
        assert self.say("offer", request, ",".join(map(str, blocks)), lease_s) == "ok"

    def done(self, request: str, timeout: float = 5.0) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if request in json.loads(self.say("done")):
                return True
            time.sleep(0.02)
        return False

    def kill(self) -> None:
        self.process.kill()
        self.process.wait(10)


@pytest.fixture(scope="module")
def peer():
    side = Peer()
    yield side
    side.kill()


@pytest.fixture(scope="module")
def here():
    """The consumer's cache and plane, shared by the tests (zeroed for each)."""
    kv = caches(seed=None)
    return kv, plane(kv)


@pytest.fixture
def dst(here):
    kv, side = here
    for tensor in kv.values():
        tensor.zero_()
    return kv, KVClient(side, lambda: b"secret")


def test_a_pull_reads_exact_blocks_from_the_other_process_and_ends_the_lease(peer, dst):
    kv, client = dst
    src = caches(seed=1)
    remote, local = [2, 3, 4, 9], [0, 1, 5, 6]
    peer.offer("r1", remote)
    moved = client.pull(handle(peer.port, "r1", remote), remote, local, 0, time.monotonic() + 20)
    assert moved == len(remote) * LAYERS * BLOCK_BYTES
    for name in src:
        assert torch.equal(kv[name][local], src[name][remote])
        assert not kv[name][[2, 3, 4, 7]].any()  # nothing else written
    assert peer.done("r1")


def test_the_producers_metadata_crosses_once_per_consumer(peer, dst, monkeypatch):
    kv, client = dst
    loads = []
    agent = client.plane.agent
    original = agent.add_remote_agent
    monkeypatch.setattr(agent, "add_remote_agent", lambda md: loads.append(md) or original(md))
    client.plane._forget(
        ("127.0.0.1", peer.port), client.plane._known.get(("127.0.0.1", peer.port), "")
    )
    src = caches(seed=1)
    for request, remote, local in (("m1", [5, 6], [9, 10]), ("m2", [7, 1, 8], [3, 12, 4])):
        peer.offer(request, remote)
        client.pull(handle(peer.port, request, remote), remote, local, 0, time.monotonic() + 20)
        for name in src:
            assert torch.equal(kv[name][local], src[name][remote])
    assert len(loads) == 1


@pytest.mark.parametrize(
    "case, reason",
    [
        ("wrong secret", "auth"),
        ("expired lease", "lease_expired"),
        ("blocks it does not hold", "bad_blocks"),
        ("a tcp consumer", "handshake"),
    ],
)
def test_a_refused_pull_moves_nothing(peer, dst, case, reason):
    kv, client = dst
    if case == "wrong secret":
        client = KVClient(client.plane, lambda: b"guess")
    if case == "a tcp consumer":
        tcp = plane_class("tcp")(describe(kv, "smol", BLOCK_SIZE, HEADS, HEAD_DIM, 0, 1, "tcp"), kv)
        client = KVClient(tcp, lambda: b"secret")
    lease_s = -1 if case == "expired lease" else 60
    peer.offer(f"x-{reason}", [1, 2], lease_s)
    wanted = [1, 2, 3] if case == "blocks it does not hold" else [1, 2]
    with pytest.raises(TransferError) as refused:
        client.pull(handle(peer.port, f"x-{reason}", wanted), wanted, [4, 5, 6][: len(wanted)], 0,
                    time.monotonic() + 10)  # fmt: skip
    assert refused.value.reason == reason
    assert not any(t.any() for t in kv.values())


def test_a_peer_that_stops_mid_read_fails_the_pull_at_its_deadline_and_a_dead_one_at_once(
    monkeypatch,
):
    """Over UCX's TCP transport (a stopped process cannot answer it; shared memory would still
    read a stopped process's pages): the READ is cancelled at the pull's deadline, the agent
    forgotten; once the process is dead the next pull fails at connect."""
    monkeypatch.setenv("UCX_TLS", "tcp")
    frozen = Peer(UCX_TLS="tcp", UCX_NET_DEVICES="lo")
    try:
        kv = caches(seed=None)
        side = plane(kv, NET_DEVICES="lo")
        client = KVClient(side, lambda: b"secret")
        frozen.offer("ok", [1])
        client.pull(handle(frozen.port, "ok", [1]), [1], [2], 0, time.monotonic() + 20)
        assert frozen.say("freeze") == "ok"
        frozen.offer("stuck", [3, 4])
        started = time.monotonic()
        with pytest.raises(TransferError) as stuck:
            client.pull(handle(frozen.port, "stuck", [3, 4]), [3, 4], [5, 6], 0, started + 2)
        assert stuck.value.reason == "timeout"
        assert time.monotonic() - started < 4
        assert side._known == {}
    finally:
        frozen.kill()
    with pytest.raises(TransferError) as dead:
        client.pull(handle(frozen.port, "gone", [1]), [1], [2], 0, time.monotonic() + 5)
    assert dead.value.reason == "connect"


def test_ucx_settings_reach_the_environment_before_ucx_starts(monkeypatch):
    for name in ("UCX_TCP_TX_SEG_SIZE", "UCX_NET_DEVICES", "UCX_CUDA_IPC_ENABLE_GET_ZCOPY"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("UCX_TCP_RX_SEG_SIZE", "128k")
    monkeypatch.setenv("UCX_TLS", "all")
    chosen = apply_ucx_env({"TLS": "rc,cuda_copy", "UCX_NET_DEVICES": "mlx5_0:1"})
    assert chosen == {
        "UCX_TCP_TX_SEG_SIZE": "256k",  # pdserve's default where the environment set none
        "UCX_TLS": "rc,cuda_copy",  # the config over the environment
        "UCX_NET_DEVICES": "mlx5_0:1",
    }  # UCX_TCP_RX_SEG_SIZE: the environment's 128k stays
    ipc = "UCX_CUDA_IPC_ENABLE_GET_ZCOPY"
    assert ipc not in apply_ucx_env({})  # a cache in host memory: no GPU defaults
    assert apply_ucx_env({}, gpu=True)[ipc] == "y"  # a GPU cache: READs over CUDA IPC
    assert apply_ucx_env({"CUDA_IPC_ENABLE_GET_ZCOPY": "n"}, gpu=True)[ipc] == "n"  # config wins
    with pytest.raises(ValueError, match="not a UCX variable"):
        ConnectorSettings.from_extra({"secret": "s", "transport": "nixl", "ucx": {"tls; rm": "x"}})
    assert ConnectorSettings.from_extra({"secret": "s", "ucx": {"TLS": "tcp"}}).ucx == {
        "TLS": "tcp"
    }
