"""The pre-launch memory check: the job's own placement and layouts, on its devices, before any process starts.

``job_plan`` scores the plan the config describes: the default pool holds
the actor and every role not placed elsewhere, each ``trainer.placement``
pool its roles (an entry naming another role shares its pool), each role at
its configured TP / PP / micro-batch, the rollout at its TP / PP with as many
sequences at once as ``rollout.kv_cache_bytes`` holds. ``check_job_memory``
refuses a job whose plan does not fit a device in some stage, with the
table of what each role holds, the context parallelism that makes it fit at
its own layout where one does (``context_parallel_fix``), and the nearest
plan that fits (the search's best, as overrides). ``check_before_launch`` runs it on GPU jobs: from
``hybridflow train`` before any process starts, and from ``RLTrainer.build``
before any worker (the Python API, pools declared with ``register_placement``
included); ``trainer.memory_check=false`` (``hybridflow train --force``) skips it.
"""

from __future__ import annotations

from controller.planner.hardware import GIB, Cluster
from controller.planner.options import Option, evaluate_option, kv_concurrency
from controller.planner.report import plan_overrides
from controller.planner.search import Plan, PlanError, SetPlan, search, step_time, weight_transfer_time
from controller.planner.timing import Efficiency
from controller.planner.workload import Workload, job_workload
from hybridengine.model.spec import ModelConfigError

__all__ = ["MemoryCheckError", "check_before_launch", "check_job_memory", "context_parallel_fix", "gpu_cluster",
           "job_plan", "job_sets", "local_cluster"]


class MemoryCheckError(PlanError):
    """The job's plan does not fit its devices; the message holds the table and the nearest plan that fits."""


def job_sets(config, workload: Workload) -> list[tuple[tuple[str, ...], int]]:
    """(roles, devices) of each pool the config gives: the default pool first."""
    from controller.checks.placement import job_pools

    pools = job_pools(config.trainer)
    where = {role: pools[role].name if role in pools else "default" for role in workload.role_names}
    if "rollout" in where and "rollout" not in config.trainer.placement:
        where["rollout"] = where["actor"]
    names = sorted(set(where.values()), key=lambda name: (name != where["actor"], name))
    shapes = {shape.name: shape for shape in pools.values()}
    return [(tuple(r for r in workload.role_names if where[r] == name), shapes[name].world_size) for name in names]


def job_plan(config, cluster: Cluster, workload: Workload | None = None,
             efficiency: Efficiency | None = None, lora_sync: str | None = None) -> Plan:
    """The plan ``config`` runs, scored on ``cluster``'s devices (a ValueError when a layout cannot split a model).
    A LoRA actor's adapters reach the generating role as ``lora_sync`` says, or as the config sets them; with
    ``rollout.lora_sync: auto``, as the planner chooses (``lora_choice.choose_lora_sync``)."""
    workload = workload or job_workload(config)
    efficiency = efficiency or Efficiency()
    modes = workload.lora_modes()
    if lora_sync is None and len(modes) > 1:
        from controller.planner.lora_choice import choose_lora_sync

        return choose_lora_sync(config, cluster, efficiency, workload).plan
    mode = lora_sync or modes[0]
    groups = []
    for roles, devices in job_sets(config, workload):
        options: list[Option] = []
        for role in roles:
            work = workload.role(role)
            gen = concurrency = None
            tp, pp = work.tp, work.pp
            if role == "judge":  # a generative judge: its own engine at its own TP, its own KV cache
                gen = (work.tp, 1)
                concurrency = kv_concurrency(workload, work.spec, work.tp, config.reward.judge.kv_cache_bytes, work)
            elif work.generates:
                gen = (workload.generation_tp, workload.generation_pp)
                concurrency = kv_concurrency(workload, work.spec, gen[0], config.rollout.kv_cache_bytes)
                if role == "rollout":
                    tp, pp = gen
            cp = 1 if work.serves else work.cp
            if devices % (tp * pp * cp):
                raise ValueError(f"{role}: TP {tp} x PP {pp}" + (f" x CP {cp}" if cp > 1 else "")
                                 + f" does not divide its pool's {devices} devices")
            try:
                work.padded(tp).check_layout(tp, pp)
            except ModelConfigError as exc:
                raise ValueError(f"{role}: {exc}") from None
            ep, etp = (1, None) if work.serves else (work.ep, work.etp)
            options.append(evaluate_option(work, workload, cluster, efficiency, devices, tp, pp,
                                           work.micro_batch, gen, concurrency, ep, etp, mode, cp))
        groups.append(SetPlan(roles, devices, tuple(options)))
    transfer = sum(weight_transfer_time(o, cluster, efficiency) for g in groups if g.roles == ("rollout",)
                   for o in g.options)
    total, stages = step_time(workload, tuple(groups), transfer, efficiency.step_s, accelerator=cluster.accelerator)
    return Plan(tuple(groups), total, stages, transfer)


def _table(plan: Plan, usable: int) -> str:
    lines = [f"  {'pool (roles)':<36} {'role':<12} {'layout':<36} {'state GiB':>9} {'work GiB (gen/prep/train)':>26} "
             f"{'peak GiB':>8}"]
    for group in plan.sets:
        peak = max(group.memory)
        for i, option in enumerate(group.options):
            work = "/".join(f"{max(0, e) / GIB:.2f}" for e in option.extra)
            name = f"{'+'.join(group.roles)} ({group.devices})" if i == 0 else ""
            flag = (f"{peak / GIB:.2f}" + (" > usable" if peak > usable else "")) if i == 0 else ""
            lines.append(f"  {name:<36} {option.role:<12} {option.layout:<36} {option.resident / GIB:>9.2f} {work:>26} "
                         f"{flag:>8}")
    return "\n".join(lines)


