"""Colocated serving end to end: the openai client against a real `pdserve serve`."""

from __future__ import annotations

import httpx
import openai
import pytest

from tests.e2e.conftest import (
    BAD_REQUESTS,
    CHAT,
    assert_greedy_matches_plain_vllm,
    assert_rejected,
    stop_and_check_nothing_left,
)

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", timeout=120)


def test_completion_returns_real_text(client, server):
    result = client.completions.create(
        model=server.model, prompt="The capital of France is", max_tokens=8, temperature=0
    )
    assert "Paris" in result.choices[0].text
    assert result.usage.prompt_tokens == 5 and result.usage.completion_tokens == 8
    assert result.choices[0].finish_reason == "length"


def test_completion_streams(client, server):
    stream = client.completions.create(
        model=server.model,
        prompt="The capital of France is",
        max_tokens=8,
        temperature=0,
        stream=True,
    )
    pieces = [chunk.choices[0].text for chunk in stream if chunk.choices]
    assert len(pieces) >= 2
    assert "Paris" in "".join(pieces)


def test_chat_returns_real_text(client, server):
    result = client.chat.completions.create(
        model=server.model, messages=CHAT, max_tokens=16, temperature=0
    )
    message = result.choices[0].message
    assert message.role == "assistant" and "Paris" in message.content
    assert result.choices[0].finish_reason == "stop"


def test_chat_streams_with_usage(client, server):
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
    assert "Paris" in text
    assert chunks[-1].usage.completion_tokens >= 2


def test_raw_stream_ends_with_done(server):
    body = {"prompt": "Hello", "max_tokens": 4, "stream": True}
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=60) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        events = [line for line in response.iter_lines() if line]
    assert events[-1] == "data: [DONE]"
    assert all(line.startswith("data: ") for line in events)


def test_greedy_output_equals_offline_vllm(client, server, default_model_dir, tmp_path):
    assert_greedy_matches_plain_vllm(client, server.model, default_model_dir, tmp_path)


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
