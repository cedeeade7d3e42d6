"""The router's two edges in-process on port 0 — real HTTP (uvicorn) and real gRPC — over fake
nodes: response shapes, server-sent events, error codes and events, admission, cancellation."""

from __future__ import annotations

import asyncio
import json
import time

import grpc
import httpx
import pytest
import pytest_asyncio

from pdserve_core.config import RouterConfig
from pdserve_core.engine.types import CACHE_SALT_ARG
from pdserve_proto.v1 import generate_pb2 as pb
from pdserve_proto.v1 import generate_pb2_grpc as pb_grpc
from router.decides.admission import Admission
from router.faces.grpc_api import ENGINE_ERROR, create_server
from router.faces.vllm_face import Renderer
from router.metrics import RouterMetrics
from router.service import RouterService
from tests.helpers.fake_nodes import FakeNode, disaggregated, request_limits, retry_policy

pytestmark = pytest.mark.asyncio(loop_scope="module")  # the servers' loop

KEY = "test-key"
LIMIT_BYTES = 64 << 10
AUTH = {"Authorization": f"Bearer {KEY}"}
LIMIT = 2


class Router:
    def __init__(self, url, grpc, service: RouterService, nodes, health, app, new_app) -> None:
        self.url, self.grpc, self.service, self.nodes = url, grpc, service, nodes
        self.health, self.app, self.new_app = health, app, new_app

    def reset(self) -> None:
        for fake in self.nodes.values():
            fake.die_after, fake.delay_s, fake.kv_failure = None, 0.0, False
            fake.ends_in_error = False
            fake.cached_tokens = None
            fake.calls.clear()
            fake.healthy = True
        for pool in self.service.dispatcher.pools.values():
            for node in pool.nodes:
                node.healthy = True


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def router(default_model_dir):
    import uvicorn

    from pdserve_core.config import PDServeConfig
    from router.faces.connections import uvicorn_config
    from router.faces.vllm_face import serve_app

    nodes = {"p0": FakeNode("p0"), "d0": FakeNode("d0")}
    dispatcher = disaggregated([nodes["p0"]], [nodes["d0"]])
    metrics = RouterMetrics(dispatcher.pools, dispatcher.mode, tpot_target_s=0.1)
    metrics.watch(dispatcher)
    service = RouterService(
        dispatcher, metrics, Admission(LIMIT), retry_policy(3), 30, request_limits()
    )
    router = {"api_key": KEY, "max_request_bytes": LIMIT_BYTES, "body_timeout_s": SLOW_S}
    config = PDServeConfig.model_validate(
        {"engine": {"dtype": "float32", "max_model_len": 2048}, "router": router}
    )
    app = await serve_app(service, config, str(default_model_dir), "smol")
    server = uvicorn.Server(uvicorn_config(app, "127.0.0.1", 0, 4096, SLOW_S, log_level="error"))
    task = asyncio.create_task(server.serve())
    deadline = time.monotonic() + 30
    while not server.started:
        assert time.monotonic() < deadline and not task.done(), "uvicorn did not start"
        await asyncio.sleep(0.02)
    port = server.servers[0].sockets[0].getsockname()[1]
    grpc_server, grpc_port, health = await create_server(
        service, Renderer(app.state), "127.0.0.1:0", RouterConfig(api_key=KEY)
    )
    url = f"http://127.0.0.1:{port}"

    async def new_app():  # one app per server: vLLM's app ends its state when its server stops
        return await serve_app(service, config, str(default_model_dir), "smol")

    yield Router(url, f"127.0.0.1:{grpc_port}", service, nodes, health, app, new_app)
    await grpc_server.stop(grace=1)
    server.should_exit = True
    await task


@pytest_asyncio.fixture(loop_scope="module")
async def http(router):
    router.reset()
    async with httpx.AsyncClient(base_url=router.url, headers=AUTH, timeout=30) as client:
        yield client
    assert router.service.admission.outstanding == 0


def events(text: str) -> list[str]:
    return [line.removeprefix("data: ") for line in text.splitlines() if line]


