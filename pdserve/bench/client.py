"""Sends a workload to an OpenAI-compatible `/v1/completions` endpoint and times every token.

Each request is streamed (server-sent events) with `ignore_eos` and `stream_options.include_usage`
so the output length is the one asked for and the last event reports the tokens generated. Open
loop for timed arrivals (a request is sent at its time whatever is still running), closed loop
for a fixed concurrency. A run stops sending at `duration_s` and waits for what is in flight.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable, Sequence
from typing import Any

import httpx

from pdserve.bench.stats import RequestRecord
from pdserve.bench.workload import RequestSpec

DONE = "[DONE]"


def parse_sse_line(line: str) -> dict | str | None:
    """One line of an SSE stream: the JSON payload of a `data:` line, "[DONE]", or None for
    blank lines, comments and other fields. A payload that is not JSON raises ValueError."""
    line = line.strip()
    if not line.startswith("data:"):
        return None
    data = line[len("data:") :].strip()
    if data == DONE:
        return DONE
    try:
        return json.loads(data)
    except json.JSONDecodeError as error:
        raise ValueError(f"malformed SSE data: {data[:200]!r}") from error


def apply_event(record: RequestRecord, event: dict, now_s: float) -> None:
    """Fold one streamed event into the request's record."""
    if "error" in event:
        error = event["error"]
        record.error = f"{error.get('type', 'error')}: {error.get('message', '')}"
        return
    if event.get("usage"):
        record.output_tokens = event["usage"].get("completion_tokens", record.output_tokens)
    if event.get("choices"):
        record.token_times_s.append(now_s)
        record.token_counts.append(1)
        if not event.get("usage"):
            record.output_tokens = max(record.output_tokens, len(record.token_times_s))


async def send(
    http: httpx.AsyncClient,
    spec: RequestSpec,
    model: str,
    start: float,
    timeout_s: float,
    extra_body: dict | None = None,
) -> RequestRecord:
    sent = time.monotonic() - start
    record = RequestRecord(spec.index, spec.kind, len(spec.prompt_token_ids), sent)
    body = {
        "model": model,
        "prompt": spec.prompt_token_ids,
        "max_tokens": spec.max_tokens,
        "ignore_eos": True,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
        **(extra_body or {}),
    }
    await stream_into(http, body, record, start, timeout_s)
    return record


async def stream_into(
    http: httpx.AsyncClient,
    body: dict,
    record: RequestRecord,
    start: float,
    timeout_s: float,
    on_event: Callable[[dict], None] | None = None,
) -> None:
    """POST a streamed completion and fold its events into `record` (an error, if any, goes
    there too); `on_event` sees each event as well."""
    try:
        async with asyncio.timeout(timeout_s):
            async with http.stream("POST", "/v1/completions", json=body) as response:
                if response.status_code != 200:
                    text = (await response.aread()).decode(errors="replace")
                    record.error = f"HTTP {response.status_code}: {text[:200]}"
                    return
                async for line in response.aiter_lines():
                    event = parse_sse_line(line)
                    if event == DONE:
                        break
                    if isinstance(event, dict):
                        apply_event(record, event, time.monotonic() - start)
                        if on_event is not None:
                            on_event(event)
        if record.error is None:
            record.end_s = time.monotonic() - start
    except TimeoutError:
        record.error = f"timeout after {timeout_s:.0f} s"
    except (httpx.HTTPError, ValueError) as error:
        record.error = f"{type(error).__name__}: {error}"


async def run_load(
    url: str,
    requests: Sequence[RequestSpec],
    model: str,
    concurrency: int | None = None,
    duration_s: float | None = None,
    api_key: str | None = None,
    timeout_s: float = 600.0,
    extra_body: dict | None = None,
) -> tuple[list[RequestRecord], float]:
    """Send `requests` (timed ones at their `at_s`; untimed ones `concurrency` at a time) until
    they are all sent or `duration_s` passed; returns the records and the run's length.
    `extra_body`: more fields for every request."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
    async with httpx.AsyncClient(
        base_url=url, headers=headers, timeout=timeout_s, limits=limits
    ) as http:
        start = time.monotonic()
        deadline = start + duration_s if duration_s else None

        def open_for_sending() -> bool:
            return deadline is None or time.monotonic() < deadline

        if concurrency:
            queue: asyncio.Queue[RequestSpec] = asyncio.Queue()
            for spec in requests:
                queue.put_nowait(spec)
            records: list[RequestRecord] = []

            async def worker() -> None:
                while open_for_sending() and not queue.empty():
                    spec = queue.get_nowait()
                    records.append(await send(http, spec, model, start, timeout_s, extra_body))

            await asyncio.gather(*(worker() for _ in range(concurrency)))
        else:

            async def timed(spec: RequestSpec) -> RequestRecord | None:
                await asyncio.sleep(max(0.0, start + (spec.at_s or 0.0) - time.monotonic()))
                if not open_for_sending():
                    return None
                return await send(http, spec, model, start, timeout_s, extra_body)

            results = await asyncio.gather(*(timed(spec) for spec in requests))
            records = [r for r in results if r is not None]
        return sorted(records, key=lambda r: r.sent_s), time.monotonic() - start


async def served_model(url: str, api_key: str | None = None) -> str:
    """The first model the endpoint lists (what requests name)."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    async with httpx.AsyncClient(base_url=url, headers=headers, timeout=30) as http:
        response = await http.get("/v1/models")
        response.raise_for_status()
        data: Any = response.json()
        return data["data"][0]["id"]
