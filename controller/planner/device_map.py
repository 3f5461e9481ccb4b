"""``device_map="auto"``: the planner's fastest layouts for the roles that ask for one, the rest as configured.

The job's placement stays as the config gives it (its pools and their
devices); every role the user laid out keeps its TP / PP, every role keeps
its micro-batch. For the ``auto`` roles the search (``search.best_on_split``
on that one placement and split) picks, among the layouts that fit a device
in every stage beside their pool's other roles, the one with the fastest
predicted step: TP x PP (and CP where a long sequence needs it) for a megatron role, the generation TP for the
rollout (at the KV cache the config gives it). Nothing fits: a ValueError
with the smallest footprint tried.

``job_cluster`` is the job's devices as the planner sees them: the GPUs
(their kind matched in ``hardware.ACCELERATORS``), or on the CPU path the
job's processes sharing this machine, measured by ``hybridflow plan
--calibrate`` where it ran and nominal figures otherwise (only the order of
the layouts matters here, and memory decides most of it).
"""

from __future__ import annotations

from dataclasses import replace

from controller.planner.hardware import GIB, Accelerator, Cluster
from controller.planner.options import Pin
from controller.planner.prelaunch import gpu_cluster, job_sets
from controller.planner.search import best_on_split
from controller.planner.timing import CPU_LORA_DECODE_OVERHEAD, Efficiency
from controller.planner.workload import job_workload

__all__ = ["auto_layouts", "job_cluster"]

# An uncalibrated CPU process: the order of magnitude of one core of a current server.
_NOMINAL_CORE = dict(fp32_flops=50e9, bf16_flops=100e9, memory_bandwidth=10e9)
_NOMINAL_GLOO = dict(bandwidth=1e9, latency=200e-6)


def job_cluster(nodes: int, devices_per_node: int, processes: int, device_bytes: int) -> tuple[Cluster, Efficiency]:
    """The job's devices: ``nodes`` x ``devices_per_node`` GPUs of this machine's kind (``prelaunch.gpu_cluster``),
    or ``processes`` CPU processes sharing ``device_bytes`` of RAM on this machine."""
    gpus = gpu_cluster(nodes, devices_per_node)
    if gpus is not None:
        return gpus, Efficiency()
    from controller.planner.calibrate import load_calibration, local_cluster, local_efficiency
    from controller.planner.hardware import ClusterError

    try:
        figures = load_calibration()
        cluster, efficiency = local_cluster(processes, figures), local_efficiency(figures)
        device = cluster.accelerator
    except ClusterError:  # not calibrated: nominal figures
        device = Accelerator("cpu-process (nominal)", 0, _NOMINAL_CORE["bf16_flops"], _NOMINAL_CORE["memory_bandwidth"],
                             _NOMINAL_GLOO["bandwidth"], _NOMINAL_GLOO["bandwidth"], "nominal, not measured",
                             link_latency=_NOMINAL_GLOO["latency"], network_latency=_NOMINAL_GLOO["latency"],
                             fp32_flops=_NOMINAL_CORE["fp32_flops"], reserved_bytes=0)
        efficiency = Efficiency(lora_decode_overhead=CPU_LORA_DECODE_OVERHEAD)
    device = replace(device, memory_bytes=device_bytes // processes)  # the processes share the machine's RAM
    return Cluster(1, processes, device), efficiency


def _size(nbytes: int) -> str:
    return f"{nbytes / GIB:.2f} GiB" if nbytes >= GIB else f"{nbytes / 2**20:.1f} MiB"


def auto_layouts(config, auto: set[str], cluster: Cluster, efficiency: Efficiency | None = None,
                 flash_attention: bool = True) -> dict[str, tuple[int, int, int]]:
    """(TP, PP, CP) of each role of ``auto`` (the rollout's: its generation TP x PP, CP 1) in the fastest plan that
    fits; ``flash_attention``: GPU kernels (the CPU path keeps attention's scores)."""
    workload = job_workload(config, flash_attention=flash_attention)
    sets = job_sets(config, workload)
    pins = {}
    for roles, _ in sets:
        for role in roles:
            work = workload.role(role)
            gen_tp = workload.generation_tp if work.generates and "rollout" not in auto else None
            kv = config.rollout.kv_cache_bytes if work.generates else None  # the engine's cache, as configured
            if role == "rollout":  # on a pool of its own, laid out as it generates
                pins[role] = Pin(gen_tp=gen_tp, kv_cache_bytes=kv)
            else:
                fixed = role not in auto
                pins[role] = Pin(tp=work.tp if fixed else None, pp=work.pp if fixed else None,
                                 cp=work.cp if fixed else None,
                                 micro_batch=work.micro_batch, gen_tp=gen_tp, kv_cache_bytes=kv)
    placement, split = tuple(roles for roles, _ in sets), tuple(n for _, n in sets)
    plan, need = best_on_split(workload, cluster, placement, split, efficiency, pins)
    if plan is None:
        what = (f"its smallest layout needs {_size(need)} on a device" if need else
                "no layout of its models divides its pools' devices")
        raise ValueError(f'device_map="auto" ({", ".join(sorted(auto))}): the job fits no layout on {cluster} '
                         f"({_size(cluster.accelerator.usable_bytes)} usable a device): {what}; use more "
                         f"devices, or set tensor_parallel= / pipeline_parallel= yourself")
    layouts = {}
    for role in auto:
        if role == "rollout":
            generating = next(o for s in plan.sets for o in s.options if o.gen_tp is not None)
            layouts[role] = (generating.gen_tp, generating.gen_pp, 1)
        elif role in workload.role_names:
            option = plan.option(role)
            layouts[role] = (option.tp, option.pp, option.cp)
    return layouts
