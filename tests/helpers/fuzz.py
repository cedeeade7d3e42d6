"""The fuzzing tier's engine: requests generated from the API's own schemas, sent to a live
router, and an account of what came back and of what the server held afterwards.

The schemas are vLLM's `CompletionRequest` and `ChatCompletionRequest` (the pydantic models the
router validates every body with); hypothesis-jsonschema draws bodies from their JSON schemas.
Each request is one of two kinds:
- **whole** (a tenth): a body drawn from the whole schema, with the served model's name most of
  the time — mostly refused, which is the point: every refusal must be a 4xx with a JSON error;
- **grafted** (the rest): a small valid request with one to three of the schema's properties
  added, each drawn from its own sub-schema — so odd values reach the engines, not only the
  validation.
Fields that only make a request long (`max_tokens`, `min_tokens`, `n`) are folded into small
ranges, and a request that leaves its length unset gets 16 tokens, so that thousands of requests
fit in minutes; the refusals of their extremes are in the
hostile list (`HOSTILE`), sent as they are.

What must hold (`Report.problems`): no 5xx (status or a streamed error event), every 4xx with a
JSON error, every request answered within the client's timeout, every pool healthy at every
look, no engine process replaced, and no KV block held by any node 2 s after the last answer.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import httpx

CLIENT_TIMEOUT_S = 120.0
DRAIN_S = 10.0
"""A request the engines still run this long after the last answer is one the router lost."""
FOLD = {"max_tokens": 16, "max_completion_tokens": 16, "min_tokens": 16, "n": 4}
"""Drawn integers above these are folded into 1..limit (their extremes are in HOSTILE)."""
CHAT = [{"role": "user", "content": "Say something."}]
PROMPTS = (
    "The sea is",
    "Complete this sentence with emojis: I love coding 🚀",
    "天空是什么颜色？请用中文回答。",
    "café, naïve, cafe\u0301 — and more:",
)
"""A grafted completion's prompt: plain, or one whose characters span several byte-level tokens
(the first token the prefill node samples may end halfway through one)."""

LONG_TEMPLATE = "{% for i in range(500) %}A {% endfor %}"
HOSTILE: list[tuple[str, str, object]] = [
    # (name, path, JSON body or raw bytes)
    (
        "client template",
        "/v1/chat/completions",
        {"messages": CHAT, "chat_template_kwargs": {"chat_template": LONG_TEMPLATE}},
    ),
    (
        "template tokenize",
        "/v1/chat/completions",
        {"messages": CHAT, "chat_template_kwargs": {"tokenize": True}},
    ),
    (
        "long request_id",
        "/v1/completions",
        {"prompt": "hi", "max_tokens": 4, "request_id": "r" * 600},
    ),
    ("n 2000", "/v1/completions", {"prompt": "hi", "max_tokens": 2, "n": 2000}),
    ("n 300", "/v1/completions", {"prompt": "hi", "max_tokens": 2, "n": 300}),
    (
        "n 200 logprobs 20",
        "/v1/completions",
        {"prompt": "hi", "max_tokens": 100, "n": 200, "logprobs": 20},
    ),
    (
        "max_completion_tokens 0",
        "/v1/chat/completions",
        {"messages": CHAT, "max_completion_tokens": 0},
    ),
    ("logprobs 21", "/v1/completions", {"prompt": "hi", "logprobs": 21}),
    (
        "nested schema",
        "/v1/chat/completions",
        b'{"messages": [{"role": "user", "content": "hi"}], "response_format": {"type": '
        b'"json_schema", "json_schema": {"name": "x", "schema": '
        + b"[" * 50_000
        + b"]" * 50_000
        + b"}}}",
    ),
    (
        "huge schema",
        "/v1/chat/completions",
        {
            "messages": CHAT,
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "x", "schema": {"enum": ["x" * (70 << 10)]}},
            },
        },
    ),
    ("nested body", "/v1/completions", b"[" * 100_000 + b"]" * 100_000),
    (
        "engine internals",
        "/v1/completions",
        {"prompt": "hi", "kv_transfer_params": {"do_remote_prefill": True, "remote_port": 1}},
    ),
    ("token id past the vocabulary", "/v1/completions", {"prompt": [10**9], "max_tokens": 2}),
    ("prompt past max_model_len", "/v1/completions", {"prompt": "hi " * 2100}),
]


@dataclass
class Answer:
    name: str
    status: int  # 0: no answer (timeout or connection error)
    seconds: float
    problem: str = ""  # empty when the answer is acceptable


@dataclass
class Report:
    answers: list[Answer] = field(default_factory=list)
    unhealthy: list[str] = field(default_factory=list)
    replaced_engines: list[str] = field(default_factory=list)
    blocks_held_after: int = 0
    requests_left: int = 0
    left_on: list[str] = field(default_factory=list)  # the nodes that still ran requests
    seconds: float = 0.0

    def problems(self) -> list[str]:
        found = [f"{a.name}: {a.problem}" for a in self.answers if a.problem]
        found += [f"unhealthy: {u}" for u in self.unhealthy[:10]]
        found += [f"engine replaced: {e}" for e in self.replaced_engines]
        if self.blocks_held_after:
            found.append(f"{self.blocks_held_after} KV blocks held 2 s after the last answer")
        if self.requests_left:
            found.append(
                f"{self.requests_left} requests still on the nodes {DRAIN_S:.0f} s after the "
                f"last answer: {'; '.join(self.left_on)}"
            )
        return found

    def summary(self) -> dict:
        statuses = Counter(a.status for a in self.answers)
        return {
            "requests": len(self.answers),
            "seconds": round(self.seconds, 1),
            "statuses": {str(k): v for k, v in sorted(statuses.items())},
            "5xx": sum(v for k, v in statuses.items() if k >= 500),
            "problems": len(self.problems()),
            "unhealthy_looks": len(self.unhealthy),
            "engines_replaced": len(self.replaced_engines),
            "blocks_held_2s_after": self.blocks_held_after,
            "requests_left_on_nodes": self.requests_left,
        }


def _schemas() -> dict[str, dict]:
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
    from vllm.entrypoints.openai.completion.protocol import CompletionRequest

    return {
        "/v1/completions": CompletionRequest.model_json_schema(),
        "/v1/chat/completions": ChatCompletionRequest.model_json_schema(),
    }


def _with_defs(sub: dict, defs: dict) -> dict:
    """A property's sub-schema with the definitions it refers to, and only those (the library
    checks every schema it builds against the metaschema: with all the request's definitions
    in each, that was most of a draw's time)."""
    needed: dict = {}
    todo = [sub]
    while todo:
        node = todo.pop()
        if isinstance(node, dict):
            ref = node.get("$ref")
            if isinstance(ref, str) and ref.startswith("#/$defs/"):
                name = ref.removeprefix("#/$defs/")
                if name not in needed:
                    needed[name] = defs[name]
                    todo.append(defs[name])
            todo.extend(node.values())
        elif isinstance(node, list):
            todo.extend(node)
    return {**sub, "$defs": needed} if needed else sub


