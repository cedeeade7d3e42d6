"""A router that leaves between a request's legs: the prefill node gives back the KV it kept for
that router's decode legs once the router's token stream closes (not when each lease ends), and
keeps another router's. The real prefill node's relay and token plane over loopback (the legs
opened on it, their vLLM `SamplingParams` decoded by the node), with an engine that only
answers."""

from __future__ import annotations

import asyncio
import time

import pytest

from pdserve_core.engine import actor
from pdserve_core.engine.legs import Prefill
from prefill_node.node import PrefillNode
from router.links.token_stream import TokenStream
from tests.helpers.engine_outputs import step_output

SECRET = "the-cluster-secret"


class OneStepEngine:
    """vLLM's side of a prefill: one step, one token, the KV handle on the finished output."""

    async def generate(self, prompt, params, request_id):
        handle = {"remote_request_id": request_id, "lease_deadline": time.time() + 30}
        yield step_output(7, "x", True, handle)


def prefill(request_id: str) -> Prefill:
    from vllm import SamplingParams

    return Prefill(request_id, list(range(40)), SamplingParams(max_tokens=4))


async def _poll(what, deadline_s: float) -> bool:
    deadline = time.monotonic() + deadline_s
    while time.monotonic() < deadline:
        if what():
            return True
        await asyncio.sleep(0.01)
    return False


async def test_a_routers_kept_kv_is_given_back_when_it_leaves(monkeypatch):
    monkeypatch.setattr(actor, "GIVE_BACK_GRACE_S", 0.2)
    node = PrefillNode("p0", {}, None, "127.0.0.1", None, SECRET)
    node._engine = OneStepEngine()
    given: list[dict] = []

    async def give_back(handle: dict) -> bool:
        given.append(handle)
        return True

    node.give_back = give_back
    address = await node.delta_endpoint()
    routers = [await TokenStream.connect("p0", *address, SECRET) for _ in range(2)]

    handles = []
    for i, tokens in enumerate(routers):
        got = [d async for d in tokens.stream(prefill(f"req-{i}"))]
        assert got[-1].token_ids == [7]
        handles.append(got[-1].handle)
    routers[0].close()  # router 0 dies between the legs
    assert await _poll(lambda: given, 5)
    assert given == [handles[0]]  # its prefill's KV, and not router 1's
    routers[1].close()
    assert await _poll(lambda: len(given) == 2, 5)
    assert given[1] == handles[1]
    node._deltas.close()


async def test_a_node_that_keeps_no_kv_for_others_gives_nothing_back():
    from pdserve_core.engine.actor import EngineActor

    node = EngineActor("c0", {}, None, "127.0.0.1", None, SECRET)
    node._engine = OneStepEngine()
    address = await node.delta_endpoint()
    tokens = await TokenStream.connect("c0", *address, SECRET)
    leg = prefill("req")
    from pdserve_core.engine.legs import Whole

    whole = Whole(leg.request_id, leg.prompt_token_ids, leg.params)
    got = [d async for d in tokens.stream(whole)]
    assert got and not node._aside
    tokens.close()
    assert await _poll(lambda: not node._deltas.channels, 5)
    assert not node._aside  # no give-back scheduled: a colocated engine keeps no KV for others
    node._deltas.close()


pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")
