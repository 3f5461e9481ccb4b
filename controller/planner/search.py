"""The search: placements of the roles, devices per colocated set, each role's layout (HybridFlow's Algorithm 1).

1. A **placement** groups the roles into colocated sets (every set
   partition of the roles; a rollout that overlaps training is a set of its
   own). Roles of one set share its devices and take turns.
2. A **split** gives each set a number of devices: a divisor of a node's
   devices, or whole nodes, all of the cluster's devices in use, and the
   sets must pack onto the nodes.
3. Each role on its set's devices has its **options** (``planner.options``):
   layouts, micro-batch, generation layout and concurrency, each already
   fitting a device alone and undominated. A set combines one option per
   role; it fits when, in every stage, the roles' model state plus the
   largest working memory of the roles active in that stage fits one device.
4. The **step time** (``critical_path``) follows the step's dataflow over
   the pools: generation, then scoring, then the old and reference
   log-probs and the values, then the advantages on the driver, then the
   critic's and the actor's updates. Within the log-prob/values stage and
   within the updates, sets on disjoint devices work at once and the roles
   of one set take turns, so the stage lasts as long as its slowest set;
   the stages follow each other. A rollout on its own pool under
   one-step-off or async generates while the others work, plus the weight
   transfer. ``Workload.overlap`` False (``trainer.overlap: false``) scores
   the sequential controller: every phase in turn, the sum.

The search is exact. Each role keeps only its undominated options: those
no other option of it beats in every stage time and every memory figure.
Then, for each split, a depth-first branch and bound over the roles cuts
a branch only when even the fastest remaining options cannot beat the best
plan found so far, or when the smallest remaining model states cannot fit.
It returns each placement's optimum, and the tests check that against
brute force. The ``plans`` of a ``PlanResult`` are the best plan of each
placement, fastest first.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from functools import lru_cache

from controller.planner.hardware import Accelerator, Cluster
from controller.planner.options import Option, Pin, links_for, role_options, smallest_footprint
from controller.planner.timing import Efficiency, transfer_time
from controller.planner.workload import Workload
from controller.runtime.placement import ClusterNode, PlacementError, PoolShape, fit_pools

__all__ = ["PHASES", "Plan", "PlanError", "PlanResult", "Rejected", "SCORING_ROLES", "SetPlan", "best_on_split",
           "critical_path", "device_splits", "phase_times", "placements", "search", "set_partitions", "set_phase_times",
           "shared_host", "step_time", "weight_transfer_time"]


class PlanError(ValueError):
    """No plan fits, or the pins contradict each other or the cluster; the message says which and why."""


@dataclass(frozen=True)
class SetPlan:
    roles: tuple[str, ...]
    devices: int
    options: tuple[Option, ...]

    @property
    def times(self) -> tuple[float, float, float]:
        """Seconds in each stage, its roles in turn."""
        return tuple(sum(o.times[s] for o in self.options) for s in range(3))

    @property
    def phases(self) -> tuple[float, float, float, float]:
        """Seconds in each of ``PHASES``, its roles in turn (``critical_path`` reads these)."""
        return set_phase_times(self.options)

    @property
    def memory(self) -> tuple[int, int, int]:
        """Bytes per device in each stage: every role's state plus the largest working set of the stage."""
        return _set_memory(self.options)


def _active_extra(option: Option, stage: int) -> float:
    """What ``option`` adds to a device while it works in ``stage``; -inf when it does not work then."""
    return option.extra[stage] if option.times[stage] > 0 or option.extra[stage] > 0 else -math.inf


def _set_memory(options) -> tuple[int, int, int]:
    resident = sum(o.resident for o in options)
    peaks = []
    for s in range(3):
        top = max(_active_extra(o, s) for o in options)
        peaks.append(resident + (top if top > -math.inf else 0))
    return tuple(peaks)


@dataclass(frozen=True)
class Plan:
    sets: tuple[SetPlan, ...]
    step_time: float
    stage_times: tuple[float, float, float]
    transfer_time: float = 0.0

    @property
    def placement(self) -> tuple[tuple[str, ...], ...]:
        return tuple(s.roles for s in self.sets)

    @property
    def peak_memory(self) -> int:
        return max(max(s.memory) for s in self.sets)

    def option(self, role: str) -> Option:
        for s in self.sets:
            for o in s.options:
                if o.role == role:
                    return o
        raise KeyError(role)


