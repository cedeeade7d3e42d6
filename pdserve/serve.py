"""`pdserve serve`: start (or join) Ray, place the engine pools, and serve the router's APIs.

Order of events: resolve the model folder → Ray, while vLLM's front checks the front-end flags
(a bad flag stops here, before any engine) → router processes, if several (they import while the
engines start) → engine actors (started in parallel, each with a start deadline) → router HTTP
server → "ready" log line (and optional ready file) →
serve until SIGINT/SIGTERM → stop the HTTP server, shut the engines down, kill their actors,
and shut down the Ray this process started. A signal during start-up takes the same clean-up path.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import json
import logging
import os
import secrets
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

import ray

from pdserve import LOG_FORMAT
from pdserve.nodes import ENGINE_START_TIMEOUT_S, RayNodeFactory, place_pools, ray_node
from pdserve_core.config import DEFAULT_MODEL, PDServeConfig, engine_threads
from pdserve_core.model_prep import prepare_default_model
from pdserve_core.roofline.serving import default_chunk_size

logger = logging.getLogger("pdserve.serve")  # as well when run as `python -m pdserve.serve`


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


@contextlib.contextmanager
def ray_token_private():
    """Ray's token (`RAY_AUTH_TOKEN_PATH`, else ~/.ray/auth_token) kept to its owner. Ray writes
    the file with the process's umask — 0644 by default, readable by every local user, who could
    then run code in the cluster — so Ray starts under umask 0077 here (its session files too),
    and a token file found or written is made 0600 in a 0700 folder."""
    default = Path.home() / ".ray" / "auth_token"
    path = Path(os.environ.get("RAY_AUTH_TOKEN_PATH") or default)

    def tighten() -> None:
        if path == default and path.parent.is_dir():
            path.parent.chmod(0o700)
        if path.is_file():
            path.chmod(0o600)

    tighten()
    old = os.umask(0o077)
    try:
        yield
    finally:
        os.umask(old)
        tighten()


def _namespace() -> str:
    """This run's Ray namespace: its nodes' names are its own on a shared cluster, and its other
    router processes (`router.replicas`) find the nodes there by name."""
    return f"pdserve-{secrets.token_hex(4)}"


def _init_ray(config: PDServeConfig) -> bool:
    """Start a local Ray (returns True) or join `ray.address` (returns False).

    Without an address this always starts a new Ray of its own (`address="local"`): a bare
    `ray.init()` would join the cluster named in Ray's `ray_current_cluster` file (the last one
    `ray start` made on this machine), whoever made it."""
    if config.ray.address:
        with ray_token_private():
            ray.init(
                address=config.ray.address, namespace=_namespace(), logging_level=logging.WARNING
            )
        logger.info("joined Ray cluster at %s", config.ray.address)
        return False
    if os.environ.get("RAY_AUTH_MODE") == "disabled":
        logger.warning(
            "Ray's token authentication is off (RAY_AUTH_MODE=disabled): Ray listens on this "
            "host's address (Ray 2.60 has no loopback-only mode), so anyone who reaches its "
            "ports can run code in this cluster"
        )
    pools = config.pools
    resources = {
        "prefill_pool": float(max(1, pools.prefill.replicas)),
        "decode_pool": float(max(1, pools.decode.replicas)),
    }
    with ray_token_private():
        ray.init(
            address="local",
            namespace=_namespace(),
            num_cpus=config.ray.num_cpus,
            resources=resources,
            include_dashboard=False,
            logging_level=logging.WARNING,
        )
    logger.info("started a local Ray (%s CPUs)", ray.cluster_resources().get("CPU"))
    return True


def _members(config: PDServeConfig, pools: dict[str, list], infos: dict[str, list], secret: str):
    """The router's view of each placed actor: a node reached through Ray, by pool."""
    return {
        name: [
            ray_node(config, actor, info, secret)
            for actor, info in zip(actors, infos[name], strict=True)
        ]
        for name, actors in pools.items()
    }


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


