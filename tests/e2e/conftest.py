"""One real `pdserve serve` (real Ray, real vLLM CPU engine, real HTTP) shared by the session."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import psutil
import pytest

from pdserve.bench.compare import launch
from pdserve_core.roofline.serving import CPU_BLOCK_TOKENS

START_DEADLINE_S = 300
STOP_DEADLINE_S = 60


@dataclass
class Server:
    url: str
    process: subprocess.Popen
    log: Path
    model: str
    grpc: str = ""
    headers: dict = field(default_factory=dict)  # the API key, where the server has one
    routers: list[dict] = field(default_factory=list)
    """With several routers (`--routers N`): each one's {"http", "grpc", "pid"}, router 0 first."""


def _wait_ready(process: subprocess.Popen, ready: Path, log: Path) -> dict:
    deadline = time.monotonic() + START_DEADLINE_S
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(
                f"pdserve serve exited with {process.returncode}:\n{log.read_text()[-5000:]}"
            )
        if ready.exists() and ready.read_text():
            return json.loads(ready.read_text())
        time.sleep(0.2)
    raise TimeoutError(
        f"pdserve serve not ready in {START_DEADLINE_S} s:\n{log.read_text()[-5000:]}"
    )


def stop_and_check_nothing_left(process: subprocess.Popen) -> list[str]:
    """SIGTERM the server; return the descendants (Ray, vLLM) still alive after the deadline."""
    if process.poll() is not None:  # exited (and reaped) already: no tree left to walk
        return []
    tree = psutil.Process(process.pid).children(recursive=True)
    process.send_signal(signal.SIGTERM)
    process.wait(timeout=STOP_DEADLINE_S)
    _, alive = psutil.wait_procs(tree, timeout=STOP_DEADLINE_S)
    leftovers = [f"{p.pid} {p.name()}" for p in alive if p.is_running()]
    for p in alive:
        p.kill()
    return leftovers


def start_server(
    work: Path, *extra_args: str, api_key: str | None = None, env: dict | None = None
) -> Server:
    """Run `pdserve serve` (real Ray, real vLLM engines, real HTTP on a free loopback port)."""
    ready, log = work / "ready.json", work / "serve.log"
    env = dict(os.environ, **(env or {}), VLLM_RPC_BASE_PATH=str(work), PYTHONUNBUFFERED="1")
    command = [
        sys.executable,
        "-m",
        "pdserve.cli",
        "serve",
        "--port",
        "0",
        "--grpc-port",
        "0",
        "--ready-file",
        str(ready),
    ]
    with log.open("w") as out:  # in the tests' session (docs/benchmarks.md, "A server's session")
        process = launch([*command, *extra_args], out, env)
    try:
        urls = _wait_ready(process, ready, log)
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        models = httpx.get(f"{urls['http']}/v1/models", timeout=10, headers=headers).json()
        model = models["data"][0]["id"]
        return Server(
            urls["http"], process, log, model, urls["grpc"], headers, urls.get("routers", [])
        )
    except BaseException:  # never leave a server behind (it would hold its ports)
        stop_and_check_nothing_left(process)
        raise


def assert_utilization_within_one(server: Server) -> None:
    """Every node's compute and bandwidth utilization on the router's /metrics lies in [0, 1]:
    the peaks are measured in the engine's dtype with its threads, and a step that beats them
    raises them (router/metrics/cluster.py). Checked on each server as it ends, so every run of
    the suite checks it on its host, whatever the host's dtype."""
    names = ("pdserve_node_compute_utilization_ratio", "pdserve_node_bandwidth_utilization_ratio")
    ratios = {
        (sample.name, sample.labels.get("node")): sample.value
        for sample in samples(server)
        if sample.name in names
    }
    assert ratios, "no node's utilization on /metrics"  # every server here has served
    outside = {key: value for key, value in ratios.items() if not 0.0 <= value <= 1.0}
    assert not outside, f"utilization outside [0, 1]: {outside}"


def finish_server(server: Server) -> None:
    if server.process.poll() is None:
        try:
            assert_utilization_within_one(server)
        finally:  # stopped whatever the metrics say
            leftovers = stop_and_check_nothing_left(server.process)
        assert server.process.returncode == 0, server.log.read_text()[-3000:]
        assert leftovers == [], f"processes left after SIGTERM: {leftovers}"


