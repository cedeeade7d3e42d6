"""The scheduler halves of the connector — the producer's (prefill_node/kv_producer.py) and the
consumer's (decode_node/kv_consumer.py) — stepped by hand with stand-in requests and blocks."""

from __future__ import annotations

import time
from types import SimpleNamespace

from decode_node.kv_consumer import ConsumerScheduler
from pdserve.kv.handle import KVHandle
from pdserve.kv.settings import ConnectorSettings
from prefill_node.kv_producer import ProducerScheduler

SETTINGS = ConnectorSettings(secret="x", lease_s=30)


def producer() -> ProducerScheduler:
    s = ProducerScheduler(SETTINGS, engine_id="engine-p")
    s.set_ports({0: 7001})
    return s


def consumer() -> ConsumerScheduler:
    return ConsumerScheduler(SETTINGS)


def request(rid: str, prompt_tokens: int, params: dict | None):
    return SimpleNamespace(
        request_id=rid, num_prompt_tokens=prompt_tokens, kv_transfer_params=params
    )


class Blocks:
    def __init__(self, all_ids: list[int], fresh: list[int]) -> None:
        self.all_ids, self.fresh = all_ids, fresh

    def get_block_ids(self):
        return (self.all_ids,)

    def get_unhashed_block_ids(self):
        return self.fresh


def test_producer_keeps_blocks_and_returns_a_handle():
    s = producer()
    done = request("p-1", 300, {"do_remote_decode": True})
    before = time.time()
    keep, params = s.request_finished(done, [4, 5, 6], finished_normally=True)
    assert keep is True
    handle = KVHandle.from_params(params)
    assert handle.request_id == "p-1" and handle.block_ids == (4, 5, 6)
    assert handle.ports == (7001,) and handle.num_tokens == 300
    assert before + 29 < handle.lease_deadline < time.time() + 31
    offers = s.take_offers()
    assert offers["p-1"].block_ids == [4, 5, 6]
    assert not s.take_offers()  # each offer is shipped once


def test_producer_frees_aborted_and_plain_requests_at_once():
    s = producer()
    aborted = request("p-2", 10, {"do_remote_decode": True})
    plain = request("p-3", 10, None)
    assert s.request_finished(aborted, [1], finished_normally=False) == (False, None)
    assert s.request_finished(plain, [1], finished_normally=True) == (False, None)
    assert not s.take_offers()


def handle_params(blocks: list[int], tokens: int) -> dict:
    return KVHandle(
        "127.0.0.1", (7001,), "p-9", tuple(blocks), tokens, time.time() + 30, "engine-p", "tcp"
    ).to_params()


def test_consumer_loads_what_the_producer_computed_minus_local_hits():
    s = consumer()
    # prompt of 300 tokens + the producer's sampled token = 301; 128 tokens cached locally
    req = request("d-1", 301, handle_params([10, 11, 12], 300))
    assert s.get_num_new_matched_tokens(req, 128) == (172, True)
    s.update_state_after_alloc(req, Blocks([3, 7, 8], fresh=[7, 8]), 172)
    spec = s.take_pulls()["d-1"]
    assert spec.remote_block_ids == [11, 12] and spec.local_block_ids == [7, 8]
    assert req.kv_transfer_params["do_remote_prefill"] is False
    s.update_state_after_alloc(req, Blocks([3, 7, 8], fresh=[7, 8]), 172)  # second call: no-op
    assert not s.take_pulls()


def test_consumer_with_everything_cached_loads_nothing():
    s = consumer()
    req = request("d-2", 257, handle_params([1, 2, 3], 256))
    assert s.get_num_new_matched_tokens(req, 256) == (0, False)
    assert s.get_num_new_matched_tokens(request("d-3", 5, None), 0) == (0, False)


def test_consumer_with_everything_cached_gives_the_handle_back():
    s = consumer()
    req = request("d-6", 257, handle_params([1, 2, 3], 256))
    s.update_state_after_alloc(req, Blocks([4, 5], fresh=[]), 0)
    pulls = s.take_pulls()
    assert list(pulls) == ["release:d-6"] and pulls["release:d-6"].release_only
    assert not s.is_receiving("d-6")


def test_a_request_aborted_mid_pull_keeps_its_blocks_until_the_pull_ends():
    s = consumer()
    req = request("d-4", 129, handle_params([1, 2], 128))
    s.update_state_after_alloc(req, Blocks([5], fresh=[5]), 128)
    assert s.is_receiving("d-4")  # the connector keeps the blocks of a finished request
    s.pulls_ended({"d-4"})
    assert not s.is_receiving("d-4")


def test_a_broken_handle_still_reaches_the_worker_as_a_failed_pull():
    s = consumer()
    req = request("d-5", 100, {"do_remote_prefill": True, "remote_host": "h"})
    assert s.get_num_new_matched_tokens(req, 0) == (100, True)
    s.update_state_after_alloc(req, Blocks([1], fresh=[1]), 100)
    assert s.take_pulls()["d-5"].remote_block_ids == []
