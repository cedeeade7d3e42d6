"""Disaggregated serving end to end: `pdserve serve` 1P1D (real Ray, two real vLLM engines in
float32, KV over TCP), the openai client, gRPC, bad input, and nodes killed under the router."""

from __future__ import annotations

import concurrent.futures
import json
import os
import secrets
import signal
import threading
import time

import httpx
import openai
import pytest

from tests.e2e.conftest import (
    BAD_REQUESTS,
    CHAT,
    assert_rejected,
    finish_server,
    metric,
    node_stats_settled,
    samples,
    start_server,
)

API_KEY = "test-key"
MAX_OUTSTANDING = 4


@pytest.fixture(scope="module")
def server(default_model_dir, tmp_path_factory):
    """The default configuration (1P1D) in float32 (exact comparisons hold on any CPU), plus an
    API key, a small admission limit, every prompt prefilled on the prefill node (the seam under
    test; test_default_config.py serves the adaptive default), and the KV crossing on mutual TLS
    (every other e2e server moves it on plain TCP)."""
    from tests.helpers.certs import issue

    work = tmp_path_factory.mktemp("serve-1p1d")
    certs = issue(work / "certs")
    config = work / "pdserve.yaml"
    config.write_text(
        f"router: {{api_key: {API_KEY}, max_outstanding_requests: {MAX_OUTSTANDING},\n"
        "         placement: {mode: remote}}\n"
        "engine: {dtype: float32}\n"
        f"kv_transfer: {{tls: {{cert_file: {certs.cert_file}, key_file: {certs.key_file},\n"
        f"                     ca_file: {certs.ca_file}}}}}\n"
    )
    server = start_server(work, "--config", str(config), api_key=API_KEY)
    yield server
    finish_server(server)


@pytest.fixture(scope="module")
def corpus_text() -> str:
    from tests.conftest import REPO

    return (REPO / "docs" / "design.md").read_text()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, timeout=120)


AUTH = {"Authorization": f"Bearer {API_KEY}"}


@pytest.fixture(autouse=True)
def all_nodes_healthy(server):
    """Each test starts with every node in its pool (kill tests leave a node restarting)."""
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline:
        pools = health(server)["pools"]
        if all(p["healthy"] == len(p["nodes"]) for p in pools.values()):
            return
        time.sleep(0.5)
    raise AssertionError(f"nodes did not all rejoin: {health(server)}")


def health(server) -> dict:
    return httpx.get(f"{server.url}/health", headers=server.headers, timeout=10).json()


def test_health_shows_both_pools(server):
    body = health(server)
    assert body["status"] == "ok" and body["mode"] == "disaggregated"
    assert body["pools"]["prefill"]["healthy"] == 1 and body["pools"]["decode"]["healthy"] == 1


