"""Colocated serving end to end: the openai client against a real `pdserve serve`."""

from __future__ import annotations

import json
import os
import signal
import threading
import time

import httpx
import openai
import pytest

from pdserve_core.engine.dtype import native_dtype
from tests.e2e.conftest import (
    BAD_REQUESTS,
    CHAT,
    assert_greedy_matches_plain_vllm,
    assert_rejected,
    metric,
    metric_reaching,
    samples,
    stop_and_check_nothing_left,
)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", timeout=120)


def test_completion_returns_text_and_streams_the_same(client, server):
    """What the model says depends on the CPU's bf16 kernels; that a stream spells the same
    greedy text as the whole response, with honest usage, does not."""
    result = client.completions.create(
        model=server.model, prompt="The capital of France is", max_tokens=8, temperature=0
    )
    assert result.choices[0].text.strip()
    assert result.usage.prompt_tokens == 5 and result.usage.completion_tokens == 8
    assert result.choices[0].finish_reason == "length"
    stream = client.completions.create(
        model=server.model,
        prompt="The capital of France is",
        max_tokens=8,
        temperature=0,
        stream=True,
    )
    pieces = [chunk.choices[0].text for chunk in stream if chunk.choices]
    assert len(pieces) >= 2
    assert "".join(pieces) == result.choices[0].text


def test_chat_returns_text_and_streams_the_same_with_usage(client, server):
    result = client.chat.completions.create(
        model=server.model, messages=CHAT, max_tokens=16, temperature=0
    )
    message = result.choices[0].message
    assert message.role == "assistant" and message.content.strip()
    assert result.choices[0].finish_reason in ("stop", "length")
    stream = client.chat.completions.create(
        model=server.model,
        messages=CHAT,
        max_tokens=16,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == message.content
    assert chunks[-1].usage.completion_tokens == result.usage.completion_tokens


def test_raw_stream_ends_with_done(server):
    body = {"prompt": "Hello", "max_tokens": 4, "stream": True}
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=60) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        events = [line for line in response.iter_lines() if line]
    assert events[-1] == "data: [DONE]"
    assert all(line.startswith("data: ") for line in events)


def test_greedy_output_equals_offline_vllm(client, server, default_model_dir, tmp_path):
    """One engine against one engine, each prompt alone: the same computation on this host."""
    dtype = native_dtype(gpu=False)  # the default config's engine on this host
    assert_greedy_matches_plain_vllm(client, server.model, default_model_dir, tmp_path, dtype)


@pytest.mark.parametrize(("path", "body", "raw", "status", "says"), BAD_REQUESTS)
def test_bad_requests_get_clear_4xx(server, path, body, raw, status, says):
    assert_rejected(server, path, body, raw, status, says)


def test_health_and_models(server):
    assert httpx.get(f"{server.url}/health", timeout=10).json()["status"] == "ok"
    models = httpx.get(f"{server.url}/v1/models", timeout=10).json()
    assert models["data"][0]["id"] == "SmolLM2-135M-Instruct"
    assert models["data"][0]["max_model_len"] == 2048


def _running(server) -> int:
    """Requests the engine runs, as its last health check said (router 0's view)."""
    health = httpx.get(f"{server.url}/health", timeout=10).json()
    return health["pools"]["colocated"]["nodes"][0]["running"]


def _poll(what, deadline_s: float) -> bool:
    deadline = time.monotonic() + deadline_s
    while time.monotonic() < deadline:
        if what():
            return True
        time.sleep(0.1)
    return False


def test_the_log_tells_requests_not_engine_steps(client, server):
    """The engine's per-step records feed the metrics, not the log: 128 engine steps add a
    handful of lines at most (vLLM's logging stat logger wrote one per step, through Ray's log
    pipeline on the serving cores). The engine's lines reach the server's log through Ray's log
    monitor, so the check polls for them."""

    def lines() -> int:
        return server.log.read_text(errors="replace").count("\n")

    before = lines()
    for _ in range(4):
        client.completions.create(
            model=server.model,
            prompt="Count: one, two,",
            max_tokens=32,
            temperature=0,
            extra_body={"ignore_eos": True},
        )
    assert not _poll(lambda: lines() - before >= 16, deadline_s=5), (
        f"{lines() - before} log lines for 128 engine steps:\n"
        + "\n".join(server.log.read_text(errors="replace").splitlines()[before:][:10])
    )


