"""How far the routers carry tokens: 1, 2 and 4 router processes (`router.replicas`) over engine
nodes that cost nothing, so the routers alone are the limit.

The nodes are the real engine actor (`EngineActor`: Ray, the token stream, its frames) with a
fake engine in place of vLLM: each step (`--step-ms`; 0: as fast as asked) every running request
gets one token. The routers are the real ones, started by the real keeper (pdserve/routers.py)
and pinned one per core where there are cores for them. The client is a raw-socket SSE reader
(asyncio, no HTTP library) that spreads its requests over the routers in turn.

Phases, each `--seconds` long, for each router count:
- stream: 64 streams of 256 tokens each, nodes as fast as asked: tokens/s;
- short: 64 clients sending 4-token requests: requests/s;
- cadence: `--cadence-streams` streams at one token per 25 ms step each (a GPU decode node's
  cadence; 128 streams = 5,120 tokens/s asked): tokens/s delivered, the gap between a stream's
  tokens (p50, p99) against the step;
and for every phase the routers' CPU (cores busy, summed over the routers) and CPU per token or
request. On a 2-core host the client and the nodes share the cores with the routers, so the
scaling measured there is a floor.

Beside them (`--vllm`, on by default), what a user would run instead: vLLM's own OpenAI server
(its app and serving layer, built as `vllm serve` builds them, over vLLM's own `AsyncLLM`: input
processing, output processor, detokenizer, stat loggers) over an engine that costs nothing,
pinned to one core, twice:
- `vllm-core-process`: as `vllm serve` runs, its engine core in a process of its own (vLLM's
  scheduler and busy loop, reached over vLLM's ZMQ hop) whose executor has no model
  (`NullExecutor`: each step every scheduled request gets one token) — the API server pays what
  it pays in a real deployment, as the routers pay the token stream to their nodes;
- `vllm-null-core`: the same fake steps answered in the server's own process (`NullCore`, in
  place of vLLM's engine core client), so the ZMQ hop is not paid: a floor no deployment runs.
The same phases, the same client; CPU is the API server process's alone, as it is the routers'.
Both run on asyncio's own event loop: `vllm serve` runs its server on uvloop, which made vLLM's
server (and the router) slower on this benchmark (results/bench/router-scale/README.md), so the
baseline is the faster of the two for vLLM.
Writes
results/bench/router-scale/<cpu>-<cores>c.json:
    python benchmarks/router_scale.py [--routers 1 2 4] [--seconds 8] [--no-vllm]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import re
import secrets
import statistics
import sys
import time
from concurrent.futures import Future
from pathlib import Path
from types import SimpleNamespace

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import psutil  # noqa: E402
import ray  # noqa: E402
from vllm.v1.executor.abstract import Executor  # noqa: E402

from pdserve_core.engine.actor import EngineActor  # noqa: E402
from pdserve_core.engine.types import NodeInfo  # noqa: E402
from tests.helpers.engine_outputs import step_output  # noqa: E402

GPU_STEP_S = 0.025
READY = "null vLLM serves on port "
TOKEN = b"~"
"""Each fake token's text: nothing else in a response has it, so counting it counts tokens, however
many the router put in one event."""


class FakeEngine:
    """What the engine actor asks of vLLM's AsyncLLM, answered without a model: every step each
    running request gets one token (id 100 + its position, text `TOKEN`). `step_s` 0: each request
    yields its tokens as fast as its consumer takes them."""

    errored = False
    tokenizer = None

    def __init__(self, step_s: float) -> None:
        self.step_s = step_s
        self._tick = asyncio.Event()
        self._ticker = asyncio.get_running_loop().create_task(self._steps()) if step_s else None

    async def _steps(self) -> None:
        while True:
            await asyncio.sleep(self.step_s)
            self._tick.set()
            self._tick = asyncio.Event()

    async def generate(self, prompt, params, request_id):
        for i in range(params.max_tokens):
            if self.step_s:
                await self._tick.wait()
            else:
                await asyncio.sleep(0)
            last = i + 1 == params.max_tokens
            yield step_output(100 + i, TOKEN.decode(), last)

    async def abort(self, request_id: str) -> None:
        pass

    async def check_health(self) -> None:
        pass

    def shutdown(self) -> None:
        if self._ticker:
            self._ticker.cancel()


class FakeEngineActor(EngineActor):
    """The engine actor with `FakeEngine` as its engine."""

    async def start(self) -> NodeInfo:
        # what the actor's request path imports from vLLM, imported now as a real start does
        # (a first import there would hold the actor's loop for seconds)
        import vllm.exceptions  # noqa: F401
        import vllm.sampling_params  # noqa: F401
        import vllm.v1.engine.exceptions  # noqa: F401

        self._engine = FakeEngine(self._engine_args["step_s"])
        return NodeInfo(
            name=self._name,
            pid=os.getpid(),
            ray_node_id=ray.get_runtime_context().get_node_id(),
            max_model_len=4096,
            block_size=16,
            start_s=0.0,
            num_blocks=1 << 16,
        )


class NullCore:
    """vLLM's engine core as AsyncLLM reaches it (its `EngineCoreClient`), answered in the API
    server's own process without a model: each step (`step_s`; 0: as fast as the output
    handler asks) every running request gets one token, `token_id`, until its `max_tokens`."""

    engine_ranks_managed = [0]
    resources = SimpleNamespace(engine_dead=False)

    def __init__(self, step_s: float, token_id: int) -> None:
        self.step_s, self.token_id = step_s, token_id
        self.running: dict[str, int] = {}
        """Request id -> tokens still to give."""
        self.woken = asyncio.Event()

    async def get_supported_tasks_async(self) -> tuple[str, ...]:
        return ("generate",)

    async def add_request_async(self, request) -> None:
        self.running[request.request_id] = request.sampling_params.max_tokens
        self.woken.set()

    async def abort_requests_async(self, request_ids) -> None:
        for request_id in request_ids:
            self.running.pop(request_id, None)

    async def get_output_async(self):
        from vllm.v1.engine import EngineCoreOutput, EngineCoreOutputs, FinishReason

        while not self.running:
            self.woken.clear()
            await self.woken.wait()
        await asyncio.sleep(self.step_s)
        outputs = []
        for request_id, left in list(self.running.items()):
            done = left == 1
            finish = FinishReason.LENGTH if done else None
            outputs.append(EngineCoreOutput(request_id, [self.token_id], finish_reason=finish))
            if done:
                del self.running[request_id]
            else:
                self.running[request_id] = left - 1
        return EngineCoreOutputs(outputs=outputs, timestamp=time.monotonic())

    def dp_engines_running(self) -> bool:
        return False

    def get_kv_event_sources(self) -> list:
        return []

    def shutdown(self, timeout: float | None = None) -> None:
        pass


class NullExecutor(Executor):
    """vLLM's executor with no model, for an engine core process of vLLM's own (the
    `vllm-core-process` baseline): each step (`$NULL_STEP_S`; 0: as fast as the busy loop runs)
    every request the scheduler scheduled gets one token, `$NULL_TOKEN_ID`. Its KV cache is
    declared, never allocated."""

    def _init_executor(self) -> None:
        text = self.model_config.hf_text_config
        self._layers = text.num_hidden_layers
        self._kv_heads = getattr(text, "num_key_value_heads", None) or text.num_attention_heads
        self._head_size = text.hidden_size // text.num_attention_heads
        self._step_s = float(os.environ.get("NULL_STEP_S", "0"))
        self._token_id = int(os.environ.get("NULL_TOKEN_ID", "0"))

    def collective_rpc(self, method, timeout=None, args=(), kwargs=None, non_block=False):
        return _done([None]) if non_block else [None]  # no workers: nothing to tell

    def get_kv_cache_specs(self) -> list[dict]:
        import torch
        from vllm.v1.kv_cache_interface import FullAttentionSpec

        spec = FullAttentionSpec(
            block_size=self.cache_config.block_size or 16,
            num_kv_heads=self._kv_heads,
            head_size=self._head_size,
            dtype=torch.float32,
        )
        return [{f"model.layers.{i}.self_attn.attn": spec for i in range(self._layers)}]

    def get_supported_kv_cache_layouts(self) -> list[list[str]]:
        return [["LBNHC"]]

    def determine_available_memory(self) -> list[int]:
        return [64 << 30]  # declared only: room for every stream of the cadence phase

    def compile_or_warm_up_model(self) -> None:
        pass

    @property
    def supported_tasks(self) -> tuple[str, ...]:
        return ("generate",)

    def execute_model(self, scheduler_output, non_block: bool = False):
        from vllm.v1.outputs import ModelRunnerOutput

        if self._step_s:
            time.sleep(self._step_s)
        ids = list(scheduler_output.num_scheduled_tokens)
        output = ModelRunnerOutput(
            req_ids=ids,
            req_id_to_index={request_id: i for i, request_id in enumerate(ids)},
            sampled_token_ids=[[self._token_id] for _ in ids],
        )
        return _done(output) if non_block else output

    def check_health(self) -> None:
        pass

    def shutdown(self) -> None:
        pass


def _done(value):
    future: Future = Future()
    future.set_result(value)
    return future


def serve_null_vllm(model_dir: str, step_s: float, core: str) -> None:
    """`--serve-null-vllm`: vLLM's OpenAI app (built as `vllm serve` builds it) over vLLM's own
    `AsyncLLM` — its input processing, output processor and detokenizer, request queues and stat
    loggers — on a free loopback port; prints `READY` and the port once it serves. `core`:
    "process", vLLM's engine core in its own process over `NullExecutor`; "in-process",
    `NullCore` in this process."""
    import socket

    import uvicorn
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.entrypoints.launchers.api_server.app_state import init_app_state
    from vllm.entrypoints.launchers.app import build_app
    from vllm.tokenizers import get_tokenizer
    from vllm.usage.usage_lib import UsageContext
    from vllm.v1.engine import core_client
    from vllm.v1.engine.async_llm import AsyncLLM

    from router.faces.vllm_face import vllm_args

    args = vllm_args(model_dir, "m")

    async def main() -> None:
        [token_id] = get_tokenizer(model_dir).encode(TOKEN.decode(), add_special_tokens=False)
        if core == "process":  # the engine core process reads these
            os.environ |= {"NULL_STEP_S": str(step_s), "NULL_TOKEN_ID": str(token_id)}
            args.distributed_executor_backend = NullExecutor
        else:
            null = NullCore(step_s, token_id)
            core_client.EngineCoreClient.make_async_mp_client = staticmethod(lambda *a, **k: null)
        config = AsyncEngineArgs.from_cli_args(args).create_engine_config(
            UsageContext.OPENAI_API_SERVER
        )
        engine = AsyncLLM.from_vllm_config(config, usage_context=UsageContext.OPENAI_API_SERVER)
        tasks = await engine.get_supported_tasks()
        app = build_app(args, tasks, config.model_config)
        await init_app_state(engine, app.state, args, tasks)
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        server = uvicorn.Server(uvicorn.Config(app, log_level="warning", access_log=False))
        task = asyncio.create_task(server.serve(sockets=[sock]))
        while not server.started:
            await asyncio.sleep(0.05)
        print(f"{READY}{sock.getsockname()[1]}", flush=True)
        await task

    asyncio.run(main())


async def _sse(address, body: bytes, counts: dict, gaps: list | None, end: float) -> None:
    """POST one streamed request and read it until it ends or `end`: its tokens count while the
    phase runs, the gaps between reads that brought tokens go to `gaps`."""
    reader, writer = await asyncio.open_connection(*address)
    writer.write(
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Connection: close\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body)
    )
    last = None
    try:
        while True:
            left = end - time.monotonic()
            if left <= 0:
                return
            try:
                data = await asyncio.wait_for(reader.read(65536), left)
            except TimeoutError:
                return
            if not data:
                counts["requests"] += 1
                return
            seen = data.count(TOKEN)
            now = time.monotonic()
            if seen and gaps is not None:
                if last is not None:
                    gaps.append(now - last)
                last = now
            counts["tokens"] += seen
    finally:
        writer.close()


async def _phase(urls, body: dict, clients: int, seconds: float, gaps: list | None) -> dict:
    """`clients` loops, each sending `body` again as soon as its last ends, over the routers in
    turn, for `seconds`."""
    payload = json.dumps(body).encode()
    counts = {"tokens": 0, "requests": 0}
    end = time.monotonic() + seconds

    async def client(i: int) -> None:
        n = i
        while time.monotonic() < end:
            await _sse(urls[n % len(urls)], payload, counts, gaps, end)
            n += 1

    await asyncio.gather(*(client(i) for i in range(clients)))
    return counts


def _cpu(pids) -> float:
    total = 0.0
    for pid in pids:
        times = psutil.Process(pid).cpu_times()
        total += times.user + times.system
    return total


async def measure(urls, pids, body, clients, seconds, with_gaps=False) -> dict:
    await _phase(urls, body, clients, 1.0, None)  # warm: connections, caches
    gaps: list | None = [] if with_gaps else None
    before, began = _cpu(pids), time.monotonic()
    counts = await _phase(urls, body, clients, seconds, gaps)
    wall = time.monotonic() - began
    cores = (_cpu(pids) - before) / wall
    out = {
        "tokens_per_s": round(counts["tokens"] / wall, 1),
        "requests_per_s": round(counts["requests"] / wall, 1),
        "router_cores": round(cores, 3),
    }
    if counts["tokens"]:
        out["router_cpu_ms_per_token"] = round(1000 * cores * wall / counts["tokens"], 4)
    if counts["requests"]:
        out["router_cpu_ms_per_request"] = round(1000 * cores * wall / counts["requests"], 3)
    if gaps:
        gaps.sort()
        out["gap_p50_ms"] = round(1000 * statistics.median(gaps), 1)
        out["gap_p99_ms"] = round(1000 * gaps[int(0.99 * (len(gaps) - 1))], 1)
    return out


async def with_routers(count: int, nodes: list, infos: list, model_dir: Path, secret: str, use):
    """Run `count` routers over the nodes with the real keeper and call `await use(ready lines)`;
    then stop them."""
    from pdserve.routers import Keeper
    from pdserve_core.config import PDServeConfig

    config = PDServeConfig.model_validate(
        {
            "mode": "colocated",
            "pools": {"colocated": {"replicas": len(nodes)}},
            "router": {"replicas": count, "http_port": 0, "grpc_port": 0},
            "kv_transfer": {"secret": secret},
        }
    )
    keeper = Keeper(config, secret, {"colocated": nodes}, {"colocated": infos}, (model_dir, "m"))
    served = asyncio.get_running_loop().create_future()
    keeping = asyncio.create_task(keeper.keep(served.set_result))
    try:
        await asyncio.wait([served, keeping], return_when=asyncio.FIRST_COMPLETED)
        await use(served.result())
    finally:
        keeper.stop()
        await keeping


VLLM_SERVERS = {"process": "vllm-core-process", "in-process": "vllm-null-core"}
"""`serve_null_vllm`'s engine cores, and the name each baseline's points go by."""


def with_null_vllm(step_s: float, plan: dict, seconds: float, core: str) -> list[dict]:
    """The plan's phases against vLLM's own server over a null engine (`serve_null_vllm`, its
    engine core `core`), the server in a process of its own pinned to core 0 as router 0 is (an
    engine core process of vLLM's is not pinned, as the nodes are not)."""
    import subprocess

    command = [sys.executable, __file__, "--serve-null-vllm", str(step_s), "--null-core", core]
    server = subprocess.Popen(command, stdout=subprocess.PIPE, text=True)
    try:
        line = ""
        while not line.startswith(READY):  # vLLM's logs may come first
            line = server.stdout.readline()
            if not line:
                raise RuntimeError(f"vLLM's server exited with {server.wait()}")
        port = int(line.removeprefix(READY))
        psutil.Process(server.pid).cpu_affinity([0])
        points = []
        for phase, (body, clients, gaps) in plan.items():
            point = {"server": VLLM_SERVERS[core], "phase": phase, "clients": clients}
            point |= asyncio.run(
                measure([("127.0.0.1", port)], [server.pid], body, clients, seconds, gaps)
            )
            points.append({k.replace("router_", "server_"): v for k, v in point.items()})
        return points
    finally:
        _stop_with_children(psutil.Process(server.pid))
        server.wait(timeout=30)


def _stop_with_children(process: psutil.Process) -> None:
    """Stop `process` and every process it started (vLLM's engine core outlives its API server
    otherwise, and ignores SIGTERM once orphaned): SIGTERM, then SIGKILL to those left after
    10 s."""
    family = [process, *process.children(recursive=True)]
    for member in family:
        with contextlib.suppress(psutil.NoSuchProcess):
            member.terminate()
    _, left = psutil.wait_procs(family, timeout=10)
    for member in left:
        with contextlib.suppress(psutil.NoSuchProcess):
            member.kill()
    psutil.wait_procs(left, timeout=10)


def cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.machine()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--routers", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--nodes", type=int, default=2)
    parser.add_argument("--seconds", type=float, default=8.0)
    parser.add_argument("--cadence-streams", type=int, default=128)
    parser.add_argument("--out", type=Path)
    parser.add_argument(
        "--vllm",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="measure vLLM's own OpenAI server over a null engine beside the routers",
    )
    parser.add_argument(
        "--vllm-cores",
        nargs="+",
        choices=list(VLLM_SERVERS),
        default=list(VLLM_SERVERS),
        help="vLLM's baselines: its engine core in a process of its own over a null executor "
        "(as `vllm serve` runs), and/or a null core in the API server's process",
    )
    parser.add_argument("--serve-null-vllm", type=float, metavar="STEP_S", help=argparse.SUPPRESS)
    parser.add_argument("--null-core", choices=list(VLLM_SERVERS), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve_null_vllm is not None:  # the vLLM server's own process (below)
        from pdserve_core.model_prep import prepare_default_model

        serve_null_vllm(str(prepare_default_model()), args.serve_null_vllm, args.null_core)
        return 0

    from pdserve_core.model_prep import prepare_default_model

    model_dir = prepare_default_model()
    cores = os.cpu_count() or 1
    ray.init(address="local", namespace=f"bench-{secrets.token_hex(4)}", num_cpus=cores)
    secret = secrets.token_hex(32)
    results = {"host": cpu_model(), "cores": cores, "points": []}
    base = {"model": "m", "prompt": "hello", "stream": True, "ignore_eos": True}
    plans = {
        "fast": {
            "stream": ({**base, "max_tokens": 256}, 64, False),
            "short": ({**base, "max_tokens": 4}, 64, False),
        },
        "cadence": {"cadence": ({**base, "max_tokens": 2000}, args.cadence_streams, True)},
    }
    for label, step_s in (("fast", 0.0), ("cadence", GPU_STEP_S)):
        actor = ray.remote(FakeEngineActor)
        nodes = [
            actor.options(name=f"pdserve-colocated-{i}", max_concurrency=1000, num_cpus=0).remote(
                f"pdserve-colocated-{i}", {"step_s": step_s}, None, "127.0.0.1", None, secret
            )
            for i in range(args.nodes)
        ]
        infos = ray.get([node.start.remote() for node in nodes])
        for count in args.routers:

            async def use(ready, count=count, label=label):
                pids = [r["pid"] for r in ready]
                for i, pid in enumerate(pids):  # one core each, where there are cores
                    psutil.Process(pid).cpu_affinity([i % cores])
                urls = [("127.0.0.1", r["http_port"]) for r in ready]
                for phase, (body, clients, gaps) in plans[label].items():
                    point = {"routers": count, "phase": phase, "clients": clients}
                    point |= await measure(urls, pids, body, clients, args.seconds, gaps)
                    if phase == "cadence":
                        point["tokens_per_s_asked"] = round(clients / GPU_STEP_S)
                        point["step_ms"] = GPU_STEP_S * 1000
                    print(json.dumps(point), flush=True)
                    results["points"].append(point)

            asyncio.run(with_routers(count, nodes, infos, model_dir, secret, use))
        for node in nodes:
            ray.kill(node)
        if args.vllm:
            for core in args.vllm_cores:
                for point in with_null_vllm(step_s, plans[label], args.seconds, core):
                    print(json.dumps(point), flush=True)
                    results["points"].append(point)
    ray.shutdown()
    slug = re.sub(r"[^a-z0-9]+", "-", cpu_model().lower()).strip("-")
    out = args.out or REPO / "results/bench/router-scale" / f"{slug}-{cores}c.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=1) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