def check_job_memory(config, cluster: Cluster, efficiency: Efficiency | None = None) -> Plan:
    """The job's plan when it fits ``cluster``'s devices in every stage; else a MemoryCheckError with the table
    and the nearest plan that fits."""
    workload = job_workload(config)
    plan = job_plan(config, cluster, workload, efficiency)
    usable = cluster.accelerator.usable_bytes
    if all(max(group.memory) <= usable for group in plan.sets):
        return plan
    worst = max(plan.sets, key=lambda g: max(g.memory))
    stage = max(range(3), key=lambda s: worst.memory[s])
    message = [f"the job is predicted not to fit its devices ({cluster}, {usable / GIB:.2f} GiB usable each): "
               f"the pool of {'+'.join(worst.roles)} needs {max(worst.memory) / GIB:.2f} GiB a device in the "
               f"{('generation', 'preparation', 'training')[stage]} stage", _table(plan, usable)]
    fix = context_parallel_fix(config, cluster, worst.roles, efficiency)
    if fix is not None:
        message.append(fix)
    best = search(workload, cluster, efficiency, top=1)
    if best.plans:
        overrides = plan_overrides(best.plans[0], cluster)
        message.append(f"the nearest plan that fits ({best.plans[0].step_time:.3g} s a step, "
                       f"{best.plans[0].peak_memory / GIB:.2f} GiB a device at most): " + " ".join(overrides))
    else:
        message.append(f"no plan fits {cluster} (hybridflow plan shows the smallest); use more or larger devices")
    message.append("hybridflow train --force (trainer.memory_check=false) skips this check")
    raise MemoryCheckError("\n".join(message))


_CP_SECTIONS = {"actor": "actor", "critic": "critic", "ref_policy": "ref_policy"}  # and registered roles' own


def _splits_sequences(config, role: str) -> bool:
    """Whether ``role``'s engine section is one whose sequences may be split (a registered role's: the teacher's)."""
    from controller.rl.role_registry import role_engine

    return role in _CP_SECTIONS or role_engine(config, role) is not None


def _with_context_parallel(config, role: str, cp: int):
    """``config`` with ``role``'s engine split over ``cp`` context-parallel ranks (its TP / PP as they are)."""
    from controller.rl.role_specs import with_parallelism

    return with_parallelism(config, role, None, None, cp)


def context_parallel_fix(config, cluster: Cluster, roles: tuple[str, ...],
                         efficiency: Efficiency | None = None) -> str | None:
    """The context parallelism that makes the job fit at its own TP / PP, as a sentence naming the setting: the
    smallest CP for one of ``roles`` (the pool that does not fit), else for all of them; None when none does
    (or the roles' sequences cannot be split: not a dense megatron role without LoRA)."""
    workload = job_workload(config)
    usable = cluster.accelerator.usable_bytes
    devices = dict(job_sets(config, workload))
    candidates = []
    for role in roles:
        work = workload.role(role)
        if (_splits_sequences(config, role) and work.cp == 1 and work.spec.moe is None and not work.lora_rank
                and work.spec.vision is None):
            candidates.append(role)
    if not candidates:
        return None
    pool = devices[next(r for r in devices if roles[0] in r)]
    for group in [(role,) for role in candidates] + ([tuple(candidates)] if len(candidates) > 1 else []):
        cp = 2
        while pool % (cp * max(workload.role(r).tp * workload.role(r).pp for r in group)) == 0:
            changed = config
            for role in group:
                changed = _with_context_parallel(changed, role, cp)
            try:
                plan = job_plan(changed, cluster, efficiency=efficiency)
            except ValueError:
                break
            if all(max(g.memory) <= usable for g in plan.sets):
                settings = " ".join(f"{_CP_SECTIONS.get(r, r)}.engine.context_parallel={cp}" for r in group)
                return (f"each sequence split over {cp} context-parallel ranks makes it fit at its own layout "
                        f"({plan.peak_memory / GIB:.2f} GiB a device at most, {plan.step_time:.3g} s a step): "
                        f"{settings}")
            cp *= 2
    return None


def check_before_launch(config) -> Plan | None:
    """The pre-launch check of a GPU job (``hybridflow train`` before any process, ``RLTrainer.build`` before any
    worker): ``check_job_memory`` on this machine's GPUs; nothing on the CPU path or with
    ``trainer.memory_check`` false (``--force``)."""
    if not config.trainer.memory_check:
        return None
    cluster = local_cluster(config)
    return None if cluster is None else check_job_memory(config, cluster)


def local_cluster(config) -> Cluster | None:
    """This machine's GPUs as the job's cluster (trainer.nnodes x nproc of the first GPU's kind), None on CPU."""
    return gpu_cluster(config.trainer.nnodes, config.trainer.nproc)


def gpu_cluster(nodes: int, devices_per_node: int) -> Cluster | None:
    """``nodes`` x ``devices_per_node`` GPUs of this machine's first GPU's kind and memory; None on CPU."""
    from hybridengine.device import accelerator_available, accelerator_properties

    if not accelerator_available():
        return None
    from controller.planner.hardware import matching_accelerator

    name, memory = accelerator_properties()
    return Cluster(nodes, devices_per_node, matching_accelerator(name, memory))

