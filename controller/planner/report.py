"""A search's result for people and for programs: tables, the overrides of a plan, JSON.

``render`` prints the best plans (each with its memory per role and device,
its stage times, step time and reshard bytes) and why every other
placement lost; ``plan_overrides`` gives the ``key=value`` overrides that
make a job's config run the plan (``hybridflow plan --write``); ``result_json``
is what ``--json`` writes.
"""

from __future__ import annotations

from controller.planner.hardware import GIB, Cluster
from controller.planner.options import Option
from controller.planner.search import Plan, PlanResult
from controller.planner.workload import STAGES, Workload

__all__ = ["plan_json", "plan_overrides", "render", "result_json"]

_SECTION = {"actor": "actor.engine", "critic": "critic.engine", "ref_policy": "ref_policy.engine",
            "reward_model": "reward.engine", "cost": "cost_model.engine"}


def _gib(n: float) -> str:
    return f"{n / GIB:.2f}"


def _pool(devices: int, cluster: Cluster) -> dict[str, int]:
    if devices > cluster.devices_per_node:
        return {"nodes": devices // cluster.devices_per_node, "processes_per_node": cluster.devices_per_node}
    return {"nodes": 1, "processes_per_node": devices}


def plan_overrides(plan: Plan, cluster: Cluster) -> list[str]:
    """The config overrides that run ``plan``: pools (the actor's set is the default pool), layouts, micro-batches."""
    out: list[str] = []
    for index, group in enumerate(plan.sets):
        pool = _pool(group.devices, cluster)
        if "actor" in group.roles:
            out += [f"trainer.nnodes={pool['nodes']}", f"trainer.nproc={pool['processes_per_node']}"]
        else:
            first = group.roles[0]
            out.append(f"trainer.placement.{first}={{nodes: {pool['nodes']}, "
                       f"processes_per_node: {pool['processes_per_node']}}}")
            out += [f"trainer.placement.{role}={first}" for role in group.roles[1:]]
        for option in group.options:
            out += _layout_overrides(option)
    if len(plan.sets) > 1:
        out.append("trainer.launcher=ray")
    return out


def _layout_overrides(option: Option) -> list[str]:
    # The KV cache the plan sized: exactly its concurrency's sequences at full length.
    kv = [f"rollout.kv_cache_bytes={option.memory['KV cache']}"] if "KV cache" in option.memory else []
    if option.lora_sync is not None:
        kv.append(f"rollout.lora_sync={option.lora_sync}")
    if option.role == "rollout":
        return [f"rollout.tensor_parallel={option.tp}", f"rollout.pipeline_parallel={option.pp}", *kv]
    if option.role == "judge":  # its own engine at its own TP, its KV cache sized for its verdicts
        return [f"reward.judge.tensor_parallel={option.tp}", f"reward.judge.kv_cache_bytes={option.memory['KV cache']}"]
    section = _SECTION.get(option.role, f"{option.role}.engine")  # a registered role's: teacher.engine
    out = [f"{section}.tensor_parallel={option.tp}", f"{section}.pipeline_parallel={option.pp}",
           f"{section}.micro_batch_size={option.micro_batch}"]
    if option.cp > 1:
        out.append(f"{section}.context_parallel={option.cp}")
    if option.ep > 1 or option.etp is not None:  # a mixture of experts' expert parallelism
        out += [f"{section}.expert_parallel={option.ep}",
                f"{section}.expert_tensor_parallel={'null' if option.etp is None else option.etp}"]
    if option.gen_tp is not None:
        out += [f"rollout.tensor_parallel={option.gen_tp}", f"rollout.pipeline_parallel={option.gen_pp}", *kv]
    return out


def _describe_placement(placement) -> str:
    return " | ".join("+".join(s) for s in placement)


def render(result: PlanResult, workload: Workload, cluster: Cluster, show_rejected: int = 20) -> str:
    lines = [f"cluster {cluster}: {cluster.devices} device(s), {_gib(cluster.accelerator.usable_bytes)} GiB usable "
             f"each; {workload.sequences} sequences of {workload.prompt_len} + {workload.response_len} tokens a step; "
             f"roles: {', '.join(workload.role_names)}; {result.evaluated} (placement, split) pairs scored"]
    for rank, plan in enumerate(result.plans, 1):
        lines.append("")
        lines.append(f"#{rank}  {plan.step_time:.4g} s a step  [{_describe_placement(plan.placement)}]  "
                     + "  ".join(f"{name} {t:.3g} s" for name, t in zip(STAGES, plan.stage_times))
                     + (f"  transfer {plan.transfer_time:.3g} s" if plan.transfer_time else ""))
        lines.append(f"    {'set':<28} {'devices':>7}  {'role':<12} {'layout':<36} {'state GiB':>9} "
                     f"{'work GiB (gen/prep/train)':>26} {'peak GiB':>8} {'reshard MiB':>11}")
        for group in plan.sets:
            peak = max(group.memory)
            for i, option in enumerate(group.options):
                work = "/".join(_gib(max(0, e)) for e in option.extra)
                lines.append(f"    {('+'.join(group.roles) if i == 0 else ''):<28} {(group.devices if i == 0 else ''):>7}  "
                             f"{option.role:<12} {option.layout:<36} {_gib(option.resident):>9} {work:>26} "
                             f"{(_gib(peak) if i == 0 else ''):>8} {option.reshard_bytes / 2**20:>11.1f}")
    if result.rejected:
        lines.append("")
        lines.append("other placements:")
        for item in result.rejected[:show_rejected]:
            if item.best is not None:
                lines.append(f"    [{_describe_placement(item.placement)}] {item.reason}")
            elif item.need:
                lines.append(f"    [{_describe_placement(item.placement)}] out of memory: its tightest set needs "
                             f"{_gib(item.need)} GiB a device at its smallest layout, "
                             f"{_gib(cluster.accelerator.usable_bytes)} GiB usable")
            else:
                lines.append(f"    [{_describe_placement(item.placement)}] {item.reason}")
    return "\n".join(lines)


def plan_json(plan: Plan, cluster: Cluster) -> dict:
    return {
        "step_time_s": plan.step_time,
        "stage_times_s": dict(zip(STAGES, plan.stage_times)),
        "transfer_time_s": plan.transfer_time,
        "placement": [list(s) for s in plan.placement],
        "sets": [{"roles": list(s.roles), "devices": s.devices, "memory_bytes": dict(zip(STAGES, s.memory)),
                  "roles_detail": [{"role": o.role, "tp": o.tp, "pp": o.pp, "cp": o.cp, "dp": o.dp,
                                    "micro_batch": o.micro_batch,
                                    "gen_tp": o.gen_tp, "gen_pp": o.gen_pp, "concurrency": o.concurrency,
                                    "lora_sync": o.lora_sync,
                                    "times_s": dict(zip(STAGES, o.times)), "state_bytes": o.resident,
                                    "memory_bytes": dict(o.memory), "reshard_bytes": o.reshard_bytes}
                                   for o in s.options]} for s in plan.sets],
        "overrides": plan_overrides(plan, cluster),
    }


def result_json(result: PlanResult, workload: Workload, cluster: Cluster) -> dict:
    return {
        "cluster": str(cluster),
        "usable_bytes_per_device": cluster.accelerator.usable_bytes,
        "sequences": workload.sequences, "prompt_len": workload.prompt_len, "response_len": workload.response_len,
        "roles": list(workload.role_names),
        "plans": [plan_json(p, cluster) for p in result.plans],
        "rejected": [{"placement": [list(s) for s in r.placement], "reason": r.reason, "need_bytes": r.need,
                      "step_time_s": r.best.step_time if r.best else None} for r in result.rejected],
        "evaluated": result.evaluated,
    }