def fake_text(prompt_tokens: int, count: int) -> str:
    """What the fake nodes generate after a prompt of `prompt_tokens` (tests/helpers)."""
    return "".join(f" t{p}" for p in range(prompt_tokens, prompt_tokens + count))


async def test_completion_whole_and_streamed(http, router):
    body = {"prompt": "Hello there", "max_tokens": 4}
    whole = (await http.post("/v1/completions", json=body)).json()
    assert whole["choices"][0]["text"] == fake_text(2, 4)
    usage = {"prompt_tokens": 2, "completion_tokens": 4, "total_tokens": 6}
    assert usage.items() <= whole["usage"].items()
    assert whole["choices"][0]["finish_reason"] == "length" and whole["model"] == "smol"
    body |= {"stream": True, "stream_options": {"include_usage": True}}
    response = await http.post("/v1/completions", json=body)
    assert response.headers["content-type"].startswith("text/event-stream")
    got = events(response.text)
    assert got[-1] == "[DONE]"
    chunks = [json.loads(e) for e in got[:-1]]
    assert "".join(c["choices"][0]["text"] for c in chunks if c["choices"]) == fake_text(2, 4)
    assert chunks[-1]["usage"]["completion_tokens"] == 4
    assert [c.method for c in router.nodes["p0"].calls] == ["prefill", "prefill"]


async def test_chat_first_chunk_names_the_role(http):
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "stream": True}
    chunks = [
        json.loads(e)
        for e in events((await http.post("/v1/chat/completions", json=body)).text)[:-1]
    ]
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks)
    whole = await http.post("/v1/chat/completions", json={**body, "stream": False})
    assert text == fake_text(whole.json()["usage"]["prompt_tokens"], 3)


@pytest.mark.parametrize(
    ("body", "status", "says"),
    [
        ({"prompt": "hi", "max_tokens": 0}, 400, "max_tokens must be"),
        ({"prompt": "hi", "model": "gpt-9"}, 404, "gpt-9"),
        ({"prompt": "hi", "temperature": -1}, 400, "temperature"),
        ({"max_tokens": 3}, 400, "prompt"),
        # found by the fuzzing tier: past msgpack's range it failed in the engine as a 500
        ({"prompt": "hi", "stream_interval": 2**70}, 400, "stream_interval holds an integer"),
        # found by the fuzzing tier: vLLM's beam search over the pools, one request per step
        ({"prompt": "hi", "use_beam_search": True, "n": 2}, 400, "beam search needs every"),
    ],
)
async def test_bad_input_gets_a_json_error(http, body, status, says):
    response = await http.post("/v1/completions", json=body)
    assert response.status_code == status
    error = response.json()["error"]
    assert says in error["message"] and error["code"] == status


