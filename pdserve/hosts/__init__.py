"""An emulated cluster on one machine: hosts in network namespaces (`netns`), Ray started on
them with the deploy files' own commands (`ray_hosts`), and the `pdserve hosts` command."""

from pdserve.hosts.netns import EmulatedCluster, Host, HostsError

__all__ = ["EmulatedCluster", "Host", "HostsError"]