def test_completions_and_chat_streamed_and_not(client, server):
    plain = client.completions.create(
        model=server.model, prompt="The capital of France is", max_tokens=8, temperature=0
    )
    assert plain.choices[0].text.strip()
    assert plain.usage.prompt_tokens == 5 and plain.usage.completion_tokens == 8
    stream = client.completions.create(
        model=server.model,
        prompt="The capital of France is",
        max_tokens=8,
        temperature=0,
        stream=True,
    )
    assert "".join(c.choices[0].text for c in stream if c.choices) == plain.choices[0].text
    chat = client.chat.completions.create(
        model=server.model, messages=CHAT, max_tokens=16, temperature=0
    )
    assert chat.choices[0].message.content.strip()
    chunks = list(
        client.chat.completions.create(
            model=server.model,
            messages=CHAT,
            max_tokens=16,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == (
        chat.choices[0].message.content
    )
    assert chunks[-1].usage.completion_tokens == chat.usage.completion_tokens


def test_the_kv_crosses_on_mutual_tls(client, server):
    """The decode node pulls each prompt's KV from the prefill node over TLS: the pull lands
    (bytes counted on both sides, no failure) and the output is the same as ever."""

    def moved(direction: str) -> float:  # prefill nodes send, decode nodes receive
        pool = "prefill" if direction == "sent" else "decode"
        return metric(server, "pdserve_kv_transfer_bytes_total", direction=direction, pool=pool)

    def failures() -> float:  # every reason on every node
        return sum(
            sample.value
            for sample in samples(server)
            if sample.name == "pdserve_kv_transfer_failures_total"
        )

    failed = failures()
    sent, received = moved("sent"), moved("received")
    answer = client.completions.create(
        model=server.model, prompt="The capital of France is", max_tokens=4, temperature=0
    )
    assert answer.usage.completion_tokens == 4
    node_stats_settled(server)  # the nodes' stats reach /metrics with their health checks
    assert moved("received") > received and moved("sent") > sent
    assert failures() == failed == 0


def test_the_kv_crosses_while_the_prefill_runs(client, server, corpus_text):
    """The decode node follows each prefill as it runs (a prefetch): the decode leg's pull is
    served from what it staged — one prefetch used per request, none missed — and the answer
    is what a pull would have given (the parity suite compares it with plain vLLM)."""

    def prefetches(outcome: str) -> float:
        return metric(server, "pdserve_kv_prefetches_total", outcome=outcome, pool="decode")

    node_stats_settled(server)  # the earlier tests' prefetches all counted
    used, missed = prefetches("used"), prefetches("missed")
    for words in (40, 400):  # one chunk, and a prompt of several blocks
        # a prompt no node has seen: a decode node that holds a prompt's start is not asked to
        # prefetch (it pulls only the blocks it lacks, router/dispatch.py)
        prompt = f"{secrets.token_hex(8)} " + " ".join(corpus_text.split()[:words])
        answer = client.completions.create(
            model=server.model, prompt=prompt, max_tokens=3, temperature=0
        )
        assert answer.usage.completion_tokens == 3
    node_stats_settled(server)
    assert (prefetches("used"), prefetches("missed")) == (used + 2, missed)


def test_max_tokens_one_is_served_by_the_prefill_node_alone(client, server):
    def routed(pool: str) -> float:
        return metric(server, "pdserve_routing_decisions_total", pool=pool)

    prefill, decode = routed("prefill"), routed("decode")
    one = client.completions.create(
        model=server.model, prompt="The capital of France is", max_tokens=1, temperature=0
    )
    assert one.usage.completion_tokens == 1 and one.choices[0].text
    assert (routed("prefill"), routed("decode")) == (prefill + 1, decode)
    eight = client.completions.create(
        model=server.model, prompt="The capital of France is", max_tokens=8, temperature=0
    )
    assert eight.choices[0].text.startswith(one.choices[0].text)
    assert (routed("prefill"), routed("decode")) == (prefill + 2, decode + 1)


def test_a_clients_request_id_names_the_response_only(server):
    """Two clients send the same long `request_id` at once: each gets its answer under that id
    (as vLLM answers), and both prompts cross the seam: the nodes ran them under pdserve's own
    ids, so no KV handle was refused for its id and no prompt was computed twice."""

    def count(name: str, **labels: str) -> float:
        return metric(server, name, pool="decode", node="pdserve-decode-0", **labels)

    node_stats_settled(server)
    transferred = count("pdserve_node_prompt_tokens_total", source="transferred")
    bad = count("pdserve_kv_transfer_failures_total", reason="bad_handle")
    client_id = "client-" + "r" * 600

    def ask(which: int) -> httpx.Response:
        prompt = [2000 + 50 * which + i for i in range(24)]  # distinct: no prefix cache hits
        body = {"prompt": prompt, "max_tokens": 4, "request_id": client_id}
        return httpx.post(f"{server.url}/v1/completions", json=body, headers=AUTH, timeout=120)

    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        answers = list(pool.map(ask, range(2)))
    assert [a.status_code for a in answers] == [200, 200], [a.text[:200] for a in answers]
    assert [a.json()["id"] for a in answers] == [f"cmpl-{client_id}"] * 2
    assert all(a.json()["usage"]["completion_tokens"] == 4 for a in answers)
    # each decode leg loaded its prompt's KV (23 of 24 tokens; the last one it computes)
    node_stats_settled(server)  # the stats hold both legs
    assert count("pdserve_node_prompt_tokens_total", source="transferred") >= transferred + 2 * 16
    assert count("pdserve_kv_transfer_failures_total", reason="bad_handle") == bad


def test_prefill_node_killed_falls_back_then_rejoins(client, server, corpus_text):
    """SIGKILL the prefill node's process while long prompts are being prefilled: every request
    completes (retried, then prefilled on the decode node) or ends with an explicit error; none
    hangs; Ray restarts the node and it rejoins its pool."""
    pid = health(server)["pools"]["prefill"]["nodes"][0]["pid"]
    expected = (
        client.completions.create(
            model=server.model, prompt="The capital of France is", max_tokens=8, temperature=0
        )
        .choices[0]
        .text
    )

    def ask(i: int):
        try:
            answer = client.completions.create(
                model=server.model, prompt=corpus_text[i * 300 : i * 300 + 6000], max_tokens=4
            )
            return "completed" if answer.usage.completion_tokens == 4 else "short"
        except openai.APIStatusError as error:  # an explicit error, not a hang
            return f"error {error.status_code}: {error.message}"

    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        futures = [pool.submit(ask, i) for i in range(3)]
        deadline = time.monotonic() + 30
        while node(server, "prefill")["outstanding"] < 1 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert node(server, "prefill")["outstanding"] >= 1  # the kill lands on prefills
        os.kill(pid, signal.SIGKILL)
        outcomes = [f.result(timeout=240) for f in futures]
    assert all(o == "completed" or o.startswith("error") for o in outcomes), outcomes
    assert "completed" in outcomes, outcomes  # retried, then prefilled on the decode node
    deadline = time.monotonic() + 30
    while (
        health(server)["pools"]["prefill"]["nodes"][0]["pid"] == pid
        and (health(server)["pools"]["prefill"]["healthy"])
        and time.monotonic() < deadline
    ):
        time.sleep(0.2)
    again = client.completions.create(
        model=server.model, prompt="The capital of France is", max_tokens=8, temperature=0
    )
    assert again.choices[0].text == expected
    deadline = time.monotonic() + 240
    while not health(server)["pools"]["prefill"]["healthy"] and time.monotonic() < deadline:
        time.sleep(1)
    body = health(server)
    assert body["pools"]["prefill"]["healthy"] == 1, body
    assert body["pools"]["prefill"]["nodes"][0]["pid"] != pid
    after = client.completions.create(
        model=server.model, prompt="The capital of France is", max_tokens=8, temperature=0
    )
    assert after.choices[0].text == expected
    assert metric(server, "pdserve_prefill_fallbacks_total") >= 1  # the decode node prefilled


def test_grpc_generate_streams_health_and_reflection(server, client):
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

    from pdserve_proto.v1 import generate_pb2 as pb
    from pdserve_proto.v1 import generate_pb2_grpc as pb_grpc

    with grpc.insecure_channel(server.grpc) as channel:
        stub = pb_grpc.GenerationStub(channel)
        request = pb.GenerateRequest(
            text="The capital of France is",
            sampling=pb.SamplingOptions(max_tokens=8, temperature=0),
        )
        auth = (("authorization", f"Bearer {API_KEY}"),)
        with pytest.raises(grpc.RpcError) as denied:
            list(stub.Generate(request, timeout=60))
        assert denied.value.code() == grpc.StatusCode.UNAUTHENTICATED
        chunks = list(stub.Generate(request, timeout=120, metadata=auth))
        assert len(chunks) >= 2
        over_http = client.completions.create(
            model=server.model, prompt="The capital of France is", max_tokens=8, temperature=0
        )
        assert "".join(c.text for c in chunks) == over_http.choices[0].text
        assert chunks[-1].finish_reason == "length"
        assert chunks[-1].usage.prompt_tokens == 5 and chunks[-1].usage.completion_tokens == 8
        assert sum(len(c.token_ids) for c in chunks) == 8

        chat = pb.GenerateRequest(
            chat=pb.ChatMessages(
                messages=[pb.ChatMessage(role="user", content=CHAT[0]["content"])]
            ),
            sampling=pb.SamplingOptions(max_tokens=16, temperature=0),
        )
        chat_http = client.chat.completions.create(
            model=server.model, messages=CHAT, max_tokens=16, temperature=0
        )
        chat_grpc = "".join(c.text for c in stub.Generate(chat, timeout=120, metadata=auth))
        assert chat_grpc == chat_http.choices[0].message.content

        bad = pb.GenerateRequest(text="hi", sampling=pb.SamplingOptions(max_tokens=5000))
        with pytest.raises(grpc.RpcError) as refused:
            list(stub.Generate(bad, timeout=60, metadata=auth))
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "max_model_len" in refused.value.details()
        zero = pb.GenerateRequest(text="hi", sampling=pb.SamplingOptions(max_tokens=0))
        with pytest.raises(grpc.RpcError) as empty:
            list(stub.Generate(zero, timeout=60, metadata=auth))
        assert empty.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "max_tokens" in empty.value.details()
        unknown = pb.GenerateRequest(model="gpt-9", text="hi")
        with pytest.raises(grpc.RpcError) as missing:
            list(stub.Generate(unknown, timeout=60, metadata=auth))
        assert missing.value.code() == grpc.StatusCode.NOT_FOUND

        rich = pb.GenerateRequest(
            text="Is Cairo in Egypt?",
            sampling=pb.SamplingOptions(
                max_tokens=8,
                temperature=1.0,
                seed=3,
                n=2,
                logprobs=2,
                structured_output=pb.StructuredOutput(choice=pb.Choices(choices=["yes", "no"])),
            ),
        )
        texts: dict[int, str] = {}
        for chunk in stub.Generate(rich, timeout=120, metadata=auth):
            texts[chunk.index] = texts.get(chunk.index, "") + chunk.text
            assert len(chunk.logprobs) == len(chunk.token_ids)
            for position in chunk.logprobs:
                assert position.chosen.logprob <= 0 and len(position.top) >= 1
        assert set(texts) == {0, 1} and set(texts.values()) <= {"yes", "no"}

        status = health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service="pdserve.v1.Generation"), timeout=10
        )
        assert status.status == health_pb2.HealthCheckResponse.SERVING

        reflect = reflection_pb2_grpc.ServerReflectionStub(channel)
        answers = reflect.ServerReflectionInfo(
            iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=10
        )
        services = {s.name for a in answers for s in a.list_services_response.service}
        assert "pdserve.v1.Generation" in services and "grpc.health.v1.Health" in services