HI = [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize(
    ("extra", "says"),
    [
        (
            {"chat_template_kwargs": {"chat_template": "{% for i in range(9) %}A{% endfor %}"}},
            "--trust-request-chat-template is not set",
        ),
        ({"chat_template": "{% for i in range(9) %}A{% endfor %}"}, "untrusted chat template"),
        ({"max_completion_tokens": 0}, "max_tokens"),  # 0 is not "unset"
    ],
)
async def test_hostile_chat_fields_get_400(http, extra, says):
    response = await http.post("/v1/chat/completions", json={"messages": HI, **extra})
    assert response.status_code == 400, response.text
    assert says in response.json()["error"]["message"]


async def test_chat_template_kwargs_reach_the_models_template_only(http):
    """Names the template does not read are dropped, and a client cannot have the template
    tokenized for it (vLLM's filter, as in `vllm serve`)."""
    body = {"messages": HI, "max_tokens": 2}
    plain = (await http.post("/v1/chat/completions", json=body)).json()
    kwargs = {"tokenize": True, "no_such_variable": [1] * 1000}
    odd = await http.post("/v1/chat/completions", json={**body, "chat_template_kwargs": kwargs})
    assert odd.status_code == 200, odd.text
    assert odd.json()["usage"]["prompt_tokens"] == plain["usage"]["prompt_tokens"]


async def test_missing_key_and_bad_json(router, http):
    async with httpx.AsyncClient(base_url=router.url, timeout=30) as anonymous:
        denied = await anonymous.post("/v1/completions", json={"prompt": "hi"})
    assert denied.status_code == 401 and "API key" in denied.json()["error"]["message"]
    raw = await http.post(
        "/v1/completions", content=b"{nope", headers={"content-type": "application/json"}
    )
    assert raw.status_code == 400 and "JSON" in raw.json()["error"]["message"]


async def test_a_decode_death_mid_stream_is_invisible_or_an_error_event_then_done(http, router):
    """Resumed where sampling keeps no state (here on the prefill node: the only decode node is
    gone); otherwise an error event naming the pool, then [DONE]."""
    router.nodes["d0"].die_after = 1
    body = {"prompt": "Hello there", "max_tokens": 6, "stream": True}
    got = events((await http.post("/v1/completions", json=body)).text)
    assert got[-1] == "[DONE]" and not any('"error"' in e for e in got)
    text = "".join(json.loads(e)["choices"][0]["text"] for e in got[:-1])
    assert text == fake_text(2, 6)
    router.reset()
    router.nodes["d0"].die_after = 1
    got = events((await http.post("/v1/completions", json={**body, "stop": ["x"]})).text)
    assert got[-1] == "[DONE]"
    error = json.loads(got[-2])["error"]
    assert error["code"] == 500 and "decode node d0" in error["message"]


JSON = {"content-type": "application/json"}


async def test_no_node_left_is_503_and_a_full_router_429(http, router):
    for pool in router.service.dispatcher.pools.values():
        pool.nodes[0].healthy = False
    down = await http.post("/v1/completions", json={"prompt": "hi"})
    assert down.status_code == 503 and "either pool" in down.json()["error"]["message"]
    streamed = await http.post("/v1/chat/completions", json={"messages": HI, "stream": True})
    assert streamed.status_code == 503  # the gate answers before a stream starts
    assert streamed.json()["error"]["type"] == "service_unavailable"
    assert (await http.get("/health")).status_code == 503
    # a request no node would run is the client's mistake whatever the pools' state
    nested = b'{"prompt": "hi", "x": ' + b"[" * 5_000 + b"]" * 5_000 + b"}"
    internal = {"prompt": "hi", "kv_transfer_params": {"do_remote_prefill": True}}
    for bad in (
        await http.post("/v1/completions", content=nested, headers=JSON),
        await http.post("/v1/completions", json=internal),
        await http.post("/v1/completions", json={"prompt": "hi", "ec_transfer_params": {"x": 1}}),
        await http.post("/v1/completions", content=b"[1, 2]", headers=JSON),
    ):
        assert bad.status_code == 400, bad.text
    # an empty one says nothing (vLLM passes it on only when it does): the gate answers as ever
    empty = await http.post("/v1/completions", json={"prompt": "hi", "kv_transfer_params": {}})
    assert empty.status_code == 503, empty.text
    router.reset()
    router.nodes["d0"].delay_s = 0.2
    body = {"prompt": "hi", "max_tokens": 20, "stream": True}
    async with http.stream("POST", "/v1/completions", json=body) as one:
        async with http.stream("POST", "/v1/completions", json=body) as two:
            assert one.status_code == two.status_code == 200
            full = await http.post("/v1/completions", json=body)
            assert full.status_code == 429 and full.headers["retry-after"] == "1"
    # both streams were dropped by their client: the node-side calls end, the slots come back
    deadline = time.monotonic() + 5
    while router.service.admission.outstanding and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    decode_calls = router.nodes["d0"].calls
    assert decode_calls and all(c.cancelled for c in decode_calls)


async def test_grpc_streams_and_maps_errors(router):
    async with grpc.aio.insecure_channel(router.grpc) as channel:
        stub = pb_grpc.GenerationStub(channel)
        request = pb.GenerateRequest(text="hi", sampling=pb.SamplingOptions(max_tokens=3))
        with pytest.raises(grpc.aio.AioRpcError) as denied:
            [r async for r in stub.Generate(request)]
        assert denied.value.code() == grpc.StatusCode.UNAUTHENTICATED
        auth = (("authorization", f"Bearer {KEY}"),)
        router.reset()
        replies = [r async for r in stub.Generate(request, metadata=auth)]
        assert "".join(r.text for r in replies) == fake_text(1, 3)
        assert replies[-1].finish_reason == "length" and replies[-1].usage.completion_tokens == 3
        router.reset()
        salted = pb.GenerateRequest(text="hi", sampling=request.sampling, cache_salt="tenant-a")
        assert [r.text async for r in stub.Generate(salted, metadata=auth)][-1]
        assert {
            c.params.extra_args[CACHE_SALT_ARG] for n in router.nodes.values() for c in n.calls
        } == {"tenant-a"}
        bad = pb.GenerateRequest(text="hi", sampling=pb.SamplingOptions(max_tokens=0))
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            [r async for r in stub.Generate(bad, metadata=auth)]
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        # `stop` is a string or a list of at most 4: the bound is what the message names
        five = pb.GenerateRequest(text="hi", sampling=pb.SamplingOptions(stop=["a"] * 5))
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            [r async for r in stub.Generate(five, metadata=auth)]
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "at most 4" in refused.value.details(), refused.value.details()
        for schema, says in (
            ("[" * 100_000 + "]" * 100_000, "nested too deeply"),
            ('{"enum": ["' + "x" * (70 << 10) + '"]}', "router.max_schema_bytes"),
        ):
            sampling = pb.SamplingOptions(
                max_tokens=3, structured_output=pb.StructuredOutput(json_schema=schema)
            )
            hostile = pb.GenerateRequest(text="hi", sampling=sampling)
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                [r async for r in stub.Generate(hostile, metadata=auth)]
            assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert says in refused.value.details()
        router.nodes["d0"].kv_failure = True
        with pytest.raises(grpc.aio.AioRpcError) as failed:
            [r async for r in stub.Generate(request, metadata=auth)]
        assert failed.value.code() == grpc.StatusCode.INTERNAL
        assert "KV transfer failed" in failed.value.details()
    assert router.service.admission.outstanding == 0


async def test_an_engine_error_is_vllms_500_once_on_both_faces(http, router):
    """A decode leg the engine ends with an error of its own (test_faults.py has the real one)
    is answered as vLLM's server answers it: a 500, or an error event in a stream; gRPC's
    INTERNAL. Not retried: it is the request's, not the node's."""
    router.reset()
    router.nodes["d0"].ends_in_error = True
    body = {"prompt": "hi", "max_tokens": 4}
    whole = await http.post("/v1/completions", json=body)
    assert whole.status_code == 500 and whole.json()["error"]["code"] == 500, whole.text
    assert "KV" not in whole.text
    streamed = await http.post("/v1/completions", json={**body, "stream": True})
    events = [line[6:] for line in streamed.text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]" and json.loads(events[-2])["error"]["code"] == 500, events
    async with grpc.aio.insecure_channel(router.grpc) as channel:
        request = pb.GenerateRequest(text="hi", sampling=pb.SamplingOptions(max_tokens=4))
        auth = (("authorization", f"Bearer {KEY}"),)
        with pytest.raises(grpc.aio.AioRpcError) as failed:
            [r async for r in pb_grpc.GenerationStub(channel).Generate(request, metadata=auth)]
    assert failed.value.code() == grpc.StatusCode.INTERNAL
    assert failed.value.details() == ENGINE_ERROR
    assert len(router.nodes["d0"].calls) == 3  # one leg a request
    router.reset()
    assert router.service.admission.outstanding == 0


async def test_hostile_bodies_get_4xx_and_the_router_keeps_serving(http, router):
    big = await http.post("/v1/completions", content=b"x" * (LIMIT_BYTES + 1))
    assert big.status_code == 413 and big.json()["error"]["type"] == "request_too_large"
    nested = b'{"prompt": ' + b"[" * 5_000 + b"]" * 5_000 + b"}"
    deep = await http.post("/v1/completions", content=nested[: LIMIT_BYTES - 10] + b"}")
    assert deep.status_code == 400, deep.text  # under the size bound: refused as bad JSON
    nested = b"[" * 30_000 + b"]" * 30_000
    headers = {"content-type": "application/json"}
    deeper = await http.post("/v1/completions", content=nested, headers=headers)
    assert deeper.status_code == 400 and deeper.json()["error"]["code"] == 400
    unknown = await http.get("/v1/nowhere")
    assert unknown.status_code == 404 and unknown.json()["error"]["code"] == 404
    ok = await http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
    assert ok.status_code == 200


SLOW_S = 1.0
"""The test router's header and body bounds (`router.header_timeout_s`, `body_timeout_s`)."""


async def test_slow_and_idle_connections_are_closed_and_do_not_delay_others(router, http):
    """Connections that never finish their head are closed at the header bound; a body that
    stops coming gets 408 at the body bound; a request beside 200 of them is served at once."""
    from urllib.parse import urlparse

    target = urlparse(router.url)
    await http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})  # warm
    opened = []
    for _ in range(200):
        reader, writer = await asyncio.open_connection(target.hostname, target.port)
        writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")  # and no more
        opened.append((reader, writer))
    started = time.monotonic()
    ok = await http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
    assert ok.status_code == 200 and time.monotonic() - started < 1.0
    ends = await asyncio.wait_for(
        asyncio.gather(*(reader.read() for reader, _ in opened)), SLOW_S + 5
    )
    assert ends == [b""] * 200  # each closed by the router, none answered
    for _, writer in opened:
        writer.close()

    reader, writer = await asyncio.open_connection(target.hostname, target.port)
    writer.write(
        f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\n"
        "Connection: close\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n"
        '{"prompt"'.encode()
    )
    answer = await asyncio.wait_for(reader.read(), SLOW_S + 5)
    writer.close()
    assert answer.startswith(b"HTTP/1.1 408") and b"router.body_timeout_s" in answer


