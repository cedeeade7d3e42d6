"""The connector's scheduler half, stepped by hand with stand-in requests and block lists."""

from __future__ import annotations

import time
from types import SimpleNamespace

from vllm.v1.request import RequestStatus

from pdserve.kv.handle import KVHandle
from pdserve.kv.scheduler_side import SchedulerSide
from pdserve.kv.settings import ConnectorSettings


def side() -> SchedulerSide:
    s = SchedulerSide(ConnectorSettings(secret="x", lease_s=30), engine_id="engine-p")
    s.set_ports({0: 7001})
    return s


def request(rid: str, prompt_tokens: int, params: dict | None, status=RequestStatus.WAITING):
    return SimpleNamespace(
        request_id=rid, num_prompt_tokens=prompt_tokens, kv_transfer_params=params, status=status
    )


class Blocks:
    def __init__(self, all_ids: list[int], fresh: list[int]) -> None:
        self.all_ids, self.fresh = all_ids, fresh

    def get_block_ids(self):
        return (self.all_ids,)

    def get_unhashed_block_ids(self):
        return self.fresh


def test_producer_keeps_blocks_and_returns_a_handle():
    s = side()
    done = request("p-1", 300, {"do_remote_decode": True}, RequestStatus.FINISHED_LENGTH_CAPPED)
    before = time.time()
    keep, params = s.request_finished(done, [4, 5, 6])
    assert keep is True
    handle = KVHandle.from_params(params)
    assert handle.request_id == "p-1" and handle.block_ids == (4, 5, 6)
    assert handle.ports == (7001,) and handle.num_tokens == 300
    assert before + 29 < handle.lease_deadline < time.time() + 31
    meta = s.build_connector_meta()
    assert meta.send["p-1"].block_ids == [4, 5, 6] and not meta.recv
    assert not s.build_connector_meta().send  # each offer is shipped once


def test_producer_frees_aborted_and_plain_requests_at_once():
    s = side()
    aborted = request("p-2", 10, {"do_remote_decode": True}, RequestStatus.FINISHED_ABORTED)
    plain = request("p-3", 10, None, RequestStatus.FINISHED_STOPPED)
    assert s.request_finished(aborted, [1]) == (False, None)
    assert s.request_finished(plain, [1]) == (False, None)
    assert not s.build_connector_meta().send


def handle_params(blocks: list[int], tokens: int) -> dict:
    return KVHandle(
        "127.0.0.1", (7001,), "p-9", tuple(blocks), tokens, time.time() + 30, "engine-p", "tcp"
    ).to_params()


def test_consumer_loads_what_the_producer_computed_minus_local_hits():
    s = side()
    # prompt of 300 tokens + the producer's sampled token = 301; 128 tokens cached locally
    req = request("d-1", 301, handle_params([10, 11, 12], 300))
    assert s.get_num_new_matched_tokens(req, 128) == (172, True)
    s.update_state_after_alloc(req, Blocks([3, 7, 8], fresh=[7, 8]), 172)
    spec = s.build_connector_meta().recv["d-1"]
    assert spec.remote_block_ids == [11, 12] and spec.local_block_ids == [7, 8]
    assert req.kv_transfer_params["do_remote_prefill"] is False
    s.update_state_after_alloc(req, Blocks([3, 7, 8], fresh=[7, 8]), 172)  # second call: no-op
    assert not s.build_connector_meta().recv


def test_consumer_with_everything_cached_loads_nothing():
    s = side()
    req = request("d-2", 257, handle_params([1, 2, 3], 256))
    assert s.get_num_new_matched_tokens(req, 256) == (0, False)
    assert s.get_num_new_matched_tokens(request("d-3", 5, None), 0) == (0, False)


def test_a_request_aborted_mid_pull_keeps_its_blocks_until_the_pull_ends():
    s = side()
    req = request("d-4", 129, handle_params([1, 2], 128))
    s.update_state_after_alloc(req, Blocks([5], fresh=[5]), 128)
    req.status = RequestStatus.FINISHED_ABORTED
    assert s.request_finished(req, [5]) == (True, None)
    s.update_connector_output(SimpleNamespace(finished_recving={"d-4"}))
    assert s.request_finished(req, [5]) == (False, None)


def test_a_broken_handle_still_reaches_the_worker_as_a_failed_pull():
    s = side()
    req = request("d-5", 100, {"do_remote_prefill": True, "remote_host": "h"})
    assert s.get_num_new_matched_tokens(req, 0) == (100, True)
    s.update_state_after_alloc(req, Blocks([1], fresh=[1]), 100)
    assert s.build_connector_meta().recv["d-5"].remote_block_ids == []
