"""A Ray cluster of several nodes on this machine for tests: one raylet per node, every address loopback.

    cluster = LoopbackCluster(["127.0.0.11", "127.0.0.12", "127.0.0.13"], cpus_per_node=4)
    ResourcePool([2, 2], ray_address=cluster.address)   # ranks on two of the nodes
    cluster.kill_node("127.0.0.12")                     # its raylet and workers die at once
    cluster.shutdown()

Built on Ray's own multi-node test utility (``ray.cluster_utils.Cluster``), with
each node, and so its GCS and raylet, given its own 127.0.0.x address: with
default arguments the utility binds to the machine's interface address.
127.0.0.1 itself cannot be used, since Ray replaces it with that interface
address. The GCS marks a silent node dead after about 2 s (the default is
tens of seconds).
"""

from __future__ import annotations

import ipaddress

from ray.cluster_utils import Cluster

FAST_HEALTH_CHECKS = {"health_check_initial_delay_ms": 0, "health_check_period_ms": 500,
                      "health_check_timeout_ms": 500, "health_check_failure_threshold": 4}


class LoopbackCluster:
    def __init__(self, node_ips: list[str], cpus_per_node: int = 4, object_store_mib: int = 256) -> None:
        for ip in node_ips:
            address = ipaddress.ip_address(ip)
            if not address.is_loopback or ip == "127.0.0.1":
                raise ValueError(f"node address {ip} must be a loopback address other than 127.0.0.1")
        common = {"num_cpus": cpus_per_node, "object_store_memory": object_store_mib << 20}
        self.cluster = Cluster(initialize_head=True, head_node_args={
            "node_ip_address": node_ips[0], "include_dashboard": False, "_system_config": FAST_HEALTH_CHECKS, **common})
        self.nodes = {node_ips[0]: self.cluster.head_node}
        for ip in node_ips[1:]:
            self.nodes[ip] = self.cluster.add_node(node_ip_address=ip, **common)
        self.cluster.wait_for_nodes()

    @property
    def address(self) -> str:
        return self.cluster.address

    @property
    def head_ip(self) -> str:
        return next(iter(self.nodes))

    def raylet_pids(self) -> dict[str, int]:
        return {ip: node.all_processes["raylet"][0].process.pid for ip, node in self.nodes.items()}

    def kill_node(self, ip: str) -> None:
        """Kill the node's raylet and everything it started, at once (no graceful drain)."""
        self.cluster.remove_node(self.nodes.pop(ip), allow_graceful=False)

    def shutdown(self) -> None:
        self.cluster.shutdown()