def test_an_engine_that_stops_is_counted_and_told_as_a_stall(server):
    """The engine's core, its model worker within (`engine.cpu_worker_process` false), stopped
    (SIGSTOP) for 1.2 s mid-stream, as a stalled host or a blocked step would stop it: the stream
    still ends whole, and the node's stall counter and the server's log say that every stream on
    it stopped, and for how long."""
    import psutil

    health = httpx.get(f"{server.url}/health", timeout=10).json()
    actor = psutil.Process(health["pools"]["colocated"]["nodes"][0]["pid"])
    children = actor.children(recursive=True)
    assert not [p for p in children if "VLLM::Worker" in p.name()]  # the worker is in the core
    worker = next(p for p in children if "EngineCore" in " ".join(p.cmdline()))
    before = metric(server, "pdserve_node_engine_stalls_total")
    body = {"model": server.model, "prompt": "Tell me a story", "max_tokens": 96}
    body |= {"ignore_eos": True, "stream": True, "return_token_ids": True}
    got, ended = [0], [None]

    def stream() -> None:
        with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=120) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    choice = json.loads(line.removeprefix("data: "))["choices"][0]
                    got[0] += len(choice["token_ids"] or ())
                    ended[0] = choice["finish_reason"] or ended[0]

    thread = threading.Thread(target=stream)
    thread.start()
    assert _poll(lambda: got[0] >= 8, 60), got
    worker.suspend()
    try:
        time.sleep(1.2)  # the fault's length: nothing to wait for
    finally:
        worker.resume()
    thread.join(timeout=120)
    assert got[0] == body["max_tokens"] and ended[0] == "length"
    assert metric_reaching(server, "pdserve_node_engine_stalls_total", before + 1) >= before + 1
    assert metric(server, "pdserve_node_engine_stall_seconds_total") >= 1.0
    assert _poll(lambda: "every stream stopped" in server.log.read_text(errors="replace"), 10)


def test_each_router_serves_the_one_node(server):
    """Both routers answer alike from the one engine; router 0 alone exports the node series,
    every router its own request series."""
    assert [r["http"] for r in server.routers][0] == server.url and len(server.routers) == 2
    body = {"model": server.model, "prompt": "The capital of France is", "max_tokens": 12}
    texts = [
        httpx.post(
            f"{r['http']}/v1/completions", json={**body, "temperature": 0}, timeout=60
        ).json()["choices"][0]["text"]
        for r in server.routers
    ]
    assert texts[0] == texts[1] and texts[0]
    first, second = (httpx.get(f"{r['http']}/metrics", timeout=10).text for r in server.routers)
    samples = [[line.split("{")[0] for line in text.splitlines()] for text in (first, second)]
    assert "pdserve_node_requests_running" in samples[0]
    assert not [name for name in samples[1] if name.startswith("pdserve_node_")]
    assert 'pdserve_requests_total{api="http",outcome="success"} 1.0' in second


def _known(router: dict) -> int:
    health = httpx.get(f"{router['http']}/health", timeout=10).json()
    return health["pools"]["colocated"]["nodes"][0]["prefix_blocks_known"]


def _expected_cached(server, router: int) -> float:
    name = "pdserve_prefix_expected_cached_tokens_total"
    found = samples(server, router)
    return next(s.value for s in found if s.name == name and s.labels == {"pool": "colocated"})


