"""The prefill node's lease table: offers, claims, releases and expiry, stepped by hand."""

from __future__ import annotations

import threading
import time

import pytest

from prefill_node.leases import ClaimError, ProducerTable, of_leg


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


def test_an_abandoned_offer_goes_at_the_next_collection_and_serves_no_pull():
    """The router gives back a prefill's KV nobody will read (its client left between legs)."""
    clock = Clock()
    table = ProducerTable(clock=clock)
    table.offer("r", [1, 2], deadline=1030)
    table.abandon("r", 1030)
    with pytest.raises(ClaimError) as refused:
        table.claim("r", [1], wait_s=0)
    assert refused.value.reason == "lease_expired"
    assert table.collect_done() == {"r"} and table.blocks_held() == 0
    assert table.leases_expired == 0  # given back, not expired


def test_an_abandon_that_outruns_its_offer_waits_for_it():
    clock = Clock()
    table = ProducerTable(clock=clock)
    table.abandon("r", 1030)  # the worker has not heard of the offer yet
    assert table.collect_done() == set()  # nothing offered: nothing to free
    table.offer("r", [4, 5], deadline=1030)
    assert table.collect_done() == {"r"} and table.blocks_held() == 0
    table.abandon("stale", 1005)  # for an offer that never comes: forgotten past its deadline
    clock.now = 1006
    table.collect_done()
    table.offer("stale", [6], deadline=1040)
    assert table.blocks_held() == 1


def test_the_engines_request_of_a_leg_is_the_legs_id_and_vllms_suffix_nothing_else():
    assert of_leg("req-7-p-0123abcd", "req-7-p")
    assert of_leg("req-7-p", "req-7-p")  # vLLM's request id randomization turned off
    assert not of_leg("req-7-p-0123abcd", "req-7")  # another leg's, or another request's
    assert not of_leg("req-7-p-x-0123abcd", "req-7-p")
    assert not of_leg("req-7-p-0123abc", "req-7-p")
    assert not of_leg("req-7-pp-0123abcd", "req-7-p")


def test_a_stopped_legs_offer_goes_whether_it_came_before_or_after_the_stop():
    """The router stopped a prefill leg just as vLLM finished it: the router never got the
    handle, and the engine kept the KV under its own id for the leg."""
    clock = Clock()
    table = ProducerTable(clock=clock)
    table.offer("a-p-0123abcd", [1, 2], deadline=1030)
    table.offer("b-p-89abcdef", [3], deadline=1030)  # another leg's: kept
    assert table.abandon_leg("a-p", until=1030) == 1
    with pytest.raises(ClaimError):
        table.claim("a-p-0123abcd", [1], wait_s=0)
    assert table.collect_done() == {"a-p-0123abcd"} and table.blocks_held() == 1
    assert table.leases_expired == 0  # given back, not expired
    assert table.abandon_leg("c-p", until=1030) == 0  # stopped before the worker heard of it
    table.offer("c-p-fedcba98", [4, 5], deadline=1031)
    assert table.collect_done() == {"c-p-fedcba98"} and table.blocks_held() == 1
    table.offer("c-p-00000000", [6], deadline=1031)  # the memory served one offer only
    assert table.blocks_held() == 2


def test_a_stopped_leg_that_kept_nothing_is_forgotten_after_its_time():
    clock = Clock()
    table = ProducerTable(clock=clock)
    table.abandon_leg("a-p", until=1005)  # aborted before vLLM finished it: no offer comes
    clock.now = 1006
    table.collect_done()
    table.offer("a-p-0123abcd", [1], deadline=1040)  # (a replay of the id: not abandoned)
    assert table.blocks_held() == 1


def test_an_abandoned_offer_being_read_goes_when_the_read_ends():
    table = ProducerTable(clock=Clock())
    table.offer("r", [1], deadline=1030)
    table.claim("r", [1], wait_s=0)
    table.abandon("r", 1030)
    assert table.collect_done() == set()  # never freed under a reader
    table.release("r", completed=False)
    assert table.collect_done() == {"r"}
