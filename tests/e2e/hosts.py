"""A pdserve cluster on emulated hosts (network namespaces), brought up with the deploy files'
own commands: Ray started on each host from `deploy/ray/pdserve-cluster.yaml`, `pdserve serve`
on the head with `deploy/config/cluster-cpu.yaml`, and the client on this machine reaching the
router across the head's link. Used by tests/e2e/test_hosts.py and test_hosts_nixl.py, which
share the hosts; needs root."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import yaml

from pdserve.hosts import EmulatedCluster, HostsError
from pdserve.hosts.ray_hosts import cluster_env, restart_host, start_ray
from tests.conftest import REPO
from tests.e2e.conftest import Server, _wait_ready, assert_utilization_within_one

PREFIX, SUBNET = "pdt", "127.102.0.0/24"
HOSTS = ["head", "prefill", "decode0", "decode1"]
API_KEY = "emulated-cluster-test-key"
LAUNCHER = REPO / "deploy/ray/pdserve-cluster.yaml"


@dataclass
class HostCluster:
    hosts: EmulatedCluster
    server: Server
    serve: subprocess.Popen

    def node_host(self, pid: int) -> str:
        """The host a node's process runs on (the hosts share one process table)."""
        for host in self.hosts:
            if pid in self.hosts.pids(host.name):
                return host.name
        raise AssertionError(f"pid {pid} is on no host")

    def link_bytes(self, host: str, direction: str) -> int:
        """Bytes the host's link carried: `from` the host into the bridge, or `to` it."""
        name = "rx_bytes" if direction == "from" else "tx_bytes"
        link = self.hosts.host(host).link
        return int(Path(f"/sys/class/net/{link}/statistics/{name}").read_text())


def config_for_test(
    work: Path, dtype: str = "float32", kv: dict | None = None, routers: int = 1
) -> Path:
    """deploy/config/cluster-cpu.yaml as written, with what a test needs on top: float32 (exact
    comparisons), every prompt prefilled on the prefill host (every request's KV crosses a
    link), cached prompt tokens in usage, `routers` routers on the head, and short leases
    (blocks of a cut pull come back within the test); `kv`: more `kv_transfer` settings."""
    config = yaml.safe_load((REPO / "deploy/config/cluster-cpu.yaml").read_text())
    config["engine"]["dtype"] = dtype
    config["router"]["placement"] = {"mode": "remote"}
    config["router"]["enable_prompt_tokens_details"] = True
    config["router"]["replicas"] = routers
    config["kv_transfer"]["lease_s"] = 20
    config["kv_transfer"].update(kv or {})
    path = work / "cluster.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def hosts_up() -> EmulatedCluster:
    """The four hosts up, Ray started on each with the launcher file's commands (a cluster left
    by an interrupted run taken down first). The modules that serve on them share one
    (`emulated_hosts` in tests/e2e/conftest.py): Ray's start on four hosts is 15 s of a
    2-core machine, paid once."""
    try:
        EmulatedCluster.find(PREFIX).down()
    except HostsError:
        pass
    hosts = EmulatedCluster.up(HOSTS, PREFIX, SUBNET)
    try:
        roles = {"head": "head", "prefill": "prefill_gpu"}
        roles |= {"decode0": "decode_gpu", "decode1": "decode_gpu"}
        start_ray(hosts, roles, LAUNCHER)
    except BaseException:
        hosts.down()
        raise
    return hosts


def bring_up(
    hosts: EmulatedCluster,
    work: Path,
    dtype: str = "float32",
    kv: dict | None = None,
    routers: int = 1,
) -> HostCluster:
    """`pdserve serve` ready on the head of `hosts` with `routers` routers (the server's `routers`
    list their URLs at the head's address, router 0 first). A host whose raylet has ended (Ray
    declared it dead while an earlier module had its cable out) gets Ray started again first."""
    for host in hosts:
        if not any("raylet" in _name(pid) for pid in hosts.pids(host.name)):
            restart_host(hosts, host.name, LAUNCHER)
    ready, log = work / "ready.json", work / "serve.log"
    env = cluster_env(hosts, "head") | {
        "PDSERVE_API_KEY": API_KEY,
        "VLLM_RPC_BASE_PATH": str(work),
        "PYTHONUNBUFFERED": "1",
    }
    command = [sys.executable, "-m", "pdserve.cli", "serve"]
    command += [
        "--config",
        str(config_for_test(work, dtype, kv, routers)),
        "--port",
        "0",
        "--grpc-port",
        "0",
    ]
    with log.open("w") as out:
        serve = hosts.popen(
            "head", [*command, "--ready-file", str(ready)], stdout=out,
            stderr=subprocess.STDOUT, env=env,
        )  # fmt: skip
    try:
        urls = _wait_ready(serve, ready, log)
        head = hosts.address("head")

        def at_head(http: str) -> str:  # the router listens on every interface of the head
            return f"http://{head}:{http.rsplit(':', 1)[1]}"

        url = at_head(urls["http"])
        one = [{**urls, "pid": serve.pid}]  # the ready file lists routers only when several
        each = [{**r, "http": at_head(r["http"])} for r in urls.get("routers", one)]
        headers = {"Authorization": f"Bearer {API_KEY}"}
        model = httpx.get(f"{url}/v1/models", headers=headers, timeout=10).json()["data"][0]["id"]
        server = Server(url, serve, log, model, "", headers, routers=each)
        return HostCluster(hosts, server, serve)
    except BaseException:
        _stop(hosts, serve)
        raise


def tear_down(cluster: HostCluster) -> list[str]:
    """Stop the router (it stops its engines; the hosts and their Ray stay up for the next
    module); returns the engine processes still running on a host 30 s later, which are then
    ended."""
    try:
        if cluster.serve.poll() is None:
            assert_utilization_within_one(cluster.server)
    finally:  # stopped whatever the metrics say
        left = _stop(cluster.hosts, cluster.serve)
    return left


def _stop(hosts: EmulatedCluster, serve: subprocess.Popen) -> list[str]:
    if serve.poll() is None:
        serve.terminate()
        try:
            serve.wait(timeout=90)
        except subprocess.TimeoutExpired:
            serve.kill()

    def engines() -> list[tuple[str, int]]:
        return [
            (host.name, pid)
            for host in hosts
            for pid in hosts.pids(host.name)
            if _name(pid).startswith(("ray::DecodeNode", "ray::PrefillNode", "VLLM"))
        ]

    deadline = time.monotonic() + 30
    while (left := engines()) and time.monotonic() < deadline:
        time.sleep(0.5)
    said = [f"{host}: {pid} {_name(pid)}" for host, pid in left]
    for _, pid in left:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    return said


def _name(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0].decode()
    except OSError:
        return ""


def wait_for(condition, timeout_s: float, what: str, poll_s: float = 0.2):
    """Poll `condition` until it returns something true; fail naming `what` at the deadline."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(poll_s)
    raise AssertionError(f"{what}: not within {timeout_s} s")


def can_make_hosts() -> str | None:
    """Why this machine cannot run the emulated cluster (None: it can)."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    if subprocess.run(["ip", "netns", "list"], capture_output=True).returncode != 0:
        return "`ip netns` is not available"
    return None
