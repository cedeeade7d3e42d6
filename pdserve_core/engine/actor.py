"""A vLLM `AsyncLLM` hosted in a Ray actor: what every node of every pool is made of.

Life of a request through an engine actor:
1. The router sends a leg (pdserve_core/engine/legs.py) on its token stream to the node
   (pdserve_core/engine/deltas.py: an OPEN frame), and the actor runs it by its type (`handler`):
   a `Whole` leg here (`generate`: colocated nodes, and a decode node prefilling for itself); the
   roles add theirs — `Prefill` (`PrefillNode.prefill`, prefill_node/node.py) and `Decode`
   (`DecodeNode.decode`, decode_node/node.py). The prompt is already tokenized, so the engine
   never re-tokenizes or re-applies a template. (With `router.token_stream: ray` the router
   calls `stream` itself, as a Ray streaming call.)
2. vLLM runs it with `RequestOutputKind.DELTA`; the handler yields one `TokenDelta` per engine
   output (the new token ids, their text, and on the last one the finish reason), and `relay`
   queues each on the router's token stream, which sends one frame per event-loop turn for all
   of that router's requests here.
3. If the router stops the stream (client gone, deadline: a CANCEL frame), the leg's task is
   cancelled, vLLM's `generate` sees `CancelledError` and aborts the request, which frees its KV
   blocks; a router whose connection closed has all of its requests here stopped the same way.

The actor is placed by `create_engine_actor` with the pool's Ray resources and an environment
that pins vLLM's CPU settings (thread count, binding, KV cache space) per node.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing, contextmanager
from dataclasses import replace
from typing import Any

import ray

from pdserve_core.config import (
    EngineConfig,
    PoolConfig,
    cpu_cores,
    cpu_preload_paths,
    engine_threads,
)
from pdserve_core.engine import dtype
from pdserve_core.engine.blocks import BlockLog, block_hashes
from pdserve_core.engine.deltas import END, Channel, DeltaServer, ending, server_tls
from pdserve_core.engine.frames import FrameError, leg_from
from pdserve_core.engine.legs import Whole
from pdserve_core.engine.stats import GpuSampler, StatsCollector, stat_logger_factory
from pdserve_core.engine.text import ContinuedText
from pdserve_core.engine.types import (
    CACHE_SALT_ARG,
    OUTPUT_START_ARG,
    Checkup,
    EngineDown,
    NodeInfo,
    NodeStats,
    RequestRejected,
    TokenDelta,
)
from pdserve_core.engine.worker import QUALNAME as WORKER_EXTENSION
from pdserve_core.kv.stats import KVGauges
from pdserve_core.roofline.live import resolve_peaks
from pdserve_core.roofline.serving import cpu_block_size, cpu_chunk_size
from pdserve_core.roofline.stepmodel import StepModel, device_key, find_step_model, model_key

logger = logging.getLogger(__name__)

IN_CORE_EXECUTOR = "pdserve_core.engine.executor.InCoreExecutor"
"""vLLM's executor for a CPU engine whose worker runs in the EngineCore's process (executor.py;
named, not imported: it imports vLLM)."""

GIVE_BACK_GRACE_S = 2.0
"""How long after a router's token stream closed a node gives back the KV it kept for that
router's decode legs: a pull already under way ends first (a pull takes milliseconds)."""


def plain_logprobs(logprobs: Any) -> list | None:
    """vLLM's logprobs (a list or FlatLogprobs of {token id: Logprob}, None entries allowed) as
    plain tuples that cross Ray cheaply, in vLLM's order."""
    if logprobs is None:
        return None
    return [
        None
        if position is None
        else [(tid, lp.logprob, lp.rank, lp.decoded_token) for tid, lp in position.items()]
        for position in logprobs
    ]


def _gpu_name() -> str | None:
    try:
        import torch

        return torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    except Exception:  # no usable CUDA: a CPU engine
        return None