_HOSTS: list = []
"""The emulated hosts while they are up (at most one cluster)."""


@pytest.fixture(scope="module")
def emulated_hosts():
    """Four emulated hosts with Ray on each (tests/e2e/hosts.py), brought up by the first module
    that serves on them and kept for the next (test_hosts, then test_hosts_nixl); taken down
    after the last test that uses them, as their idle Ray keeps 2.8 % of a 2-core machine busy."""
    from tests.e2e.hosts import hosts_up

    if not _HOSTS:
        _HOSTS.append(hosts_up())
    return _HOSTS[0]


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item, nextitem):
    yield  # the module's own fixtures (its `pdserve serve`) end first
    if _HOSTS and (nextitem is None or "emulated_hosts" not in nextitem.fixturenames):
        _HOSTS.pop().down()


@pytest.fixture(scope="session")
def server(default_model_dir, tmp_path_factory) -> Server:
    """The colocated server (what deploy/config/local-cpu-colocated.yaml serves), laid out by
    `--layout auto`: the default config, uniform traffic at 2 requests/s, the calibrations
    measured on a 2-core host filed as this host's: one engine on both cores wins there. Two
    routers serve it (`--routers 2`): the tests speak to router 0, and the module's last tests
    to router 1, then kill it."""
    from pdserve_core.engine.dtype import native_dtype
    from tests.helpers.layouts import file_measured_calibrations

    calibrations = file_measured_calibrations(
        tmp_path_factory.mktemp("calibration"), native_dtype(gpu=False)
    )
    server = start_server(
        tmp_path_factory.mktemp("serve"),
        "--layout",
        "auto",
        "--set",
        "layout.rate=2",
        "--set",
        "ray.num_cpus=2",
        "--routers",
        "2",
        env={"PDSERVE_CALIBRATION_DIR": str(calibrations)},
    )
    yield server
    finish_server(server)


def offline_reference(
    model_dir: Path, work: Path, completions: list, chats: list, dtype: str
) -> dict:
    """Greedy outputs of plain vLLM's offline `LLM` for the same prompts, one at a time, with
    the served engine's dtype, KV block, threads and binding
    (tests/helpers/offline_reference.py)."""
    from tests.conftest import REPO

    job = work / "job.json"
    job.write_text(
        json.dumps(
            {
                "model": str(model_dir),
                "dtype": dtype,
                "max_model_len": 2048,
                "block_size": CPU_BLOCK_TOKENS,
                "completions": completions,
                "chats": chats,
            }
        )
    )
    env = dict(
        os.environ,
        OMP_NUM_THREADS="2",
        VLLM_CPU_OMP_THREADS_BIND="0-1",
        VLLM_CPU_KVCACHE_SPACE="2",
        VLLM_RPC_BASE_PATH=str(work),
    )
    run = subprocess.run(
        [sys.executable, str(REPO / "tests/helpers/offline_reference.py"), str(job)],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    line = next(x for x in run.stdout.splitlines() if x.startswith("RESULT "))
    return json.loads(line.removeprefix("RESULT "))


CHAT = [{"role": "user", "content": "What is the capital of France?"}]
COMPLETIONS = [
    ("The capital of France is", 24),
    ("def fibonacci(n):", 40),
    ("Once upon a time, in a small village by the sea,", 32),
]


def assert_greedy_matches_plain_vllm(
    client, model: str, model_dir: Path, work: Path, dtype: str
) -> None:
    """The served greedy output equals plain vLLM's offline one, each prompt alone on both sides
    (greedy output depends on batch composition). Disaggregated servers compare in float32: in
    bf16 a prefill and a decode step may round differently on another CPU."""
    served = [
        client.completions.create(model=model, prompt=p, max_tokens=n, temperature=0)
        .choices[0]
        .text
        for p, n in COMPLETIONS
    ]
    chat = client.chat.completions.create(model=model, messages=CHAT, max_tokens=24, temperature=0)
    reference = offline_reference(model_dir, work, COMPLETIONS, [[CHAT, 24]], dtype)
    assert served == reference["completions"]
    assert chat.choices[0].message.content == reference["chats"][0]


# (path, JSON body, raw bytes instead of JSON, expected status, words the message must contain)
BAD_REQUESTS = [
    ("/v1/completions", None, b"{not json", 400, "JSON decode error"),
    ("/v1/completions", [1, 2], None, 400, "valid dictionary"),
    ("/v1/completions", {"max_tokens": 3}, None, 400, "prompt"),
    ("/v1/completions", {"prompt": 5}, None, 400, "prompt"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": "many"}, None, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 0}, None, 400, "max_tokens must be"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": -3}, None, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "hi " * 2100}, None, 400, "maximum context length"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 5000}, None, 400, "max_model_len"),
    ("/v1/completions", {"prompt": "hi", "temperature": -1}, None, 400, "temperature"),
    ("/v1/completions", {"prompt": "hi", "model": "gpt-9"}, None, 404, "gpt-9"),
    ("/v1/chat/completions", {"messages": "hello"}, None, 400, "messages"),
    ("/v1/chat/completions", {"messages": []}, None, 400, "empty conversation"),
    ("/v1/chat/completions", {"model": "x", "messages": CHAT}, None, 404, "does not exist"),
    # checked by vLLM's engine client, in the router before any node sees it (streamed: an error
    # event, as from vLLM's own server)
    ("/v1/completions", {"prompt": "hi", "logprobs": 21}, None, 400, "logprobs"),
    ("/v1/completions", {"prompt": "hi", "stop_token_ids": [10**9]}, None, 400, "stop_token_ids"),
    # engine-internal fields never reach an engine
    (
        "/v1/completions",
        None,
        b'{"prompt": "hi", "kv_transfer_params": {"do_remote_prefill": true, '
        b'"remote_num_tokens": 1e400}}',
        400,
        "kv_transfer_params",
    ),
    ("/v1/completions", {"prompt": "hi", "vllm_xargs": {"a": 1}}, None, 400, "vllm_xargs"),
]