def test_a_router_learns_what_another_router_left_on_a_node(server):
    """Router 0 runs a prompt; router 1, which never saw it, reads the blocks it left from the
    node's log with its health checks and expects them cached on the next turn it routes."""
    first, second = server.routers
    history = "Here is a long story about a lighthouse keeper and the sea. " * 12
    before = _known(second)
    body = {"model": server.model, "prompt": history, "max_tokens": 4, "temperature": 0}
    done = httpx.post(f"{first['http']}/v1/completions", json=body, timeout=60).json()
    assert done["usage"]["prompt_tokens"] >= 128
    assert _poll(lambda: _known(second) > before, 5), "router 1 never read the node's log"
    expected = _expected_cached(server, 1)
    turn = {**body, "prompt": history + done["choices"][0]["text"] + " And then?"}
    assert httpx.post(f"{second['http']}/v1/completions", json=turn, timeout=60).status_code == 200
    # the first turn's full blocks (most of its prompt, whatever the engine's block size)
    assert _expected_cached(server, 1) - expected >= done["usage"]["prompt_tokens"] / 2


def test_a_dead_router_costs_only_its_own_streams(server):
    """Kill router 1 mid-stream: router 0's stream runs to its end, the node stops router 1's
    request within 5 s (its blocks free), and the keeper starts router 1 again on its port."""
    body = {"model": server.model, "prompt": "Tell me a story", "max_tokens": 160}
    body |= {"ignore_eos": True, "stream": True, "return_token_ids": True}
    counts, ends = [0, 0], [None, None]  # tokens each stream got (an event may carry several)

    def stream(i: int) -> None:
        try:
            url = f"{server.routers[i]['http']}/v1/completions"
            with httpx.stream("POST", url, json=body, timeout=120) as response:
                for line in response.iter_lines():
                    if line.startswith("data: {"):
                        chunk = json.loads(line.removeprefix("data: "))
                        counts[i] += len(chunk["choices"][0]["token_ids"] or ())
                        ends[i] = chunk["choices"][0]["finish_reason"] or ends[i]
        except httpx.HTTPError as error:
            ends[i] = error

    streams = [threading.Thread(target=stream, args=(i,)) for i in (0, 1)]
    for thread in streams:
        thread.start()
    assert _poll(lambda: min(counts) >= 5 and _running(server) == 2, 60), (counts, ends)
    os.kill(server.routers[1]["pid"], signal.SIGKILL)
    killed = time.monotonic()
    assert _poll(lambda: _running(server) == 1, 5), "the node still runs the dead router's request"
    assert time.monotonic() - killed < 5 and counts[0] < body["max_tokens"]  # router 0's still runs
    for thread in streams:
        thread.join(timeout=120)
    assert counts[0] == body["max_tokens"] and ends[0] == "length"
    assert isinstance(ends[1], httpx.HTTPError) and counts[1] < body["max_tokens"]
    assert _poll(lambda: _running(server) == 0, 5)

    again = server.routers[1]["http"]

    def serves() -> bool:
        try:
            return httpx.get(f"{again}/health", timeout=5).status_code == 200
        except httpx.HTTPError:
            return False

    assert _poll(serves, 120), server.log.read_text()[-3000:]
    short = {"model": server.model, "prompt": "Hi", "max_tokens": 4}
    assert httpx.post(f"{again}/v1/completions", json=short, timeout=60).status_code == 200
    log = server.log.read_text()
    assert f"router 1 (pid {server.routers[1]['pid']}) exited (signal SIGKILL)" in log
    assert "router 1 serves again on port" in log


def test_sigterm_stops_everything_it_started(server):
    """Last in this module: stop the shared server and find no Ray or vLLM process left."""
    leftovers = stop_and_check_nothing_left(server.process)
    assert server.process.returncode == 0, server.log.read_text()[-3000:]
    assert leftovers == []
    log = server.log.read_text()
    assert "pdserve ready" in log and "pdserve stopped" in log
    # `--layout auto` chose this layout by simulation and said why, with both candidates' figures
    assert "layout: colocated (2 threads), simulated with this host's calibrations" in log
    assert "partitioned 1+1: " in log and "colocated engine" in log