async def test_metrics_and_detailed_health_need_the_key(router, http):
    async with httpx.AsyncClient(base_url=router.url, timeout=30) as anonymous:
        assert (await anonymous.get("/metrics")).status_code == 401
        assert (await anonymous.get("/pdserve/v1/steps")).status_code == 401
        assert (await anonymous.get("/openapi.json")).status_code == 401
        bare = await anonymous.get("/health")
        assert bare.status_code == 200 and bare.json() == {"status": "ok"}
    detailed = (await http.get("/health")).json()
    assert set(detailed["pools"]) == {"prefill", "decode"}
    assert (await http.get("/metrics")).status_code == 200
    assert "/v1/completions" in (await http.get("/openapi.json")).json()["paths"]
    steps = (await http.get("/pdserve/v1/steps")).json()["nodes"]
    assert {n["pool"] for n in steps} == {"prefill", "decode"}  # fake nodes keep no steps
    assert all(n["records"] == [] and n["fields"][-2:] == ["seconds", "gap_seconds"] for n in steps)


async def test_nodes_are_asked_at_once_and_a_silent_one_is_named_not_waited_on(
    router, http, monkeypatch
):
    import router.faces.openai_http as openai_http

    monkeypatch.setattr(openai_http, "NODE_ANSWER_S", 0.5)
    stuck = router.nodes["p0"]

    async def never(seen=0):
        await asyncio.Event().wait()

    monkeypatch.setattr(stuck, "step_records", never)
    started = time.monotonic()
    answer = (await http.get("/pdserve/v1/steps")).json()
    assert time.monotonic() - started < 5
    assert answer["unanswered"] == ["p0"] and [n["node"] for n in answer["nodes"]] == ["d0"]


