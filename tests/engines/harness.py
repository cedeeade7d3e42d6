"""Real engines for the KV transfer tests: the node actors pdserve serves with, in Ray.

`start_engines` places prefill nodes (`PrefillNode`, connector as producer), decode nodes
(`DecodeNode`, consumer) and plain engines (`EngineActor`, the one-engine reference).
`disaggregated()` does what the router does: `prefill` on a prefill node, then `decode` on a
decode node with the prompt, the first token and the handle. Engines run in float32 unless a
test says otherwise: exact comparisons hold on any CPU only in fp32.
"""

from __future__ import annotations

import asyncio
import os
import time
from dataclasses import dataclass, field
from typing import Any

import ray

from decode_node.node import DecodeNode
from pdserve_core.config import EngineConfig, PoolConfig
from pdserve_core.engine.actor import EngineActor, create_engine_actor
from pdserve_core.engine.legs import Decode, Leg, Prefill, Whole
from pdserve_core.engine.types import TokenDelta
from pdserve_core.kv import vllm_kv_transfer_config
from pdserve_core.kv.settings import ConnectorSettings
from prefill_node.node import PrefillNode

SECRET = "test-cluster-secret"
START_TIMEOUT_S = 400


@dataclass
class Engines:
    actors: dict[str, Any]
    infos: dict[str, Any] = field(default_factory=dict)

    def __getitem__(self, name: str):
        return self.actors[name]

    def stop(self) -> None:
        """Shut every engine down at once (each waits seconds for vLLM's processes to exit),
        then end the actors; one already dead (a test killed it) is only ended."""
        shutdowns = [actor.shutdown.remote() for actor in self.actors.values()]
        for shutdown in shutdowns:
            try:
                ray.get(shutdown, timeout=30)
            except Exception:
                pass
        for actor in self.actors.values():
            ray.kill(actor, no_restart=True)


def start_engines(
    model: str, roles: dict[str, tuple[type, dict | None]], dtype: str = "float32",
    kv_cache_gib: int = 1, worker_process: tuple[str, ...] = (),
) -> Engines:  # fmt: skip
    """Start one engine per entry ({name: (actor class, KV transfer config or None)}); those
    named in `worker_process` run vLLM's model worker in a process of its own, as vLLM does on a
    CPU (`engine.cpu_worker_process`), the others inside the EngineCore's, pdserve's default."""
    engine = EngineConfig(dtype=dtype, kv_cache_space_gib=kv_cache_gib, omp_threads=1)
    pool = PoolConfig(num_cpus=1, max_restarts=0)
    actors = {
        name: create_engine_actor(
            cls,
            f"kvtest-{name}-{os.getpid()}",
            model,
            "model",
            engine.model_copy(update={"cpu_worker_process": name in worker_process}),
            pool,
            i,
            kv_transfer=kv,
        )
        for i, (name, (cls, kv)) in enumerate(roles.items())
    }
    engines = Engines(actors)
    names = list(actors)
    infos = ray.get([actors[n].start.remote() for n in names], timeout=START_TIMEOUT_S)
    engines.infos = dict(zip(names, infos, strict=True))
    return engines


def producer(**extra: Any) -> tuple[type, dict]:
    settings = ConnectorSettings(secret=SECRET, **extra)
    return PrefillNode, vllm_kv_transfer_config("kv_producer", settings, "recompute")


def consumer(policy: str = "recompute", **extra: Any) -> tuple[type, dict]:
    """A decode node pulling only from this machine's KV servers (as pdserve configures it)."""
    settings = ConnectorSettings(**{"secret": SECRET, "peer_hosts": ("127.0.0.1",), **extra})
    return DecodeNode, vllm_kv_transfer_config("kv_consumer", settings, policy)


def plain() -> tuple[type, None]:
    return EngineActor, None


def greedy(max_tokens: int):
    from vllm import SamplingParams

    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)


async def call(actor, leg: Leg) -> list[TokenDelta]:
    """All deltas of one leg, run as a Ray streaming call (`EngineActor.stream`)."""
    stream = actor.stream.options(num_returns="streaming").remote(leg)
    return [await ref async for ref in stream]


async def generate(actor, token_ids: list[int], params, request_id: str) -> list[TokenDelta]:
    return await call(actor, Whole(request_id, token_ids, params))


async def decode(actor, prompt: list[int], params, first: list[int], handle) -> list[TokenDelta]:
    return await call(actor, Decode(rid("decode"), prompt, params, first, handle))


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


async def prefill(p, prompt: list[int], max_tokens: int) -> list[TokenDelta]:
    """The prefill leg alone; its last delta carries the handle."""
    first = await call(p, Prefill(rid("prefill"), prompt, greedy(max_tokens)))
    handle = first[-1].handle
    assert handle and handle.get("do_remote_prefill"), f"producer returned no handle: {first[-1]}"
    return first


async def disaggregated(p, d, prompt: list[int], max_tokens: int, mutate=None) -> PDResult:
    """Prefill on `p`, decode on `d`; `mutate(handle)` may corrupt (a copy of) the handle."""
    started = time.monotonic()
    first = await prefill(p, prompt, max_tokens)
    handle = first[-1].handle
    if mutate:
        handle = dict(handle)
        mutate(handle)
    first_token = tokens(first)
    rest = await decode(d, prompt, greedy(max_tokens), first_token, handle)
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
