"""NCCL transport: the NCCL backend's calls under the collective plane's pairing, on CPU (a
stand-in NCCL library that records what it is asked), and a real two-rank transfer on machines
with two or more GPUs. The plane's own logic runs for real on gloo (test_kv_gloo.py)."""

from __future__ import annotations

import multiprocessing
import time

import pytest
import torch

from pdserve_core.kv.transport.collective import CONSUMER_RANK, PRODUCER_RANK, Pairing, pair_key
from pdserve_core.kv.transport.nccl import NcclBackend
from pdserve_core.kv.wire import ProtocolError


class RecordingNccl:
    """Implements the three calls pairing makes; each unique id is distinct."""

    def __init__(self) -> None:
        self.inits: list[tuple[int, bytes, int]] = []
        self._next = 0

    def ncclGetUniqueId(self):
        self._next += 1

        class Uid:
            internal = bytes([self._next]) * 128

        return Uid()

    def unique_id_from_bytes(self, data: bytes) -> bytes:
        return data

    def ncclCommInitRank(self, world: int, unique_id: bytes, rank: int):
        self.inits.append((world, unique_id, rank))
        return f"comm-{len(self.inits)}"


def test_first_contact_sends_an_id_then_reuses_the_pair_key():
    consumer = Pairing(NcclBackend(RecordingNccl()))
    producer = Pairing(NcclBackend(RecordingNccl()))
    peer = ("10.0.0.1", 7000)
    first = consumer.consumer_fields(peer)
    assert len(first["nccl_unique_id"]) == 128
    served = producer.producer_link(first)
    link = consumer.consumer_link(peer, first)
    assert producer.backend.library.inits == [(2, first["nccl_unique_id"], PRODUCER_RANK)]
    assert consumer.backend.library.inits == [(2, first["nccl_unique_id"], CONSUMER_RANK)]
    assert (served.peer_rank, link.peer_rank) == (CONSUMER_RANK, PRODUCER_RANK)

    again = consumer.consumer_fields(peer)
    assert again == {"nccl_pair_key": pair_key(first["nccl_unique_id"])}
    assert consumer.consumer_link(peer, again) is link
    assert producer.producer_link(again) is served
    assert len(producer.backend.library.inits) == 1 and len(consumer.backend.library.inits) == 1


def test_each_producer_gets_its_own_communicator():
    consumer = Pairing(NcclBackend(RecordingNccl()))
    a = consumer.consumer_fields(("h", 1))
    b = consumer.consumer_fields(("h", 2))
    assert a["nccl_unique_id"] != b["nccl_unique_id"]


def test_unknown_pair_key_and_bad_ids_are_refused():
    producer = Pairing(NcclBackend(RecordingNccl()))
    with pytest.raises(ProtocolError, match="unknown pair key"):
        producer.producer_link({"nccl_pair_key": b"x" * 16})
    with pytest.raises(ProtocolError, match="128 bytes"):
        producer.producer_link({"nccl_unique_id": b"short"})


def test_a_failed_pairing_is_forgotten():
    consumer = Pairing(NcclBackend(RecordingNccl()))
    peer = ("h", 1)
    first = consumer.consumer_fields(peer)
    consumer.forget(peer)
    assert "nccl_unique_id" in consumer.consumer_fields(peer)
    assert first


def _two_gpus() -> bool:
    return torch.cuda.is_available() and torch.cuda.device_count() >= 2


def _rank(role: str, port_queue, result_queue) -> None:
    import torch

    from decode_node.kv_client import KVClient
    from pdserve_core.kv.handle import KVHandle
    from pdserve_core.kv.layout import describe
    from pdserve_core.kv.stats import TransferStats
    from pdserve_core.kv.transport.nccl import NcclPlane
    from prefill_node.kv_server import KVServer
    from prefill_node.leases import ProducerTable

    device = torch.device("cuda", 0 if role == "producer" else 1)
    torch.cuda.set_device(device)
    gen = torch.Generator(device="cpu").manual_seed(0)
    kv = {
        f"layer.{i}": (
            torch.randn(8, 16, 8, 128, generator=gen)
            if role == "producer"
            else torch.zeros(8, 16, 8, 128)
        )
        .to(torch.bfloat16)
        .to(device)
        for i in range(4)
    }
    layout = describe(kv, "m", 16, 8, 64, 0, 1, "nccl")
    plane = NcclPlane(layout, kv)
    if role == "producer":
        table = ProducerTable()
        table.offer("r0", [1, 2, 5], time.time() + 60)
        table.offer("r1", [1, 2, 5], time.time() + 60)
        port_queue.put(KVServer(plane, table, lambda: b"s", TransferStats()).start())
        deadline, done = time.monotonic() + 60, set()
        while len(done) < 2 and time.monotonic() < deadline:
            done |= table.collect_done()
            time.sleep(0.05)
        result_queue.put(("producer", {k: v[[1, 2, 5]].cpu() for k, v in kv.items()}))
    else:
        port = port_queue.get(timeout=60)
        for attempt in range(2):  # the second pull reuses the communicator
            handle = KVHandle(
                "127.0.0.1", (port,), f"r{attempt}", (1, 2, 5), 40, time.time() + 60, "e", "nccl"
            )
            KVClient(plane, lambda: b"s").pull(
                handle, [1, 2, 5], [0, 3, 4], 0, time.monotonic() + 60
            )
        result_queue.put(("consumer", {k: v[[0, 3, 4]].cpu() for k, v in kv.items()}))


@pytest.mark.gpu
@pytest.mark.skipif(not _two_gpus(), reason="needs two CUDA GPUs for a two-rank NCCL group")
def test_two_rank_nccl_transfer_moves_exact_blocks():
    ctx = multiprocessing.get_context("spawn")
    ports, results = ctx.Queue(), ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(r, ports, results)) for r in ("producer", "consumer")]
    for p in procs:
        p.start()
    got = dict(results.get(timeout=180) for _ in procs)
    for p in procs:
        p.join(timeout=60)
    for name, sent in got["producer"].items():
        assert torch.equal(sent, got["consumer"][name])


def test_a_stalled_pair_is_aborted_and_paired_afresh():
    """The watchdog's half that needs no GPU: a wait that outlives its deadline raises, and an
    aborted pair is forgotten on both sides (the next contact sends a new id)."""
    from pdserve_core.kv.transport.collective import wait_until

    started = time.monotonic()
    with pytest.raises(TimeoutError):
        wait_until(lambda: False, time.monotonic() + 0.2)
    assert time.monotonic() - started < 2
    wait_until(lambda: True, time.monotonic())

    library = RecordingNccl()
    library.aborted = []
    library.ncclCommAbort = library.aborted.append
    consumer = Pairing(NcclBackend(library))
    peer = ("h", 1)
    link = consumer.consumer_link(peer, consumer.consumer_fields(peer))
    assert "nccl_pair_key" in consumer.consumer_fields(peer)
    consumer.abort(link)
    assert library.aborted == [link.comm]
    assert "nccl_unique_id" in consumer.consumer_fields(peer)
