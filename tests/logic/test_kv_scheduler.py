"""The scheduler halves of the connector — the producer's (prefill_node/kv_producer.py) and the
consumer's (decode_node/kv_consumer.py) — stepped by hand with stand-in requests and blocks."""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest

from decode_node.kv_consumer import ConsumerScheduler
from pdserve_core.kv.handle import HandleError, KVHandle
from pdserve_core.kv.settings import ConnectorSettings
from prefill_node.kv_producer import ProducerScheduler

SETTINGS = ConnectorSettings(secret="x", lease_s=30)


def producer() -> ProducerScheduler:
    s = ProducerScheduler(SETTINGS, engine_id="engine-p")
    s.set_ports({0: 7001})
    return s


def consumer(load: str = "async") -> ConsumerScheduler:
    settings = ConnectorSettings(secret="x", lease_s=30, load=load)
    return ConsumerScheduler(settings, block_size=128)


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
    keep, params = s.request_finished(done, [4, 5, 6], handed_over=True)
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
    assert s.request_finished(aborted, [1], handed_over=False) == (False, None)
    assert s.request_finished(plain, [1], handed_over=True) == (False, None)
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
    assert spec.cached_blocks == 1  # counted as KV that did not cross
    assert req.kv_transfer_params["do_remote_prefill"] is False
    s.update_state_after_alloc(req, Blocks([3, 7, 8], fresh=[7, 8]), 172)  # second call: no-op
    assert not s.take_pulls()


def test_a_sync_consumer_loads_all_but_the_token_it_computes_in_the_same_step():
    """`load: sync`: the request is scheduled at once, computing what is not matched, so the
    match leaves at least one token; the pull covers the blocks of the matched tokens only (not
    the block vLLM allocated for the token it computes), after the local cache hit."""
    s = consumer("sync")
    # 256-token prompt + the producer's token: 256 loaded (2 blocks), 1 computed (a 3rd block)
    req = request("d-20", 257, handle_params([10, 11], 256))
    assert s.get_num_new_matched_tokens(req, 0) == (256, False)
    s.update_state_after_alloc(req, Blocks([5, 6, 7], fresh=[]), 256)
    spec = s.take_pulls()["d-20"]
    assert spec.sync and spec.local_block_ids == [5, 6] and spec.remote_block_ids == [10, 11]
    assert not s.is_receiving("d-20")  # loaded before the step's forward: nothing in flight
    # the bare prompt (first token on the decode node): its last token is recomputed here
    bare = request("d-21", 300, handle_params([10, 11, 12], 300))
    assert s.get_num_new_matched_tokens(bare, 128) == (171, False)
    s.update_state_after_alloc(bare, Blocks([3, 7, 8], fresh=[]), 171)
    spec = s.take_pulls()["d-21"]
    assert spec.local_block_ids == [7, 8] and spec.remote_block_ids == [11, 12]


def test_a_sync_consumer_fails_a_broken_handle_on_its_blocks():
    s = consumer("sync")
    req = request("d-22", 101, {"do_remote_prefill": True, "remote_host": "h"})
    matched, load_async = s.get_num_new_matched_tokens(req, 0)
    assert (matched, load_async) == (100, False)
    s.update_state_after_alloc(req, Blocks([1], fresh=[]), matched)
    spec = s.take_pulls()["d-22"]
    assert spec.remote_block_ids == [] and spec.local_block_ids == [1]


def test_consumer_with_everything_cached_loads_nothing():
    s = consumer()
    req = request("d-2", 257, handle_params([1, 2, 3], 256))
    assert s.get_num_new_matched_tokens(req, 256) == (0, False)
    assert s.get_num_new_matched_tokens(request("d-3", 5, None), 0) == (0, False)


def test_consumer_with_everything_cached_gives_the_handle_back():
    s = consumer()
    req = request("d-6", 257, handle_params([1, 2, 3], 256))
    assert s.get_num_new_matched_tokens(req, 256) == (0, False)
    s.update_state_after_alloc(req, Blocks([4, 5], fresh=[]), 0)
    pulls = s.take_pulls()
    assert list(pulls) == ["release:d-6"] and pulls["release:d-6"].release_only
    assert pulls["release:d-6"].cached_blocks == 2
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


HOSTILE = [
    ("remote_num_tokens", float("inf")),
    ("remote_num_tokens", 1e400),
    ("remote_num_tokens", "300"),
    ("remote_num_tokens", True),
    ("remote_num_tokens", -5),
    ("remote_block_ids", [1, -2]),
    ("remote_block_ids", list(range(100_000))),
    ("remote_block_ids", "1,2,3"),
    ("remote_ports", [0]),
    ("remote_ports", [70000]),
    ("remote_host", 5),
    ("remote_host", "x" * 1000),
    ("lease_deadline", float("nan")),
    ("lease_deadline", "soon"),
    ("lease_token", "not hex"),
    ("remote_request_id", {"a": 1}),
]


