"""A prefetch over real loopback sockets: a decode worker follows a prefill while it runs (the
producer's forward stepped by hand through `WriteProgress`, as the connector's hooks step it),
stages each layer as it is written, and serves the request's pull from what it staged."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from decode_node.kv_consumer import ConsumerWorker, RecvSpec
from decode_node.staging import StagedKV, Staging
from pdserve_core.kv.handle import KVHandle
from pdserve_core.kv.settings import ConnectorSettings
from pdserve_core.kv.stats import TransferStats
from pdserve_core.kv.transport.tcp import TcpPlane
from pdserve_core.kv.wire import TransferError
from prefill_node.kv_server import KVServer
from prefill_node.leases import ProducerTable
from prefill_node.progress import StepWrite, WriteProgress
from tests.sockets.test_kv_tcp import BLOCK_SIZE, LAYERS, caches, layout, until

KEY = "5e" * 16


@pytest.fixture
def producer():
    kv = caches(fill=True)
    plane = TcpPlane(layout(kv), kv)
    progress = WriteProgress(LAYERS)
    table = ProducerTable()
    server = KVServer(plane, table, lambda: b"secret", TransferStats(), progress=progress)
    port = server.start()
    yield kv, progress, table, port, server
    server.close()


def consumer_worker(**settings) -> tuple[dict, ConsumerWorker]:
    kv = caches(fill=False)
    settings = ConnectorSettings(secret="secret", **settings)
    return kv, ConsumerWorker(settings, TcpPlane(layout(kv), kv), TransferStats(), 0)


def as_bytes(cache: torch.Tensor, blocks: list[int]) -> torch.Tensor:
    return cache.reshape(cache.shape[0], -1).view(torch.uint8)[blocks]


def forward(progress: WriteProgress, write: StepWrite, before_layer=None) -> None:
    """One engine step of the producer: begin, each layer written, done."""
    progress.begin_step({KEY: write})
    for layer in range(LAYERS):
        if before_layer is not None:
            before_layer(layer)
        progress.layer_written(layer)
    progress.step_done()


def follow_in_thread(client, port: int, staged: StagedKV, deadline_s: float = 10):
    outcome: dict = {}

    def run() -> None:
        try:
            deadline = time.monotonic() + deadline_s
            outcome["bytes"], _ = client.follow(("127.0.0.1", port), staged, deadline)
        except TransferError as error:
            outcome["error"] = error

    thread = threading.Thread(target=run)
    thread.start()
    return thread, outcome


def test_each_layer_crosses_while_the_prefill_still_runs(producer):
    src, progress, _, port, _ = producer
    _, worker = consumer_worker()
    staged = StagedKV(KEY, LAYERS, 4, worker.plane.layout.block_bytes)
    thread, outcome = follow_in_thread(worker.client, port, staged)

    def layer_before_arrived(layer: int) -> None:
        # the follower holds every earlier layer of this chunk before the forward writes the next
        if layer:
            assert until(lambda: bool(staged._got[layer - 1, :2].all()))

    # chunk 1: tokens [0, 200) into blocks 5, 6; chunk 2: [200, 300) also into block 9
    forward(progress, StepWrite("p-1", [5, 6], 0, 200, BLOCK_SIZE, False), layer_before_arrived)
    assert not staged.ended.is_set()  # the prompt is not done
    forward(progress, StepWrite("p-1", [5, 6, 9], 200, 300, BLOCK_SIZE, True))
    thread.join(10)
    assert "error" not in outcome
    assert staged.request_id == "p-1" and staged.block_ids == (5, 6, 9)
    for layer, name in enumerate(sorted(src)):
        assert torch.equal(staged.data[layer, :3], as_bytes(src[name], [5, 6, 9]))
    assert progress.followed() == 0  # read to its end: forgotten


def test_a_cached_prefix_goes_at_once_and_a_late_follower_reads_everything(producer):
    src, progress, _, port, _ = producer
    _, worker = consumer_worker()
    # the engine had the first two blocks cached: this prefill computes tokens [256, 300) only
    forward(progress, StepWrite("p-2", [3, 4, 11], 256, 300, BLOCK_SIZE, True))
    staged = StagedKV(KEY, LAYERS, 4, worker.plane.layout.block_bytes)
    thread, outcome = follow_in_thread(worker.client, port, staged)
    thread.join(10)
    assert "error" not in outcome and staged.block_ids == (3, 4, 11)
    for layer, name in enumerate(sorted(src)):
        assert torch.equal(staged.data[layer, :3], as_bytes(src[name], [3, 4, 11]))


def test_a_prefill_that_ends_without_a_hand_over_ends_the_follow_with_why(producer):
    _, progress, _, port, _ = producer
    _, worker = consumer_worker()
    staged = StagedKV(KEY, LAYERS, 4, worker.plane.layout.block_bytes)
    thread, outcome = follow_in_thread(worker.client, port, staged)
    progress.begin_step({KEY: StepWrite("p-3", [1, 2], 0, 200, BLOCK_SIZE, False)})
    progress.layer_written(0)
    progress.fail(KEY, "the prefill was preempted")
    thread.join(10)
    assert "preempted" in str(outcome["error"])


def test_a_prefill_that_never_runs_ends_the_follow_at_its_deadline(producer):
    _, _, _, port, _ = producer
    _, worker = consumer_worker()
    staged = StagedKV(KEY, LAYERS, 4, worker.plane.layout.block_bytes)
    thread, outcome = follow_in_thread(worker.client, port, staged, deadline_s=0.5)
    thread.join(10)
    assert outcome["error"].reason == "timeout"


def test_a_prompt_larger_than_the_room_is_refused(producer):
    _, progress, _, port, _ = producer
    _, worker = consumer_worker()
    staged = StagedKV(KEY, LAYERS, 2, worker.plane.layout.block_bytes)
    thread, outcome = follow_in_thread(worker.client, port, staged)
    forward(progress, StepWrite("p-4", [1, 2, 3], 0, 300, BLOCK_SIZE, True))
    thread.join(10)
    assert "more than 2 blocks" in str(outcome["error"])


def handle(port: int, request_id: str, blocks: list[int], key: str = KEY) -> KVHandle:
    lease = time.time() + 30
    return KVHandle(
        "127.0.0.1", (port,), request_id, tuple(blocks), 300, lease, "", "tcp", prefetch_key=key
    )


def test_the_pull_is_served_from_the_prefetch_and_releases_the_lease(producer):
    src, progress, table, port, _ = producer
    dst, worker = consumer_worker()
    assert worker.prefetch(KEY, "127.0.0.1", [port], 300, BLOCK_SIZE)
    forward(progress, StepWrite("p-5", [5, 6, 9], 0, 300, BLOCK_SIZE, True))
    table.offer("p-5", [5, 6, 9], time.time() + 30)
    held = handle(port, "p-5", [5, 6, 9])
    spec = RecvSpec(held.to_params(), [6, 9], [0, 1], sync=True, cached_blocks=1)  # 5: cached
    assert worker._transfer("p-5", spec)
    for name in src:
        assert torch.equal(dst[name][[0, 1]], src[name][[6, 9]])
    assert until(table.collect_done) == {"p-5"}  # the release was the lease's one read
    counters = worker.stats.snapshot(_gauges())["counters"]
    assert counters["prefetches_used"] == 1 and counters["transfers_received"] == 1
    assert counters["releases"] == 0  # the lease ended by a read, not given back unread
    assert (counters["blocks_received"], counters["blocks_cached"]) == (2, 1)


def _gauges():
    from pdserve_core.kv.stats import KVGauges

    return KVGauges()


def test_a_prefetch_that_is_not_the_handles_is_dropped_and_the_request_pulls(producer):
    src, progress, table, port, _ = producer
    dst, worker = consumer_worker()
    assert worker.prefetch(KEY, "127.0.0.1", [port], 300, BLOCK_SIZE)
    forward(progress, StepWrite("p-6", [5, 6], 0, 200, BLOCK_SIZE, True))
    # the handle names other blocks than the prefill the key followed: nothing staged is used
    table.offer("p-6", [2, 3], time.time() + 30)
    spec = RecvSpec(handle(port, "p-6", [2, 3]).to_params(), [2, 3], [7, 8], sync=True)
    staged = worker.staging._staged[KEY]
    assert until(staged.ended.is_set)
    assert worker._transfer("p-6", spec)
    for name in src:
        assert torch.equal(dst[name][[7, 8]], src[name][[2, 3]])  # pulled, not staged
    counters = worker.stats.snapshot(_gauges())["counters"]
    assert counters["prefetches_missed"] == 1 and counters["prefetches_used"] == 0
    assert worker.staging.held_bytes() == 0


def test_prefetches_are_bounded_by_the_staging_budget(producer):
    _, _, _, port, _ = producer
    _, worker = consumer_worker(prefetch_mib=1)
    block_bytes = worker.plane.layout.block_bytes
    per_block = LAYERS * block_bytes
    tokens = (1 << 20) // per_block * BLOCK_SIZE  # as many blocks as 1 MiB holds, less one
    assert not worker.prefetch(KEY, "127.0.0.1", [port], tokens + BLOCK_SIZE, BLOCK_SIZE)
    assert worker.prefetch(KEY, "127.0.0.1", [port], tokens - BLOCK_SIZE, BLOCK_SIZE)
    assert not worker.prefetch(KEY, "127.0.0.1", [port], BLOCK_SIZE, BLOCK_SIZE)  # key taken
    _, off = consumer_worker(prefetch_mib=0)
    assert not off.prefetch("6f" * 16, "127.0.0.1", [port], BLOCK_SIZE, BLOCK_SIZE)


@pytest.mark.parametrize(
    "key, host, ports, tokens",
    [
        ("zz" * 16, "127.0.0.1", [1], 10),  # not hex
        (KEY[:-2], "127.0.0.1", [1], 10),  # too short
        (KEY, "10.0.0.9", [1], 10),  # a host handles may not name
        (KEY, "127.0.0.1", [], 10),  # no port for this rank
        (KEY, "127.0.0.1", [1], 0),
        (KEY, "127.0.0.1", [1], 1 << 40),
    ],
)
def test_a_hostile_prefetch_ask_is_declined(key, host, ports, tokens):
    _, worker = consumer_worker(peer_hosts=("127.0.0.1",))
    assert not worker.prefetch(key, host, ports, tokens, BLOCK_SIZE)


def test_staged_prefetches_nobody_takes_are_dropped_after_keep_s():
    staging = Staging(1 << 20, keep_s=0.0)
    staged = staging.reserve(KEY, 1, 1, 16)
    staged.fail("nobody came")
    assert staging.reserve("77" * 16, 1, 1, 16) is not None
    assert staging.take(KEY) is None


def test_a_dropped_prefetch_ends_its_follow_at_once(producer):
    """The pull gave up on a prefetch still running (its link stalled): its connection is cut
    then, so the follow's thread and memory are not held until its own deadline."""
    _, _, _, port, _ = producer
    _, worker = consumer_worker()
    staged = StagedKV(KEY, LAYERS, 4, worker.plane.layout.block_bytes)
    thread, outcome = follow_in_thread(worker.client, port, staged, deadline_s=60)
    assert until(lambda: staged._conn is not None)
    started = time.monotonic()
    staged.drop("still running")
    thread.join(10)
    assert not thread.is_alive() and time.monotonic() - started < 5
    assert outcome["error"].reason in ("connection_reset", "handshake")