def test_api_key_is_required(server):
    body = {"prompt": "hi", "max_tokens": 2}
    denied = httpx.post(f"{server.url}/v1/completions", json=body, timeout=30)
    assert denied.status_code == 401 and "API key" in denied.json()["error"]["message"]
    wrong = httpx.post(
        f"{server.url}/v1/completions",
        json=body,
        timeout=30,
        headers={"Authorization": "Bearer nope"},
    )
    assert wrong.status_code == 401
    assert (
        httpx.post(f"{server.url}/v1/completions", json=body, timeout=60, headers=AUTH).status_code
        == 200
    )


def node(server, pool: str) -> dict:
    return health(server)["pools"][pool]["nodes"][0]


def test_a_full_router_answers_429_and_a_disconnect_aborts_on_the_nodes(server):
    """Hold MAX_OUTSTANDING long streams open: the next request gets 429 with Retry-After.
    Then drop the streams: the decode node stops running them (aborted, blocks freed)."""
    body = {
        "prompt": "Write a very long story about the sea.",
        "max_tokens": 1500,
        "ignore_eos": True,
        "stream": True,
    }
    clients = [httpx.Client(timeout=60) for _ in range(MAX_OUTSTANDING)]
    streams = []
    try:
        for c in clients:
            stream = c.stream("POST", f"{server.url}/v1/completions", json=body, headers=AUTH)
            response = stream.__enter__()
            assert response.status_code == 200
            lines = response.iter_lines()  # kept: dropping it would close the response
            next(lines)  # a first event: the request is in flight
            streams.append((stream, lines))
        full = httpx.post(f"{server.url}/v1/completions", json=body, headers=AUTH, timeout=30)
        assert full.status_code == 429
        refused = metric(server, "pdserve_requests_total", outcome="rate_limit_exceeded")
        assert refused >= 1
        assert full.headers["retry-after"] and "retry later" in full.json()["error"]["message"]

        deadline = time.monotonic() + 30
        while node(server, "decode")["running"] < 1 and time.monotonic() < deadline:
            time.sleep(0.2)
        assert node(server, "decode")["running"] >= 1
    finally:
        for stream, _ in streams:
            stream.__exit__(None, None, None)
        for c in clients:
            c.close()
    deadline = time.monotonic() + 30  # a 1500-token stream would run for a minute or more

    def busy(decode: dict) -> bool:  # the cache usage is the engine's last report: polled too
        return bool(decode["running"] or decode["outstanding"] or decode["kv_cache_usage"])

    while busy(node(server, "decode")) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert node(server, "decode")["running"] == 0 and node(server, "decode")["outstanding"] == 0
    assert node(server, "decode")["kv_cache_usage"] == 0.0
    assert metric(server, "pdserve_requests_total", outcome="cancelled") >= MAX_OUTSTANDING
    ok = httpx.post(
        f"{server.url}/v1/completions",
        json={"prompt": "hi", "max_tokens": 2},
        headers=AUTH,
        timeout=60,
    )
    assert ok.status_code == 200