async def test_grpc_health_follows_the_pools(router):
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from router.faces.grpc_api import follow_pools

    follower = asyncio.create_task(follow_pools(router.health, router.service.dispatcher))
    try:
        async with grpc.aio.insecure_channel(router.grpc) as channel:
            stub = health_pb2_grpc.HealthStub(channel)

            async def status():
                reply = await stub.Check(health_pb2.HealthCheckRequest(service=""))
                return reply.status

            for pool in router.service.dispatcher.pools.values():
                pool.nodes[0].healthy = False
            deadline = time.monotonic() + 10
            while await status() != health_pb2.HealthCheckResponse.NOT_SERVING:
                assert time.monotonic() < deadline
                await asyncio.sleep(0.1)
            router.reset()
            while await status() != health_pb2.HealthCheckResponse.SERVING:
                assert time.monotonic() < deadline
                await asyncio.sleep(0.1)
    finally:
        follower.cancel()


async def test_a_non_streamed_request_whose_client_leaves_is_cancelled(router, http):
    router.nodes["d0"].delay_s = 0.2
    body = {"prompt": "hi", "max_tokens": 40}
    with pytest.raises(httpx.ReadTimeout):
        await http.post("/v1/completions", json=body, timeout=1.0)
    deadline = time.monotonic() + 10
    while router.service.admission.outstanding and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    assert router.service.admission.outstanding == 0
    assert router.nodes["d0"].calls and router.nodes["d0"].calls[-1].cancelled