def test_a_prefill_aborted_before_it_ran_ends_its_follow(producer):
    _, progress, _, port, _ = producer
    _, worker = consumer_worker()
    staged = StagedKV(KEY, LAYERS, 4, worker.plane.layout.block_bytes)
    thread, outcome = follow_in_thread(worker.client, port, staged, deadline_s=60)
    progress.begin_step({})
    progress.fail(KEY, "the prefill ended without a hand-over")  # never scheduled
    thread.join(10)
    assert not thread.is_alive() and "without a hand-over" in str(outcome["error"])


def test_prefetches_waiting_for_their_prefills_leave_the_pulls_their_slots(monkeypatch):
    """A burst of queued prefills, each followed while it waits, takes every follow slot: one more
    prefetch is refused with a reason, and the pull of a finished prefill is still served."""
    import prefill_node.kv_server as kv_server

    monkeypatch.setattr(kv_server, "MAX_PULLS", 2)
    monkeypatch.setattr(kv_server, "MAX_FOLLOWS", 2)
    src = caches(fill=True)
    table, progress = ProducerTable(), WriteProgress(LAYERS)
    plane = TcpPlane(layout(src), src)
    server = KVServer(plane, table, lambda: b"secret", TransferStats(), progress=progress)
    port = server.start()
    try:
        dst, worker = consumer_worker()
        size = worker.plane.layout.block_bytes
        waiting = [
            follow_in_thread(worker.client, port, StagedKV(f"{i:032x}", LAYERS, 4, size), 30)
            for i in range(2)
        ]
        assert until(lambda: server._follows._value == 0)  # both follows are waiting
        thread, outcome = follow_in_thread(worker.client, port, StagedKV(KEY, LAYERS, 4, size))
        thread.join(10)
        assert "too many prefetches" in str(outcome["error"])
        table.offer("p-7", [4], time.time() + 30)
        spec = RecvSpec(handle(port, "p-7", [4], key="").to_params(), [4], [2], sync=True)
        assert worker._transfer("p-7", spec)
        for name in src:
            assert torch.equal(dst[name][2], src[name][4])
    finally:
        server.close()
        for i in range(2):
            progress.fail(f"{i:032x}", "test over")
        for thread, _ in waiting:
            thread.join(10)