def test_clients_that_leave_free_the_prefill_nodes_kv_at_once(server, corpus_text):
    """Streaming clients that leave at their first token, and ones that leave during their
    prefill: within a few seconds the prefill node holds no KV for anyone (not a lease later:
    the lease is 30 s here), and the router still serves."""
    lease_s = 30.0
    words = corpus_text.split()

    def leave(index: int, during_prefill: bool) -> None:
        prompt = " ".join(words[index * 300 : index * 300 + 300])  # distinct: no prefix hits
        body = {"prompt": prompt, "max_tokens": 64, "ignore_eos": True, "stream": True}
        timeout = httpx.Timeout(60, read=0.3) if during_prefill else 60
        try:
            with httpx.stream(
                "POST", f"{server.url}/v1/completions", json=body, headers=AUTH, timeout=timeout
            ) as response:
                for line in response.iter_lines():
                    if line.startswith("data: {"):
                        return  # the first token came: gone
        except httpx.ReadTimeout:
            return  # gone during the prefill

    started = time.monotonic()
    with concurrent.futures.ThreadPoolExecutor(MAX_OUTSTANDING) as pool:
        list(pool.map(leave, range(8), [i % 2 == 0 for i in range(8)]))
    left = time.monotonic()
    deadline = left + 15
    while node(server, "prefill")["kv_blocks_held"] and time.monotonic() < deadline:
        time.sleep(0.1)
    freed_s = time.monotonic() - left
    assert node(server, "prefill")["kv_blocks_held"] == 0, node(server, "prefill")
    assert freed_s < 5 < lease_s, freed_s
    print(f"8 clients left over {left - started:.1f} s; prefill KV freed {freed_s:.2f} s later")
    ok = httpx.post(
        f"{server.url}/v1/completions", json={"prompt": "hi", "max_tokens": 2}, headers=AUTH
    )
    assert ok.status_code == 200