def _strategies():
    """(path, mode, fields) with mode "whole" (a tenth: a body drawn from the whole schema) or
    "grafted" (one to three of the schema's own properties, each drawn from its sub-schema)."""
    from hypothesis import strategies as st
    from hypothesis_jsonschema import from_schema

    whole, grafted = [], []
    for path, schema in _schemas().items():
        fields = {
            name: from_schema(_with_defs(sub, schema.get("$defs", {})))
            for name, sub in schema["properties"].items()
            if name not in ("model", "prompt", "messages")
        }
        whole.append(from_schema(schema).map(lambda body, p=path: (p, "whole", body)))
        names = sorted(fields)
        grafted.append(
            st.lists(st.sampled_from(names), min_size=1, max_size=3, unique=True)
            .flatmap(lambda keys, f=fields: st.fixed_dictionaries({k: f[k] for k in keys}))
            .map(lambda body, p=path: (p, "grafted", body))
        )
    either = (st.one_of(*whole), st.one_of(*grafted))
    return st.integers(0, 9).flatmap(lambda i: either[0] if i == 0 else either[1])


def draw(count: int, seed: int) -> list[tuple[str, str, dict]]:
    """`count` (path, mode, fields) triples drawn from the request schemas, reproducibly: the
    same schemas, libraries, this file and seed give the same draw, so it is kept on disk under
    their hash (building the strategies and drawing take seconds)."""
    from importlib.metadata import version

    from pdserve_core.model_prep import cache_dir

    key = json.dumps(
        [_schemas(), version("hypothesis"), version("hypothesis-jsonschema"), count, seed],
        sort_keys=True,
    )
    digest = hashlib.sha256(key.encode() + Path(__file__).read_bytes()).hexdigest()[:24]
    kept = cache_dir() / "fuzz" / f"draw-{digest}.json"
    if kept.is_file():
        return [tuple(triple) for triple in json.loads(kept.read_text())]
    drawn = _draw(count, seed)
    kept.parent.mkdir(parents=True, exist_ok=True)
    partial = kept.with_suffix(f".{os.getpid()}.tmp")
    partial.write_text(json.dumps(drawn))
    partial.replace(kept)
    return drawn