def engine_env(engine: EngineConfig, pool: PoolConfig, replica: int) -> dict[str, str]:
    """Environment for one engine actor (passed through Ray's runtime_env)."""
    threads = engine_threads(engine, pool)
    bind = pool.cpu_bind[replica % len(pool.cpu_bind)] if pool.cpu_bind else "nobind"
    env = {
        "OMP_NUM_THREADS": str(threads),
        "VLLM_CPU_OMP_THREADS_BIND": bind,
        "VLLM_CPU_KVCACHE_SPACE": str(engine.kv_cache_space_gib),
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
    }
    preload = cpu_preload_paths(engine.cpu_preload) if not pool.num_gpus else []
    if preload:  # vLLM adds torch's libgomp unless an OpenMP runtime is already preloaded
        env["LD_PRELOAD"] = ":".join(preload)
    for name in ("VLLM_RPC_BASE_PATH", "PDSERVE_CACHE_DIR", "PDSERVE_CALIBRATION_DIR"):
        if os.environ.get(name):
            env[name] = os.environ[name]
    return env


def omp_binding(bind: str, ld_preload: str) -> dict[str, str]:
    """The OpenMP environment that pins an engine's threads to the cores `bind` names ("1",
    "0-1", "0,2-3"; "nobind" or "": none), for the OpenMP runtime `ld_preload` loads: what vLLM's
    multiprocessing executor sets for each CPU worker process it spawns. An engine whose worker
    runs in its EngineCore (the in-core executor) is spawned by no such executor, so without this
    its threads were never pinned and `cpu_bind` bound nothing (each engine's compute thread
    free on every core). Intel OpenMP: one core per thread in order, and a thread spins 5 ms
    after a parallel region before it sleeps (vLLM's `KMP_BLOCKTIME`); GNU OpenMP: the same
    order; any other runtime: the standard places."""
    if bind in ("", "nobind", "auto"):
        return {}
    listed = ",".join(map(str, cpu_cores(bind)))
    if "libiomp" in ld_preload or "libomp" in ld_preload:
        return {
            "KMP_AFFINITY": f"granularity=fine,explicit,proclist=[{listed}]",
            "KMP_BLOCKTIME": "5",
            "KMP_TPAUSE": "0",
        }
    if "libgomp" in ld_preload:
        return {"GOMP_CPU_AFFINITY": listed.replace(",", " ")}
    return {"OMP_PLACES": "{" + listed + "}", "OMP_PROC_BIND": "true"}


@contextmanager
def spawned_with(env: dict[str, str]):
    """`os.environ` with `env` added while the block runs (the processes it spawns inherit it),
    then as it was: the actor's own OpenMP runtime has started and is not pinned."""
    before = {name: os.environ.get(name) for name in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for name, value in before.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


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
        # vLLM's default stat loggers off: its logging one writes a line per engine step once
        # iteration details are on, and each line crossed Ray's log pipeline (the actor, Ray's
        # log monitor, the GCS, the router's printer) on the cores the engines and the router
        # use. pdserve's own stat logger (`stats.py`) still gets every step, and vLLM's
        # Prometheus logger stays.
        disable_log_stats=True,
    )
    if engine.max_num_batched_tokens:
        kwargs["max_num_batched_tokens"] = engine.max_num_batched_tokens
    if engine.long_prefill_token_threshold:
        kwargs["long_prefill_token_threshold"] = engine.long_prefill_token_threshold
    if engine.block_size:
        kwargs["block_size"] = engine.block_size
    if engine.reasoning_parser:
        kwargs["reasoning_parser"] = engine.reasoning_parser
    if not engine.cpu_worker_process:  # the engine actor passes it on (vLLM rewrites "uni" on CPU)
        kwargs["distributed_executor_backend"] = "uni"
    # the actor's word reaches the workers: the KV connector's methods, the warm-up
    kwargs["worker_extension_cls"] = WORKER_EXTENSION
    if kv_transfer:
        kwargs["kv_transfer_config"] = kv_transfer
    return kwargs


def _advertised_host(host: str) -> str:
    """The address peers reach a server bound to `host` at: this host's Ray node address for
    every interface."""
    return ray.util.get_node_ip_address() if host in ("0.0.0.0", "::") else host


def _advertised(kv_transfer: dict[str, Any]) -> dict[str, Any]:
    """A KV server bound to every interface tells decode nodes this host's cluster address."""
    extra = dict(kv_transfer.get("kv_connector_extra_config") or {})
    if extra.get("host") in ("0.0.0.0", "::") and not extra.get("advertise_host"):
        extra["advertise_host"] = _advertised_host(extra["host"])
    return {**kv_transfer, "kv_connector_extra_config": extra}