async def test_a_streaming_client_that_leaves_during_the_prefill_stops_it(router, http):
    """Before the first token the router has answered nothing yet; a client that leaves then is
    noticed anyway: the prefill leg is cancelled on its node, no decode leg starts."""
    router.nodes["p0"].delay_s = 5.0  # a long prefill
    body = {"prompt": "hi", "max_tokens": 4, "stream": True}
    with pytest.raises(httpx.ReadTimeout):
        await http.post("/v1/completions", json=body, timeout=1.0)
    deadline = time.monotonic() + 4  # well before the prefill would have ended
    while router.service.admission.outstanding and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    assert router.service.admission.outstanding == 0
    assert router.nodes["p0"].calls[-1].cancelled and not router.nodes["d0"].calls


async def test_both_faces_speak_mutual_tls_when_configured(router, tmp_path):
    """router.tls: https and a secure gRPC port, each refusing a client without a certificate
    the client CA signed; the same service answers behind them."""
    import ssl

    import trustme
    import uvicorn

    from pdserve_core.tls import ServerFiles
    from router.faces.connections import uvicorn_config
    from tests.helpers.certs import issue

    router.reset()  # fake nodes as made (a test before may have slowed them)
    ca = trustme.CA()
    server_files = issue(tmp_path / "router", ("127.0.0.1",), ca)
    client_files = issue(tmp_path / "client", ("client.example",), ca)
    tls = ServerFiles(server_files.cert_file, server_files.key_file, server_files.ca_file)
    app = await router.new_app()
    server = uvicorn.Server(uvicorn_config(app, "127.0.0.1", 0, 64, 5, "error", tls))
    task = asyncio.create_task(server.serve())
    grpc_server, grpc_port, _ = await create_server(
        router.service, Renderer(router.app.state), "127.0.0.1:0", RouterConfig(api_key=KEY), tls
    )
    try:
        deadline = time.monotonic() + 30
        while not server.started:
            assert time.monotonic() < deadline and not task.done(), "uvicorn did not start"
            await asyncio.sleep(0.02)
        url = f"https://127.0.0.1:{server.servers[0].sockets[0].getsockname()[1]}"
        trusted = ssl.create_default_context(cafile=server_files.ca_file)
        with pytest.raises(httpx.HTTPError):  # no client certificate: the handshake fails
            async with httpx.AsyncClient(verify=trusted, timeout=10) as bare:
                await bare.get(f"{url}/health")
        trusted.load_cert_chain(client_files.cert_file, client_files.key_file)
        async with httpx.AsyncClient(verify=trusted, headers=AUTH, timeout=30) as client:
            body = {"prompt": "Hello there", "max_tokens": 3}
            answer = await client.post(f"{url}/v1/completions", json=body)
        assert answer.status_code == 200
        assert answer.json()["choices"][0]["text"] == fake_text(2, 3)

        address = f"127.0.0.1:{grpc_port}"
        request = pb.GenerateRequest(text="hi", sampling=pb.SamplingOptions(max_tokens=3))
        auth = (("authorization", f"Bearer {KEY}"),)
        ca_pem = open(server_files.ca_file, "rb").read()
        anonymous = grpc.ssl_channel_credentials(root_certificates=ca_pem)
        async with grpc.aio.secure_channel(address, anonymous) as channel:
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                [r async for r in pb_grpc.GenerationStub(channel).Generate(request, metadata=auth)]
            assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
        known = grpc.ssl_channel_credentials(
            root_certificates=ca_pem,
            private_key=open(client_files.key_file, "rb").read(),
            certificate_chain=open(client_files.cert_file, "rb").read(),
        )
        async with grpc.aio.secure_channel(address, known) as channel:
            replies = [
                r async for r in pb_grpc.GenerationStub(channel).Generate(request, metadata=auth)
            ]
        assert "".join(r.text for r in replies) == fake_text(1, 3)
        async with grpc.aio.insecure_channel(address) as channel:  # plain text is not served
            with pytest.raises(grpc.aio.AioRpcError) as plain:
                [r async for r in pb_grpc.GenerationStub(channel).Generate(request, metadata=auth)]
            assert plain.value.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        await grpc_server.stop(grace=1)
        server.should_exit = True
        await task
    assert router.service.admission.outstanding == 0