async def _serve(
    service, config: PDServeConfig, on_ready, scaler=None, model=None, listen=None
) -> None:
    """Serve HTTP and gRPC until SIGINT/SIGTERM, with the pools' health watchers alongside;
    then stop both servers gracefully and return (uvicorn would re-raise the signal).
    `listen(loop)`: starts following the keeper (several routers)."""
    import uvicorn

    from router.faces.connections import uvicorn_config
    from router.faces.grpc_api import create_server, follow_pools
    from router.faces.vllm_face import Renderer, serve_app

    class _Server(uvicorn.Server):
        @contextlib.contextmanager
        def capture_signals(self):
            yield

    from router import build

    watches = build.memberships(config, service.dispatcher.pools.values())
    for watch in watches:
        watch.start()
    if scaler is not None:
        scaler.start()
    if listen is not None:
        listen(asyncio.get_running_loop())
    router = config.router
    host = router.host
    tls = router.tls.files() if router.tls else None
    model_dir, served = model
    app = await serve_app(service, config, str(model_dir), served)
    grpc_server, grpc_port, grpc_health = await create_server(
        service, Renderer(app.state), f"{host}:{router.grpc_port}", router, tls
    )
    health_task = asyncio.create_task(follow_pools(grpc_health, service.dispatcher))
    http = _Server(
        uvicorn_config(
            app,
            host,
            router.http_port,
            router.max_connections,
            router.header_timeout_s,
            tls=tls,
            per_client=router.max_connections_per_client,
        )
    )
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, lambda s=signum: _request_exit(http, s))
    task = asyncio.create_task(http.serve())
    while not http.started and not task.done():
        await asyncio.sleep(0.05)
    if http.started:
        on_ready(host, http.servers[0].sockets[0].getsockname()[1], grpc_port)
    await task
    health_task.cancel()
    await asyncio.gather(health_task, return_exceptions=True)
    await grpc_health.enter_graceful_shutdown()
    await grpc_server.stop(grace=5)
    if scaler is not None:
        await scaler.stop()
    for watch in watches:
        await watch.stop()


def _log_autoscale(config: PDServeConfig) -> None:
    policy = config.pools.autoscale
    logger.info(
        "autoscale on: a check every %.0f s, %d-%s prefill and %d-%s decode nodes; replicas %s",
        policy.interval_s,
        policy.min_prefill,
        policy.max_prefill or "any",
        policy.min_decode,
        policy.max_decode or "any",
        "fixed"
        if policy.add_above is None and policy.remove_below is None
        else f"added at pressure >= {policy.add_above}, removed below {policy.remove_below}",
    )


def layout_advice(config: PDServeConfig, host_cores: int | None = None) -> str | None:
    """What a user on a small CPU host should be told about the split it is getting: measured on
    two cores (docs/design.md, "Two cores"), one engine on both cores serves uniform prompts
    faster, the split streams smoothly past long prompts. None where that does not apply (a GPU,
    a joined cluster, colocated, more cores than measured)."""
    if config.mode != "disaggregated" or config.ray.address:
        return None
    pools = config.pools
    if pools.prefill.num_gpus or pools.decode.num_gpus:
        return None
    cores = config.ray.num_cpus or host_cores or os.cpu_count() or 1
    threads = engine_threads(config.engine, pools.decode)
    if cores > 2 or threads >= cores:
        return None
    return (
        f"this host has {cores} cores and the decode engine {threads} thread"
        f"{'s' * (threads != 1)}: measured on such a host, uniform prompts are served faster by "
        "one engine on both cores (--set mode=colocated: plain vLLM's speed), this split "
        "streams more smoothly when long prompts arrive among streams, and --layout auto "
        "chooses for the traffic in the config's `layout` section (docs/design.md, 'Two "
        "cores'; results/bench/layouts)"
    )


def serve_router(
    config: PDServeConfig,
    secret: str,
    pools: dict[str, list],
    infos: dict[str, list],
    model: tuple[Path, str],
    on_ready,
    factory: RayNodeFactory | None = None,
    node_series: bool = True,
    keeper: Any = None,
) -> None:
    """One router over the started nodes (`pools`: their actors, `infos`: what each said at its
    start), serving until SIGINT/SIGTERM. `factory`: the autoscaler's, if this router runs it;
    `node_series`: whether its /metrics exports the cluster's series (the nodes, the pools, the
    keeper's autoscale decisions); `keeper`: the lines of the keeper that runs this router, to
    follow (pdserve/routers.py)."""
    from router import build
    from router.decides.admission import Admission
    from router.metrics import RouterMetrics
    from router.service import RouterService

    dispatcher = build.dispatcher(config, _members(config, pools, infos, secret))
    metrics = RouterMetrics(
        dispatcher.pools,
        dispatcher.mode,
        tpot_target_s=config.router.tpot_target_s,
        nodes=node_series,
    )
    metrics.watch(dispatcher)
    scaler = None if factory is None else build.scaler(config, dispatcher, factory=factory)
    if scaler is not None:
        metrics.watch_autoscale(scaler)
        _log_autoscale(config)
    admission = Admission(config.router.max_outstanding_requests)
    service = RouterService(
        dispatcher,
        metrics,
        admission,
        build.retry_policy(config),
        config.router.request_timeout_s,
        build.request_limits(config),
    )
    metrics.in_flight.set_function(lambda: admission.outstanding)
    listen = None
    if keeper is not None:
        counting = node_series and config.pools.autoscale.enabled
        count = metrics.count_autoscale() if counting else None
        listen = _follower(keeper, dispatcher, lambda info: _reach(config, info, secret), count)
    asyncio.run(_serve(service, config, on_ready, scaler, model, listen))


