"""vLLM's own OpenAI server over pdserve's pools (router/faces/vllm_face.py), with fake nodes:
vLLM's layer validates, renders and shapes; pdserve's dispatch runs what it asks for."""

from __future__ import annotations

import json
import logging

import httpx
import pytest
import pytest_asyncio

from pdserve_core.engine.types import CACHE_SALT_ARG
from router.decides.admission import Admission
from router.metrics import RouterMetrics
from router.service import RouterService
from tests.helpers.fake_nodes import FakeNode, disaggregated, request_limits, retry_policy

LIMIT = 2
KEY = "face-key"
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
]


class Face:
    def __init__(self, http: httpx.AsyncClient, service: RouterService, nodes: dict) -> None:
        self.http, self.service, self.nodes = http, service, nodes
        self.root_levels: tuple[int, int] = (0, 0)

    def calls(self) -> list:
        return [call for node in self.nodes.values() for call in node.calls]

    def reset(self) -> None:
        for node in self.nodes.values():
            node.calls.clear()
            node.healthy, node.delay_s = True, 0.0
        for pool in self.service.dispatcher.pools.values():
            for node in pool.nodes:
                node.healthy = True


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def face(default_model_dir):
    from pdserve_core.config import PDServeConfig
    from router.faces.vllm_face import serve_app

    nodes = {"p0": FakeNode("p0"), "d0": FakeNode("d0")}
    dispatcher = disaggregated([nodes["p0"]], [nodes["d0"]])
    metrics = RouterMetrics(dispatcher.pools, dispatcher.mode, tpot_target_s=0.1)
    service = RouterService(
        dispatcher, metrics, Admission(LIMIT), retry_policy(3), 30, request_limits()
    )
    flags = ["--tool-call-parser", "hermes", "--enable-auto-tool-choice"]
    config = PDServeConfig.model_validate(
        {
            "engine": {"dtype": "float32"},
            "router": {"vllm_args": flags, "api_key": KEY},
        }
    )
    root = logging.getLogger()
    level = root.level
    app = await serve_app(service, config, str(default_model_dir), "smol")
    levels = (level, root.level)
    transport = httpx.ASGITransport(app=app)
    headers = {"authorization": f"Bearer {KEY}"}
    async with httpx.AsyncClient(
        transport=transport, base_url="http://face", headers=headers
    ) as http:
        face = Face(http, service, nodes)
        face.root_levels = levels
        yield face


@pytest_asyncio.fixture(loop_scope="module")
async def http(face):
    face.reset()
    return face.http


