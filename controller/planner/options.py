"""Every way one role can run on ``n`` devices, with its memory and its time per stage.

An ``Option`` is a role at one layout: TP x PP x DP and the micro-batch (a
mixture of experts also its expert parallelism EP, with each expert whole on
a rank or cut over TP: ETP 1 or TP); for the role that generates, also the
generation layout the hybrid engine reaches from it and how many sequences a
generation engine runs at once (what its KV cache holds). A dense megatron role may also split each
sequence over context-parallel ranks (CP): the planner tries CP 2, 4, ... at a layout only where the
sizes below it leave the role's activations too large for a device. ``role_options`` lists the
options that fit one device's memory by themselves, keeping only those no other option beats on
every stage time and every memory figure (the search combines roles, and a
dominated option never makes a better combination).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from functools import lru_cache

from hybridengine.model.spec import ModelConfigError
from hybridengine.parallel.layout import ParallelLayout, divisors
from hybridengine.reshard.expert_group import linear_bound
from hybridengine.reshard.plan import GenerationLayout, legal_generation_layouts, plan_reshard

from controller.planner.hardware import Cluster
from controller.planner.memory import (ActivationShape, activation_bytes, dtype_bytes, expert_weight_bytes,
                                       kv_bytes_per_sequence, kv_cache_bytes, lora_adapter_bytes, lora_gather_bytes,
                                       lora_merged_bytes, state_memory, weight_bytes)
from controller.planner.timing import (Efficiency, ExpertGrid, Link, PassShape, all_gather_time, forward_time,
                                       generation_time, lora_merge_time, train_time, transfer_time, weight_load_time)
from controller.planner.workload import RoleWork, Workload

__all__ = ["Option", "Pin", "evaluate_option", "kv_concurrency", "role_options", "links_for"]

MICRO_BATCHES = (1, 2, 4, 8, 16)
CONCURRENCY_LEVELS = 6  # generation: the most sequences at once, then halved this many times at most


@dataclass(frozen=True)
class Pin:
    """What the user fixed for a role (``--pin role.key=value``); None: the planner chooses."""

    tp: int | None = None
    pp: int | None = None
    ep: int | None = None  # a mixture of experts' expert parallelism
    cp: int | None = None  # context parallelism
    micro_batch: int | None = None
    gen_tp: int | None = None
    devices: int | None = None
    colocate_with: str | None = None
    kv_cache_bytes: int | None = None  # the generating role: its engine's KV cache, as ``rollout.kv_cache_bytes``


@dataclass(frozen=True)
class Option:
    role: str
    devices: int
    tp: int
    pp: int
    dp: int
    micro_batch: int
    times: tuple[float, float, float]  # seconds in the generation, preparation and training stages
    resident: int  # bytes held on a device for the whole step (model state)
    extra: tuple[int, int, int]  # bytes added on a device while it works in each stage (0 when idle)
    gen_tp: int | None = None
    gen_pp: int | None = None
    concurrency: int | None = None  # sequences a generation engine runs at once
    reshard_bytes: int = 0  # bytes each rank receives to build its generation shard
    memory: dict = field(default_factory=dict, compare=False)  # the breakdown, for the report
    ep: int = 1  # a mixture of experts' expert parallelism
    etp: int | None = None  # and its expert TP (None: the TP size)
    lora_sync: str | None = None  # a LoRA actor's generation: its adapters merged or served (rollout.lora_sync)
    transfer_bytes: int | None = None  # a rollout pool's: what crosses from the actor's pool each step (None: resident)
    cp: int = 1  # context parallelism: each sequence over this many ranks (``dp`` counts the replicas without them)

    def dominates(self, other: "Option") -> bool:
        mine = (*self.times, self.resident, *self.extra)
        theirs = (*other.times, other.resident, *other.extra)
        return all(a <= b for a, b in zip(mine, theirs)) and mine != theirs

    @property
    def layout(self) -> str:
        text = f"TP{self.tp} " + (f"CP{self.cp} " if self.cp > 1 else "") + f"PP{self.pp} DP{self.dp}"
        if self.ep > 1 or self.etp is not None:
            text += f" EP{self.ep}" + (f" ETP{self.etp}" if self.etp is not None else "")
        text += f" mb{self.micro_batch}"
        if self.gen_tp is not None:
            text += f", generation TP{self.gen_tp}" + (f" PP{self.gen_pp}" if self.gen_pp != 1 else "")
        if self.lora_sync is not None:
            text += f", LoRA {self.lora_sync}"
        return text


def links_for(cluster: Cluster, ranks: int) -> Link:
    """The link a group of ``ranks`` consecutive ranks uses: the node's when it fits one node, else the network."""
    device = cluster.accelerator
    if ranks <= cluster.devices_per_node:
        return Link(device.link_bandwidth, device.link_latency)
    return Link(device.network_bandwidth, device.network_latency)