def _delta_of(output: Any, completion: Any, prompt_tokens: int, first: bool) -> TokenDelta:
    """One sequence's new output (`completion`) of vLLM's `RequestOutput` as a delta: the KV
    handle on the request's last, its prompt's logprobs and cache hits on its first."""
    return TokenDelta(
        token_ids=list(completion.token_ids),
        text=completion.text,
        finish_reason=completion.finish_reason,
        stop_reason=completion.stop_reason,
        num_prompt_tokens=prompt_tokens,
        handle=output.kv_transfer_params if output.finished else None,
        index=completion.index,
        logprobs=plain_logprobs(completion.logprobs),
        prompt_logprobs=plain_logprobs(output.prompt_logprobs) if first else None,
        num_cached_tokens=output.num_cached_tokens if first else None,
    )


class EngineActor:
    """Ray actor body (wrapped by `ray.remote` in `create_engine_actor`)."""

    ROLE = "colocated"
    """The pool role this class serves (its step-time calibration is looked up by it)."""

    def __init__(
        self,
        name: str,
        engine_args: dict[str, Any],
        peaks: dict[str, Any] | None = None,
        stream_host: str = "127.0.0.1",
        stream_tls: dict[str, str] | None = None,
        stream_secret: str | None = None,
    ) -> None:
        self._name = name
        self._engine_args = engine_args
        self._peaks = peaks or {}
        self._engine = None
        self._build: asyncio.Future | None = None
        """The engine's build under way, or the one that made the engine serving now."""
        self._stats = NodeStats()
        self._collector = StatsCollector(self._stats, name)
        self._gpu: GpuSampler | None = None
        self._max_num_batched_tokens = 0
        self._blocks = BlockLog()
        """The blocks each finished request left in the engine, for every router to read."""
        self._block_size = 0
        self._deltas = DeltaServer(name, stream_secret, on_close=self._router_left, run=self.relay)
        """The token stream: routers that prove `stream_secret` (the run's cluster secret)."""
        self._aside: set[asyncio.Task] = set()
        """Give-backs under way (kept: a task nobody holds may be collected)."""
        self._stream_host = stream_host
        """Where the token stream listens ("0.0.0.0": every interface, the Ray node's address
        told to routers)."""
        self._stream_tls = stream_tls
        """The KV plane's TLS files: the token stream is mutual TLS with them (None: TCP)."""
        self._stream_context = None

    async def start(self) -> NodeInfo:
        """Build the vLLM engine, once; returns what the router needs to know about it.

        Every router that finds the node without an engine asks for one (after a restart by
        Ray, a dead or stuck engine): a call while an engine is being built waits for that
        build, and a call once it serves answers with its start, so several routers make one
        engine. After a failed build, or once the engine is dropped, the next call builds
        again."""
        build = self._build
        if build is None or (
            build.done() and (self._engine is None or build.cancelled() or build.exception())
        ):
            build = self._build = asyncio.ensure_future(self._start())
        return await asyncio.shield(build)  # a caller that gives up leaves the build running

    async def _start(self) -> NodeInfo:
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        started = time.monotonic()
        self._stream_context = server_tls(self._stream_tls)  # a bad file fails the start here
        kwargs = dict(self._engine_args)
        gpu = _gpu_name() is not None
        kwargs["dtype"] = dtype.resolve(kwargs.get("dtype", dtype.NATIVE), gpu)
        if not gpu:  # decided on the engine's own host, as the dtype is
            chunk = cpu_chunk_size(
                kwargs.get("max_num_batched_tokens"), kwargs["max_num_seqs"], self.ROLE
            )
            if chunk:
                kwargs["max_num_batched_tokens"] = chunk
            kwargs["block_size"] = cpu_block_size(kwargs.get("block_size"))
        if kwargs.get("kv_transfer_config"):
            from vllm.config import KVTransferConfig

            kv_transfer = _advertised(kwargs["kv_transfer_config"])
            kwargs["kv_transfer_config"] = KVTransferConfig(**kv_transfer)
        if kwargs.get("distributed_executor_backend") == "uni" and _gpu_name() is None:
            # vLLM's CPU platform turns "uni" into its multiprocessing executor (for an engine
            # in the caller's own process, whose OpenMP runtime has started); named by its
            # class, the worker runs in the EngineCore's process, spawned once the platform has
            # set the threads and preloads (the binding: below), as on a GPU (executor.py: and
            # its steps timed whole)
            kwargs["distributed_executor_backend"] = IN_CORE_EXECUTOR
            bind = os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "")
            pinned = omp_binding(bind, os.environ.get("LD_PRELOAD", ""))
        else:
            pinned = {}
        args = AsyncEngineArgs(**kwargs)
        with spawned_with(pinned):  # the EngineCore, and its worker with it, pinned as vLLM pins
            self._engine = AsyncLLM.from_engine_args(  # a worker process of its own
                args, stat_loggers=[stat_logger_factory(self._collector)]
            )
        if pinned:
            logger.info("%s: OpenMP threads pinned (%s)", self._name, pinned)
        vllm_config = self._engine.vllm_config
        self._block_size = vllm_config.cache_config.block_size
        self._start_utilization(vllm_config)
        await self._warm_sampler()
        await self._keep_seeds_across_chunks()
        info = NodeInfo(
            name=self._name,
            pid=os.getpid(),
            ray_node_id=ray.get_runtime_context().get_node_id(),
            max_model_len=vllm_config.model_config.max_model_len,
            block_size=vllm_config.cache_config.block_size,
            num_blocks=vllm_config.cache_config.num_gpu_blocks or 0,
            start_s=round(time.monotonic() - started, 2),
            **await self._kv_endpoint(),
        )
        logger.info(
            "engine %s ready in %.1f s (KV blocks of %d tokens, at most %d tokens a step)",
            self._name,
            info.start_s,
            info.block_size,
            vllm_config.scheduler_config.max_num_batched_tokens,
        )
        return info

    async def _warm_sampler(self) -> None:
        """Compile the sampler's logprob kernel before the node serves (the workers'
        `pdserve_warm_sampler`), not at the first request with logprobs, with every stream on
        the engine waiting for it. A warm-up that fails costs that wait later, not the node."""
        try:
            seconds = await self._engine.collective_rpc("pdserve_warm_sampler")
        except Exception as error:  # vLLM's sampler changed: it compiles at the first logprobs
            logger.warning(
                "%s: the sampler's warm-up failed (%s: %s); the first request with logprobs "
                "will compile it, every stream here waiting",
                self._name,
                type(error).__name__,
                error,
            )
            return
        logger.info("%s: sampler's logprob kernel compiled in %.1f s", self._name, max(seconds))

    async def _keep_seeds_across_chunks(self) -> None:
        """On a CPU, mend the workers' sampling of seeded requests whose prompt a step splits
        (pdserve_core/engine/worker.py): without it the first such request kills the engine."""
        try:
            mended = await self._engine.collective_rpc("pdserve_keep_seeds_across_chunks")
        except Exception as error:
            mended = [f"{type(error).__name__}: {error}"]
        if all(m is True for m in mended):
            return
        logger.warning(
            "%s: seeded sampling across split prompts not mended (%s): on this CPU engine a "
            "request with a `seed` whose prompt a step splits will end the engine",
            self._name,
            mended,
        )

    async def _kv_endpoint(self) -> dict[str, Any]:
        """The KV connector's endpoint for NodeInfo: KV server address and ports (a producer),
        and whether it takes prefetches (a consumer)."""
        if not self._engine_args.get("kv_transfer_config"):
            return {}
        ranks = await self._engine.collective_rpc("pdserve_kv_endpoint")
        info: dict[str, Any] = {"prefetch": all(rank and rank["prefetch"] for rank in ranks)}
        if ranks and all(rank and "port" in rank for rank in ranks):
            info |= {"kv_host": ranks[0]["host"], "kv_ports": tuple(r["port"] for r in ranks)}
        return info

    def _start_utilization(self, vllm_config: Any) -> None:
        """Give the stats collector the model's shapes, this node's device peaks and its step-time
        model: the calibration stored for this device and model, else the plain roofline."""
        from pdserve_core.roofline.specs import model_from_hf_config

        model_config = vllm_config.model_config
        dtype = str(model_config.dtype).removeprefix("torch.")
        self._collector.model = model_from_hf_config(
            model_config.hf_config.to_dict(), self._name, dtype=dtype
        )
        peaks = resolve_peaks(**self._peaks, dtype=dtype)
        self._collector.set_peaks(peaks)
        self._stats.max_num_seqs = vllm_config.scheduler_config.max_num_seqs
        self._max_num_batched_tokens = vllm_config.scheduler_config.max_num_batched_tokens
        self._gpu = GpuSampler.create()
        self._stats.device = device_key(_gpu_name())
        self._stats.model_key = model_key(model_config.model, dtype)
        self._collector.set_step_model(
            find_step_model(self._stats.device, self._stats.model_key, self.ROLE)
            or StepModel.roofline(peaks.flops, peaks.mem_bandwidth)
        )
        logger.info(
            "%s: device %s, model %s, step-time model %s",
            self._name,
            self._stats.device,
            self._stats.model_key,
            self._stats.step_model_source,
        )

    async def generate(self, leg: Whole) -> AsyncIterator[TokenDelta]:
        """A whole request on this engine: prefill and decode."""
        run = self._run(leg.request_id, leg.prompt_token_ids, leg.params)
        async with aclosing(run) as deltas:  # a stopped leg is aborted in vLLM before it ends
            async for delta in deltas:
                yield delta

    def handler(self, leg: Any) -> Callable[[Any], AsyncIterator[TokenDelta]]:
        """The method that runs `leg` here, by its type; the roles add theirs (a node runs only
        the legs its role has)."""
        if type(leg) is Whole:
            return self.generate
        raise ValueError(f"{self._name} runs no {type(leg).__name__} legs")

    async def stream(self, leg: Any) -> AsyncIterator[TokenDelta]:
        """`leg`'s deltas as a Ray streaming call (`router.token_stream: ray`)."""
        async for delta in self.handler(leg)(leg):
            yield delta

    async def delta_endpoint(self) -> tuple[str, int]:
        """Where a router connects for its token stream (pdserve_core/engine/deltas.py)."""
        host = self._stream_host
        if self._stream_tls and self._stream_context is None:
            self._stream_context = server_tls(self._stream_tls)
        return await self._deltas.endpoint(host, _advertised_host(host), self._stream_context)

    def params_type(self) -> Any:
        """What a leg's `params` decode into from the token stream: vLLM's `SamplingParams`."""
        from vllm import SamplingParams

        return SamplingParams

    async def relay(self, channel: Channel, tag: int, payload: Any) -> None:
        """Run the leg a router opened on its token stream `channel` under `tag`, and send its
        deltas there, then `END` or the exception that ended it. The router stops it by
        cancelling the stream (vLLM aborts the request and frees its blocks)."""
        try:
            leg = leg_from(payload, self.params_type())
        except FrameError as error:  # the router's own fault: not the client's 400
            channel.send(tag, RuntimeError(f"{self._name} could not read the leg: {error}"))
            return
        handle = None
        try:
            run = self.handler(leg)
            async with aclosing(run(leg)) as deltas:
                async for delta in deltas:
                    handle = delta.handle or handle
                    channel.send(tag, delta)
                    if channel.congested:
                        await channel.drain()
        except Exception as error:  # the request's end, told in order after its deltas
            channel.send(tag, ending(error, f"{leg.KIND} on {self._name}"))
            return
        if handle is not None and hasattr(self, "give_back"):
            channel.keep(handle)  # its KV waits here for the router's decode leg
        channel.send(tag, END)

    def _router_left(self, channel: Any) -> None:
        """A router's token stream closed (it died, or its link did): the KV this node keeps for
        its decode legs is given back after `GIVE_BACK_GRACE_S` (a pull under way ends first),
        not when each lease ends."""
        if channel.kept and hasattr(self, "give_back"):
            self._aside_task(self._give_back_later(list(channel.kept.values())))

    def _aside_task(self, work: Any) -> None:
        """Run `work` beside the request that asked for it, kept until it ends."""
        task = asyncio.get_running_loop().create_task(work)
        self._aside.add(task)
        task.add_done_callback(self._aside.discard)

    async def _give_back_later(self, handles: list[dict[str, Any]]) -> None:
        await asyncio.sleep(GIVE_BACK_GRACE_S)
        freed = 0
        for handle in handles:
            try:
                freed += bool(await self.give_back(handle))
            except Exception as error:  # the engine may be gone: its leases went with it
                logger.warning("%s: giving back %s: %r", self._name, handle, error)
                return
        if freed:
            logger.info(
                "%s: freed the KV of %d prefills whose router left before their decode",
                self._name,
                freed,
            )

    async def _run(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: Any,
        output_start: int | None = None,
    ) -> AsyncIterator[TokenDelta]:
        """Feed one request to vLLM and yield its deltas, one per sequence that has new output
        (the handle, if any, on the last). vLLM's refusal of the request becomes
        `RequestRejected`, a dead engine `EngineDown`. Where the client's prompt ends inside
        `prompt_token_ids` (`output_start`, or the router's `OUTPUT_START_ARG` for a resumed
        stream, whichever is earlier), the rest being output sent already, the deltas' text
        continues from there (pdserve_core/engine/text.py)."""
        from vllm.exceptions import VLLMClientError
        from vllm.sampling_params import RequestOutputKind
        from vllm.v1.engine.exceptions import EngineDeadError

        if self._engine is None:
            raise EngineDown(f"{self._name} has no engine (it is starting)")
        sampling_params.output_kind = RequestOutputKind.DELTA
        prompt = {"prompt_token_ids": prompt_token_ids}
        extra = dict(sampling_params.extra_args or {})
        salt = extra.pop(CACHE_SALT_ARG, None)
        starts = [output_start, extra.pop(OUTPUT_START_ARG, None)]
        sampling_params.extra_args = extra or None
        if salt:  # the prompt shares cached blocks only with prompts of the same salt
            prompt["cache_salt"] = salt
        start = min((s for s in starts if isinstance(s, int) and s > 0), default=None)
        text = None
        if start is not None and start < len(prompt_token_ids):
            tokens = prompt_token_ids
            text = ContinuedText(
                self._engine.tokenizer, tokens[:start], tokens[start:], sampling_params
            )
        self._stats.requests_started_total += 1
        context = 0  # this request's tokens counted in the decode context (once it decodes)
        first = True
        produced: list[int] = []  # its one sequence's tokens (n = 1), for the block log
        outputs = self._engine.generate(prompt, sampling_params, request_id)
        try:
            async with aclosing(outputs):  # closed with this run: vLLM aborts the request now
                async for output in outputs:
                    new_tokens = sum(len(c.token_ids) for c in output.outputs)
                    grown = (context or len(prompt_token_ids)) + new_tokens
                    self._stats.decode_context_tokens += grown - context
                    context = grown
                    if sampling_params.n == 1:
                        produced += output.outputs[0].token_ids
                    for completion in output.outputs:
                        delta = _delta_of(output, completion, len(prompt_token_ids), first)
                        yield delta if text is None else replace(delta, text=text.text(delta))
                        first = False
            # its prompt's blocks, and its output's but the last token's (sampled, never
            # computed): what a conversation's next turn sends back
            if self._block_size:
                tokens = list(prompt_token_ids) + produced[:-1]
                self._blocks.add(block_hashes(tokens, self._block_size, salt))
        except VLLMClientError as error:
            raise RequestRejected(str(error)) from None
        except EngineDeadError:
            raise EngineDown(f"the engine of {self._name} died") from None
        finally:
            self._stats.decode_context_tokens -= context
            self._stats.requests_finished_total += 1

    async def abort(self, request_id: str) -> None:
        await self._engine.abort(request_id)

    async def check_health(self) -> bool:
        """True while the engine serves. False when there is none: never built, or found dead
        here and cleared, so the router builds a new one (`start`)."""
        if self._engine is None:
            return False
        try:
            await self._engine.check_health()
            dead = self._engine.errored
        except Exception as error:
            logger.error("engine %s failed its health check: %r", self._name, error)
            dead = True
        if dead:
            logger.error("engine %s is dead; clearing it for a rebuild", self._name)
            self._drop_engine()
        return not dead

    async def drop_engine(self) -> None:
        """The router found the engine stuck (requests held, no step for `router.engine_stall_s`):
        end it; the next health check reports no engine and the router builds a new one."""
        if self._engine is not None:
            logger.error("engine %s is stuck; ending it for a rebuild", self._name)
            self._drop_engine()

    def _drop_engine(self) -> None:
        engine, self._engine = self._engine, None
        self._blocks.clear()
        # what the dead engine last reported (its queue, its cache, the KV it held for decode
        # nodes) died with it; a new engine reports only once it steps, maybe never while idle
        stats = self._stats
        stats.running = stats.waiting = 0
        stats.kv_cache_usage = 0.0
        stats.kv.gauges = KVGauges()
        self._collector.engine_gone()
        try:
            engine.shutdown()
        except Exception as error:  # it is dead already; its processes are reaped with it
            logger.warning("shutting down the dead engine of %s: %r", self._name, error)

    async def prefix_blocks(self, seen: int) -> tuple[int, list[list[int]]]:
        """The blocks requests left in this engine, from the log's entry `seen` on (every router
        reads it with its health checks: router/decides/prefixes.py)."""
        return self._blocks.since(seen)

    async def checkup(self, seen: int | None) -> Checkup:
        """A router's health check in one call: `check_health`, `stats`, and `prefix_blocks`
        from `seen` unless it is None (a router that does not route by prefix)."""
        healthy = await self.check_health()
        blocks = None if seen is None else self._blocks.since(seen)
        return healthy, await self.stats(), blocks

    async def step_records(self, seen: int = 0) -> dict[str, Any]:
        """The engine's recent steps after the first `seen` (each [prompt tokens, prompt
        sequences, decode tokens, decode sequences, context tokens, seconds]), with what a fit
        needs to know: the model's shapes, the device and model keys, the chunk size."""
        from dataclasses import asdict

        total, records = self._collector.records_since(seen)
        model = self._collector.model
        return {
            "steps_seen": total,
            "records": records,
            "device": self._stats.device,
            "model": self._stats.model_key,
            "role": self.ROLE,
            "model_spec": asdict(model) if model else None,
            "step_model": self._stats.step_model_source,
            "max_num_batched_tokens": self._max_num_batched_tokens,
            "max_num_seqs": self._stats.max_num_seqs,
        }

    async def stats(self) -> NodeStats:
        stats = self._stats
        if stats.requests_started_total == stats.requests_finished_total:
            # vLLM reports the scheduler at each step, so an idle engine's last report still
            # counts the request its final step finished: nothing is in flight here
            stats.running = stats.waiting = 0
        if self._gpu is not None:
            self._gpu.sample(stats)
        return stats

    async def shutdown(self) -> None:
        self._deltas.close()
        if self._engine is not None:
            self._engine.shutdown()
            self._engine = None