STREAM = {
    "prompt": "Tell me about the sea.",
    "max_tokens": 300,
    "ignore_eos": True,
    "temperature": 0,
}


def _streams_through(server, kill, count: int = 3) -> list[dict]:
    """`count` greedy streams; `kill()` runs once the decode node is running them. Returns, per
    stream, its text, error events and usage."""

    under_way = threading.Semaphore(0)  # released once per stream, at its 20th event

    def stream_one(_):
        body = {**STREAM, "stream": True, "stream_options": {"include_usage": True}}
        with httpx.stream(
            "POST", f"{server.url}/v1/completions", json=body, headers=AUTH, timeout=300
        ) as response:
            events = []
            for line in response.iter_lines():
                if line.startswith("data: "):
                    events.append(line[6:])
                    if len(events) == 20:
                        under_way.release()
        assert events[-1] == "[DONE]"
        chunks = [json.loads(e) for e in events[:-1]]
        return {
            "text": "".join(c["choices"][0]["text"] for c in chunks if c.get("choices")),
            "errors": [c["error"] for c in chunks if "error" in c],
            "usage": next((c["usage"] for c in chunks if c.get("usage")), None),
        }

    with concurrent.futures.ThreadPoolExecutor(count) as pool:
        futures = [pool.submit(stream_one, i) for i in range(count)]
        for _ in range(count):  # every stream well under way
            assert under_way.acquire(timeout=120), "a stream sent no 20 events in 120 s"
        deadline = time.monotonic() + 10  # on the decode node, as its stats say (each second)
        while node(server, "decode")["running"] < 1 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert node(server, "decode")["running"] >= 1
        kill()
        return [f.result(timeout=280) for f in futures]