def _legal_layout(work: RoleWork, tp: int, pp: int, ep: int = 1, etp: int | None = None, n: int | None = None) -> bool:
    try:
        work.padded(tp).check_layout(tp, pp, ep, etp)
        if n is not None:
            ParallelLayout.for_world(n, tp, pp, ep, etp)
    except (ModelConfigError, ValueError):
        return False
    return True


def _expert_grids(work: RoleWork, n: int, tp: int, pp: int, pin: Pin) -> list[tuple[int, int | None]]:
    """(EP, ETP) of a layout: (1, None) for a dense model; for a mixture of experts every EP that divides
    the experts and a stage's ranks, each expert cut over TP (ETP None) or, with TP > 1, whole (ETP 1)."""
    if work.spec.moe is None:
        return [(1, None)]
    grids = []
    for ep in divisors(work.spec.moe.num_experts):
        if pin.ep is not None and ep != pin.ep:
            continue
        for etp in (None, 1) if tp > 1 else (None,):
            if _legal_layout(work, tp, pp, ep, etp, n):
                grids.append((ep, etp))
    return grids


def _layouts(work: RoleWork, n: int, cluster: Cluster, pin: Pin) -> list[tuple[int, int, int, int | None]]:
    found = []
    for tp in divisors(n):
        if tp > cluster.devices_per_node or (pin.tp is not None and tp != pin.tp):
            continue
        for pp in divisors(n // tp):
            if (pin.pp is not None and pp != pin.pp) or not _legal_layout(work, tp, pp):
                continue
            found += [(tp, pp, ep, etp) for ep, etp in _expert_grids(work, n, tp, pp, pin)]
    return found


def _context_parallel_sizes(work: RoleWork, workload: Workload, cluster: Cluster, n: int, tp: int, pp: int,
                            pin: Pin) -> list[int]:
    """CP sizes to try at TP x PP on ``n`` devices: the pinned one; else 1, and for a dense megatron role without
    LoRA or a vision tower each next power of two that divides the DP ranks while the one before does not fit a
    device at one sequence per micro-batch (its state and its training, or forward, activations)."""
    if pin.cp is not None:
        return [pin.cp] if (n // (tp * pp)) % pin.cp == 0 else []
    sizes = [1]
    if work.role == "rollout" or work.spec.moe is not None or work.lora_rank or work.spec.vision is not None:
        return sizes
    spec, dp = work.padded(tp), n // (tp * pp)
    state = state_memory(spec, tp, pp, dp, work.precision, work.trains, work.distributed_optimizer).total
    while dp % (sizes[-1] * 2) == 0:
        shape = ActivationShape(1, workload.seq_len, work.precision, workload.flash_attention, work.recompute,
                                work.recompute_num_layers, context_parallel=sizes[-1], packed=sizes[-1] > 1)
        if state + activation_bytes(spec, tp, pp, shape, pp, trains=work.trains) <= cluster.accelerator.usable_bytes:
            break
        sizes.append(sizes[-1] * 2)
    return sizes


def _micro_batches(work: RoleWork, workload: Workload, dp: int, pin: Pin) -> list[int]:
    if work.trains:
        if work.mini_batch % dp:
            return []
        per_rank = work.mini_batch // dp
    else:
        per_rank = math.ceil(workload.sequences / dp)
    choices = MICRO_BATCHES if pin.micro_batch is None else (pin.micro_batch,)
    return [m for m in choices if m <= per_rank and (not work.trains or per_rank % m == 0)]


def evaluate_option(work: RoleWork, workload: Workload, cluster: Cluster, efficiency: Efficiency, n: int, tp: int,
                    pp: int, micro_batch: int, gen: tuple[int, int] | None = None,
                    concurrency: int | None = None, ep: int = 1, etp: int | None = None,
                    lora_sync: str | None = None, cp: int = 1) -> Option:
    """One role at one layout on ``n`` devices: memory and stage times (``ep`` / ``etp``: a mixture of
    experts' expert parallelism; ``lora_sync``: how a LoRA actor's adapters reach the generating role; ``cp``:
    context parallelism, among the ``n / (TP x PP)`` data-parallel ranks)."""
    # The option's times are its set's working alone: only its set's devices busy (what matters for CPU
    # processes sharing a machine's cores). Where sets work at once the search stretches them by the cores they
    # then share (``search.shared_host``); a rollout pool of its own generating beside them under one-step-off
    # is not modeled.
    device = cluster.accelerator.working(n)
    # Python runs on one core: a process given more of the machine does its host work faster too.
    efficiency = efficiency.on_faster_host(min(1.0, device.cores_per_device)
                                           / min(1.0, cluster.accelerator.cores_per_device))
    dp = n // (tp * pp)
    spec = work.padded(tp)
    seq = workload.seq_len
    patches = workload.image_tokens * spec.vision.spatial_merge_size ** 2 if spec.vision is not None else 0
    shape = ActivationShape(micro_batch, seq, work.precision, workload.flash_attention, work.recompute,
                            work.recompute_num_layers, micro_batch * patches if work.train_vision else 0,
                            context_parallel=cp, packed=cp > 1 or work.packed)
    tp_link, dp_link, pp_link = links_for(cluster, tp), links_for(cluster, n), links_for(cluster, tp * pp)
    # what a pass's shape adds to its sequences (a forward pass runs a trained tower's FLOPs once either way)
    images = dict(image_tokens=workload.image_tokens, vision_trains=work.train_vision, context_parallel=cp,
                  cp_link=links_for(cluster, tp * cp))
    experts = ExpertGrid(ep, etp, links_for(cluster, ep * (tp if etp is None else etp)))
    memory: dict[str, int] = {}
    times = [0.0, 0.0, 0.0]
    extra = [0, 0, 0]
    if work.serves:  # generation only, from its own copy (a rollout pool's, a judge's): weights and KV are its state
        state_weights = weight_bytes(work.spec, tp, pp, _generation_precision(work, workload))
        memory["weights"] = state_weights
    else:
        state = state_memory(spec, tp, pp, dp, work.precision, work.trains, work.distributed_optimizer, ep, etp,
                             work.lora_rank, work.lora_targets, work.train_vision)
        memory.update(weights=state.weights, gradients=state.gradients, optimizer=state.optimizer)
        state_weights = state.total
    if work.forward_passes:
        forward_act = activation_bytes(spec, tp, pp, shape, 1, trains=False)
        memory["forward activations"] = forward_act
        extra[1] = forward_act
        times[1] = work.forward_passes * forward_time(spec, tp, pp, dp, PassShape(workload.sequences, seq, micro_batch,
                                                                                  **images),
                                                      device, work.precision, tp_link, efficiency, pp_link, experts)
    if work.trains:
        steps = work.epochs * max(1, workload.sequences // work.mini_batch)
        micro = work.mini_batch // (dp // cp) // micro_batch
        train_act = activation_bytes(spec, tp, pp, shape, micro, trains=True)
        memory["training activations"] = train_act
        extra[2] = train_act
        times[2] = train_time(spec, tp, pp, dp, PassShape(workload.sequences * work.epochs, seq, micro_batch, **images), steps,
                              device, work.precision, tp_link, dp_link, efficiency, work.distributed_optimizer,
                              work.recompute, pp_link, experts)
    reshard, transfer = 0, None
    if work.role == "judge":  # verdicts on every sample, its checkpoint loaded once (the scoring phase's time)
        gen_tp, gen_pp = gen
        prompt_len, response_len = work.lengths(workload)
        kv = kv_cache_bytes(work.spec, gen_tp, prompt_len + response_len, concurrency, work.precision,
                            workload.kv_block_tokens)
        memory["KV cache"] = kv
        state_weights += kv  # its engine keeps its cache for the whole step (it is not put to sleep)
        times[0] += generation_time(work.spec, gen_tp, n // (gen_tp * gen_pp), workload.sequences, prompt_len,
                                    response_len, concurrency, device, links_for(cluster, gen_tp), efficiency,
                                    work.precision)
    elif work.generates and lora_sync is not None:
        times[0], extra[0], reshard, transfer = _lora_generation(work, workload, cluster, efficiency, device, n, tp, pp,
                                                                 gen, concurrency, lora_sync, memory)
        state_weights += memory.get("generation base", 0) + memory.get("merged linears", 0)
    elif work.generates:
        gen_tp, gen_pp = gen
        replicas = n // (gen_tp * gen_pp)
        kv = kv_cache_bytes(work.spec, gen_tp, seq, concurrency, workload.generation_precision,
                            workload.kv_block_tokens)
        memory["KV cache"] = kv
        if work.role == "rollout":  # the weights arrive from the actor's pool (the search adds the transfer)
            extra[0] = kv
            times[0] += weight_load_time(work.spec, state_weights, device, efficiency)
        else:
            gen_shard = weight_bytes(work.spec.with_padded_vocab(work.vocab_multiple, tp), gen_tp, gen_pp,
                                     workload.generation_precision)
            # The released training weights: the dense part (a mixture of experts keeps its training experts).
            released = memory["weights"] - expert_weight_bytes(spec, tp, pp, work.precision, ep, etp) \
                if workload.release_training else 0
            memory["generation weights"] = gen_shard
            extra[0] = gen_shard + kv - released
            group = tp * pp // (gen_tp * gen_pp)  # the micro-DP group: ranks whose shards make one generation shard
            expert_shard = expert_weight_bytes(work.spec, gen_tp, gen_pp, workload.generation_precision)
            dense_shard = gen_shard - expert_shard
            if group > 1:
                reshard = (group - 1) * dense_shard // group
                times[0] += (all_gather_time(dense_shard, group, links_for(cluster, group), efficiency)
                             + work.spec.num_layers * efficiency.reshard_layer_s)
            if expert_shard:  # the routed experts point to point, at their bound (hybridengine.reshard.expert_group)
                received = expert_reshard_bytes(work.spec, ParallelLayout.for_world(n, tp, pp, ep, etp),
                                                GenerationLayout(gen_tp, gen_pp), workload.generation_precision)
                reshard += received
                times[0] += transfer_time(received, links_for(cluster, n), efficiency)
            times[0] += weight_load_time(work.spec, gen_shard, device, efficiency)
        times[0] += generation_time(work.spec, gen_tp, replicas, workload.sequences, workload.prompt_len,
                                    workload.response_len, concurrency, device, links_for(cluster, gen_tp), efficiency,
                                    workload.generation_precision, workload.image_tokens)
    return Option(work.role, n, tp, pp, dp // cp, micro_batch, tuple(times), state_weights, tuple(extra),
                  gen[0] if gen else None, gen[1] if gen else None, concurrency, reshard, memory, ep, etp,
                  lora_sync if work.generates else None, transfer, cp)


def _generation_precision(work: RoleWork, workload: Workload) -> str:
    """The precision a role generates in: a judge's its own, the policy's rollout the workload's."""
    return work.precision if work.role == "judge" else workload.generation_precision


def _lora_generation(work: RoleWork, workload: Workload, cluster: Cluster, efficiency: Efficiency, device, n: int,
                     tp: int, pp: int, gen: tuple[int, int], concurrency: int, mode: str, memory: dict
                     ) -> tuple[float, int, int, int | None]:
    """The generation stage of a LoRA actor's policy, its adapters ``mode`` (merge or adapter): the stage's time,
    the bytes it adds while generating, what each rank receives for it, and what crosses to a rollout pool.

    The frozen base reaches the generation layout once and is kept: by the actor's ranks (a copy where a micro-DP
    group gathers it; at the training layout, the training shards themselves; a slice of them, views but for
    fc1, whose gate and up halves are cut apart) or by a rollout pool's. The steady step then moves
    the adapters alone (``workers.megatron.hybrid_bridge``); ``merge`` rebuilds the adapted linears in a buffer
    kept between steps, ``adapter`` has vLLM serve them (their slots beside its weights, its LoRA kernels in every
    generation). The training weights are not released. An engine that sleeps between rollouts takes its whole
    shard each step; one that keeps it takes the merged linears only, or the new adapters."""
    gen_tp, gen_pp = gen
    precision = workload.generation_precision
    element = dtype_bytes(precision)
    rank, targets = workload.lora_rank, workload.lora_targets
    replicas = n // (gen_tp * gen_pp)
    seq = workload.seq_len
    kv = kv_cache_bytes(work.spec, gen_tp, seq, concurrency, precision, workload.kv_block_tokens)
    memory["KV cache"] = kv
    own_pool = work.role == "rollout"
    gen_shard = (memory["weights"] if own_pool else
                 weight_bytes(work.spec.with_padded_vocab(work.vocab_multiple, tp), gen_tp, gen_pp, precision))
    merged = lora_merged_bytes(work.spec, gen_tp, gen_pp, precision, targets)
    slots = lora_adapter_bytes(work.spec, gen_tp, gen_pp, precision, rank, targets) if mode == "adapter" else 0
    whole = lora_adapter_bytes(work.spec, 1, 1, precision, rank, targets)
    if not own_pool:  # the engine's own copy, while it generates (a rollout pool's are its state)
        memory["generation weights"] = gen_shard
    if own_pool or (gen_tp < tp or gen_pp < pp):  # received, or gathered by a micro-DP group: a copy
        memory["generation base"] = gen_shard
    elif gen_tp > tp:  # a slice of the training shards: views, but fc1's [gate; up] is cut apart and joined again
        memory["generation base"] = lora_merged_bytes(work.spec, gen_tp, gen_pp, precision, ("gate_proj", "up_proj"))
    if mode == "merge":
        memory["merged linears"] = merged
    else:
        memory["served adapters"] = slots
    time = 0.0
    transfer = None
    if own_pool:  # the adapters whole from the actor's pool (the search adds the transfer)
        transfer, received = whole, 0
    else:  # gathered whole over the actor's TP, then its stages
        received = lora_gather_bytes(work.spec, tp, pp, precision, rank, targets)
        time += all_gather_time(whole, tp * pp, links_for(cluster, tp * pp), efficiency)
    if mode == "merge":
        time += lora_merge_time(merged, rank, element, device, efficiency)
    # What the engine takes each step; a new LoRA reaches every layer too (vLLM's add_lora).
    if mode == "merge":
        loaded = gen_shard if workload.generation_sleeps else merged
    else:
        loaded = (gen_shard if workload.generation_sleeps else 0) + slots
    time += weight_load_time(work.spec, loaded, device, efficiency)
    generation = generation_time(work.spec, gen_tp, replicas, workload.sequences, workload.prompt_len,
                                 workload.response_len, concurrency, device, links_for(cluster, gen_tp), efficiency,
                                 precision)
    if mode == "adapter":
        generation += (generation - efficiency.call_s) * efficiency.lora_decode_overhead
    return time + generation, (0 if own_pool else gen_shard) + kv + slots, received, transfer


@lru_cache(maxsize=1024)  # the same (layout, generation layout) for every micro-batch and concurrency option
def expert_reshard_bytes(spec, train: ParallelLayout, gen: GenerationLayout, precision: str) -> int:
    """The most any rank receives of its generation experts from ``train``: the experts' bound (closed form)."""
    layout = plan_reshard(train, gen)
    return max(linear_bound(spec, layout, rank, dtype_bytes(precision)) for rank in range(train.world_size))


def kv_concurrency(workload: Workload, spec, gen_tp: int, cache_bytes: int, work: RoleWork | None = None) -> int:
    """Sequences at full length that ``cache_bytes`` of KV cache holds on a rank at generation TP ``gen_tp`` (of
    ``work``'s own lengths and precision where it generates with its own: a judge)."""
    seq = sum(work.lengths(workload)) if work is not None else workload.seq_len
    precision = _generation_precision(work, workload) if work is not None else workload.generation_precision
    per_sequence = kv_bytes_per_sequence(spec, gen_tp, seq, precision, workload.kv_block_tokens)
    held_back = kv_cache_bytes(spec, gen_tp, seq, 0, precision, workload.kv_block_tokens)
    return max(1, min(workload.max_num_seqs, (cache_bytes - held_back) // per_sequence))


def _generation_choices(work: RoleWork, workload: Workload, n: int, tp: int, pp: int, pin: Pin):
    traits = workload.generation_traits
    if work.serves:
        layouts = [(t, 1) for t in divisors(n) if _legal_layout(work, t, 1)]
        if traits.pipeline_parallel and work.role == "rollout":
            layouts += [(t, p) for t in divisors(n) for p in divisors(n // t) if p > 1 and _legal_layout(work, t, p)]
    else:
        layouts = [(g.tensor_parallel, g.pipeline_parallel)
                   for g in legal_generation_layouts(ParallelLayout.for_world(n, tp, pp))]
        if not traits.pipeline_parallel:
            layouts = [(t, p) for t, p in layouts if p == 1]
    if work.spec.moe is not None:  # the experts must split over the generation TP; some engines run them at TP1
        layouts = [(t, p) for t, p in layouts if work.spec.moe.expert_ffn_hidden_size % t == 0
                   and (traits.experts_at_tensor_parallel or t == 1)]
    for gen_tp, gen_pp in layouts:
        if pin.gen_tp is not None and gen_tp != pin.gen_tp:
            continue
        replicas = n // (gen_tp * gen_pp)
        if pin.kv_cache_bytes is not None:
            levels = [kv_concurrency(workload, work.spec, gen_tp, pin.kv_cache_bytes, work)]
        else:
            most = min(math.ceil(workload.sequences / replicas), workload.max_num_seqs)
            levels = sorted({max(1, most >> k) for k in range(CONCURRENCY_LEVELS)}, reverse=True)
        for concurrency in levels:
            yield (gen_tp, gen_pp), concurrency


def _all_options(work: RoleWork, workload: Workload, cluster: Cluster, efficiency: Efficiency, n: int, pin: Pin):
    """Every option of ``work`` on ``n`` devices, whatever its memory."""
    for tp, pp, ep, etp in _layouts(work, n, cluster, pin) if not work.serves else [(1, 1, 1, None)]:
        sizes = _context_parallel_sizes(work, workload, cluster, n, tp, pp, pin) if not work.serves else [1]
        for cp in sizes:
            replicas = n // (tp * pp * cp)
            micro_batches = _micro_batches(work, workload, replicas, pin) if not work.serves else [1]
            for micro in micro_batches:
                gens = _generation_choices(work, workload, n, tp, pp, pin) if work.generates else [(None, None)]
                # how a LoRA policy's adapters reach its generation (a judge serves its own checkpoint)
                modes = workload.lora_modes() if work.generates and work.role != "judge" else (None,)
                for gen, concurrency in gens:
                    at = gen if work.serves else (tp, pp)  # a rollout of its own, a judge: as it generates
                    for mode in modes:
                        yield evaluate_option(work, workload, cluster, efficiency, n, *at, micro, gen, concurrency,
                                              ep, etp, mode, cp)


def footprint(option: Option) -> int:
    """The most ``option`` holds on a device in any stage."""
    return option.resident + max(0, *option.extra)


def role_options(work: RoleWork, workload: Workload, cluster: Cluster, efficiency: Efficiency, n: int,
                 pin: Pin | None = None, prune: bool = True) -> list[Option]:
    """Every option of ``work`` on ``n`` devices that fits a device by itself; ``prune``: the undominated ones."""
    budget = cluster.accelerator.usable_bytes
    found = [o for o in _all_options(work, workload, cluster, efficiency, n, pin or Pin()) if footprint(o) <= budget]
    if not prune:
        return found
    return [o for o in found if not any(other.dominates(o) for other in found)]


def smallest_footprint(work: RoleWork, workload: Workload, cluster: Cluster, efficiency: Efficiency,
                       n: int, pin: Pin | None = None) -> int | None:
    """The least a device holds for ``work`` on ``n`` devices over every option ``pin`` allows (None: no legal
    layout)."""
    return min((footprint(o) for o in _all_options(work, workload, cluster, efficiency, n, pin or Pin())),
               default=None)