@dataclass(frozen=True)
class Rejected:
    placement: tuple[tuple[str, ...], ...]
    reason: str
    best: Plan | None = None  # the placement's best plan, when one fits
    need: int | None = None  # out of memory: the least a device needs, over every split and layout tried


@dataclass(frozen=True)
class PlanResult:
    plans: tuple[Plan, ...]  # each placement's best, fastest first (the ``top`` of them)
    rejected: tuple[Rejected, ...]  # every other placement, and why it lost
    evaluated: int = 0  # (placement, split) pairs scored


def set_partitions(items: tuple[str, ...]):
    """Every partition of ``items`` into non-empty sets, each set in ``items``' order (Bell(len) of them)."""
    if not items:
        yield ()
        return
    first, rest = items[0], items[1:]
    for partition in set_partitions(rest):
        yield ((first,),) + partition
        for i in range(len(partition)):
            yield partition[:i] + ((first,) + partition[i],) + partition[i + 1:]


def placements(workload: Workload, pins: dict[str, Pin]) -> list[tuple[tuple[str, ...], ...]]:
    """The placements the job allows, actor's set first: a rollout of its own stays alone; pins' colocations hold."""
    roles = workload.role_names
    found = []
    for partition in set_partitions(roles):
        sets = sorted((tuple(r for r in roles if r in part) for part in partition), key=lambda s: roles.index(s[0]))
        where = {r: i for i, s in enumerate(sets) for r in s}
        if "rollout" in where and len(sets[where["rollout"]]) > 1:
            continue
        if any(pin.colocate_with is not None and where[pin.colocate_with] != where[role] for role, pin in pins.items()):
            continue
        found.append(tuple(sets))
    return found


def allowed_sizes(cluster: Cluster) -> list[int]:
    """Devices a set may take: a divisor of a node's devices, or whole nodes."""
    node = cluster.devices_per_node
    return sorted({d for d in range(1, node + 1) if node % d == 0} | {node * k for k in range(1, cluster.nodes + 1)})


