"""A vLLM `AsyncLLM` hosted in a Ray actor: the unit every pool is made of.

Life of a request through an engine actor:
1. The router opens `generate` as a Ray streaming call with (request_id, token_ids, params);
   the prompt is already tokenized, so the engine never re-tokenizes or re-applies a template.
2. `generate` feeds vLLM with `RequestOutputKind.DELTA` and yields one `TokenDelta` per engine
   output: the new token ids, their text, and on the last one the finish reason (and, on a prefill
   node, the KV handle vLLM's connector returned in `kv_transfer_params`).
3. If the caller cancels the stream (client gone, deadline), Ray cancels the task, vLLM's
   `generate` sees `CancelledError` and aborts the request, which frees its KV blocks.

The actor is created by `create_engine_actor` with the pool's Ray resources and an environment
that pins vLLM's CPU settings (thread count, binding, KV cache space) per node.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from dataclasses import dataclass
from typing import Any

import ray

from pdserve.config import EngineConfig, PoolConfig
from pdserve.engine_stats import EngineStats, GpuSampler, StatsCollector, stat_logger_factory
from pdserve.roofline.live import resolve_peaks

logger = logging.getLogger(__name__)


class KVLoadFailed(RuntimeError):
    """The decode engine could not load the request's KV and the policy is `fail`."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(f"KV transfer failed ({reason}): {message}")
        self.reason, self.detail = reason, message

    def __reduce__(self):  # crosses Ray's process boundary intact
        return (type(self), (self.reason, self.detail))


@dataclass(frozen=True)
class TokenDelta:
    """New output of one request since the previous delta."""

    token_ids: list[int]
    text: str
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    num_prompt_tokens: int = 0
    kv_transfer_params: dict[str, Any] | None = None


def _pulls_kv(sampling_params: Any) -> bool:
    params = (sampling_params.extra_args or {}).get("kv_transfer_params")
    return bool(params and "remote_request_id" in params)


def engine_env(engine: EngineConfig, pool: PoolConfig, replica: int) -> dict[str, str]:
    """Environment for one engine actor (passed through Ray's runtime_env)."""
    threads = engine.omp_threads or max(1, int(pool.num_cpus))
    bind = pool.cpu_bind[replica % len(pool.cpu_bind)] if pool.cpu_bind else "nobind"
    env = {
        "OMP_NUM_THREADS": str(threads),
        "VLLM_CPU_OMP_THREADS_BIND": bind,
        "VLLM_CPU_KVCACHE_SPACE": str(engine.kv_cache_space_gib),
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
    }
    for name in ("VLLM_RPC_BASE_PATH", "PDSERVE_CACHE_DIR"):
        if os.environ.get(name):
            env[name] = os.environ[name]
    return env