def _draw(count: int, seed: int) -> list[tuple[str, str, dict]]:
    from hypothesis import HealthCheck, Phase, given, settings
    from hypothesis import seed as hypothesis_seed

    drawn: list[tuple[str, str, dict]] = []

    @hypothesis_seed(seed)
    @settings(
        max_examples=count,
        database=None,
        deadline=None,
        phases=[Phase.generate],
        suppress_health_check=list(HealthCheck),
    )
    @given(_strategies())
    def collect(triple):
        drawn.append(triple)

    collect()
    return drawn[:count]


def _fold(body: dict) -> dict:
    if not isinstance(body.get("max_completion_tokens"), int):
        if not isinstance(body.get("max_tokens"), int):  # unset: the rest of the context
            body["max_tokens"] = FOLD["max_tokens"]
    for name, limit in FOLD.items():
        value = body.get(name)
        if isinstance(value, int) and not isinstance(value, bool) and value > limit:
            body[name] = 1 + value % limit
    return body


def shape(path: str, mode: str, drawn: dict, model: str, rng: random.Random) -> dict:
    """The body actually sent (module docstring: whole or grafted)."""
    if mode == "whole":
        body = dict(drawn)
        if rng.random() < 0.9:
            body["model"] = model
        return _fold(body)
    base: dict = {"model": model, "max_tokens": 8, "stream": rng.random() < 0.5}
    base |= {"prompt": rng.choice(PROMPTS)} if path == "/v1/completions" else {"messages": CHAT}
    return _fold(base | drawn)


def _judge(response: httpx.Response, text: str) -> str:
    """What is wrong with one answer (empty: nothing)."""
    if response.status_code >= 500:
        return f"{response.status_code}: {text[:300]}"
    if response.status_code >= 400:
        try:
            error = json.loads(text)["error"]
            assert error["message"] and error["code"] == response.status_code
        except (ValueError, KeyError, TypeError, AssertionError):
            return f"{response.status_code} without a JSON error body: {text[:200]}"
        return ""
    if response.headers.get("content-type", "").startswith("text/event-stream"):
        lines = [x.removeprefix("data: ") for x in text.splitlines() if x.startswith("data: ")]
        if not lines or lines[-1] != "[DONE]":
            return f"stream ended without [DONE]: {text[-200:]}"
        for line in lines[:-1]:
            error = json.loads(line).get("error")
            if error and int(error.get("code") or 500) >= 500:
                return f"error event {error}"
    return ""


def send(url: str, headers: dict, name: str, path: str, body: object) -> Answer:
    started = time.monotonic()
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    try:
        with httpx.stream(
            "POST",
            f"{url}{path}",
            content=raw,
            headers={**headers, "content-type": "application/json"},
            timeout=CLIENT_TIMEOUT_S,
        ) as response:
            text = response.read().decode(errors="replace")
    except httpx.HTTPError as error:  # what was sent and when, to replay it
        took = time.monotonic() - started
        problem = f"no answer after {took:.1f} s: {error!r} — sent {raw[:400]!r}"
        return Answer(name, 0, took, problem)
    problem = _judge(response, text)
    if problem:  # what was sent, to replay it
        problem += f" — sent {raw[:400]!r}"
    return Answer(name, response.status_code, time.monotonic() - started, problem)


def health(url: str, headers: dict) -> dict:
    return httpx.get(f"{url}/health", headers=headers, timeout=10).json()


def engine_processes(url: str, headers: dict) -> dict[str, tuple[int, ...]]:
    """Node name -> its actor's pid and its EngineCore's pids (on this machine)."""
    import psutil

    found = {}
    for pool in health(url, headers)["pools"].values():
        for node in pool["nodes"]:
            if not node.get("pid"):  # not started, or not a process (fake nodes)
                found[node["name"]] = ()
                continue
            try:
                actor = psutil.Process(node["pid"])
                cores = [
                    p.pid
                    for p in actor.children(recursive=True)
                    if "EngineCore" in " ".join(p.cmdline())
                ]
            except (psutil.Error, TypeError):
                cores = []
            found[node["name"]] = (node["pid"], *sorted(cores))
    return found


