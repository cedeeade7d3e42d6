"""Hosts on one Linux machine: network namespaces joined by a bridge, addressed in 127.0.0.0/8.

Life of an emulated cluster:
1. `up(["head", "prefill", "decode0"])` makes one network namespace per host (`<prefix>-<host>`),
   a bridge in the machine's own namespace, and a veth pair per host: `eth0` inside the host,
   `<prefix>-<i>` on the bridge (the host's *link*). Host i gets `<subnet>.<i+1>`, the bridge
   `<subnet>.254`, so a process on the machine itself reaches every host (the client's seat).
   Addresses stay in the loopback range: the hosts route them between each other because
   `route_localnet` is set inside each host and on the bridge only, nothing else on the machine
   changes, and no packet leaves the machine.
2. Processes are started in a host with `popen(host, argv)` (`ip netns exec`); each host has its
   own folder under `/tmp/pdh/<prefix>/<host>` for per-host state (Ray's `--temp-dir`).
3. A link is cut (`cut`, the host's veth goes down: its TCP connections hang as on a pulled cable),
   restored (`restore`), or shaped (`shape`, an `htb` rate both ways). `kill(host)` ends every
   process of the host (the pids the namespace holds), as when a machine dies.
4. `down()` ends every process in every host by the namespace's own pids, deletes the namespaces,
   links and bridge, and the state file. Nothing else on the machine is touched.

The state (`/run/pdserve-hosts/<prefix>.json`) lets another process (the CLI, a test) find the
cluster that `up` made.
"""

from __future__ import annotations

import ipaddress
import json
import logging
import os
import re
import shutil
import signal
import subprocess
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

logger = logging.getLogger(__name__)

STATE_DIR = Path(os.environ.get("PDSERVE_HOSTS_STATE", "/run/pdserve-hosts"))
HOST_ROOT = Path("/tmp/pdh")
DEFAULT_PREFIX = "pdh"
DEFAULT_SUBNET = "127.100.0.0/24"
_NAME = re.compile(r"^[a-z][a-z0-9]{0,9}$")
HTB_ROOT = ("root", "handle", "1:", "htb", "default", "1")
HTB_CLASS = ("parent", "1:", "classid", "1:1", "htb")
_RATE = re.compile(r"^\d+(\.\d+)?(bit|kbit|mbit|gbit)$")


class HostsError(RuntimeError):
    """A cluster that cannot be made, found or changed as asked (the message says why)."""


@dataclass
class Host:
    name: str
    address: str
    netns: str
    link: str
    """The host's end on the bridge (in the machine's namespace): cut and shaped here."""
    folder: str
    role: str = ""
    """The host type it runs Ray as (set by `ray_hosts.start_ray`)."""