def engine_kwargs(
    model: str,
    engine: EngineConfig,
    served_name: str,
    kv_transfer: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """vLLM `AsyncEngineArgs` keyword arguments for one engine (`kv_transfer`: the fields of a
    vLLM `KVTransferConfig`, for engines in a disaggregated pool)."""
    kwargs: dict[str, Any] = dict(
        model=model,
        served_model_name=served_name,
        dtype=engine.dtype,
        max_model_len=engine.max_model_len,
        enforce_eager=engine.enforce_eager,
        max_num_seqs=engine.max_num_seqs,
        enable_prefix_caching=engine.enable_prefix_caching,
        seed=engine.seed,
        gpu_memory_utilization=engine.gpu_memory_utilization,
        enable_logging_iteration_details=True,  # per-step tokens and time for the utilization
    )
    if engine.max_num_batched_tokens:
        kwargs["max_num_batched_tokens"] = engine.max_num_batched_tokens
    if kv_transfer:
        kwargs["kv_transfer_config"] = kv_transfer
    return kwargs


def _advertised(kv_transfer: dict[str, Any]) -> dict[str, Any]:
    """A KV server bound to every interface tells decode nodes this host's cluster address."""
    extra = dict(kv_transfer.get("kv_connector_extra_config") or {})
    if extra.get("host") in ("0.0.0.0", "::") and not extra.get("advertise_host"):
        extra["advertise_host"] = ray.util.get_node_ip_address()
    return {**kv_transfer, "kv_connector_extra_config": extra}


class EngineActor:
    """Ray actor body (wrapped by `ray.remote` in `create_engine_actor`)."""

    def __init__(
        self, name: str, engine_args: dict[str, Any], peaks: dict[str, Any] | None = None
    ) -> None:
        self._name = name
        self._engine_args = engine_args
        self._peaks = peaks or {}
        self._engine = None
        self._stats = EngineStats()
        self._collector = StatsCollector(self._stats)
        self._gpu: GpuSampler | None = None

    async def start(self) -> dict[str, Any]:
        """Build the vLLM engine; returns what the router needs to know about it."""
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        started = time.monotonic()
        kwargs = dict(self._engine_args)
        if kwargs.get("kv_transfer_config"):
            from vllm.config import KVTransferConfig

            kv_transfer = _advertised(kwargs["kv_transfer_config"])
            kwargs["kv_transfer_config"] = KVTransferConfig(**kv_transfer)
        args = AsyncEngineArgs(**kwargs)
        # vLLM's default logging stat logger would log every step (iteration details are on)
        logging.getLogger("vllm.v1.metrics.loggers").setLevel(logging.WARNING)
        self._engine = AsyncLLM.from_engine_args(
            args, stat_loggers=[stat_logger_factory(self._collector)]
        )
        vllm_config = self._engine.vllm_config
        self._start_utilization(vllm_config)
        info = {
            "name": self._name,
            "pid": os.getpid(),
            "ray_node_id": ray.get_runtime_context().get_node_id(),
            "max_model_len": vllm_config.model_config.max_model_len,
            "block_size": vllm_config.cache_config.block_size,
            "start_s": round(time.monotonic() - started, 2),
        }
        logger.info("engine %s ready in %.1f s", self._name, info["start_s"])
        return info

    def _start_utilization(self, vllm_config: Any) -> None:
        """Give the stats collector the model's shapes and this node's device peaks."""
        from pdserve.roofline.specs import model_from_hf_config

        model_config = vllm_config.model_config
        dtype = str(model_config.dtype).removeprefix("torch.")
        self._collector.model = model_from_hf_config(
            model_config.hf_config.to_dict(), self._name, dtype=dtype
        )
        self._collector.set_peaks(resolve_peaks(**self._peaks))
        self._stats.max_num_seqs = vllm_config.scheduler_config.max_num_seqs
        self._gpu = GpuSampler.create()

    async def generate(self, request_id: str, prompt_token_ids: list[int], sampling_params: Any):
        from vllm.sampling_params import RequestOutputKind

        sampling_params.output_kind = RequestOutputKind.DELTA
        prompt = {"prompt_token_ids": prompt_token_ids}
        self._stats.requests_started_total += 1
        context = 0  # this request's tokens counted in the decode context (once it decodes)
        try:
            async for output in self._engine.generate(prompt, sampling_params, request_id):
                completion = output.outputs[0]
                grown = (context or len(prompt_token_ids)) + len(completion.token_ids)
                self._stats.decode_context_tokens += grown - context
                context = grown
                if completion.finish_reason == "error" and _pulls_kv(sampling_params):
                    raise await self._kv_failure(request_id)
                yield TokenDelta(
                    token_ids=list(completion.token_ids),
                    text=completion.text,
                    finish_reason=completion.finish_reason,
                    stop_reason=completion.stop_reason,
                    num_prompt_tokens=len(prompt_token_ids),
                    kv_transfer_params=output.kv_transfer_params if output.finished else None,
                )
        finally:
            self._stats.decode_context_tokens -= context
            self._stats.requests_finished_total += 1

    async def _kv_failure(self, request_id: str) -> KVLoadFailed:
        """The reason the connector recorded for this request's failed pull (it arrives with
        the same or the next engine step's stats)."""
        deadline = time.monotonic() + 2.0
        while (why := self._stats.kv.failure_of(request_id)) is None:
            if time.monotonic() > deadline:
                return KVLoadFailed("unknown", "the engine reported a KV load failure")
            await asyncio.sleep(0.02)
        return KVLoadFailed(*why)

    async def abort(self, request_id: str) -> None:
        await self._engine.abort(request_id)

    async def check_health(self) -> bool:
        if self._engine is None:
            return False
        await self._engine.check_health()
        return not self._engine.errored

    async def stats(self) -> dict[str, Any]:
        if self._gpu is not None:
            self._gpu.sample(self._stats)
        return self._stats.as_dict()

    async def shutdown(self) -> None:
        if self._engine is not None:
            self._engine.shutdown()
            self._engine = None


def create_engine_actor(
    name: str,
    model: str,
    served_name: str,
    engine: EngineConfig,
    pool: PoolConfig,
    replica: int,
    max_restarts: int = 0,
    kv_transfer: dict[str, Any] | None = None,
):
    """Place one engine actor with the pool's Ray resources; call `.start.remote()` next."""
    env = engine_env(engine, pool, replica)
    peaks = {
        "device": engine.device,
        "flops": engine.peak_flops,
        "mem_bandwidth": engine.peak_mem_bandwidth,
        "threads": int(env["OMP_NUM_THREADS"]),
    }
    actor_cls = ray.remote(EngineActor)
    return actor_cls.options(
        name=name,
        num_cpus=pool.num_cpus,
        num_gpus=pool.num_gpus,
        resources=dict(pool.resources),
        max_restarts=max_restarts,
        max_concurrency=1000,
        runtime_env={"env_vars": env},
    ).remote(name, engine_kwargs(model, engine, served_name, kv_transfer), peaks)


def create_pool_node(
    config: Any,
    pool_name: str,
    kv_role: str,
    model_dir: str,
    served: str,
    replica: int,
    secret: str,
):
    """One node of a disaggregated pool: an engine actor whose vLLM loads pdserve's KV connector
    in `kv_role`, with the pool's resources and restart budget (`config`: PDServeConfig)."""
    from pdserve.kv import vllm_kv_transfer_config

    kv, pool = config.kv_transfer, getattr(config.pools, pool_name)
    serves_kv = kv_role == "kv_producer"
    port = kv.port + replica if kv.port and serves_kv else 0
    return create_engine_actor(
        f"pdserve-{pool_name}-{replica}",
        model_dir,
        served,
        config.engine,
        pool,
        replica,
        max_restarts=pool.max_restarts,
        kv_transfer=vllm_kv_transfer_config(
            kv_role,
            secret,
            kv.transport,
            kv.failure_policy,
            kv.host,
            port,
            kv.lease_s,
            kv.timeout_s,
        ),
    )
