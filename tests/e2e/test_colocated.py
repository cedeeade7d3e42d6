"""Colocated serving end to end: the openai client against a real `pdserve serve`."""

from __future__ import annotations

import httpx
import openai
import pytest

from pdserve_core.engine.dtype import native_dtype
from tests.e2e.conftest import (
    BAD_REQUESTS,
    CHAT,
    assert_greedy_matches_plain_vllm,
    assert_rejected,
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
