"""Several routers over one set of pools (`router.replicas`): the keeper, and one router process.

With `router.replicas` N > 1, `pdserve serve` starts N router processes (`python -m
pdserve.serve`: `pdserve.serve.router_process`) with the nodes, so that each imports vLLM's front
while the engines build; once the nodes are up it tells each its part on stdin (the config, Ray's
address and namespace, the nodes' names and what each said at its start), and keeps them:

- router i serves HTTP on `router.http_port` + i and gRPC on `router.grpc_port` + i (each a free
  port where the config says 0), and prints one line when it serves: its ports and pid;
- the keeper's process owns the nodes' actors (so a router's death never takes a node with it)
  and serves nothing; it says "ready" once every router serves;
- a router that exits is started again on the same ports, after a pause that grows while it keeps
  dying young (1 s to 30 s); its streams ended with its connections, and each node stops a
  request whose router's token stream closed (the legs it opened are cancelled), which frees
  its KV;
- SIGINT / SIGTERM stops every router (each finishes gracefully, as one router does), then the
  nodes.

Router 0 alone exports the node and pool series at /metrics, so that summing a series over the
routers counts each node once; every router exports its own request series. A router's process
dies with the keeper (Linux's parent-death signal), so no router outlives the nodes.

With `pools.autoscale` the keeper alone decides (router/decides/autoscale.py): it health-checks
the nodes itself, runs the autoscaler over pools of its own, starts and stops nodes (it owns
their actors, so they outlive any router), and after each check tells every router its decision
and, when the pools changed, the roster that results (router/roster.py) — one JSON line on the
router's stdin each. Every router follows the roster; router 0 counts the decisions in
`pdserve_autoscale_decisions_total`. So each check is decided once, whatever the number of
routers, and a router started again is told the roster of its time.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import dataclasses
import json
import logging
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

import ray

from pdserve_core.config import PDServeConfig

logger = logging.getLogger(__name__)

READY_TIMEOUT_S = 300.0
"""How long a router process may take to serve (importing vLLM and building its server takes
10-40 s on a small CPU host, longer while several start at once)."""
BACKOFF_S = (1.0, 2.0, 5.0, 10.0, 30.0)
"""Pauses before starting a router that died again, each death within `YOUNG_S` of its start
moving one step on."""
YOUNG_S = 60.0
STOP_GRACE_S = 30.0
"""How long a stopping router may take to finish before it is killed."""


@dataclasses.dataclass
class _Router:
    index: int
    http_port: int
    grpc_port: int
    process: asyncio.subprocess.Process | None = None
    waiting: bool = False
    """`process` was started ahead (`spawn`) and waits for its task."""


async def spawn(index: int) -> asyncio.subprocess.Process:
    """Router `index`'s process: it imports what it serves with (vLLM's front, 5-10 s on a small
    CPU host), then waits for its task on stdin. `pdserve serve` starts them with the engines,
    so that a router has imported by the time the nodes are up."""
    return await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "pdserve.serve",
        str(index),
        str(os.getpid()),
        stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
    )


async def _spawn_all(count: int) -> list[asyncio.subprocess.Process]:
    return [await spawn(index) for index in range(count)]


@contextlib.contextmanager
def started_ahead(count: int):
    """Yields an event loop (`asyncio.Runner`) and `count` router processes spawned on it, for
    `Keeper(..., spawned=...)` and `keep` on the same loop. On the way out, a process still
    waiting (the start failed before the keeper took it) is killed, and the loop closed."""
    with asyncio.Runner() as runner:
        processes = runner.run(_spawn_all(count))
        try:
            yield runner, processes
        finally:
            for process in processes:
                if process.returncode is None:
                    with contextlib.suppress(ProcessLookupError):
                        process.kill()
                    runner.run(process.wait())


class Keeper:
    """Runs and keeps `router.replicas` router processes over the started nodes."""

    def __init__(
        self,
        config: PDServeConfig,
        secret: str,
        pools: dict[str, list],
        infos: dict[str, list],
        model: tuple[Path, str],
        scaling: tuple[dict[str, list], Any] | None = None,
        spawned: list[asyncio.subprocess.Process] | None = None,
    ) -> None:
        """`scaling`: with `pools.autoscale`, the nodes as the router sees them (role -> `Node`)
        and the factory that starts and stops nodes: the keeper then decides for the routers.
        `spawned`: router i's process for each i, started ahead (`spawn`) on the loop `keep`
        will run on; the keeper starts its own where there are none."""
        kv = config.kv_transfer.model_copy(update={"secret": secret})
        self._config = config.model_copy(update={"kv_transfer": kv})
        context = ray.get_runtime_context()
        self._part = {
            "ray_address": context.gcs_address,
            "namespace": context.namespace,
            "model_dir": str(model[0]),
            "served": model[1],
            "nodes": {pool: [dataclasses.asdict(info) for info in infos[pool]] for pool in pools},
        }
        http, grpc = config.router.http_port, config.router.grpc_port
        self._routers = [  # port 0 stays 0: a free port each
            _Router(i, http and http + i, grpc and grpc + i) for i in range(config.router.replicas)
        ]
        for router, process in zip(self._routers, spawned or (), strict=False):
            router.process, router.waiting = process, True
        self._stop = asyncio.Event()
        self._scaling = None if scaling is None else _Scaling(config, *scaling, self._tell)

    def _task(self, router: _Router) -> bytes:
        """What router `router` is told on its stdin: one line."""
        ports = {"http_port": router.http_port, "grpc_port": router.grpc_port}
        config = self._config.model_copy(
            update={"router": self._config.router.model_copy(update=ports)}
        )
        task = {**self._part, "config": config.model_dump(mode="json")}
        if self._scaling is not None:  # the pools as they are now
            task["nodes"] = self._scaling.roster
        return json.dumps(task).encode() + b"\n"

    def _tell(self, message: dict) -> None:
        """One line to every router that runs (the keeper's decisions, router/roster.py); not to
        one still waiting for its task, which carries the roster of its time."""
        line = json.dumps(message).encode() + b"\n"
        for router in self._routers:
            process = router.process
            if process is not None and process.returncode is None and not router.waiting:
                with contextlib.suppress(ConnectionError, RuntimeError):  # it is exiting
                    process.stdin.write(line)

    async def _start(self, router: _Router) -> dict:
        """Start `router`'s process (or take the one started ahead) and wait for its line saying
        where it serves."""
        if not router.waiting:
            router.process = await spawn(router.index)
        router.waiting = False
        process = router.process
        with contextlib.suppress(ConnectionError):  # it died waiting: its stdout says so below
            process.stdin.write(self._task(router))  # stdin stays open: the keeper's word follows
            await process.stdin.drain()
        try:
            line = await asyncio.wait_for(process.stdout.readline(), READY_TIMEOUT_S)
        except TimeoutError:
            process.kill()
            await process.wait()
            raise RuntimeError(
                f"router {router.index} did not serve within {READY_TIMEOUT_S:.0f} s"
            ) from None
        if not line:
            code = await process.wait()
            raise RuntimeError(f"router {router.index} exited ({code}) before it served")
        ready = json.loads(line)
        # it serves on these ports from now on, and again on them if started again
        router.http_port, router.grpc_port = ready["http_port"], ready["grpc_port"]
        return ready

    async def _keep(self, router: _Router, served: asyncio.Future) -> None:
        """Run `router` until the keeper stops, starting it again each time it exits."""
        step = 0
        while not self._stop.is_set():
            began = time.monotonic()
            try:
                ready = await self._start(router)
            except RuntimeError as error:
                if not served.done():
                    served.set_exception(error)
                    return
                logger.error("%s", error)
            else:
                if served.done():
                    logger.info(
                        "router %d serves again on port %d (pid %d)",
                        router.index,
                        ready["http_port"],
                        ready["pid"],
                    )
                else:
                    served.set_result(ready)
                code = await router.process.wait()
                if self._stop.is_set():
                    return
                logger.warning(
                    "router %d (pid %d) exited (%s); its streams ended with it; starting it again",
                    router.index,
                    ready["pid"],
                    _exit_reason(code),
                )
            step = step + 1 if time.monotonic() - began < YOUNG_S else 0
            pause = BACKOFF_S[min(step, len(BACKOFF_S) - 1)]
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stop.wait(), pause)

    async def keep(self, on_ready) -> None:
        """Start every router, call `on_ready(list of each router's ready line)` once all serve,
        and keep them until SIGINT / SIGTERM; then stop them."""
        loop = asyncio.get_running_loop()
        for signum in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(signum, self._stopping, signum)
        served = [loop.create_future() for _ in self._routers]
        keeping = [
            asyncio.create_task(self._keep(router, ready))
            for router, ready in zip(self._routers, served, strict=True)
        ]
        if self._scaling is not None:
            self._scaling.start()
        try:
            waiting = asyncio.gather(*served)
            stopped = asyncio.create_task(self._stop.wait())
            await asyncio.wait([waiting, stopped], return_when=asyncio.FIRST_COMPLETED)
            if waiting.done():
                on_ready(waiting.result())  # a router that could not start raises here
                await stopped
            else:
                waiting.cancel()
                await asyncio.gather(waiting, return_exceptions=True)
        finally:
            self._stop.set()
            if self._scaling is not None:
                await self._scaling.stop()
            await asyncio.gather(*(self._end(router) for router in self._routers))
            await asyncio.gather(*keeping, return_exceptions=True)

    def _stopping(self, signum: int) -> None:
        logger.info("received %s; stopping the routers", signal.Signals(signum).name)
        self._stop.set()

    def stop(self) -> None:
        """Stop every router (as SIGTERM does); `keep` returns once they have."""
        self._stop.set()

    async def _end(self, router: _Router) -> None:
        process = router.process
        if process is None or process.returncode is not None:
            return
        process.terminate()
        try:
            await asyncio.wait_for(process.wait(), STOP_GRACE_S)
        except TimeoutError:
            logger.warning(
                "router %d did not stop in %.0f s; killing it", router.index, STOP_GRACE_S
            )
            process.kill()
            await process.wait()


class _Scaling:
    """The keeper's autoscaler: its own pools and health checks over the nodes, the autoscaler
    over them, and `tell` after each check (the decision, and the roster when it changed)."""

    def __init__(self, config: PDServeConfig, members: dict[str, list], factory, tell) -> None:
        from router import build

        self._pools = build.pools(config, members)
        self._watches = build.memberships(config, self._pools.values(), prefix_aware=False)
        self._scaler = build.pool_scaler(
            config, self._pools["prefill"], self._pools["decode"], self._decided, factory
        )
        self._tell = tell
        self.roster = self._describe()

    def _describe(self) -> dict[str, list[dict]]:
        from router.roster import describe

        return describe(self._pools)

    def _decided(self, decision) -> None:
        message: dict[str, Any] = {
            "decision": {"action": decision.action, "reason": decision.reason}
        }
        roster = self._describe()
        if roster != self.roster:  # a move or a removal now, a node started since the last
            self.roster = message["roster"] = roster
        self._tell(message)

    def start(self) -> None:
        for watch in self._watches:
            watch.start()
        self._scaler.start()

    async def stop(self) -> None:
        await self._scaler.stop()
        for watch in self._watches:
            await watch.stop()


def _exit_reason(code: int) -> str:
    if code < 0:
        return f"signal {signal.Signals(-code).name}"
    return f"exit code {code}"


def die_with(keeper: int) -> None:
    """Have Linux send this process SIGTERM when its parent, the keeper, dies."""
    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    if os.getppid() != keeper:  # the keeper died before the line above
        raise SystemExit("router: its keeper is gone")