def _watch(url: str, headers: dict, report: Report, stop: threading.Event) -> None:
    while not stop.wait(0.5):
        try:
            body = health(url, headers)
        except (httpx.HTTPError, ValueError) as error:
            report.unhealthy.append(f"/health did not answer: {error!r}")
            continue
        for name, pool in body.get("pools", {}).items():
            if pool["healthy"] != len(pool["nodes"]):
                report.unhealthy.append(f"{name}: {pool['healthy']}/{len(pool['nodes'])}")


def _held(url: str, headers: dict) -> tuple[int, dict[str, dict]]:
    """(KV blocks held over every node, the nodes running or queueing requests — name: their
    /health view), as /health reports them."""
    blocks, busy = 0, {}
    for pool in health(url, headers)["pools"].values():
        for node in pool["nodes"]:
            blocks += node.get("kv_blocks_held") or 0
            if node.get("running") or node.get("waiting"):
                busy[node["name"]] = node
    return blocks, busy


def _requests_left(url: str, headers: dict, busy: dict, since: float) -> dict[str, dict]:
    """The nodes still running requests `DRAIN_S` after `since`, polled each second: node
    stats reach the router once a second, so a request that ended a moment ago may still
    show."""
    while busy and time.monotonic() < since + DRAIN_S:
        time.sleep(1.0)
        busy = _held(url, headers)[1]
    return busy


def bodies(model: str, count: int, seed: int) -> list[tuple[str, dict]]:
    """`count` drawn requests as sent, (path, body): the same for the same seed."""
    rng = random.Random(seed)
    return [
        (path, shape(path, mode, fields, model, rng)) for path, mode, fields in draw(count, seed)
    ]


def outcome(url: str, path: str, body: dict) -> int:
    """The status a client sees: the HTTP status, or the code of the error event a stream that
    began with 200 carries (0: no answer)."""
    try:
        with httpx.stream(
            "POST",
            f"{url}{path}",
            content=json.dumps(body).encode(),
            headers={"content-type": "application/json"},
            timeout=CLIENT_TIMEOUT_S,
        ) as response:
            text = response.read().decode(errors="replace")
    except httpx.HTTPError:
        return 0
    if response.headers.get("content-type", "").startswith("text/event-stream"):
        for line in text.splitlines():
            if line.startswith("data: {") and (error := json.loads(line[6:]).get("error")):
                return int(error.get("code") or 500)
    return response.status_code


def statuses(url: str, work: list[tuple[str, dict]], concurrency: int = 4) -> list[int]:
    """The `outcome` of each of `work`'s requests, in order."""
    with ThreadPoolExecutor(concurrency) as pool:
        return list(pool.map(lambda job: outcome(url, *job), work))


def run(
    url: str,
    headers: dict,
    model: str,
    count: int,
    seed: int = 0,
    concurrency: int = 8,
    hostile: bool = True,
) -> Report:
    """Send `count` drawn requests (and the hostile list) with `concurrency` clients; watch the
    pools meanwhile; then look at what the nodes hold."""
    rng = random.Random(seed)
    work = [
        (f"drawn {i} ({mode})", path, shape(path, mode, fields, model, rng))
        for i, (path, mode, fields) in enumerate(draw(count, seed))
    ]
    if hostile:
        work += [(f"hostile {name}", path, body) for name, path, body in HOSTILE]
    rng.shuffle(work)
    report = Report()
    before = engine_processes(url, headers)
    stop = threading.Event()
    watcher = threading.Thread(target=_watch, args=(url, headers, report, stop), daemon=True)
    started = time.monotonic()
    watcher.start()
    try:
        with ThreadPoolExecutor(concurrency) as pool:
            report.answers = list(pool.map(lambda job: send(url, headers, *job), work))
    finally:
        stop.set()
        watcher.join()
    report.seconds = time.monotonic() - started
    last = time.monotonic()
    time.sleep(2.0)  # the target: no KV block held 2 s after the last answer
    report.blocks_held_after, busy = _held(url, headers)
    left = _requests_left(url, headers, busy, last)
    report.requests_left = sum(node["running"] + node["waiting"] for node in left.values())
    report.left_on = [
        f"{name} running {node['running']}, waiting {node['waiting']} (requests started "
        f"{node['requests_total']}; the router has {node['outstanding']} outstanding there)"
        for name, node in left.items()
    ]
    after = engine_processes(url, headers)
    report.replaced_engines = [
        f"{name}: {before[name]} -> {after.get(name)}"
        for name in before
        if after.get(name) != before[name]
    ]
    return report