def assert_rejected(server, path, body, raw, status, says, headers=None) -> None:
    headers = dict(headers or {})
    if raw:
        headers["content-type"] = "application/json"
        response = httpx.post(f"{server.url}{path}", content=raw, headers=headers, timeout=30)
    else:
        response = httpx.post(f"{server.url}{path}", json=body, headers=headers, timeout=30)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert says in error["message"]
    assert error["code"] == status


def samples(server: Server, router: int | None = None) -> list:
    """Every sample of one scrape of the router's /metrics: the one the tests speak to, or with
    `router`, that router of the server's (`--routers`)."""
    from prometheus_client.parser import text_string_to_metric_families

    url = server.url if router is None else server.routers[router]["http"]
    answer = httpx.get(f"{url}/metrics", headers=server.headers, timeout=10)
    answer.raise_for_status()
    return [s for family in text_string_to_metric_families(answer.text) for s in family.samples]


def metric(server: Server, name: str, **labels: str) -> float:
    """One sample of the router's /metrics (0 when the series is absent)."""
    for sample in samples(server):
        if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
            return sample.value
    return 0.0


NODE_STATS_DEADLINE_S = 10.0
"""How long a node counter may take to reach /metrics: the router polls node stats each second."""


def node_stats_settled(server: Server) -> None:
    """Return once every healthy node's figures on the router (/health, /metrics) were asked for
    after this call began: they count all the node did before it, so a counter read next holds
    every request that ended before the call (the router polls node stats each second)."""
    start = time.monotonic()
    deadline = start + NODE_STATS_DEADLINE_S
    while True:
        sent = time.monotonic()  # the router's clock is this host's monotonic clock
        answer = httpx.get(f"{server.url}/health", headers=server.headers, timeout=10)
        nodes = [n for pool in answer.json()["pools"].values() for n in pool["nodes"]]
        ages = [n["stats_age_s"] for n in nodes if n["healthy"]]
        # asked at (router's now) - age, and the router's now is past `sent`
        if ages and all(age is not None and sent - age > start + 0.01 for age in ages):
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"node stats not renewed in {NODE_STATS_DEADLINE_S} s: {nodes}")
        time.sleep(0.2)


def metric_reaching(server: Server, name: str, floor: float, **labels: str) -> float:
    """The sample once it is at least `floor`, or as it stands after `NODE_STATS_DEADLINE_S`
    (a node's counters reach the router with its next stats poll, not with the response)."""
    deadline = time.monotonic() + NODE_STATS_DEADLINE_S
    while (value := metric(server, name, **labels)) < floor and time.monotonic() < deadline:
        time.sleep(0.2)
    return value