@pytest.mark.parametrize(
    ("field", "value"), HOSTILE, ids=[f"{f}={str(v)[:12]}" for f, v in HOSTILE]
)
def test_a_hostile_handle_is_refused_with_a_reason(field, value):
    params = {**handle_params([1, 2], 200), field: value}
    with pytest.raises(HandleError):
        KVHandle.from_params(params)


def test_a_handle_for_an_unknown_host_is_refused():
    params = handle_params([1], 100)
    assert KVHandle.from_params(params, peer_hosts=("127.0.0.1",)).host == "127.0.0.1"
    with pytest.raises(HandleError, match="not a KV server of this cluster"):
        KVHandle.from_params({**params, "remote_host": "10.9.9.9"}, peer_hosts=("127.0.0.1",))


@pytest.mark.parametrize(("field", "value"), HOSTILE[:5])
def test_the_consumer_turns_a_hostile_handle_into_a_failed_pull(field, value):
    """The scheduler hook never raises: the request waits for a pull that is reported failed,
    and vLLM applies the failure policy."""
    s = consumer()
    req = request("d-9", 301, {**handle_params([1, 2, 3], 300), field: value})
    matched, load_async = s.get_num_new_matched_tokens(req, 0)
    assert load_async and matched == 301
    s.update_state_after_alloc(req, Blocks([4, 5, 6], fresh=[4, 5, 6]), matched)
    spec = s.take_pulls()["d-9"]
    assert spec.remote_block_ids == []  # the worker fails it as bad_handle


def test_an_aborted_request_gives_its_unpulled_handle_back():
    s = consumer()
    req = request("d-10", 129, handle_params([1, 2], 128))
    s.request_finished(req)  # aborted before it was scheduled: nothing was pulled
    pulls = s.take_pulls()
    assert list(pulls) == ["release:d-10"] and pulls["release:d-10"].release_only


class _Config(SimpleNamespace):
    pass


def _connector(role: str, kind):
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from pdserve_core.kv.connector import PDServeConnector

    kv = SimpleNamespace(kv_connector_extra_config={"secret": "x"}, kv_role=role, engine_id="e")
    config = _Config(kv_transfer_config=kv, cache_config=SimpleNamespace(block_size=128))
    return PDServeConnector(config, kind or KVConnectorRole.SCHEDULER, None)


def test_the_connector_holds_the_halves_its_role_asks_for():
    assert _connector("kv_producer", None).consumer is None
    assert _connector("kv_consumer", None).producer is None
    both = _connector("kv_both", None)
    assert both.producer is not None and both.consumer is not None


def test_no_scheduler_hook_raises_into_vllm():
    connector = _connector("kv_consumer", None)

    def broken(*args):
        raise RuntimeError("a bug")

    connector.consumer.get_num_new_matched_tokens = broken
    connector.consumer.update_state_after_alloc = broken
    req = request("d-11", 50, handle_params([1], 49))
    req.status = None
    assert connector.get_num_new_matched_tokens(req, 0) == (0, False)
    connector.update_state_after_alloc(req, Blocks([1], fresh=[1]), 49)
    assert connector.consumer.take_pulls()["d-11"].remote_block_ids == []  # reported failed
    # a consumer asked to act as producer ignores it
    req = request("d-12", 50, {"do_remote_decode": True})
    req.status = None
    assert connector.request_finished(req, [1, 2]) == (False, None)


class _Client:
    """Stands in for the KV client: a pull moves 1000 bytes, or fails for the hosts listed."""

    def __init__(self, failing: tuple[str, ...] = ()) -> None:
        self.failing, self.pulled = failing, []

    def pull(self, handle, remote, local, tp_rank, deadline):
        from pdserve_core.kv.wire import TransferError

        if handle.request_id in self.failing:
            raise TransferError("connect", "refused")
        self.pulled.append(list(local))
        return 1000


def _worker(client: _Client):
    from decode_node.kv_consumer import ConsumerWorker
    from pdserve_core.kv.stats import TransferStats

    worker = ConsumerWorker(SETTINGS, plane=None, stats=TransferStats(), tp_rank=0)
    worker.client = client  # no data plane: the fake client stands in for the pulls
    return worker


def _spec(request_id: str, local: list[int], sync: bool):
    from decode_node.kv_consumer import RecvSpec

    params = {**handle_params([1, 2], 256), "remote_request_id": request_id}
    return RecvSpec(params, [1, 2], local, sync=sync)