def _reach(config: PDServeConfig, info, secret: str):
    """A node this router has not met, by its name in the run's Ray namespace."""
    return ray_node(config, ray.get_actor(info.name), info, secret)


def node_info(described: dict[str, Any]):
    """A node's start info as the keeper sends it (JSON)."""
    from pdserve_core.engine.types import NodeInfo

    return NodeInfo(**{**described, "kv_ports": tuple(described["kv_ports"])})


def _follower(lines, dispatcher, reach, count=None):
    """What a router does with the keeper's lines after its task: make its pools hold each
    roster (router/roster.py; `reach(info)`: a node it has not met), and `count(action,
    reason)` each decision (router 0). Returns `listen(loop)`, which starts reading them (a
    thread: a pipe) onto the loop."""
    from router.roster import follow

    def heard(line: str) -> None:
        try:
            message = json.loads(line)
            if "roster" in message:
                roster = {
                    role: [node_info(info) for info in infos]
                    for role, infos in message["roster"].items()
                }
                for change in follow(dispatcher.pools, roster, reach):
                    logger.info("autoscale, as the keeper decided: %s", change)
            if count is not None and "decision" in message:
                count(message["decision"]["action"], message["decision"]["reason"])
        except Exception:  # a bad line costs that line, not the router
            logger.exception("the keeper's line %r", line[:200])

    def listen(loop: asyncio.AbstractEventLoop) -> None:
        def read() -> None:
            for line in lines:
                loop.call_soon_threadsafe(heard, line)

        threading.Thread(target=read, name="keeper", daemon=True).start()

    return listen


def _check_front_flags(config: PDServeConfig, model_dir: str, served: str) -> str | None:
    """vLLM's own check of the front-end flags (`router.vllm_args`): what is wrong, or None. Run
    while Ray starts (under umask 0077, `ray_token_private`): importing vLLM's front and parsing
    its flags write no file but a private temporary one (vLLM 0.32, traced)."""
    from router.faces.vllm_face import front_flags, vllm_args

    try:
        vllm_args(model_dir, served, front_flags(config))
    except (TypeError, ValueError) as error:
        return str(error)
    except SystemExit:  # its argparse's exit, in this thread
        return f"vLLM's parser refused {config.router.vllm_args} (its message above)"
    return None


def run(config: PDServeConfig, ready_file: str | None = None) -> int:
    started = time.monotonic()
    signal.signal(signal.SIGTERM, _raise_on_sigterm)
    model_dir = resolve_model(config)
    config = with_planned_chunk(config, model_dir)
    served = config.router.served_model_name or model_dir.name
    advice = None if config.layout.auto else layout_advice(config)  # auto: laid out by the CLI
    if advice:
        logger.warning("layout: %s", advice)
    with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="flags") as pool:
        checked = pool.submit(_check_front_flags, config, str(model_dir), served)
        owns_ray = _init_ray(config)  # while vLLM's front is imported and checks the flags
        problem = checked.result()
    if problem:  # before any engine starts
        logger.error("router.vllm_args: %s", problem)
        if owns_ray:
            ray.shutdown()
        return 2
    try:
        ahead = contextlib.nullcontext()
        if config.router.replicas > 1:  # they import vLLM's front while the engines start
            from pdserve.routers import started_ahead

            ahead = started_ahead(config.router.replicas)  # under Ray's settings (its auth)
        with ahead as routers:
            return _start_and_serve(config, (model_dir, served), ready_file, started, routers)
    finally:
        if owns_ray:
            ray.shutdown()
        logger.info("pdserve stopped")


