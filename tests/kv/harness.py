"""Real engines for the KV transfer tests: Ray actors hosting vLLM with pdserve's connector.

`disaggregated()` does what the router does: prefill on the producer with max_tokens=1, then
decode on the consumer with the prompt plus the producer's token and the producer's handle.
"""

from __future__ import annotations

import asyncio
import os
import time
from dataclasses import dataclass, field
from typing import Any

import ray

from pdserve.config import EngineConfig, PoolConfig
from pdserve.engine import TokenDelta, create_engine_actor
from pdserve.kv import vllm_kv_transfer_config
from pdserve.kv.handle import producer_params

SECRET = "test-cluster-secret"
START_TIMEOUT_S = 400


@dataclass
class Engines:
    actors: dict[str, Any]
    infos: dict[str, dict] = field(default_factory=dict)

    def __getitem__(self, name: str):
        return self.actors[name]

    def stop(self) -> None:
        for actor in self.actors.values():
            try:
                ray.get(actor.shutdown.remote(), timeout=30)
            except Exception:
                pass
            ray.kill(actor, no_restart=True)


def start_engines(
    model: str, roles: dict[str, dict | None], dtype: str = "bfloat16", kv_cache_gib: int = 1
) -> Engines:
    """Start one engine per entry ({name: KV transfer config or None for a plain engine})."""
    engine = EngineConfig(dtype=dtype, kv_cache_space_gib=kv_cache_gib, omp_threads=1)
    pool = PoolConfig(num_cpus=1)
    actors = {
        name: create_engine_actor(
            f"kvtest-{name}-{os.getpid()}", model, "model", engine, pool, i, kv_transfer=kv
        )
        for i, (name, kv) in enumerate(roles.items())
    }
    engines = Engines(actors)
    names = list(actors)
    infos = ray.get([actors[n].start.remote() for n in names], timeout=START_TIMEOUT_S)
    engines.infos = dict(zip(names, infos, strict=True))
    return engines


def producer(**extra: Any) -> dict:
    return vllm_kv_transfer_config("kv_producer", SECRET, **extra)


def consumer(policy: str = "recompute", **extra: Any) -> dict:
    return vllm_kv_transfer_config("kv_consumer", SECRET, failure_policy=policy, **extra)


def greedy(max_tokens: int, kv_params: dict | None = None):
    from vllm import SamplingParams

    extra = {"kv_transfer_params": kv_params} if kv_params else None
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, extra_args=extra)


async def generate(actor, token_ids: list[int], params, request_id: str) -> list[TokenDelta]:
    stream = actor.generate.options(num_returns="streaming").remote(request_id, token_ids, params)
    return [await ref async for ref in stream]


def tokens(deltas: list[TokenDelta]) -> list[int]:
    return [t for d in deltas for t in d.token_ids]


_ids = iter(range(10**9))


def rid(tag: str) -> str:
    return f"{tag}-{next(_ids)}"


@dataclass
class PDResult:
    tokens: list[int]
    handle: dict
    decode_deltas: list[TokenDelta]
    seconds: float


async def disaggregated(p, d, prompt: list[int], max_tokens: int, mutate=None) -> PDResult:
    """Prefill on `p`, decode on `d`; `mutate(handle)` may corrupt (a copy of) the handle."""
    started = time.monotonic()
    first = await generate(p, prompt, greedy(1, producer_params()), rid("prefill"))
    handle = first[-1].kv_transfer_params
    assert handle and handle.get("do_remote_prefill"), f"producer returned no handle: {first[-1]}"
    if mutate:
        handle = dict(handle)
        mutate(handle)
    first_token = tokens(first)
    rest = await generate(d, prompt + first_token, greedy(max_tokens - 1, handle), rid("decode"))
    return PDResult(first_token + tokens(rest), handle, rest, time.monotonic() - started)


async def reference(ref, prompt: list[int], max_tokens: int) -> list[int]:
    return tokens(await generate(ref, prompt, greedy(max_tokens), rid("ref")))


async def wait_for(predicate, timeout: float, what: str):
    """Poll an async predicate until it returns a truthy value or the deadline passes."""
    deadline = time.monotonic() + timeout
    while True:
        value = await predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        await asyncio.sleep(0.2)
