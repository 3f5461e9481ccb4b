"""Accelerators, links and clusters: what the planner's memory and time models run on.

``ACCELERATORS`` holds common devices with their vendor's figures (dense
bf16 tensor throughput, memory, memory bandwidth, the per-direction
bandwidth of the link between devices of one node) and the source of each.
A ``Cluster`` is ``nodes`` x ``devices_per_node`` of one accelerator, with
the network bandwidth between nodes. ``parse_cluster`` reads the command
line's ``4x8xH100-80GB`` (nodes x devices x type) or ``8xA100-80GB`` (one
node).

A device's usable memory is its capacity less ``reserved`` (the CUDA
context, communication buffers and the allocator's fragmentation; 2 GiB by
default, as measured on A100s and H100s with NCCL). The CPU "device" of this
machine is not in the table: ``hybridflow plan --calibrate`` measures it
(``controller.planner.calibrate``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace

__all__ = ["ACCELERATORS", "Accelerator", "Cluster", "ClusterError", "GIB", "matching_accelerator", "parse_cluster"]

GIB = 1 << 30


class ClusterError(ValueError):
    """A cluster description the planner cannot read; the message names the value and what is valid."""


@dataclass(frozen=True)
class Accelerator:
    name: str
    memory_bytes: int  # the device's memory
    bf16_flops: float  # dense bf16 (or the device's matmul dtype) tensor throughput, FLOP/s
    memory_bandwidth: float  # bytes/s between the device's memory and its cores
    link_bandwidth: float  # bytes/s per direction between two devices of one node (NVLink, xGMI, PCIe)
    network_bandwidth: float  # bytes/s per direction per device between nodes (its share of the NICs)
    source: str  # where the figures come from
    link_latency: float = 5e-6  # seconds per collective step within a node
    network_latency: float = 10e-6  # seconds per collective step across nodes
    fp32_flops: float | None = None  # None: half the bf16 rate (TF32 tensor cores); CPUs measure their own
    reserved_bytes: int = 2 * GIB  # not usable by the job: runtime context, communication buffers, fragmentation
    cores_per_device: float = 1.0  # CPU "devices" (processes) share the machine's cores; accelerators: 1
    # CPU processes: the machine's cores they share (0: devices of their own) and each one's threads.
    host_cores: float = 0.0
    threads_per_device: int = 1

    @property
    def usable_bytes(self) -> int:
        return self.memory_bytes - self.reserved_bytes

    def working(self, active: int) -> "Accelerator":
        """This device while ``active`` devices work at once. A CPU process's rates are stated for every
        process busy (``cores_per_device`` each); with fewer busy it takes the cores they leave, up to its
        threads. An accelerator is its own whatever the others do."""
        if not self.host_cores or active < 1:
            return self
        cores = min(float(self.threads_per_device), self.host_cores / active)
        factor = cores / self.cores_per_device
        if factor == 1.0:
            return self
        return replace(self, bf16_flops=self.bf16_flops * factor, memory_bandwidth=self.memory_bandwidth * factor,
                       fp32_flops=None if self.fp32_flops is None else self.fp32_flops * factor, cores_per_device=cores)

    def flops(self, precision: str) -> float:
        if precision == "fp32":
            return self.fp32_flops if self.fp32_flops is not None else self.bf16_flops / 2
        return self.bf16_flops


def _gpu(name, gib, tflops, hbm_tb_s, link_gb_s, network_gbit_s, source, **extra) -> Accelerator:
    return Accelerator(name, gib * GIB, tflops * 1e12, hbm_tb_s * 1e12, link_gb_s * 1e9, network_gbit_s * 1e9 / 8,
                       source, **extra)


# Dense (no sparsity) bf16 tensor rates; link: NVLink (or xGMI, PCIe) bandwidth per direction per device;
# network: one NIC per device at the speed the vendor's reference system ships with.
ACCELERATORS: dict[str, Accelerator] = {a.name: a for a in (
    _gpu("A100-40GB", 40, 312, 1.555, 300, 200, "NVIDIA A100 Tensor Core GPU datasheet (SXM4); DGX A100: 200 Gb/s HDR per GPU"),
    _gpu("A100-80GB", 80, 312, 2.039, 300, 200, "NVIDIA A100 Tensor Core GPU datasheet (SXM4 80GB); DGX A100: 200 Gb/s HDR per GPU"),
    _gpu("H100-80GB", 80, 989.4, 3.35, 450, 400, "NVIDIA H100 Tensor Core GPU datasheet (SXM5); DGX H100: 400 Gb/s NDR per GPU"),
    _gpu("H800-80GB", 80, 989.4, 3.35, 200, 400, "NVIDIA H800 SXM5 product brief: NVLink 400 GB/s"),
    _gpu("H200-141GB", 141, 989.4, 4.8, 450, 400, "NVIDIA H200 Tensor Core GPU datasheet (SXM); HGX H200: 400 Gb/s per GPU"),
    _gpu("B200-180GB", 180, 2250, 7.7, 900, 400, "NVIDIA DGX B200 datasheet (per GPU: 1/8 of the system); ConnectX-7 400 Gb/s"),
    _gpu("L40S-48GB", 48, 362.05, 0.864, 32, 100, "NVIDIA L40S datasheet; PCIe Gen4 x16 between devices"),
    _gpu("A10-24GB", 24, 125, 0.6, 32, 100, "NVIDIA A10 Tensor Core GPU datasheet; PCIe Gen4 x16 between devices"),
    _gpu("MI300X-192GB", 192, 1307.4, 5.3, 448, 400, "AMD Instinct MI300X datasheet; 7 xGMI links, 64 GB/s each per direction"),
)}
_ALIASES = {"H200": "H200-141GB", "B200": "B200-180GB", "L40S": "L40S-48GB", "A10": "A10-24GB",
            "MI300X": "MI300X-192GB", "H100": "H100-80GB", "H800": "H800-80GB"}


@dataclass(frozen=True)
class Cluster:
    nodes: int
    devices_per_node: int
    accelerator: Accelerator

    def __post_init__(self) -> None:
        for name in ("nodes", "devices_per_node"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ClusterError(f"cluster {name} must be a positive integer, got {value!r}")

    @property
    def devices(self) -> int:
        return self.nodes * self.devices_per_node

    def with_network(self, gbit_per_device: float) -> "Cluster":
        return replace(self, accelerator=replace(self.accelerator, network_bandwidth=gbit_per_device * 1e9 / 8))

    def __str__(self) -> str:
        return f"{self.nodes}x{self.devices_per_node}x{self.accelerator.name}"


_CLUSTER = re.compile(r"^(?:(\d+)x)?(\d+)x([A-Za-z0-9][A-Za-z0-9._-]*)$")


def accelerator(name: str) -> Accelerator:
    """The table's entry for ``name`` (case-insensitive; ``H100`` is ``H100-80GB``)."""
    by_lower = {k.lower(): v for k, v in ACCELERATORS.items()}
    found = by_lower.get(name.lower()) or by_lower.get(_ALIASES.get(name.upper(), "").lower())
    if found is None:
        raise ClusterError(f"unknown accelerator {name!r}; known: {', '.join(ACCELERATORS)} "
                           f"(or --cluster local for this machine's processes)")
    return found