def _events(text: str) -> list[dict]:
    lines = [line[6:] for line in text.splitlines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


@pytest.mark.asyncio(loop_scope="module")
async def test_a_completion_runs_over_both_legs_whole_and_streamed(http, face):
    body = {"model": "smol", "prompt": "hello there", "max_tokens": 5}
    whole = await http.post("/v1/completions", json=body)
    assert whole.status_code == 200, whole.text
    answer = whole.json()
    assert answer["usage"]["completion_tokens"] == 5 and answer["choices"][0]["text"]
    assert {call.method for call in face.calls()} == {"prefill", "decode"}
    face.reset()
    streamed = await http.post("/v1/completions", json={**body, "stream": True})
    chunks = _events(streamed.text)
    text = "".join(c["choices"][0]["text"] for c in chunks if c["choices"])
    assert text == answer["choices"][0]["text"]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"


@pytest.mark.asyncio(loop_scope="module")
async def test_logprobs_come_back_in_vllms_shapes(http):
    body = {"model": "smol", "prompt": "hi", "max_tokens": 3, "logprobs": 2}
    got = await http.post("/v1/completions", json=body)
    assert got.status_code == 200, got.text
    (choice,) = got.json()["choices"]
    assert len(choice["logprobs"]["tokens"]) == len(choice["logprobs"]["token_logprobs"]) == 3
    assert all(len(top) >= 1 for top in choice["logprobs"]["top_logprobs"])


@pytest.mark.asyncio(loop_scope="module")
async def test_logprob_token_ids_cross_the_seam(http):
    """vLLM leaves `logprobs` None with `logprob_token_ids` and counts the ids instead: the face
    must keep the nodes' logprobs all the same (it once answered 500, "Did not output
    logprobs")."""
    ids = [30, 1000, 2000]
    body = {"model": "smol", "prompt": "hi", "max_tokens": 3, "logprobs": 3}
    for stream in (False, True):
        got = await http.post(
            "/v1/completions", json={**body, "logprob_token_ids": ids, "stream": stream}
        )
        assert got.status_code == 200, got.text
        chunks = _events(got.text) if stream else [got.json()]
        tokens = [t for c in chunks for ch in c["choices"] for t in ch["logprobs"]["tokens"]]
        assert len(tokens) == 3 and "error" not in got.text, got.text
    chat = {"model": "smol", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
    got = await http.post(
        "/v1/chat/completions", json={**chat, "logprobs": True, "logprob_token_ids": ids}
    )
    assert got.status_code == 200, got.text
    assert len(got.json()["choices"][0]["logprobs"]["content"]) == 3


@pytest.mark.asyncio(loop_scope="module")
async def test_a_required_tool_call_reaches_the_nodes_as_structured_output(http, face):
    body = {
        "model": "smol",
        "messages": [{"role": "user", "content": "weather in Paris?"}],
        "tools": TOOLS,
        "tool_choice": "required",
        "max_tokens": 4,
    }
    got = await http.post("/v1/chat/completions", json=body)
    # the fake nodes do not follow the grammar, so vLLM's parser may refuse their text; what
    # matters here is that vLLM's layer built the constraint and pdserve carried it to both legs
    assert got.status_code in (200, 400, 500), got.text
    constrained = [call for call in face.calls() if call.params.structured_outputs is not None]
    assert constrained and {call.method for call in constrained} == {"prefill", "decode"}


@pytest.mark.asyncio(loop_scope="module")
async def test_vllms_own_refusals_and_endpoints(http):
    chat = {"model": "smol", "messages": [{"role": "user", "content": "hi"}]}
    templated = await http.post(
        "/v1/chat/completions", json={**chat, "chat_template_kwargs": {"chat_template": "x"}}
    )
    assert templated.status_code == 400
    assert "trust-request-chat-template" in templated.json()["error"]["message"]
    tokens = await http.post("/tokenize", json={"model": "smol", "prompt": "hello world"})
    assert tokens.status_code == 200 and tokens.json()["count"] >= 2
    ids = tokens.json()["tokens"]
    words = await http.post("/detokenize", json={"model": "smol", "tokens": ids})
    assert words.status_code == 200 and "hello" in words.json()["prompt"]
    unknown = await http.post("/v1/completions", json={"model": "other", "prompt": "hi"})
    assert unknown.status_code == 404


@pytest.mark.asyncio(loop_scope="module")
async def test_engine_internal_fields_are_refused_and_the_salt_reaches_every_leg(http, face):
    hi = {"model": "smol", "prompt": "hi", "max_tokens": 2}
    for field, value in (
        ("kv_transfer_params", {"do_remote_prefill": True, "remote_host": "10.0.0.1"}),
        ("vllm_xargs", {"pdserve_cache_salt": "someone-else"}),
        # the differential fuzz found it refused as "vllm_xargs", a field the body did not have
        ("ec_transfer_params", {"x": []}),
    ):
        refused = await http.post("/v1/completions", json={**hi, field: value})
        assert refused.status_code == 400 and field in refused.json()["error"]["message"]
    assert not face.calls()
    salted = await http.post("/v1/completions", json={**hi, "cache_salt": "tenant-a"})
    assert salted.status_code == 200, salted.text
    salts = {call.params.extra_args[CACHE_SALT_ARG] for call in face.calls()}
    assert salts == {"tenant-a"} and len(face.calls()) == 2


@pytest.mark.asyncio(loop_scope="module")
async def test_the_routers_refusals_keep_their_status(http, face):
    for pool in face.service.dispatcher.pools.values():
        for node in pool.nodes:
            node.healthy = False
    down = await http.post("/v1/completions", json={"model": "smol", "prompt": "hi"})
    assert down.status_code == 503 and "pool" in down.json()["error"]["message"]
    face.reset()
    too_many = await http.post(
        "/v1/completions", json={"model": "smol", "prompt": "hi", "n": 1000, "max_tokens": 2}
    )
    assert too_many.status_code == 400 and "router.max_n" in too_many.json()["error"]["message"]


@pytest.mark.asyncio(loop_scope="module")
async def test_the_key_health_and_metrics_are_the_pools(http, face):
    bare = httpx.AsyncClient(transport=http._transport, base_url="http://face")
    async with bare:
        refused = await bare.post("/v1/completions", json={"model": "smol", "prompt": "hi"})
        assert refused.status_code == 401
        assert (await bare.get("/health")).status_code == 200  # liveness needs no key
        assert (await bare.get("/metrics")).status_code == 401
    detail = (await http.get("/health")).json()
    assert detail["mode"] == "disaggregated" and set(detail["pools"]) == {"prefill", "decode"}
    await http.post("/v1/completions", json={"model": "smol", "prompt": "hi", "max_tokens": 2})
    text = (await http.get("/metrics")).text
    assert 'pdserve_requests_total{api="http",outcome="success"}' in text


async def test_building_the_face_leaves_the_routers_logging_alone(face):
    """vLLM's server state sets the root logger to ERROR as it is built: the router's own
    logs (ready, autoscale moves, node failures) would vanish."""
    before, after = face.root_levels
    assert after == before


async def test_a_generation_request_meets_its_route_first_and_no_unread_instrumentation(face):
    """Every request walks the route table until one matches, and vLLM's instrumentator timed
    each into a registry the router never exposes: the generation routes lead the table (the
    others keep vLLM's order), and the instrumentator is not in the stack."""
    from starlette.routing import Match

    from router.faces.openai_http import GENERATION_PATHS

    app = face.http._transport.app
    routes = app.router.routes
    for path in GENERATION_PATHS:
        scope = {"type": "http", "path": path, "method": "POST", "root_path": ""}
        full = [i for i, route in enumerate(routes) if route.matches(scope)[0] == Match.FULL]
        assert full and full[0] < len(GENERATION_PATHS), (path, full)
        assert routes[full[0]].path == path
    assert [
        m.cls.__module__ for m in app.user_middleware if "instrumentator" in m.cls.__module__
    ] == []


@pytest.mark.asyncio(loop_scope="module")
async def test_every_route_answers_an_empty_or_a_plausible_body_without_a_5xx(http, face):
    """Every route vLLM's server has (its OpenAPI schema: the Anthropic, SageMaker, batch and
    scoring routes too), asked with an empty body and with one that names what the common routes
    need: a 2xx or a 4xx with a JSON error, never a 5xx. /scale_elastic_ep answered 500: the
    pools' client had no such scaling, and vLLM answers anything but a ValueError with a bare
    500."""
    schema = (await http.get("/openapi.json")).json()
    plausible = {
        "model": "smol", "prompt": "hi", "messages": [{"role": "user", "content": "hi"}],
        "input": "hi", "max_tokens": 2, "tokens": [1, 2], "query": "q", "items": ["a"],
        "label_token_ids": [1], "new_data_parallel_size": 2,
    }  # fmt: skip
    answered = {}
    for path, methods in schema["paths"].items():
        path = path.replace("{response_id}", "resp_none")
        for method in methods:
            for body in ({}, plausible) if method == "post" else (None,):
                response = await http.request(method.upper(), path, json=body)
                answered[(method, path, bool(body))] = response.status_code
                if response.status_code >= 400:
                    assert "error" in response.json() or "detail" in response.json(), path
    assert [key for key, status in answered.items() if status >= 500] == []
    assert answered[("post", "/v1/messages", True)] == 200  # the routes were really asked
    scaled = await http.post("/scale_elastic_ep", json={"new_data_parallel_size": 2})
    assert scaled.status_code == 400 and "pools.autoscale" in scaled.text
