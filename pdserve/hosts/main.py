"""`pdserve hosts`: a cluster of hosts on one Linux machine (network namespaces, root needed).

pdserve hosts up                      # head, prefill, decode0, decode1 + Ray on each
pdserve hosts exec head -- pdserve serve --config deploy/config/cluster-cpu.yaml ...
pdserve hosts cut decode0             # pull decode0's cable; `restore` plugs it back
pdserve hosts shape prefill 1gbit     # limit prefill's link; `shape prefill none` lifts it
pdserve hosts down                    # every process on every host ended, nothing left
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from pdserve.hosts.netns import DEFAULT_PREFIX, DEFAULT_SUBNET, EmulatedCluster, HostsError

DEFAULT_HOSTS = ["head", "prefill", "decode0", "decode1"]
LAUNCHER_FILE = Path(__file__).resolve().parents[2] / "deploy/ray/pdserve-cluster.yaml"
ROLE_BY_NAME = {"head": "head", "prefill": "prefill_gpu", "decode": "decode_gpu"}
"""Host name prefix → host type of the launcher file, when --role does not say."""


def _roles(names: list[str], given: list[str]) -> dict[str, str]:
    roles = {}
    for name in names:
        for prefix, host_type in ROLE_BY_NAME.items():
            if name.startswith(prefix):
                roles[name] = host_type
    for item in given:
        host, _, host_type = item.partition("=")
        if host not in names or not host_type:
            raise HostsError(f"--role {item!r}: give HOST=TYPE for one of {', '.join(names)}")
        roles[host] = host_type
    missing = [name for name in names if name not in roles]
    if missing:
        raise HostsError(f"hosts {missing} have no type: name them head/prefill*/decode* or --role")
    return roles


def _up(args: argparse.Namespace) -> int:
    names = args.names or DEFAULT_HOSTS
    roles = _roles(names, args.role) if not args.no_ray else {}
    cluster = EmulatedCluster.up(names, args.prefix, args.subnet)
    if not args.no_ray:
        from pdserve.hosts.ray_hosts import start_ray

        try:
            address = start_ray(cluster, roles, Path(args.launcher_file), args.slots)
        except BaseException:
            cluster.down()
            raise
        from pdserve.hosts.ray_hosts import auth_token

        print(f"Ray cluster at {address}, token auth (token file {auth_token(cluster)})")
    for host in cluster:
        print(f"{host.name:10} {host.address:15} {roles.get(host.name, '')}")
    print(f"this machine reaches the hosts from {cluster.client_address}")
    return 0


def _exec(args: argparse.Namespace) -> int:
    from pdserve.hosts.ray_hosts import cluster_env

    cluster = EmulatedCluster.find(args.prefix)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        raise HostsError("give a command after the host: pdserve hosts exec HOST -- CMD ...")
    env = cluster_env(cluster, args.host)
    os.execvpe("ip", cluster.command(args.host, command), env)
    return 1  # not reached


def _status(args: argparse.Namespace) -> int:
    cluster = EmulatedCluster.find(args.prefix)
    rows = [
        {
            "host": h.name,
            "address": h.address,
            "netns": h.netns,
            "link": h.link,
            "processes": len(cluster.pids(h.name)),
        }  # fmt: skip
        for h in cluster
    ]
    print(json.dumps({"prefix": cluster.prefix, "client": cluster.client_address, "hosts": rows}))
    return 0


def _on_host(action: str):
    def run(args: argparse.Namespace) -> int:
        cluster = EmulatedCluster.find(args.prefix)
        if action == "shape":
            cluster.shape(args.host, None if args.rate == "none" else args.rate)
        elif action == "kill":
            print(f"{cluster.kill(args.host)} processes ended on {args.host}")
        else:
            getattr(cluster, action)(args.host)
        return 0

    return run


def _restart(args: argparse.Namespace) -> int:
    from pdserve.hosts.ray_hosts import restart_host

    restart_host(EmulatedCluster.find(args.prefix), args.host, Path(args.launcher_file))
    print(f"{args.host} restarted: Ray is up on it again")
    return 0


def _down(args: argparse.Namespace) -> int:
    EmulatedCluster.find(args.prefix).down()
    return 0


def _cmd(args: argparse.Namespace) -> int:
    try:
        return args.action(args)
    except HostsError as error:
        print(f"pdserve hosts: {error}", file=sys.stderr)
        return 2


def add_parser(commands) -> None:
    hosts = commands.add_parser(
        "hosts",
        help="a cluster of hosts on this machine (network namespaces; root)",
        description="Emulate a multi-host cluster on one Linux machine: each host a network "
        "namespace with its own address in 127.0.0.0/8, joined by a bridge, with links that "
        "can be cut and shaped. `up` also starts Ray on every host with the launcher file's "
        "own `ray start` commands. Needs root; touches nothing outside what it makes.",
    )
    hosts.add_argument("--prefix", default=DEFAULT_PREFIX, help="names the cluster (default pdh)")
    actions = hosts.add_subparsers(dest="hosts_command", metavar="ACTION", required=True)
    up = actions.add_parser("up", help="make the hosts (and start Ray on them)")
    up.add_argument("names", nargs="*", help=f"host names (default: {' '.join(DEFAULT_HOSTS)})")
    up.add_argument("--subnet", default=DEFAULT_SUBNET, help="a /24 in 127.0.0.0/8")
    up.add_argument("--no-ray", action="store_true", help="hosts only, no Ray")
    up.add_argument(
        "--launcher-file",
        default=str(LAUNCHER_FILE),
        help="Ray cluster launcher YAML whose `ray start` commands and host types are used",
    )
    up.add_argument(
        "--role",
        action="append",
        default=[],
        metavar="HOST=TYPE",
        help="host type of the launcher file for a host (default: by name, head / prefill* → "
        "prefill_gpu / decode* → decode_gpu)",
    )
    up.add_argument("--slots", type=int, default=1, help="engines each pool host holds (1)")
    up.set_defaults(action=_up)
    down = actions.add_parser("down", help="end every process on the hosts and remove them")
    down.set_defaults(action=_down)
    status = actions.add_parser("status", help="hosts, addresses and process counts (JSON)")
    status.set_defaults(action=_status)
    for action, text in (
        ("cut", "pull a host's cable (nothing crosses its link)"),
        ("restore", "plug a host's cable back"),
        ("kill", "end every process of a host at once (the machine dies)"),
    ):
        parser = actions.add_parser(action, help=text)
        parser.add_argument("host")
        parser.set_defaults(action=_on_host(action))
    restart = actions.add_parser(
        "restart",
        help="reboot a host: end its processes, start Ray on it again (a host Ray declared "
        "dead rejoins this way)",
    )
    restart.add_argument("host")
    restart.add_argument("--launcher-file", default=str(LAUNCHER_FILE))
    restart.set_defaults(action=_restart)
    shape = actions.add_parser("shape", help="limit a host's link both ways (tc htb)")
    shape.add_argument("host")
    shape.add_argument("rate", help="a tc rate (1gbit, 200mbit) or none")
    shape.set_defaults(action=_on_host("shape"))
    run = actions.add_parser(
        "exec", help="run a command on a host, in the cluster's Ray environment"
    )
    run.add_argument("host")
    run.add_argument("command", nargs=argparse.REMAINDER, help="-- CMD ARGS...")
    run.set_defaults(action=_exec)
    hosts.set_defaults(func=_cmd)