def _assert_serves_as_before(server, expected: str, max_tokens: int = 40) -> None:
    """The rebuilt node's answer begins as the uninterrupted run's (greedy: the first
    `max_tokens` tokens of a longer run are the shorter run's)."""
    again, _ = _uninterrupted(server, max_tokens)
    assert again and expected.startswith(again), (again, expected)


def _uninterrupted(server, max_tokens: int = STREAM["max_tokens"]) -> tuple[str, int]:
    """The text and prompt tokens of the same request, run without interruption."""
    request = {**STREAM, "max_tokens": max_tokens}
    answer = httpx.post(f"{server.url}/v1/completions", json=request, headers=AUTH, timeout=300)
    body = answer.json()
    return body["choices"][0]["text"], body["usage"]["prompt_tokens"]


def _wait_healthy(server, pool: str, within: float = 240) -> float:
    started = time.monotonic()
    while not health(server)["pools"][pool]["healthy"]:
        assert time.monotonic() - started < within, f"{pool} pool not healthy in {within} s"
        time.sleep(0.5)
    return time.monotonic() - started


def test_decode_node_killed_mid_stream_the_streams_continue(server):
    """SIGKILL of the decode node's actor during three 300-token streams: each stream continues
    on the one node left (the prefill node serves it whole) from the tokens already sent — the
    client sees one stream, no error, the uninterrupted run's text (float32 greedy) and usage.
    Ray restarts the node and it rejoins."""
    expected, prompt_tokens = _uninterrupted(server)
    pid = node(server, "decode")["pid"]
    resumed = metric(server, "pdserve_stream_resumes_total", pool="decode")
    outcomes = _streams_through(server, lambda: os.kill(pid, signal.SIGKILL))
    for outcome in outcomes:
        assert outcome["errors"] == [] and outcome["text"] == expected
        assert outcome["usage"]["completion_tokens"] == 300
        assert outcome["usage"]["prompt_tokens"] == prompt_tokens
    assert metric(server, "pdserve_stream_resumes_total", pool="decode") >= resumed + 3
    _wait_healthy(server, "decode")
    assert node(server, "decode")["pid"] != pid
    _assert_serves_as_before(server, expected)


def test_a_dead_engine_under_a_living_node_is_rebuilt(server):
    """SIGKILL of the decode node's EngineCore process (the actor lives on): the streams on it
    continue elsewhere, the node notices its engine is dead, builds a new one and rejoins."""
    import psutil

    expected, _ = _uninterrupted(server)
    actor = psutil.Process(node(server, "decode")["pid"])
    core = next(p for p in actor.children(recursive=True) if "EngineCore" in " ".join(p.cmdline()))
    outcomes = _streams_through(server, lambda: core.kill())
    for outcome in outcomes:
        assert outcome["errors"] == [] and outcome["text"] == expected
    _wait_healthy(server, "decode")
    assert node(server, "decode")["pid"] == actor.pid  # the same actor, a new engine
    assert not core.is_running()
    _assert_serves_as_before(server, expected)


def test_bad_http_input_is_refused_and_the_router_keeps_serving(server, client):
    for path, body, raw, status, says in BAD_REQUESTS:
        assert_rejected(server, path, body, raw, status, says, headers=AUTH)
    invalid = sum(1 for *_, status, _ in BAD_REQUESTS if status == 400)
    counted = metric(server, "pdserve_requests_total", api="http", outcome="invalid_request_error")
    assert counted >= invalid
    ok = client.completions.create(model=server.model, prompt="Hello", max_tokens=3)
    assert ok.usage.completion_tokens == 3
