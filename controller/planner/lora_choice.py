"""``rollout.lora_sync: auto``: merge a LoRA actor's adapters into the generation weights, or have vLLM serve them.

The two ways cost different things (``options._lora_generation``):

- ``merge`` keeps the adapted linears of the generation shard in a buffer of their own and rebuilds them every
  step (the frozen base read, B A added): memory for the whole step, and a merge that is bandwidth-bound;
- ``adapter`` keeps only the adapters beside the engine's weights, and pays vLLM's LoRA kernels in every
  generation (``Efficiency.lora_decode_overhead``: a small fraction on GPUs, 5.3x on this machine's CPU).

``choose_lora_sync`` scores the job's own plan both ways on its devices: the mode whose plan fits a device in
every stage; of two that fit, the faster step (merge on a tie: the engine then runs its plain kernels). When
neither fits, merge, and the memory check says why. ``resolve_lora_sync`` writes the choice into a config before
any worker starts (``RLTrainer.build``), with the reason for the console.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from controller.planner.hardware import GIB, Cluster
from controller.planner.prelaunch import job_plan
from controller.planner.search import Plan
from controller.planner.timing import Efficiency
from controller.planner.workload import Workload, job_workload

__all__ = ["LoRASyncChoice", "choose_lora_sync", "resolve_lora_sync"]


@dataclass(frozen=True)
class LoRASyncChoice:
    mode: str  # merge or adapter
    reason: str
    plans: dict[str, Plan]  # the job's plan with each mode scored

    @property
    def plan(self) -> Plan:
        return self.plans[self.mode]


def _stage_of(plan: Plan) -> str:
    worst = max(plan.sets, key=lambda s: max(s.memory))
    return ("generation", "preparation", "training")[max(range(3), key=lambda i: worst.memory[i])]


def choose_lora_sync(config, cluster: Cluster, efficiency: Efficiency | None = None,
                     workload: Workload | None = None) -> LoRASyncChoice:
    """The way a LoRA actor's adapters should reach its generation engine on ``cluster``, and why."""
    workload = workload or job_workload(config)
    efficiency = efficiency or Efficiency()
    modes = workload.lora_modes()
    if modes == (None,):
        raise ValueError("the job's actor trains no LoRA adapters (actor.lora.rank is 0): nothing to choose")
    plans = {mode: job_plan(config, cluster, workload, efficiency, lora_sync=mode) for mode in modes}
    if len(modes) == 1:
        mode = modes[0]
        why = ("set by rollout.lora_sync" if workload.lora_sync != "auto" else
               f"the {workload.generation_engine} engine takes the adapters merged")
        return LoRASyncChoice(mode, why, plans)
    usable = cluster.accelerator.usable_bytes
    fits = [m for m in modes if plans[m].peak_memory <= usable]
    merge, adapter = plans["merge"], plans["adapter"]
    if len(fits) == 2:
        mode = "adapter" if adapter.step_time < merge.step_time else "merge"
        other = "adapter" if mode == "merge" else "merge"
        why = (f"{plans[mode].step_time:.3g} s a step against {other}'s {plans[other].step_time:.3g} s; both fit "
               f"({merge.peak_memory / GIB:.2f} and {adapter.peak_memory / GIB:.2f} GiB a device, "
               f"{usable / GIB:.2f} usable; vLLM's LoRA kernels add {efficiency.lora_decode_overhead:.0%} to a "
               f"generation)")
    elif fits == ["adapter"]:
        mode = "adapter"
        why = (f"merging needs {merge.peak_memory / GIB:.2f} GiB a device in the {_stage_of(merge)} stage (the merged "
               f"linears kept beside the base), {usable / GIB:.2f} usable; served, {adapter.peak_memory / GIB:.2f} GiB")
    elif fits == ["merge"]:
        mode = "merge"
        why = (f"serving needs {adapter.peak_memory / GIB:.2f} GiB a device, {usable / GIB:.2f} usable; merged, "
               f"{merge.peak_memory / GIB:.2f} GiB")
    else:
        mode = "merge"
        why = (f"neither fits {usable / GIB:.2f} GiB a device (merge {merge.peak_memory / GIB:.2f}, adapter "
               f"{adapter.peak_memory / GIB:.2f} GiB)")
    return LoRASyncChoice(mode, why, plans)


def resolve_lora_sync(config, cluster: Cluster, efficiency: Efficiency | None = None,
                      flash_attention: bool = True) -> tuple[object, LoRASyncChoice | None]:
    """``config`` with ``rollout.lora_sync`` set: ``auto`` becomes the planner's choice on ``cluster`` (merge
    without a LoRA actor, where there is nothing to choose); the choice, or None when nothing was chosen."""
    rollout = config.rollout
    if rollout.lora_sync != "auto":
        return config, None
    if not config.actor.lora.enabled:
        return replace(config, rollout=replace(rollout, lora_sync="merge")), None
    choice = choose_lora_sync(config, cluster, efficiency, job_workload(config, flash_attention=flash_attention))
    if choice.mode == "adapter" and _moves_requests_in_flight(config):
        choice = LoRASyncChoice("merge", "a served agent's requests take new weights in flight (trainer.mode async, "
                                "rollout.server_update pause), which vLLM cannot do for a request's LoRA adapter",
                                choice.plans)
    return replace(config, rollout=replace(rollout, lora_sync=choice.mode)), choice


def _moves_requests_in_flight(config) -> bool:
    """A served agent's requests go on under each new version of the weights (``EngineLoop.update``'s pause)."""
    rollout = config.rollout
    return config.trainer.mode == "async" and rollout.serves_agent and rollout.server_update == "pause"