@dataclass
class EmulatedCluster:
    prefix: str
    subnet: str
    bridge: str
    client_address: str
    hosts: dict[str, Host] = field(default_factory=dict)

    # ---- making and unmaking ------------------------------------------------------------

    @classmethod
    def up(
        cls, names: list[str], prefix: str = DEFAULT_PREFIX, subnet: str = DEFAULT_SUBNET
    ) -> EmulatedCluster:
        """Make the hosts; a cluster already made under `prefix` is an error (`down` it first)."""
        _require_root()
        net = _check_subnet(subnet)
        _check_names(prefix, names, net)
        if _state_path(prefix).exists():
            raise HostsError(f"a cluster named {prefix!r} is up already: `pdserve hosts down`")
        addresses = list(net.hosts())
        cluster = cls(prefix, str(net), f"{prefix}-br", str(addresses[253]))
        for index, name in enumerate(names):
            cluster.hosts[name] = Host(
                name,
                str(addresses[index]),
                f"{prefix}-{name}",
                f"{prefix}-{index}",
                str(HOST_ROOT / prefix / name),
            )
        cluster.save()  # saved first, so a half-made cluster can still be taken down
        try:
            cluster._make()
        except BaseException:
            cluster.down()
            raise
        logger.info("hosts up: %s", ", ".join(f"{h.name} {h.address}" for h in cluster))
        return cluster

    def _make(self) -> None:
        length = ipaddress.ip_network(self.subnet).prefixlen
        _ip("link", "add", self.bridge, "type", "bridge")
        _ip("addr", "add", f"{self.client_address}/{length}", "dev", self.bridge)
        _sysctl(None, f"net.ipv4.conf.{self.bridge}.route_localnet=1")
        _ip("link", "set", self.bridge, "up")
        for host in self:
            Path(host.folder).mkdir(parents=True, exist_ok=True)
            _ip("netns", "add", host.netns)
            peer = ("peer", "name", "eth0", "netns", host.netns)
            _ip("link", "add", host.link, "type", "veth", *peer)
            _ip("link", "set", host.link, "master", self.bridge, "up")
            _sysctl(
                host.netns,
                "net.ipv4.conf.all.route_localnet=1",
                "net.ipv4.conf.eth0.route_localnet=1",
            )
            _ip("-n", host.netns, "link", "set", "lo", "up")
            _ip("-n", host.netns, "addr", "add", f"{host.address}/{length}", "dev", "eth0")
            _ip("-n", host.netns, "link", "set", "eth0", "up")

    def down(self, grace_s: float = 5.0) -> None:
        """End every process of every host, then remove what `up` made (missing parts are fine)."""
        self.kill(*self.hosts, grace_s=grace_s)
        for host in self:
            _ip("netns", "del", host.netns, check=False)
            _ip("link", "del", host.link, check=False)
        _ip("link", "del", self.bridge, check=False)
        shutil.rmtree(HOST_ROOT / self.prefix, ignore_errors=True)
        _state_path(self.prefix).unlink(missing_ok=True)
        logger.info("hosts %s down", self.prefix)

    # ---- finding --------------------------------------------------------------------------

    @classmethod
    def find(cls, prefix: str = DEFAULT_PREFIX) -> EmulatedCluster:
        path = _state_path(prefix)
        if not path.exists():
            raise HostsError(f"no cluster named {prefix!r} is up (`pdserve hosts up` makes one)")
        data = json.loads(path.read_text())
        hosts = {name: Host(**host) for name, host in data.pop("hosts").items()}
        return cls(**data, hosts=hosts)

    def save(self) -> None:
        STATE_DIR.mkdir(parents=True, exist_ok=True)
        _state_path(self.prefix).write_text(json.dumps(asdict(self), indent=2))

    def __iter__(self):
        return iter(self.hosts.values())

    def host(self, name: str) -> Host:
        if name not in self.hosts:
            raise HostsError(f"no host {name!r} (hosts: {', '.join(self.hosts)})")
        return self.hosts[name]

    def address(self, name: str) -> str:
        return self.host(name).address

    # ---- processes ------------------------------------------------------------------------

    def command(self, name: str, argv: list[str]) -> list[str]:
        """`argv` as run inside host `name`."""
        return ["ip", "netns", "exec", self.host(name).netns, *argv]

    def popen(self, name: str, argv: list[str], **kwargs) -> subprocess.Popen:
        return subprocess.Popen(self.command(name, argv), **kwargs)

    def run(self, name: str, argv: list[str], **kwargs) -> subprocess.CompletedProcess:
        return subprocess.run(self.command(name, argv), **kwargs)

    def pids(self, name: str) -> list[int]:
        listed = _ip("netns", "pids", self.host(name).netns, check=False)
        return [int(pid) for pid in listed.split()]

    def kill(self, *names: str, grace_s: float = 0.0) -> int:
        """End every process of the hosts `names`: SIGTERM, then SIGKILL after `grace_s` (0:
        SIGKILL at once, a machine losing power). Returns how many there were."""

        def alive() -> list[int]:
            return [pid for name in names for pid in self.pids(name)]

        pids = alive()
        first = signal.SIGTERM if grace_s > 0 else signal.SIGKILL
        for pid in pids:
            _signal(pid, first)
        deadline = time.monotonic() + grace_s
        while alive() and time.monotonic() < deadline:
            time.sleep(0.1)
        for pid in alive():
            _signal(pid, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while alive() and time.monotonic() < deadline:
            time.sleep(0.05)
        if pids:
            logger.info("hosts %s: ended %d processes", ", ".join(names), len(pids))
        return len(pids)

    # ---- links ----------------------------------------------------------------------------

    def cut(self, name: str) -> None:
        """Pull the host's cable: nothing crosses its link until `restore` (no reset is sent)."""
        _ip("link", "set", self.host(name).link, "down")

    def restore(self, name: str) -> None:
        _ip("link", "set", self.host(name).link, "up")

    def shape(self, name: str, rate: str | None) -> None:
        """Limit the host's link to `rate` (tc units: 1gbit, 200mbit) both ways; None lifts it."""
        host = self.host(name)
        sides = [([], host.link), (["-n", host.netns], "eth0")]
        for where, device in sides:
            _tc(*where, "qdisc", "del", "dev", device, "root", check=False)
        if rate is None:
            return
        if not _RATE.match(rate):
            raise HostsError(f"rate {rate!r}: give a tc rate such as 1gbit, 200mbit or 500kbit")
        for where, device in sides:
            _tc(*where, "qdisc", "add", "dev", device, *HTB_ROOT)
            _tc(*where, "class", "add", "dev", device, *HTB_CLASS, "rate", rate, "ceil", rate)


def _state_path(prefix: str) -> Path:
    return STATE_DIR / f"{prefix}.json"


def _require_root() -> None:
    if os.geteuid() != 0:
        raise HostsError("network namespaces need root (run as root, or with sudo)")


def _check_subnet(subnet: str) -> ipaddress.IPv4Network:
    try:
        net = ipaddress.IPv4Network(subnet)
    except ValueError as error:
        raise HostsError(f"subnet {subnet!r}: {error}") from None
    if net.prefixlen != 24 or not net.subnet_of(ipaddress.IPv4Network("127.0.0.0/8")):
        raise HostsError(f"subnet {subnet}: give a /24 inside 127.0.0.0/8, e.g. {DEFAULT_SUBNET}")
    if ipaddress.IPv4Address("127.0.0.1") in net:
        raise HostsError(f"subnet {subnet} holds 127.0.0.1, every host's own loopback")
    return net


def _check_names(prefix: str, names: list[str], net: ipaddress.IPv4Network) -> None:
    if not _NAME.match(prefix) or len(prefix) > 6:
        raise HostsError(f"prefix {prefix!r}: 1-6 lowercase letters or digits, a letter first")
    bad = [name for name in names if not _NAME.match(name)]
    if bad:
        raise HostsError(f"host names {bad}: 1-10 lowercase letters or digits, a letter first")
    if len(set(names)) != len(names) or not names:
        raise HostsError(f"host names {names}: give at least one, each once")
    if len(names) > 200:
        raise HostsError(f"{len(names)} hosts: at most 200 in one /24")


def _run(argv: list[str], check: bool = True) -> str:
    done = subprocess.run(argv, capture_output=True, text=True)
    if check and done.returncode != 0:
        raise HostsError(f"`{' '.join(argv)}` failed: {done.stderr.strip()}")
    return done.stdout


def _ip(*args: str, check: bool = True) -> str:
    return _run(["ip", *args], check)


def _tc(*args: str, check: bool = True) -> str:
    return _run(["tc", *args], check)


def _sysctl(netns: str | None, *settings: str) -> None:
    where = ["ip", "netns", "exec", netns] if netns else []
    _run([*where, "sysctl", "-qw", *settings])


def _signal(pid: int, signum: int) -> None:
    try:
        os.kill(pid, signum)
    except ProcessLookupError:
        pass
