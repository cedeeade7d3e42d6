"""The prefill node's lease table: offers, claims, releases and expiry, stepped by hand."""

from __future__ import annotations

import threading
import time

import pytest

from prefill_node.leases import ClaimError, ProducerTable


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_offer_claim_release_frees_the_blocks():
    table = ProducerTable(clock=Clock())
    table.offer("r", [1, 2, 3], deadline=1010)
    assert table.blocks_held() == 3
    table.claim("r", [2, 3], wait_s=0)
    assert table.collect_done() == set()  # being read
    table.release("r", completed=True)
    assert table.collect_done() == {"r"}
    assert table.blocks_held() == 0 and table.leases_expired == 0


def test_a_failed_read_keeps_the_offer_until_its_lease_ends():
    clock = Clock()
    table = ProducerTable(clock=clock)
    table.offer("r", [1], deadline=1010)
    table.claim("r", [1], wait_s=0)
    table.release("r", completed=False)
    assert table.collect_done() == set()
    clock.now = 1011
    assert table.collect_done() == {"r"}
    assert table.leases_expired == 1
    with pytest.raises(ClaimError) as refused:
        table.claim("r", [1], wait_s=0)
    assert refused.value.reason == "lease_expired"


def test_no_expiry_under_a_reader():
    clock = Clock()
    table = ProducerTable(clock=clock)
    table.offer("r", [7], deadline=1001)
    table.claim("r", [7], wait_s=0)
    clock.now = 2000
    assert table.collect_done() == set()  # never freed while read
    table.release("r", completed=True)
    assert table.collect_done() == {"r"} and table.leases_expired == 0


def test_claims_are_checked():
    clock = Clock()
    table = ProducerTable(clock=clock)
    with pytest.raises(ClaimError) as unknown:
        table.claim("nope", [1], wait_s=0.05)
    assert unknown.value.reason == "unknown_request"
    table.offer("r", [1, 2], deadline=1010)
    with pytest.raises(ClaimError) as bad:
        table.claim("r", [2, 5], wait_s=0)
    assert bad.value.reason == "bad_blocks" and "[5]" in str(bad.value)
    clock.now = 1011
    with pytest.raises(ClaimError) as late:
        table.claim("r", [1], wait_s=0)
    assert late.value.reason == "lease_expired"


def test_a_claim_waits_for_an_offer_that_is_on_its_way():
    table = ProducerTable()
    timer = threading.Timer(0.1, table.offer, args=("r", [1], time.time() + 30))
    timer.start()
    started = time.monotonic()
    table.claim("r", [1], wait_s=5)
    assert time.monotonic() - started < 4
    timer.join()


def test_an_offer_for_n_readers_frees_after_the_nth_completed_read():
    """n sequences decoding from one prefill: each pulls the same blocks."""
    table = ProducerTable(clock=Clock())
    table.offer("r", [1, 2], deadline=1010, readers=3)
    for _ in range(2):
        table.claim("r", [1, 2], wait_s=0)
        table.release("r", completed=True)
        assert table.collect_done() == set()
    table.claim("r", [1], wait_s=0)
    table.release("r", completed=False)  # a failed read does not count
    assert table.collect_done() == set()
    table.claim("r", [2], wait_s=0)
    table.release("r", completed=True)
    assert table.collect_done() == {"r"} and table.leases_expired == 0


def test_a_settled_request_cannot_be_revived_by_a_replayed_lease():
    """A lease replayed after its request settled (blocks freed, maybe reused) is refused,
    however many requests settled since; after its deadline it is refused as expired."""
    clock = Clock()
    table = ProducerTable(clock=clock)
    table.offer("r", [1, 2], deadline=1010)
    table.claim("r", [1, 2], wait_s=0)
    table.release("r", completed=True)
    assert table.collect_done() == {"r"}
    for i in range(20_000):  # many others settle
        table.offer(f"o{i}", [9], deadline=1010)
        table.claim(f"o{i}", [9], wait_s=0)
        table.release(f"o{i}", completed=True)
    table.collect_done()
    with pytest.raises(ClaimError) as replayed:
        table.claim("r", [1, 2], wait_s=0, grant=([1, 2], 1010, 1))
    assert replayed.value.reason == "lease_expired" and table.blocks_held() == 0