def _start_and_serve(
    config: PDServeConfig,
    model: tuple[Path, str],
    ready_file: str | None,
    started: float,
    routers: tuple[asyncio.Runner, list] | None,
) -> int:
    """The engines, then the router (or the keeper of `routers`: their loop and their processes,
    started ahead), serving until SIGINT/SIGTERM; the engines stopped whatever happens."""
    model_dir, served = model
    actors: list = []
    try:
        secret = config.kv_transfer.secret or secrets.token_hex(32)
        pools = place_pools(config, str(model_dir), served, secret)
        actors = [actor for group in pools.values() for actor in group]
        names = [(name, i) for name, group in pools.items() for i in range(len(group))]
        started_infos = ray.get(
            [actor.start.remote() for actor in actors], timeout=ENGINE_START_TIMEOUT_S
        )
        infos: dict[str, list] = {name: [] for name in pools}
        for (name, _), info in zip(names, started_infos, strict=True):
            infos[name].append(info)
            logger.info(
                "%s engine %s up in %.1f s (pid %s)", name, info.name, info.start_s, info.pid
            )
        sizes = ", ".join(f"{len(group)} {name}" for name, group in pools.items())
        scheme = "https" if config.router.tls else "http"

        def urls(host: str, port: int, grpc_port: int) -> dict[str, str]:
            return {"http": f"{scheme}://{host}:{port}", "grpc": f"{host}:{grpc_port}"}

        def ready(routers: list[dict]) -> None:
            """Every router serves: say where (router i's ports and pid, for several)."""
            host = config.router.host
            where = [urls(host, r["http_port"], r["grpc_port"]) for r in routers]
            logger.info(
                "pdserve ready in %.1f s: serving %r on %s%s (%s: %s)",
                time.monotonic() - started,
                served,
                ", ".join(f"{w['http']} and grpc {w['grpc']}" for w in where),
                " (TLS)" if config.router.tls else "",
                config.mode,
                sizes,
            )
            if ready_file:
                described = dict(where[0])
                if len(routers) > 1:
                    described["routers"] = [
                        {**w, "pid": r["pid"]} for w, r in zip(where, routers, strict=True)
                    ]
                Path(ready_file).write_text(json.dumps(described))

        if config.router.replicas > 1:
            from pdserve.routers import Keeper

            scaling = None
            if config.pools.autoscale.enabled:  # decided once, in the keeper
                factory = RayNodeFactory(config, model_dir, served, secret, actors)
                scaling = (_members(config, pools, infos, secret), factory)
                _log_autoscale(config)
            runner, spawned = routers
            keeper = Keeper(config, secret, pools, infos, (model_dir, served), scaling, spawned)
            try:
                runner.run(keeper.keep(ready))
            except RuntimeError as error:  # a router that could not start (its log says why)
                logger.error("%s; shutting down", error)
                return 1
            logger.info("routers stopped; shutting down")
        else:
            factory = RayNodeFactory(config, model_dir, served, secret, actors)

            def on_ready(host: str, port: int, grpc_port: int) -> None:
                ready([{"http_port": port, "grpc_port": grpc_port, "pid": os.getpid()}])

            serve_router(config, secret, pools, infos, (model_dir, served), on_ready, factory)
            logger.info("HTTP and gRPC servers stopped; shutting down")
        return 0
    finally:
        _stop_actors(actors)


def _import_front() -> None:
    """What a router serves with, imported before its task comes: vLLM's front most of all."""
    import uvicorn  # noqa: F401

    import router.build  # noqa: F401
    import router.faces.grpc_api  # noqa: F401
    import router.faces.vllm_face  # noqa: F401
    import router.service  # noqa: F401


def router_process(argv: list[str]) -> int:
    """One router of several (`router.replicas`, pdserve/routers.py), `python -m pdserve.serve
    INDEX KEEPER_PID`: import what it serves with, read its task on stdin, join the run's Ray,
    find the nodes by name, serve until SIGTERM."""
    from pdserve.routers import die_with

    if len(argv) != 2 or not all(arg.isdigit() for arg in argv):
        raise SystemExit(
            "usage: python -m pdserve.serve INDEX KEEPER_PID (started by pdserve serve)"
        )
    index, keeper = map(int, argv)
    logging.basicConfig(level=logging.INFO, format=f"router {index}: {LOG_FORMAT}")
    die_with(keeper)
    to_keeper = os.dup(1)  # the keeper reads one line here: where this router serves
    os.dup2(2, 1)  # anything else printed goes to the log
    began = time.monotonic()
    _import_front()
    logger.info("imported in %.1f s; waiting for the nodes", time.monotonic() - began)
    line = sys.stdin.readline()  # its task, then the keeper's word, line by line
    if not line:  # the keeper's start failed before it had nodes to tell of
        return 0
    task: dict[str, Any] = json.loads(line)
    config = PDServeConfig.model_validate(task["config"])
    with ray_token_private():
        ray.init(
            address=task["ray_address"],
            namespace=task["namespace"],
            logging_level=logging.WARNING,
        )
    infos = {pool: [node_info(info) for info in group] for pool, group in task["nodes"].items()}
    pools = {pool: [ray.get_actor(info.name) for info in group] for pool, group in infos.items()}

    def on_ready(host: str, port: int, grpc_port: int) -> None:
        line = {"http_port": port, "grpc_port": grpc_port, "pid": os.getpid()}
        os.write(to_keeper, (json.dumps(line) + "\n").encode())
        os.close(to_keeper)

    try:
        serve_router(
            config,
            config.kv_transfer.secret,
            pools,
            infos,
            (Path(task["model_dir"]), task["served"]),
            on_ready,
            node_series=index == 0,
            keeper=sys.stdin,
        )
    finally:
        ray.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(router_process(sys.argv[1:]))
