"""Ray on the emulated hosts, started with the cluster launcher file's own commands.

`deploy/ray/pdserve-cluster.yaml` says how each host type starts Ray (`head_start_ray_commands`,
`worker_start_ray_commands`) and what it advertises (`available_node_types.*.resources`). On
the emulated cluster each host runs its type's command as written, through a shell, with what
the launcher would add on a real cloud:
- `$RAY_HEAD_IP` is the head host's address; the launcher's `--autoscaling-config` (a file it
  writes on the head) is left out: the emulated cluster has a fixed set of hosts;
- `--node-ip-address` the host's own address (a host has one interface besides loopback);
- `--resources` the host type's custom resources (the pool it serves), one unit per engine the
  host is to hold, `--num-cpus` the cores it lends (the launcher takes both from the node type);
- `--temp-dir` a folder of the host's own: hosts share the machine's file system, and Ray's
  sessions, sockets and logs must not;
- the cluster's token in `RAY_AUTH_TOKEN_PATH` (the launcher copies `~/.ray/auth_token` to every
  host; here every host reads one file made for this cluster, and `~/.ray` is not touched);
- `VLLM_HOST_IP` the host's address: vLLM finds its own by routing towards a public address,
  which a host with no default route has not.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import shlex
import sys
from dataclasses import dataclass
from pathlib import Path

import yaml

from pdserve.hosts.netns import EmulatedCluster, HostsError

RAY_PORT = 6379
LAUNCHER_ONLY = ("--autoscaling-config",)
"""`ray start` flags the cluster launcher adds for its own use, left out here."""


@dataclass(frozen=True)
class HostType:
    name: str
    command: str
    """The `ray start` line of the launcher file, as written."""
    pools: tuple[str, ...]
    """The custom resources it advertises (the pools whose engines it holds)."""


def host_types(launcher_file: Path) -> dict[str, HostType]:
    """Each host type of a Ray cluster launcher file, with its start command and pool resources."""
    spec = yaml.safe_load(Path(launcher_file).read_text())
    head = spec["head_node_type"]
    (head_command,) = spec["head_start_ray_commands"]
    (worker_command,) = spec["worker_start_ray_commands"]
    types = {}
    for name, node_type in spec["available_node_types"].items():
        resources = node_type.get("resources", {})
        pools = tuple(sorted(r for r in resources if r not in ("CPU", "GPU", "memory")))
        command = head_command if name == head else worker_command
        types[name] = HostType(name, command, pools)
    return types


def auth_token(cluster: EmulatedCluster) -> Path:
    """The cluster's Ray token file (made once, readable by its owner only)."""
    path = Path(cluster.host(head_host(cluster)).folder).parent / "ray_auth_token"
    if not path.exists():
        path.touch(mode=0o600)
        path.write_text(secrets.token_hex(32))
    return path


def head_host(cluster: EmulatedCluster) -> str:
    """The host whose Ray is the head (the first host made)."""
    return next(iter(cluster.hosts))


def cluster_env(cluster: EmulatedCluster, host: str) -> dict[str, str]:
    """Environment of a process that takes part in the cluster's Ray from host `host`."""
    bin_dir = str(Path(sys.executable).parent)
    return {
        **os.environ,
        "PATH": f"{bin_dir}:{os.environ.get('PATH', '')}",
        "RAY_AUTH_MODE": "token",
        "RAY_AUTH_TOKEN_PATH": str(auth_token(cluster)),
        "RAY_ADDRESS": f"{cluster.address(head_host(cluster))}:{RAY_PORT}",
        "VLLM_HOST_IP": cluster.address(host),
    }


def start_command(
    cluster: EmulatedCluster, host: str, host_type: HostType, head: str, slots: int, cpus: float
) -> str:
    """The shell line that starts Ray on `host` as a `host_type` host."""
    line = re.sub(rf"\s({'|'.join(LAUNCHER_ONLY)})(=|\s+)\S+", "", host_type.command)
    line = line.replace("$RAY_HEAD_IP", cluster.address(head))
    resources = {pool: slots for pool in host_type.pools}
    folder = Path(cluster.host(host).folder) / "ray"
    added = [
        f"--node-ip-address={cluster.address(host)}",
        f"--temp-dir={folder}",
        f"--num-cpus={cpus:g}",
        f"--resources={json.dumps(resources)}",
        "--disable-usage-stats",
    ]
    return f"{line} {' '.join(shlex.quote(a) for a in added)}"


def start_ray(
    cluster: EmulatedCluster,
    roles: dict[str, str],
    launcher_file: Path,
    slots: int = 1,
    cpus: dict[str, float] | None = None,
) -> str:
    """Start Ray on every host: `roles` maps host → host type of `launcher_file`; the head type
    must be the first host's. Returns the cluster's address (`head:6379`)."""
    types = host_types(launcher_file)
    unknown = sorted(set(roles.values()) - set(types))
    if unknown:
        raise HostsError(f"host types {unknown} are not in {launcher_file} ({', '.join(types)})")
    heads = [h for h, t in roles.items() if "--head" in types[t].command]
    if heads != [head_host(cluster)]:
        raise HostsError(f"the first host, and only it, must be of the head type (not {heads})")
    for host in [heads[0], *(h for h in roles if h != heads[0])]:
        cluster.host(host).role = roles[host]
        _start(cluster, host, types[roles[host]], slots, (cpus or {}).get(host, 1))
    cluster.save()
    return f"{cluster.address(heads[0])}:{RAY_PORT}"


def restart_host(
    cluster: EmulatedCluster, host: str, launcher_file: Path, slots: int = 1, cpus: float = 1
) -> None:
    """A host rebooted: every process it had ended, then Ray started on it again as its type
    (how a host that Ray declared dead — a cable out longer than Ray's health checks allow, after
    which its raylet exits — joins the cluster again)."""
    role = cluster.host(host).role
    if not role:
        raise HostsError(f"{host} runs no Ray (`pdserve hosts up` without --no-ray starts it)")
    cluster.kill(host, grace_s=2.0)
    _start(cluster, host, host_types(launcher_file)[role], slots, cpus)


def _start(cluster: EmulatedCluster, host: str, host_type: HostType, slots: int, cpus: float):
    command = start_command(cluster, host, host_type, head_host(cluster), slots, cpus)
    done = cluster.run(
        host,
        ["bash", "-c", command],
        env=cluster_env(cluster, host),
        capture_output=True,
        text=True,
        timeout=120,
    )
    if done.returncode != 0:
        said = f"{done.stdout[-2000:]}{done.stderr[-3000:]}"
        raise HostsError(f"ray start on {host} failed:\n{said}")