async def test_requests_drawn_from_the_schemas_get_no_5xx_from_the_router(router):
    """The fuzzing tier's requests (tests/helpers/fuzz.py) against the router over fake nodes:
    every refusal a 4xx with a JSON error, nothing 5xx, nothing unanswered. (The e2e tier sends
    them to real engines.)"""
    from tests.helpers import fuzz

    router.reset()
    report = await asyncio.to_thread(fuzz.run, router.url, AUTH, "smol", 100, 7, LIMIT)
    assert report.problems() == []
    assert report.summary()["statuses"].get("200", 0) > 30
    assert router.service.admission.outstanding == 0


async def test_one_client_address_holds_only_its_share(router):
    """router.max_connections_per_client: a third HTTP connection from one address gets 429 and
    is closed while two are open; a second gRPC call at once from one address gets
    RESOURCE_EXHAUSTED; each place comes back when its connection or call ends."""
    import uvicorn

    from router.faces.connections import uvicorn_config

    router.reset()
    app = await router.new_app()
    server = uvicorn.Server(uvicorn_config(app, "127.0.0.1", 0, 64, 5, "error", per_client=2))
    task = asyncio.create_task(server.serve())
    grpc_server, grpc_port, _ = await create_server(
        router.service,
        Renderer(router.app.state),
        "127.0.0.1:0",
        RouterConfig(api_key=KEY, max_connections_per_client=1),
    )
    try:
        deadline = time.monotonic() + 30
        while not server.started:
            assert time.monotonic() < deadline and not task.done(), "uvicorn did not start"
            await asyncio.sleep(0.02)
        port = server.servers[0].sockets[0].getsockname()[1]
        held = [await asyncio.open_connection("127.0.0.1", port) for _ in range(2)]
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        refused = await asyncio.wait_for(reader.read(), 10)  # answered, then closed
        writer.close()
        assert refused.startswith(b"HTTP/1.1 429")
        body = json.loads(refused.split(b"\r\n\r\n", 1)[1])
        assert "router.max_connections_per_client: 2" in body["error"]["message"]
        for _, writer in held:
            writer.close()
        url = f"http://127.0.0.1:{port}"
        async with httpx.AsyncClient(base_url=url, headers=AUTH, timeout=30) as client:
            ok = await client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
        assert ok.status_code == 200

        router.nodes["d0"].delay_s = 0.2
        request = pb.GenerateRequest(text="hi", sampling=pb.SamplingOptions(max_tokens=10))
        auth = (("authorization", f"Bearer {KEY}"),)
        async with grpc.aio.insecure_channel(f"127.0.0.1:{grpc_port}") as channel:
            stub = pb_grpc.GenerationStub(channel)
            first = stub.Generate(request, metadata=auth)
            await first.read()  # the first call is under way
            with pytest.raises(grpc.aio.AioRpcError) as second:
                [r async for r in stub.Generate(request, metadata=auth)]
            assert second.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "too many calls at once" in second.value.details()
            while (reply := await first.read()) is not grpc.aio.EOF:
                last = reply
            assert last.finish_reason == "length"
            router.nodes["d0"].delay_s = 0.0
            again = [r async for r in stub.Generate(request, metadata=auth)]
            assert again[-1].usage.completion_tokens == 10
    finally:
        router.nodes["d0"].delay_s = 0.0
        await grpc_server.stop(grace=1)
        server.should_exit = True
        await task
    assert router.service.admission.outstanding == 0