def create_engine_actor(
    actor_class: type,
    name: str,
    model: str,
    served_name: str,
    engine: EngineConfig,
    pool: PoolConfig,
    replica: int,
    kv_transfer: dict[str, Any] | None = None,
    stream_host: str = "127.0.0.1",
    stream_tls: dict[str, str] | None = None,
    stream_secret: str | None = None,
):
    """Place one engine actor (`actor_class`: EngineActor or a role's subclass) with the pool's
    Ray resources and restart budget; call `.start.remote()` next."""
    env = engine_env(engine, pool, replica)
    if pool.long_prefill_token_threshold is not None:
        engine = engine.model_copy(
            update={"long_prefill_token_threshold": pool.long_prefill_token_threshold}
        )
    peaks = {
        "device": engine.device,
        "flops": engine.peak_flops,
        "mem_bandwidth": engine.peak_mem_bandwidth,
        "threads": int(env["OMP_NUM_THREADS"]),
    }
    return (
        ray.remote(actor_class)
        .options(
            name=name,
            num_cpus=pool.num_cpus,
            num_gpus=pool.num_gpus,
            resources=dict(pool.resources),
            max_restarts=pool.max_restarts,
            max_concurrency=1000,
            runtime_env={"env_vars": env},
        )
        .remote(
            name,
            engine_kwargs(model, engine, served_name, kv_transfer),
            peaks,
            stream_host,
            stream_tls,
            stream_secret,
        )
    )