@lru_cache(maxsize=1024)
def _packs(cluster: Cluster, sizes: tuple[int, ...]) -> bool:
    node = cluster.devices_per_node
    pools = [PoolShape(f"set{i}", s // node, node) if s > node else PoolShape(f"set{i}", 1, s)
             for i, s in enumerate(sorted(sizes, reverse=True))]
    nodes = [ClusterNode(f"node{i}", cpus=float(node), gpus=float(node)) for i in range(cluster.nodes)]
    try:
        fit_pools(pools, nodes, cpus_per_process=1)
    except PlacementError:
        return False
    return True


def device_splits(cluster: Cluster, sets: int, fixed: tuple[int | None, ...] | None = None):
    """Every way to give ``sets`` sets all of the cluster's devices (sizes from ``allowed_sizes``), packable."""
    sizes = allowed_sizes(cluster)
    fixed = fixed or (None,) * sets
    for combo in itertools.product(*[[f] if f is not None else sizes for f in fixed]):
        if sum(combo) == cluster.devices and _packs(cluster, tuple(sorted(combo))):
            yield combo


SCORING_ROLES = frozenset({"reward_model", "cost", "judge"})  # their passes (a judge's generation) score responses
PHASES = ("generation", "scoring", "log-probs and values", "updates")  # the step's phases, in dataflow order


def phase_times(option: Option) -> tuple[float, float, float, float]:
    """``option``'s seconds in each of ``PHASES``: a reward or cost model's forward passes and a judge's generation
    score, the other roles' forward passes are log-probs and values (the preparation stage holds both)."""
    forward = option.times[1]
    if option.role == "judge":  # its verdicts are generated in the scoring phase
        return 0.0, option.times[0] + forward, 0.0, option.times[2]
    scores = option.role in SCORING_ROLES
    return option.times[0], forward if scores else 0.0, 0.0 if scores else forward, option.times[2]


def set_phase_times(options) -> tuple[float, float, float, float]:
    """A set's seconds in each of ``PHASES``: its roles take turns on its devices, so their times add up."""
    return tuple(sum(t) for t in zip(*(phase_times(o) for o in options))) if options else (0.0,) * 4


def critical_path(phases, rollout: int | None = None, off_policy: bool = False, overlap: bool = True,
                  transfer: float = 0.0, fixed: float = 0.0, together=max) -> tuple[float, tuple[float, float, float]]:
    """The step time from each set's seconds in each of ``PHASES`` (``set_phase_times``), and the time of each
    stage (generation, preparation, training). The step's dataflow (``controller.rl.trainer``, its phases
    run by ``controller.rl.phase_flow``)::

        generation -> scoring -+-> old log-probs -+-> advantages -+-> critic update -+-> next step
                               +-> ref log-probs -+    (driver)   +-> actor update --+
                               +-> values --------+

    - **generation**: the generating role's set (the actor's, or a rollout pool's); it comes first.
    - **scoring**: the reward and cost models read the responses and are called one after another, whatever
      their pools: their times add up.
    - **log-probs and values**: the old and reference log-probs and the values read only the scored batch,
      so each starts as soon as its pool is free. Sets on disjoint devices work at once and the roles of one
      set take turns: the phase lasts as long as its slowest set (``together`` of the sets' own times).
    - **the advantages** on the driver: part of ``fixed``, the step's own host time (``Efficiency.step_s``).
    - **updates**: the critic's and the actor's read the advantages; at once on disjoint sets, in turn on
      a shared one, as the previous phase.
    - **the weight transfer** (``transfer``) to a rollout pool of its own: between the update and the
      generation that uses the new weights.

    A rollout pool of its own (``rollout``: its index) under one-step-off or async (``off_policy``)
    generates the next batch while the other sets score and train: the step is the longer of the two.
    ``overlap`` False is the sequential controller (``trainer.overlap: false``): every phase in turn, so
    every set's time adds up. ``together``: how long sets working at once in one phase take, from each
    one's time working alone (``max`` on accelerators; ``shared_host`` for CPU processes on one machine).
    """
    combine = together if overlap else sum
    generation = combine([p[0] for p in phases])
    scoring = sum(p[1] for p in phases)
    preparation = scoring + combine([p[2] for p in phases])
    training = combine([p[3] for p in phases])
    stages = (generation, preparation, training)
    if rollout is None or not off_policy:
        return generation + preparation + training + transfer + fixed, stages
    alongside = phases[rollout][0]  # the rollout pool does nothing else
    rest = combine([0.0 if k == rollout else p[0] for k, p in enumerate(phases)]) + preparation + training
    return max(alongside, rest) + transfer + fixed, stages


def shared_host(devices: tuple[int, ...], accelerator: Accelerator):
    """``critical_path``'s ``together`` for sets of ``devices`` each: ``max`` on accelerators. CPU processes
    (``Accelerator.host_cores``) share one machine's cores: a set's time alone is at the cores its own
    processes get (``Accelerator.working``); while several sets work, every busy process has an equal share
    (up to its threads), and each set advances at the ratio of the two shares until one finishes (processor
    sharing, every second of a phase taken to scale with the cores). When each set alone already keeps the
    cores busy, working at once takes the sum; only idle cores make it shorter."""
    if not accelerator.host_cores:
        return max

    def cores(active: int) -> float:
        return min(float(accelerator.threads_per_device), accelerator.host_cores / active)

    def together(times) -> float:
        left = {k: t for k, t in enumerate(times) if t > 0}
        clock = 0.0
        while left:
            share = cores(sum(devices[k] for k in left))
            rate = {k: share / cores(devices[k]) for k in left}
            first = min(left, key=lambda k: left[k] / rate[k])
            step = left[first] / rate[first]
            clock += step
            left = {k: t - step * rate[k] for k, t in left.items() if k != first and t - step * rate[k] > 0}
        return clock

    return together


def step_time(workload: Workload, sets: tuple[SetPlan, ...], transfer: float, fixed: float = 0.0, *,
              accelerator: Accelerator | None) -> tuple[float, tuple[float, float, float]]:
    """(seconds per step, per stage) by ``critical_path``, at ``workload.overlap``; ``fixed``: the step's own
    host time (``Efficiency.step_s``); ``accelerator``: the cluster's device (CPU processes share its host's
    cores when sets work at once: ``shared_host``; None: devices of their own)."""
    rollout = next((k for k, s in enumerate(sets) if s.roles == ("rollout",)), None)
    together = shared_host(tuple(s.devices for s in sets), accelerator) if accelerator is not None else max
    return critical_path([s.phases for s in sets], rollout, _off_policy(workload), workload.overlap, transfer,
                         fixed, together)


def _off_policy(workload: Workload) -> bool:
    return workload.mode in ("one_step_off", "async")


def weight_transfer_time(option: Option, cluster: Cluster, efficiency: Efficiency) -> float:
    """The actor's weights to a rollout pool of its own: each rollout rank receives its generation shard
    (over the node's link on one node, else the network); a LoRA actor's, its adapters whole (the frozen base
    crossed once)."""
    link = links_for(cluster, 1 if cluster.nodes == 1 else cluster.devices_per_node + 1)
    sent = option.resident if option.transfer_bytes is None else option.transfer_bytes
    return transfer_time(sent, link, efficiency)


class _Search:
    def __init__(self, workload: Workload, cluster: Cluster, efficiency: Efficiency, pins: dict[str, Pin],
                 prune: bool = True):
        self.workload, self.cluster, self.efficiency, self.pins, self.prune = workload, cluster, efficiency, pins, prune
        self.budget = cluster.accelerator.usable_bytes
        self._options: dict = {}
        self._footprints: dict = {}

    def options(self, role: str, n: int) -> list[Option]:
        key = (role, n)
        if key not in self._options:
            self._options[key] = role_options(self.workload.role(role), self.workload, self.cluster, self.efficiency,
                                              n, self.pins.get(role), prune=self.prune)
        return self._options[key]

    def footprint(self, role: str, n: int) -> int | None:
        key = (role, n)
        if key not in self._footprints:
            self._footprints[key] = smallest_footprint(self.workload.role(role), self.workload, self.cluster,
                                                       self.efficiency, n, self.pins.get(role))
        return self._footprints[key]

    def transfer_of(self, option: Option) -> float:
        return weight_transfer_time(option, self.cluster, self.efficiency)

    def best_for_split(self, placement, split, incumbent: float = math.inf) -> Plan | None:
        """The fastest feasible choice of one option per role (None: none beats ``incumbent`` or fits).

        Depth-first over the roles, each role's options fastest first; a branch is cut when even the
        fastest remaining options cannot beat the best plan found, or when the smallest remaining
        model states cannot fit beside what is chosen. Exact: only provably worse branches are cut.
        """
        slots = [(k, role) for k, roles in enumerate(placement) for role in roles]
        options = []
        for k, role in slots:
            opts = self.options(role, split[k])
            if not opts:
                return None
            options.append(sorted(opts, key=lambda o: (sum(o.times), o.resident)))
        rollout = next((k for k, roles in enumerate(placement) if "rollout" in roles), None)
        sets = len(placement)
        phases = [[phase_times(o) for o in opts] for opts in options]
        together = shared_host(tuple(split), self.cluster.accelerator)
        off_policy, overlap = _off_policy(self.workload), self.workload.overlap
        budget, fixed = self.budget, self.efficiency.step_s

        def objective(times, transfer_s: float) -> float:
            return critical_path(times, rollout, off_policy, overlap, transfer_s, fixed, together)[0]

        # What the roles after each depth still add at least: times per set and phase, state per set.
        min_time = [[[0.0] * 4 for _ in range(sets)] for _ in range(len(slots) + 1)]
        min_state = [[0] * sets for _ in range(len(slots) + 1)]
        min_transfer = [0.0] * (len(slots) + 1)
        for depth in range(len(slots) - 1, -1, -1):
            k = slots[depth][0]
            for j in range(sets):
                min_state[depth][j] = min_state[depth + 1][j]
                for phase in range(4):
                    min_time[depth][j][phase] = min_time[depth + 1][j][phase]
            min_state[depth][k] += min(o.resident for o in options[depth])
            for phase in range(4):
                min_time[depth][k][phase] += min(t[phase] for t in phases[depth])
            min_transfer[depth] = min_transfer[depth + 1] + (
                min(self.transfer_of(o) for o in options[depth]) if k == rollout else 0.0)
        best: list = [incumbent, None]
        times = [[0.0] * 4 for _ in range(sets)]
        state = [0] * sets
        extra = [[-math.inf] * 3 for _ in range(sets)]
        chosen: list[Option] = []
        transfer = [0.0]

        def descend(depth: int) -> None:
            if depth == len(slots):
                total = objective(times, transfer[0])
                if total < best[0] - 1e-12:
                    best[0], best[1] = total, list(chosen)
                return
            k = slots[depth][0]
            for option, option_phases in zip(options[depth], phases[depth]):
                new_state = state[k] + option.resident
                new_extra = [max(extra[k][s], _active_extra(option, s)) for s in range(3)]
                rest = min_state[depth + 1][k]
                if any(new_state + rest + (e if e > -math.inf else 0) > budget for e in new_extra):
                    continue
                added = self.transfer_of(option) if k == rollout else 0.0
                bound_times = [[times[j][p] + (option_phases[p] if j == k else 0.0) + min_time[depth + 1][j][p]
                                for p in range(4)] for j in range(sets)]
                if objective(bound_times, transfer[0] + added + min_transfer[depth + 1]) >= best[0] - 1e-12:
                    continue
                saved = (list(times[k]), state[k], list(extra[k]), transfer[0])
                times[k] = [times[k][p] + option_phases[p] for p in range(4)]
                state[k], extra[k] = new_state, new_extra
                transfer[0] += added
                chosen.append(option)
                descend(depth + 1)
                chosen.pop()
                times[k], state[k], extra[k], transfer[0] = list(saved[0]), saved[1], list(saved[2]), saved[3]

        descend(0)
        if best[1] is None:
            return None
        groups, cursor = [], 0
        for k, roles in enumerate(placement):
            groups.append(SetPlan(roles, split[k], tuple(best[1][cursor:cursor + len(roles)])))
            cursor += len(roles)
        total_transfer = sum(self.transfer_of(o) for g in groups if "rollout" in g.roles for o in g.options)
        step, stages = step_time(self.workload, tuple(groups), total_transfer, fixed,
                                 accelerator=self.cluster.accelerator)
        return Plan(tuple(groups), step, stages, total_transfer)

    def need(self, placement, split) -> int | None:
        """The least a device of the tightest set needs under this split, over every layout (None: some role
        has no legal layout on its set's devices)."""
        worst = 0
        for roles, n in zip(placement, split):
            needs = [self.footprint(r, n) for r in roles]
            if any(x is None for x in needs):
                return None
            worst = max(worst, sum(needs))
        return worst


def search(workload: Workload, cluster: Cluster, efficiency: Efficiency | None = None,
           pins: dict[str, Pin] | None = None, top: int = 5, prune: bool = True) -> PlanResult:
    """The best plans for ``workload`` on ``cluster``, and why every other placement lost."""
    efficiency = efficiency or Efficiency()
    pins = pins or {}
    engine = _Search(workload, cluster, efficiency, pins, prune)
    ranked: list[Plan] = []
    rejected: list[Rejected] = []
    evaluated = 0
    for placement in placements(workload, pins):
        fixed = tuple(_fixed_devices(roles, pins) for roles in placement)
        best_here, need = None, None
        for split in device_splits(cluster, len(placement), fixed):
            evaluated += 1
            plan = engine.best_for_split(placement, split, best_here.step_time if best_here else math.inf)
            if plan is not None:
                best_here = plan
            elif best_here is None:
                n = engine.need(placement, split)
                if n is not None:
                    need = n if need is None else min(need, n)
        if best_here is not None:
            ranked.append(best_here)
        else:
            rejected.append(Rejected(placement, "out of memory" if need else
                                     "no layout of its models divides any split of the devices", None, need))
    ranked.sort(key=lambda p: (p.step_time, p.peak_memory, _signature(p)))
    if not ranked:
        return PlanResult((), tuple(rejected), evaluated)
    winner = ranked[0]
    kept = tuple(ranked[:top])
    for plan in ranked[top:]:
        slower = plan.step_time / winner.step_time - 1
        rejected.append(Rejected(plan.placement, f"slower: {plan.step_time:.3g} s a step, {slower:+.1%}", plan))
    rejected.sort(key=lambda r: (r.best is None, r.best.step_time if r.best else -(r.need or 0)))
    return PlanResult(kept, tuple(rejected), evaluated)


def best_on_split(workload: Workload, cluster: Cluster, placement, split, efficiency: Efficiency | None = None,
                  pins: dict[str, Pin] | None = None) -> tuple[Plan | None, int | None]:
    """The fastest plan of one placement on one split of the devices, and when none fits, the least a device
    of its tightest set needs (None: no layout divides its devices)."""
    engine = _Search(workload, cluster, efficiency or Efficiency(), pins or {})
    plan = engine.best_for_split(placement, split)
    return plan, None if plan is not None else engine.need(placement, split)


def _fixed_devices(roles: tuple[str, ...], pins: dict[str, Pin]) -> int | None:
    fixed = {pins[r].devices for r in roles if r in pins and pins[r].devices is not None}
    if len(fixed) > 1:
        raise PlanError(f"pins give colocated roles {roles} different device counts {sorted(fixed)}")
    return fixed.pop() if fixed else None


def _signature(plan: Plan) -> tuple:
    return tuple((s.roles, s.devices, tuple((o.tp, o.pp, o.cp, o.micro_batch, o.gen_tp or 0, o.concurrency or 0)
                                            for o in s.options)) for s in plan.sets)