async def test_an_unexpected_fault_is_a_json_500_and_gives_its_slot_back(http, router, monkeypatch):
    class Broken:
        def check(self, prepared):
            raise RuntimeError("a bug")

    monkeypatch.setattr(router.service, "limits", Broken())
    response = await http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
    assert response.status_code == 500
    assert response.json()["error"]["code"] == 500


async def test_every_refusal_is_counted_once_whichever_layer_refuses(http, router):
    def count(kind: str) -> float:
        labels = {"api": "http", "outcome": kind}
        return (
            router.service.metrics.registry.get_sample_value("pdserve_requests_total", labels) or 0
        )

    invalid, unknown = count("invalid_request_error"), count("model_not_found")
    refused = [
        {"prompt": "hi", "temperature": -1},  # vLLM's layer
        {"prompt": "hi", "vllm_xargs": {"x": 1}},  # the router's prepare
        {"prompt": "hi", "n": 200, "temperature": 1},  # the router's limits (router.max_n)
    ]
    for body in refused:
        assert (await http.post("/v1/completions", json=body)).status_code == 400
    assert (
        await http.post("/v1/completions", json={"prompt": "hi", "model": "x"})
    ).status_code == 404
    assert count("invalid_request_error") == invalid + len(refused)
    assert count("model_not_found") == unknown + 1


@pytest.mark.asyncio(loop_scope="module")
async def test_grpc_reports_cached_tokens_only_where_the_setting_says(router):
    """As HTTP's `--enable-prompt-tokens-details`: off (the default), a client cannot read what
    other clients' prompts left in the cache."""
    router.reset()
    for fake in router.nodes.values():
        fake.cached_tokens = 64
    request = pb.GenerateRequest(text="hi", sampling=pb.SamplingOptions(max_tokens=3))
    auth = (("authorization", f"Bearer {KEY}"),)
    reported = {}
    for setting in (False, True):
        server, port, _ = await create_server(
            router.service,
            Renderer(router.app.state),
            "127.0.0.1:0",
            RouterConfig(api_key=KEY, enable_prompt_tokens_details=setting),
        )
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                stub = pb_grpc.GenerationStub(channel)
                replies = [r async for r in stub.Generate(request, metadata=auth)]
            reported[setting] = replies[-1].usage.cached_tokens
        finally:
            await server.stop(grace=1)
    router.reset()
    assert reported == {False: 0, True: 64}


@pytest.mark.asyncio(loop_scope="module")
async def test_grpc_takes_logprob_token_ids(router):
    router.reset()
    sampling = pb.SamplingOptions(max_tokens=3, logprobs=2, logprob_token_ids=[30, 1000])
    request = pb.GenerateRequest(text="hi", sampling=sampling)
    auth = (("authorization", f"Bearer {KEY}"),)
    async with grpc.aio.insecure_channel(router.grpc) as channel:
        stub = pb_grpc.GenerationStub(channel)
        replies = [r async for r in stub.Generate(request, metadata=auth)]
    assert sum(len(r.logprobs) for r in replies) == 3  # one entry per token, across the seam
    asked = [c.params.logprob_token_ids for n in router.nodes.values() for c in n.calls]
    assert asked and all(list(ids) == [30, 1000] for ids in asked)  # every leg was asked