def parse_cluster(text: str) -> Cluster:
    """``NODESxDEVICESxTYPE`` (``4x8xH100-80GB``) or ``DEVICESxTYPE`` (one node)."""
    match = _CLUSTER.match(text.strip())
    if match is None:
        raise ClusterError(f"cluster {text!r} is not NODESxDEVICESxTYPE (e.g. 4x8xH100-80GB) or DEVICESxTYPE "
                           f"(e.g. 8xA100-80GB), nor 'local'")
    nodes, devices, name = match.groups()
    return Cluster(int(nodes or 1), int(devices), accelerator(name))


def matching_accelerator(device_name: str, memory_bytes: int) -> Accelerator:
    """The table's entry for a device as the runtime names it ("NVIDIA A100-SXM4-80GB"), with its measured
    memory; a device the table lacks gets an A100-80GB's speeds (the memory check reads only the memory)."""
    upper = device_name.upper()
    candidates = [a for a in ACCELERATORS.values() if a.name.split("-")[0] in upper]
    if candidates:
        found = min(candidates, key=lambda a: abs(a.memory_bytes - memory_bytes))
        return replace(found, memory_bytes=memory_bytes)
    base = ACCELERATORS["A100-80GB"]
    return replace(base, name=device_name, memory_bytes=memory_bytes,
                   source=f"{device_name}: memory as the runtime reports it; speeds assumed an A100-80GB's")
