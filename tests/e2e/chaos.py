"""A chaos run against a live router: steady streamed traffic, engine processes killed at random
(a node's whole actor, or only its EngineCore under a living actor), hostile requests mixed in;
then an account of every request and of every kill.

Requests (seeded, so a run can be repeated): greedy streams with 20–120 output tokens and
prompts of 10–600 tokens, a fifth of them with a stop string (sampling state: a stream cut
mid-way cannot continue and must end with an explicit error); a tenth hostile (engine-internal
fields, an oversized body, deeply nested JSON, a client that vanishes mid-stream, one that sends
its body slowly). Every request must end on its own: completed, or an explicit error (a 4xx/5xx
JSON body, or an SSE error event then [DONE]); none may hang past the client's timeout.
"""

from __future__ import annotations

import json
import random
import signal
import socket
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from urllib.parse import urlparse

import httpx
import psutil

CLIENT_TIMEOUT_S = 240.0


@dataclass
class Outcome:
    kind: str  # stream | stateful | hostile-* | vanish
    result: str  # completed | error-http-<code> | error-event | vanished | hung | broken
    seconds: float
    detail: str = ""


@dataclass
class Kill:
    at: float
    pool: str
    node: str
    target: str  # actor | engine
    seen_down: bool = False
    recovered_s: float | None = None


