"""A leg the router stops (its client left, its deadline passed) between two of vLLM's outputs is
aborted in vLLM before the stop returns, on every kind of node: closing the leg's generator
closes vLLM's request stream at once, not in the event loop's finalizer a turn later. The
node's own code over an engine that streams tokens until it is closed, as vLLM's
`AsyncLLM.generate` does (it aborts the request when its stream is closed)."""

from __future__ import annotations

import pytest

from decode_node.node import DecodeNode
from pdserve_core.engine.actor import EngineActor
from pdserve_core.engine.legs import Decode, Prefill, Whole
from prefill_node.node import PrefillNode
from tests.helpers.engine_outputs import step_output


class Engine:
    """Streams one token a step for ever; records the requests whose stream was closed."""

    tokenizer = None  # no text to continue (a decode leg's): the test reads tokens

    def __init__(self) -> None:
        self.aborted: list[str] = []

    async def generate(self, prompt, params, request_id):
        try:
            while True:
                yield step_output(7, "x", finished=False)
        finally:
            self.aborted.append(request_id)

    async def collective_rpc(self, method, args=()):
        return [False]


def params():
    from vllm import SamplingParams

    return SamplingParams(max_tokens=100)


LEGS = [
    (EngineActor, lambda: Whole("r-w", [1, 2, 3], params())),
    (PrefillNode, lambda: Prefill("r-p", [1, 2, 3], params())),
    (DecodeNode, lambda: Decode("r-d", [1, 2, 3], params(), [4], {"remote_request_id": "x"})),
]


@pytest.mark.parametrize(("node_type", "make_leg"), LEGS, ids=["whole", "prefill", "decode"])
async def test_a_stopped_leg_is_aborted_in_vllm_before_the_stop_returns(node_type, make_leg):
    node = node_type("n0", {})
    node._engine = engine = Engine()
    leg = make_leg()
    deltas = node.handler(leg)(leg)
    first = await anext(deltas)
    assert first.token_ids == [7]
    assert engine.aborted == []
    await deltas.aclose()  # the router stopped the leg
    assert engine.aborted == [leg.request_id]