def test_sync_pulls_end_before_the_step_and_report_failures_as_blocks():
    """`start` returns only when this step's sync pulls ended (the forward reads their blocks); a
    failed one names its local blocks for vLLM's failure policy and is never reported as a
    finished async receive. Async pulls end in `results`."""
    worker = _worker(_Client(failing=("bad",)))
    worker.start({"ok": _spec("ok", [5, 6], True), "bad": _spec("bad", [7, 8], True)})
    assert worker.client.pulled == [[5, 6]]
    assert worker.load_errors() == {7, 8} and worker.load_errors() == set()
    assert worker.results() == (set(), set())
    worker.start({"later": _spec("later", [9], False)})
    deadline = time.monotonic() + 5
    while not (got := worker.results())[0] and time.monotonic() < deadline:
        time.sleep(0.01)
    assert got == ({"later"}, set())
    worker.close()


# ---- a followed prefill: which tokens and blocks each step writes (prefill_node/progress.py) ----

KEY = "ab" * 16


def _new(rid: str, prompt: int, blocks: list[int], computed: int, params: dict | None):
    extra = {"kv_transfer_params": params} if params else {}
    return SimpleNamespace(
        req_id=rid,
        prompt_token_ids=list(range(prompt)),
        sampling_params=SimpleNamespace(extra_args=extra),
        block_ids=(blocks,),
        num_computed_tokens=computed,
    )


def _step(new=(), cached=(), scheduled=None, resumed=(), preempted=()):
    """A SchedulerOutput's fields the producer reads; `cached`: (rid, new blocks, computed)."""
    return SimpleNamespace(
        scheduled_new_reqs=list(new),
        scheduled_cached_reqs=SimpleNamespace(
            req_ids=[c[0] for c in cached],
            new_block_ids=[(c[1],) if c[1] else None for c in cached],
            num_computed_tokens=[c[2] for c in cached],
            resumed_req_ids=set(resumed),
        ),
        num_scheduled_tokens=scheduled or {},
        preempted_req_ids=set(preempted),
    )


def test_a_followed_prefill_is_planned_chunk_by_chunk():
    s = ProducerScheduler(SETTINGS, engine_id="engine-p", block_size=16)
    params = {"do_remote_decode": True, "prefetch_key": KEY}
    plain = _new("other", 40, [1, 2, 3], 0, {"do_remote_decode": True})
    first = s.plan_writes(
        _step([_new("p", 70, [7, 8], 20, params), plain], scheduled={"p": 12, "other": 40})
    )
    assert list(first) == [KEY]  # only a prefill that carries a key is followed
    w = first[KEY]
    assert (w.request_id, w.block_ids, w.start, w.end, w.final) == ("p", [7, 8], 20, 32, False)
    last = s.plan_writes(_step(cached=[("p", [9, 10], 32)], scheduled={"p": 38}))
    w = last[KEY]
    assert (w.block_ids, w.start, w.end, w.final) == ([7, 8, 9, 10], 32, 70, True)
    assert s.plan_writes(_step(cached=[("p", [], 70)], scheduled={"p": 1})) == {}  # done


def test_a_followed_prefill_that_ends_early_or_is_preempted_is_unfollowed():
    s = ProducerScheduler(SETTINGS, engine_id="engine-p", block_size=16)
    params = {"do_remote_decode": True, "prefetch_key": KEY}
    s.plan_writes(_step([_new("p", 70, [7], 0, params)], scheduled={"p": 16}))
    s.plan_writes(_step(cached=[("p", [8], 0)], scheduled={"p": 16}, resumed=["p"]))
    assert s.take_unfollowed() == {KEY: "the prefill was preempted"}
    s.plan_writes(_step([_new("q", 70, [7], 0, params)], scheduled={"q": 16}))
    s.request_finished(request("q", 70, params), [7], handed_over=False)  # aborted mid-prompt
    assert "ended before its last prompt token" in s.take_unfollowed()[KEY]
    keep, handle = s.request_finished(request("r", 70, params), [7], handed_over=False)
    assert (keep, handle) == (False, None)  # stopped at its first token: nothing will come
    assert s.take_unfollowed() == {KEY: "the prefill ended without a hand-over"}


def test_a_followed_prefill_names_its_key_in_the_handle():
    s = producer()
    params = {"do_remote_decode": True, "prefetch_key": KEY}
    _, handle = s.request_finished(request("p", 300, params), [4, 5, 6], handed_over=True)
    assert KVHandle.from_params(handle).prefetch_key == KEY
    params["prefetch_key"] = "not-hex-" * 4  # a malformed key is no key
    _, handle = s.request_finished(request("p2", 300, params), [4], handed_over=True)
    assert KVHandle.from_params(handle).prefetch_key == ""