@dataclass
class Account:
    outcomes: list[Outcome] = field(default_factory=list)
    kills: list[Kill] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, outcome: Outcome) -> None:
        with self.lock:
            self.outcomes.append(outcome)

    def summary(self) -> dict:
        by = Counter((o.kind, o.result) for o in self.outcomes)
        recovered = sorted(k.recovered_s for k in self.kills if k.recovered_s is not None)
        return {
            "requests": len(self.outcomes),
            "outcomes": {f"{kind}: {result}": n for (kind, result), n in sorted(by.items())},
            "kills": len(self.kills),
            "kills_by_target": dict(Counter(f"{k.pool} {k.target}" for k in self.kills)),
            "time_to_healthy_s": {
                "p50": recovered[len(recovered) // 2] if recovered else None,
                "max": recovered[-1] if recovered else None,
            },
        }


def health(url: str, headers: dict) -> dict:
    return httpx.get(f"{url}/health", headers=headers, timeout=10).json()


def _stream(url: str, headers: dict, body: dict, kind: str, account: Account) -> None:
    started = time.monotonic()
    try:
        with httpx.stream(
            "POST", f"{url}/v1/completions", json=body, headers=headers, timeout=CLIENT_TIMEOUT_S
        ) as response:
            if response.status_code != 200:
                response.read()
                result = f"error-http-{response.status_code}"
                account.add(Outcome(kind, result, time.monotonic() - started, response.text[:200]))
                return
            events = [line[6:] for line in response.iter_lines() if line.startswith("data: ")]
    except httpx.TimeoutException:
        account.add(Outcome(kind, "hung", time.monotonic() - started))
        return
    seconds = time.monotonic() - started
    if not events or events[-1] != "[DONE]":
        account.add(Outcome(kind, "broken", seconds, str(events[-2:])))
        return
    chunks = [json.loads(e) for e in events[:-1]]
    errors = [c["error"]["message"] for c in chunks if "error" in c]
    if errors:
        account.add(Outcome(kind, "error-event", seconds, errors[0][:200]))
        return
    tokens = sum(1 for c in chunks for ch in c.get("choices", ()) if ch.get("text") is not None)
    finished = [ch["finish_reason"] for c in chunks for ch in c.get("choices", ())]
    result = "completed" if tokens and any(finished) else "broken"
    account.add(Outcome(kind, result, seconds))


def _hostile(url: str, headers: dict, rng: random.Random, account: Account) -> None:
    started = time.monotonic()
    which = rng.choice(["internal", "huge", "nested", "vanish", "slow"])
    kind = f"hostile-{which}"
    try:
        if which == "vanish":
            body = {"prompt": "Tell me a long story.", "max_tokens": 200, "stream": True}
            with httpx.stream(
                "POST", f"{url}/v1/completions", json=body, headers=headers, timeout=60
            ) as response:
                for i, _ in enumerate(response.iter_lines()):
                    if i >= 3:
                        break  # and go away
            account.add(Outcome(kind, "vanished", time.monotonic() - started))
            return
        if which == "slow":
            account.add(Outcome(kind, _slow_client(url, headers), time.monotonic() - started))
            return
        content = {
            "internal": b'{"prompt": "hi", "kv_transfer_params": {"do_remote_prefill": true,'
            b' "remote_num_tokens": 1e400, "remote_host": "10.0.0.1"}}',
            "huge": b'{"prompt": "' + b"a" * (6 << 20) + b'"}',
            "nested": b"[" * 20_000 + b"]" * 20_000,
        }[which]
        response = httpx.post(
            f"{url}/v1/completions",
            content=content,
            headers={**headers, "content-type": "application/json"},
            timeout=60,
        )
        result = f"error-http-{response.status_code}"
        account.add(Outcome(kind, result, time.monotonic() - started, response.text[:120]))
    except httpx.TimeoutException:
        account.add(Outcome(kind, "hung", time.monotonic() - started))


def _slow_client(url: str, headers: dict) -> str:
    """Send a request's body a few bytes a second, then read the answer."""
    target = urlparse(url)
    body = b'{"prompt": "hi", "max_tokens": 3}'
    head = (
        f"POST /v1/completions HTTP/1.1\r\nHost: {target.hostname}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n"
        + "".join(f"{k}: {v}\r\n" for k, v in headers.items())
        + "Connection: close\r\n\r\n"
    ).encode()
    with socket.create_connection((target.hostname, target.port), timeout=60) as conn:
        conn.sendall(head)
        for i in range(0, len(body), 4):
            conn.sendall(body[i : i + 4])
            time.sleep(0.2)
        answer = b""
        while chunk := conn.recv(65536):
            answer += chunk
    status = answer.split(b" ", 2)[1].decode() if answer.startswith(b"HTTP/") else "none"
    return "completed" if status == "200" else f"error-http-{status}"


def client(url, headers, prompts, seed: int, stop: threading.Event, account: Account) -> None:
    rng = random.Random(seed)
    while not stop.is_set():
        roll = rng.random()
        if roll < 0.1:
            _hostile(url, headers, rng, account)
            continue
        start = rng.randrange(0, len(prompts) - 700)
        body = {
            "prompt": prompts[start : start + rng.randint(10, 600)],
            "max_tokens": rng.randint(20, 120),
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
        }
        kind = "stream"
        if roll < 0.3:
            body["stop"] = ["<<no such text>>"]
            kind = "stateful"
        _stream(url, headers, body, kind, account)
        if account.outcomes[-1].result.startswith("error-http-5"):
            stop.wait(1.0)  # as a client honouring Retry-After would, rather than spinning


def killer(url, headers, every_s: float, seed: int, stop: threading.Event, account: Account):
    """Kill a random node's actor or EngineCore every `every_s` seconds."""
    rng = random.Random(seed)
    while not stop.wait(every_s):
        pools = health(url, headers)["pools"]
        alive = [(pool, n) for pool, view in pools.items() for n in view["nodes"] if n["healthy"]]
        if not alive:
            continue
        pool, node = rng.choice(alive)
        try:
            actor = psutil.Process(node["pid"])
            if rng.random() < 0.5:
                actor.send_signal(signal.SIGKILL)
                target = "actor"
            else:
                cores = [
                    p
                    for p in actor.children(recursive=True)
                    if "EngineCore" in " ".join(p.cmdline())
                ]
                cores[0].send_signal(signal.SIGKILL)
                target = "engine"
        except (psutil.Error, IndexError):
            continue
        with account.lock:
            account.kills.append(Kill(time.monotonic(), pool, node["name"], target))


def watch_recovery(url, headers, stop: threading.Event, account: Account) -> None:
    """Note when each killed node is back: out of its pool after the kill, then healthy."""
    while not stop.wait(0.5):
        try:
            pools = health(url, headers)["pools"]
        except httpx.HTTPError:
            continue
        healthy = {n["name"] for view in pools.values() for n in view["nodes"] if n["healthy"]}
        now = time.monotonic()
        with account.lock:
            for kill in account.kills:
                if kill.recovered_s is not None:
                    continue
                if kill.node not in healthy:
                    kill.seen_down = True
                elif kill.seen_down:
                    kill.recovered_s = round(now - kill.at, 1)
