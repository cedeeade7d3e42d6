"""`pdserve serve`: start (or join) Ray, place the engine pools, and serve the router's APIs.

Order of events: resolve the model folder → Ray → engine actors (started in parallel, each
with a start deadline) → router HTTP server → "ready" log line (and optional ready file) →
serve until SIGINT/SIGTERM → stop the HTTP server, shut the engines down, kill their actors,
and shut down the Ray this process started. A signal during start-up takes the same clean-up path.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import signal
import time
from pathlib import Path

import ray

from pdserve.config import DEFAULT_MODEL, PDServeConfig, PoolConfig
from pdserve.engine import create_engine_actor
from pdserve.model_prep import prepare_default_model
from pdserve.roofline.serving import default_chunk_size

logger = logging.getLogger(__name__)

ENGINE_START_TIMEOUT_S = 600.0


def resolve_model(config: PDServeConfig) -> Path:
    if config.model == DEFAULT_MODEL:
        return prepare_default_model()
    return Path(config.model).expanduser().resolve()


def with_planned_chunk(config: PDServeConfig, model_dir: Path) -> PDServeConfig:
    """Fill `engine.max_num_batched_tokens` from the roofline planner when the user set none."""
    engine = config.engine
    if engine.max_num_batched_tokens is not None:
        return config
    chunk = default_chunk_size(model_dir, engine.device, engine.max_num_seqs)
    if chunk is None:
        return config
    return config.model_copy(
        update={"engine": engine.model_copy(update={"max_num_batched_tokens": chunk})}
    )


def _init_ray(config: PDServeConfig) -> bool:
    """Start a local Ray (returns True) or join `ray.address` (returns False)."""
    if config.ray.address:
        ray.init(address=config.ray.address, logging_level=logging.WARNING)
        logger.info("joined Ray cluster at %s", config.ray.address)
        return False
    pools = config.pools
    resources = {
        "prefill_pool": float(max(1, pools.prefill.replicas)),
        "decode_pool": float(max(1, pools.decode.replicas)),
    }
    ray.init(
        num_cpus=config.ray.num_cpus,
        resources=resources,
        include_dashboard=False,
        logging_level=logging.WARNING,
    )
    logger.info("started a local Ray (%s CPUs)", ray.cluster_resources().get("CPU"))
    return True


def _start_pool(config: PDServeConfig, model_dir: Path, served: str, role: str, pool: PoolConfig):
    actors = [
        create_engine_actor(
            f"pdserve-{role}-{replica}", str(model_dir), served, config.engine, pool, replica
        )
        for replica in range(pool.replicas)
    ]
    return actors, [actor.start.remote() for actor in actors]


def _stop_actors(actors: list) -> None:
    if not actors:
        return
    try:
        ray.get([actor.shutdown.remote() for actor in actors], timeout=15)
    except Exception as error:  # an actor that is already dead cannot shut down
        logger.warning("engine shutdown: %s", error)
    for actor in actors:
        ray.kill(actor, no_restart=True)


def _request_exit(server, signum: int) -> None:
    logger.info("received %s; stopping", signal.Signals(signum).name)
    server.should_exit = True


def _raise_on_sigterm(signum, frame):
    raise SystemExit(128 + signum)


async def _serve_http(app, host: str, port: int, on_ready) -> None:
    """Serve until SIGINT/SIGTERM, then return normally (uvicorn would re-raise the signal)."""
    import uvicorn

    class _Server(uvicorn.Server):
        @contextlib.contextmanager
        def capture_signals(self):
            yield

    server = _Server(uvicorn.Config(app, host=host, port=port, log_level="warning"))
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, lambda s=signum: _request_exit(server, s))
    task = asyncio.create_task(server.serve())
    while not server.started and not task.done():
        await asyncio.sleep(0.05)
    if server.started:
        bound = server.servers[0].sockets[0].getsockname()
        on_ready(bound[0], bound[1])
    await task


def run(config: PDServeConfig, ready_file: str | None = None) -> int:
    from router.frontend import Frontend
    from router.openai_http import RouterState, create_app
    from router.pools import Node, Pool

    started = time.monotonic()
    signal.signal(signal.SIGTERM, _raise_on_sigterm)
    model_dir = resolve_model(config)
    config = with_planned_chunk(config, model_dir)
    served = config.router.served_model_name or model_dir.name
    owns_ray = _init_ray(config)
    actors: list = []
    try:
        if config.mode != "colocated":
            raise NotImplementedError(
                "disaggregated mode is not available yet; use mode: colocated"
            )
        actors, starting = _start_pool(
            config, model_dir, served, "colocated", config.pools.colocated
        )
        infos = ray.get(starting, timeout=ENGINE_START_TIMEOUT_S)
        nodes = [Node(info["name"], actor, info) for actor, info in zip(actors, infos, strict=True)]
        for info in infos:
            logger.info(
                "engine %s up in %.1f s (pid %s)", info["name"], info["start_s"], info["pid"]
            )
        frontend = Frontend(str(model_dir), served, infos[0]["max_model_len"])
        state = RouterState(frontend=frontend, pool=Pool("colocated", nodes), config=config.router)

        def on_ready(host: str, port: int) -> None:
            logger.info(
                "pdserve ready in %.1f s: serving %r on http://%s:%d (colocated, %d engine(s))",
                time.monotonic() - started,
                served,
                host,
                port,
                len(nodes),
            )
            if ready_file:
                Path(ready_file).write_text(json.dumps({"http": f"http://{host}:{port}"}))

        asyncio.run(
            _serve_http(create_app(state), config.router.host, config.router.http_port, on_ready)
        )
        logger.info("HTTP server stopped; shutting down")
        return 0
    finally:
        _stop_actors(actors)
        if owns_ray:
            ray.shutdown()
        logger.info("pdserve stopped")
