"""Time per phase of one role at one layout, from FLOPs, bytes moved and link speeds.

- **Forward passes** (log-probs, values, reference, reward) and **updates**
  are compute-bound: 2 FLOPs per parameter per token forward, 6 for a
  training pass (8 with full recomputation), plus attention's 4 s^2 h per
  sequence per layer forward, at the efficiency ``Efficiency`` states, on
  the busiest pipeline stage (the last one holds the output layer too); PP
  adds the sends between stages; TP
  adds two all-reduces of the hidden states per layer forward (four with
  backward), PP the 1F1B bubble ((PP - 1) / micro-batches), DP the gradient
  reduce per optimizer step (and the parameter all-gather of the distributed
  optimizer), the optimizer step reads and writes its state once.
- **A mixture of experts** counts the FLOPs of the weights a token goes
  through (the router, its k experts, a shared expert), the same whatever
  the expert parallelism under balanced routing; EP adds the token dispatch
  and combine (an all-to-all per MoE layer, twice forward, four times with
  backward) and reduces the experts' gradients over the expert-DP ranks; a
  decode step reads only the experts its batch's tokens reach.
- **Generation** is prefill (compute-bound) then one decode step per new
  token, bound by reading the weights and the KV cache from memory, or by
  compute when the batch is large; sequences beyond what the KV cache holds
  wait for a later wave.
- **LoRA adapters** reach a generation engine merged or served. Merging
  reads the frozen base's adapted linears and writes them back with the
  product B A added (2 x rank FLOPs per weight) every step; served, they cost
  the engine's LoRA kernels a fraction of every generation
  (``Efficiency.lora_decode_overhead``).
- **Collectives** are ring algorithms: an all-reduce moves 2 (n - 1) / n of
  the buffer per rank, an all-gather or reduce-scatter (n - 1) / n, each
  step paying the link's latency. A group within one node uses the node's
  link, a group across nodes the network.
- **Host-side costs** of the framework itself, per event: each call of a
  role's phase, each micro-batch through each layer, each optimizer step,
  each decode step, each layer gathered by the reshard and loaded into the
  generation engine, each RL step. They are zero unless stated (a GPU's
  kernels hide most of them); on this CPU they are fitted to measured runs
  (``planner.fit``, ``tools/plan_vs_measured.py --fit``), and they dominate
  a tiny model's step.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from hybridengine.model.spec import ModelSpec

from controller.planner.hardware import Accelerator
from controller.planner.memory import dtype_bytes, expert_weight_bytes, kv_bytes_per_token, weight_bytes

__all__ = ["CPU_LORA_DECODE_OVERHEAD", "HOST_COSTS", "lora_merge_time", "Efficiency", "ExpertGrid", "Link", "PassShape", "all_gather_time", "all_reduce_time",
           "all_to_all_time", "forward_time",
           "generation_time", "model_flops_per_token", "stage_flops_per_token", "optimizer_step_time", "train_time",
           "transfer_time", "weight_load_time"]


@dataclass(frozen=True)
class Efficiency:
    """Fractions of the device's peak the phases reach (measured on this CPU by ``--calibrate``)."""

    train: float = 0.40  # model FLOPs utilisation of a training pass
    forward: float = 0.45  # of a forward pass (log-probs, values, reward)
    prefill: float = 0.45
    decode_compute: float = 0.30  # decode when compute-bound (large batches)
    memory: float = 0.75  # of the memory bandwidth, decode and the optimizer step
    link: float = 0.80  # of a link's bandwidth, collectives
    # Host-side seconds per event (see the module's docstring); ``HOST_COSTS`` names them.
    call_s: float = 0.0  # each call of a role's phase: dispatch, the batch in and the results out
    micro_batch_layer_s: float = 0.0  # each micro-batch through one layer, per pass (training: 3 passes)
    optimizer_step_s: float = 0.0  # each optimizer step: clipping, the norm and the step's small collectives
    decode_step_s: float = 0.0  # each decode step of a generation engine: scheduling, sampling
    weight_load_layer_s: float = 0.0  # each layer's new weights loaded into the generation engine
    reshard_layer_s: float = 0.0  # each layer gathered over the micro-DP group, when the reshard gathers
    step_s: float = 0.0  # each RL step, outside the roles: rewards, advantages, data, metrics
    # The time a generation engine serving LoRA adapters (vLLM's LoRA kernels, one adapter) adds to a generation,
    # as a fraction of it. GPUs: an estimate, not measured here (two small kernels a linear per step, some 10-20%
    # of a decode step); this CPU's is measured (``CPU_LORA_DECODE_OVERHEAD``).
    lora_decode_overhead: float = 0.15


    def on_faster_host(self, speedup: float) -> "Efficiency":
        """The host costs of the roles' processes when each runs ``speedup`` times faster (a CPU process given
        more of the machine's cores); the step's own cost (the driver's) stays."""
        if speedup == 1.0:
            return self
        return replace(self, **{name: getattr(self, name) / speedup for name in HOST_COSTS if name != "step_s"})


# vLLM's CPU LoRA kernels on this machine: the SmolLM2 example with rank 16 on every linear generated in 11.0 s a
# step served against 1.75 s merged (docs/concepts/lora.md), 6.3x.
CPU_LORA_DECODE_OVERHEAD = 5.3

HOST_COSTS = ("call_s", "micro_batch_layer_s", "optimizer_step_s", "decode_step_s", "weight_load_layer_s",
              "reshard_layer_s", "step_s")


@dataclass(frozen=True)
class Link:
    bandwidth: float  # bytes/s per direction per rank
    latency: float  # seconds per step


def model_flops_per_token(spec: ModelSpec) -> float:
    """Forward FLOPs per token of the matmuls (2 per weight), the output layer included. A mixture of experts
    counts the weights a token goes through: the router, its k experts and a shared expert with its gate."""
    h, d = spec.hidden_size, spec.head_dim
    attention = h * (spec.num_attention_heads + 2 * spec.num_query_groups) * d + spec.num_attention_heads * d * h
    mlp = 3 * h * spec.ffn_hidden_size
    if spec.moe is not None:
        moe = spec.moe
        mlp = (h * moe.num_experts + 3 * h * (moe.topk * moe.expert_ffn_hidden_size + moe.shared_expert_ffn_hidden_size)
               + (h if moe.shared_expert_ffn_hidden_size else 0))
    output = spec.num_labels * h if spec.is_value_model else spec.vocab_size * h
    return 2.0 * (spec.num_layers * (attention + mlp) + output)


def all_to_all_time(nbytes: float, ranks: int, link: Link, efficiency: Efficiency) -> float:
    """Each rank sends ``nbytes`` spread evenly over ``ranks`` ranks (its own share stays)."""
    if ranks <= 1 or nbytes <= 0:
        return 0.0
    return (ranks - 1) / ranks * nbytes / (link.bandwidth * efficiency.link) + (ranks - 1) * link.latency


@dataclass(frozen=True)
class ExpertGrid:
    """A mixture of experts' expert parallelism on a role's layout, and the link its all-to-all takes."""

    ep: int = 1
    etp: int | None = None  # None: the TP size
    link: Link | None = None  # None: the TP group's (the caller's ``tp_link``)

    def exchange_time(self, spec: ModelSpec, tp: int, tokens: int, precision: str, passes: int,
                      efficiency: Efficiency, tp_link: Link) -> float:
        """The token dispatch and combine of every MoE layer of a stage over ``passes`` passes (forward 2, a
        training pass 4): each rank's share of ``tokens`` (sequence-parallel under TP), k copies each."""
        if spec.moe is None:
            return 0.0
        group = self.ep * (tp if self.etp is None else self.etp)
        share = tokens * spec.moe.topk * spec.hidden_size * dtype_bytes(precision) / tp
        return passes * all_to_all_time(share, group, self.link or tp_link, efficiency)


def _attention_flops(spec: ModelSpec, seq_len: int) -> float:
    """Forward FLOPs of QK^T and PV for one sequence over every layer (the full square, as computed)."""
    return 4.0 * spec.num_layers * seq_len * seq_len * spec.num_attention_heads * spec.head_dim


def all_reduce_time(nbytes: float, ranks: int, link: Link, efficiency: Efficiency) -> float:
    if ranks <= 1 or nbytes <= 0:
        return 0.0
    return 2 * (ranks - 1) / ranks * nbytes / (link.bandwidth * efficiency.link) + 2 * (ranks - 1) * link.latency


def all_gather_time(nbytes: float, ranks: int, link: Link, efficiency: Efficiency) -> float:
    """Each rank ends with ``nbytes`` gathered from ``ranks`` equal parts (or sends them: reduce-scatter)."""
    if ranks <= 1 or nbytes <= 0:
        return 0.0
    return (ranks - 1) / ranks * nbytes / (link.bandwidth * efficiency.link) + (ranks - 1) * link.latency


def transfer_time(nbytes: float, link: Link, efficiency: Efficiency) -> float:
    return 0.0 if nbytes <= 0 else nbytes / (link.bandwidth * efficiency.link) + link.latency


@dataclass(frozen=True)
class PassShape:
    sequences: int  # over the whole role (all DP ranks)
    seq_len: int
    micro_batch: int
    image_tokens: int = 0  # a vision-language model's image tokens per sequence (of seq_len)
    vision_trains: bool = False  # its tower trains (a training pass runs its backward too)
    context_parallel: int = 1  # CP: each sequence split over this many of the DP ranks
    cp_link: Link | None = None  # the link the CP group's K/V all-gather takes (None: the TP group's)


def vision_flops_per_image_token(spec: ModelSpec) -> float:
    """Forward FLOPs of the vision tower and merger per image token (merge_size**2 patches): the patch embedding,
    each block's matmuls and its attention within a window (``window_size`` pixels square), the merger's MLP."""
    v = spec.vision
    if v is None:
        return 0.0
    d, f, patches = v.hidden_size, v.intermediate_size, v.spatial_merge_size ** 2
    window = (v.window_size // v.patch_size) ** 2
    block = 2.0 * (4 * d * d + 3 * d * f) + 4.0 * window * d
    merged = d * patches
    return patches * (2.0 * v.patch_features * d + v.depth * block) + 2.0 * (merged * merged + merged * v.out_hidden_size)


def stage_flops_per_token(spec: ModelSpec, pp: int) -> float:
    """Forward FLOPs per token of the busiest pipeline stage: its layers, and the output layer on the last."""
    layer = (model_flops_per_token(spec) - _output_flops(spec)) / spec.num_layers
    busiest = 0.0
    for stage in range(pp):
        layers = len(spec.layers_of_stage(stage, pp))
        busiest = max(busiest, layers * layer + (_output_flops(spec) if stage == pp - 1 else 0.0))
    return busiest


def _output_flops(spec: ModelSpec) -> float:
    return 2.0 * (spec.num_labels if spec.is_value_model else spec.vocab_size) * spec.hidden_size


def _pass_time(spec: ModelSpec, tp: int, pp: int, dp: int, shape: PassShape, device: Accelerator, precision: str,
               tp_link: Link, efficiency: Efficiency, flops_factor: float, mfu: float, tp_collectives: int,
               pp_link: Link | None = None, experts: ExpertGrid | None = None) -> float:
    """One pass on one DP replica: the busiest stage's compute and host time per micro-batch, stretched by
    the 1F1B bubble, plus TP's all-reduces, PP's sends between stages and a mixture of experts' all-to-alls
    (no call cost: see the callers). Balanced routing gives every rank the same expert work whatever the
    expert parallelism: it changes the memory, the all-to-all and the gradient reduction.

    Context parallelism (``dp`` counts its ranks; ``dp / CP`` replicas take rows of their own): each rank
    computes a CP-th of every sequence, attention's included (the zigzag split evens the causal work), and
    each layer all-gathers the K/V of its sequences over the CP group (a reduce-scatter of their gradients in
    the backward pass)."""
    cp = shape.context_parallel
    per_rank = math.ceil(shape.sequences / max(1, dp // cp))
    stage = stage_flops_per_token(spec, pp) * per_rank * shape.seq_len / cp
    attention = (_attention_flops(spec, shape.seq_len) * per_rank * math.ceil(spec.num_layers / pp)
                 / spec.num_layers / cp)
    compute = flops_factor * (stage + attention) / (tp * device.flops(precision) * mfu)
    # the vision tower on the first stage, replicated over TP: every TP rank runs the replica's images
    vision = vision_flops_per_image_token(spec) * per_rank * shape.image_tokens
    compute += (flops_factor if shape.vision_trains else 1.0) * vision / (device.flops(precision) * mfu)
    micro = max(1, math.ceil(per_rank / shape.micro_batch))
    bubble = (pp - 1) / micro
    hidden = shape.micro_batch * shape.seq_len / cp * spec.hidden_size * dtype_bytes(precision)
    layers = math.ceil(spec.num_layers / pp)
    tp_comm = micro * layers * tp_collectives * all_reduce_time(hidden, tp, tp_link, efficiency)
    if cp > 1:  # K and V of every query group on this TP rank, whole sequences once gathered
        kv = 2 * shape.micro_batch * shape.seq_len * max(spec.num_query_groups // tp, 1) * spec.head_dim
        tp_comm += micro * layers * (tp_collectives // 2) * all_gather_time(
            kv * dtype_bytes(precision), cp, shape.cp_link or tp_link, efficiency)
    sends = (tp_collectives // 2) * micro * transfer_time(hidden / tp, pp_link or tp_link, efficiency) if pp > 1 else 0.0
    host = micro * layers * flops_factor * efficiency.micro_batch_layer_s
    exchange = micro * layers * (experts or ExpertGrid()).exchange_time(
        spec, tp, shape.micro_batch * shape.seq_len, precision, tp_collectives, efficiency, tp_link)
    return (compute + host) * (1 + bubble) + tp_comm + sends + exchange


def forward_time(spec: ModelSpec, tp: int, pp: int, dp: int, shape: PassShape, device: Accelerator, precision: str,
                 tp_link: Link, efficiency: Efficiency, pp_link: Link | None = None,
                 experts: ExpertGrid | None = None) -> float:
    """A forward pass over ``shape.sequences`` (log-probs, values, reference, reward)."""
    return _pass_time(spec, tp, pp, dp, shape, device, precision, tp_link, efficiency, 1.0, efficiency.forward, 2,
                      pp_link, experts) + efficiency.call_s


def optimizer_step_time(param_count_per_rank: float, device: Accelerator, efficiency: Efficiency) -> float:
    """Adam over the rank's elements: read and write master weights and both moments, read the gradient,
    write the bf16 weights (about 30 bytes per element)."""
    return 30 * param_count_per_rank / (device.memory_bandwidth * efficiency.memory)


def train_time(spec: ModelSpec, tp: int, pp: int, dp: int, shape: PassShape, optimizer_steps: int,
               device: Accelerator, precision: str, tp_link: Link, dp_link: Link, efficiency: Efficiency,
               distributed_optimizer: bool = False, recompute: str | None = None, pp_link: Link | None = None,
               experts: ExpertGrid | None = None) -> float:
    """``shape.sequences`` trained (every epoch's) in ``optimizer_steps`` mini-batches. A mixture of experts'
    routed experts (``experts``: one rank's at its EP x ETP) reduce their gradients over the expert-DP ranks."""
    factor = 4.0 if recompute == "full" else 3.0
    grid = experts or ExpertGrid()
    mini = replace(shape, sequences=max(1, shape.sequences // optimizer_steps))
    per_mini = _pass_time(spec, tp, pp, dp, mini, device, precision, tp_link, efficiency, factor, efficiency.train,
                          6 if recompute == "full" else 4, pp_link, grid)
    stage_elements = weight_bytes(spec, tp, pp, "fp32", grid.ep, grid.etp) / 4
    expert_elements = expert_weight_bytes(spec, tp, pp, "fp32", grid.ep, grid.etp) / 4
    edp = max(1, tp * dp // (grid.ep * (tp if grid.etp is None else grid.etp)))
    dp_comm, owned = 0.0, 0.0
    for elements, ranks in ((stage_elements - expert_elements, dp), (expert_elements, edp)):
        grads = elements * 4  # fp32 gradient reduction
        if distributed_optimizer:  # reduce-scatter the gradients, all-gather the updated parameters
            dp_comm += (all_gather_time(grads, ranks, dp_link, efficiency)
                        + all_gather_time(elements * dtype_bytes(precision), ranks, dp_link, efficiency))
            owned += elements / ranks
        else:
            dp_comm += all_reduce_time(grads, ranks, dp_link, efficiency)
            owned += elements
    step = optimizer_step_time(owned, device, efficiency) + efficiency.optimizer_step_s
    return optimizer_steps * (per_mini + dp_comm + step) + efficiency.call_s


def generation_time(spec: ModelSpec, tp: int, replicas: int, sequences: int, prompt_len: int, response_len: int,
                    concurrency: int, device: Accelerator, tp_link: Link, efficiency: Efficiency,
                    precision: str = "bf16", image_tokens: int = 0) -> float:
    """``sequences`` generated by ``replicas`` engines of TP ``tp``, each ``concurrency`` sequences at a time; a
    vision-language prompt's ``image_tokens`` go through the vision tower (whole on every rank) in its prefill."""
    per_replica = math.ceil(sequences / replicas)
    waves = math.ceil(per_replica / concurrency)
    batch = min(per_replica, concurrency)
    flops_token = model_flops_per_token(spec)
    peak = device.flops(precision)
    weights = weight_bytes(spec, tp, 1, precision)
    if spec.moe is not None:  # a decode step reads the experts its batch's tokens go to: of E, k per token
        moe = spec.moe
        experts = expert_weight_bytes(spec, tp, 1, precision)
        touched = 1.0 - (1.0 - moe.topk / moe.num_experts) ** batch
        weights = weights - experts + experts * touched
    kv_token = kv_bytes_per_token(spec, tp, precision)
    prefill = (flops_token * batch * prompt_len + _attention_flops(spec, prompt_len) * batch / 2) / (
        tp * peak * efficiency.prefill)
    prefill += vision_flops_per_image_token(spec) * batch * image_tokens / (peak * efficiency.prefill)
    context = prompt_len + response_len / 2
    read = (weights + batch * context * kv_token) / (device.memory_bandwidth * efficiency.memory)
    compute = flops_token * batch / (tp * peak * efficiency.decode_compute)
    hidden = batch * spec.hidden_size * dtype_bytes(precision)
    tp_comm = 2 * spec.num_layers * all_reduce_time(hidden, tp, tp_link, efficiency)
    decode = response_len * (max(read, compute) + tp_comm + efficiency.decode_step_s)
    return waves * (prefill + decode) + efficiency.call_s


def weight_load_time(spec: ModelSpec, shard_bytes: float, device: Accelerator, efficiency: Efficiency) -> float:
    """The generation engine taking its new shard: one copy of it through memory, and each layer's host cost."""
    return (shard_bytes / (device.memory_bandwidth * efficiency.memory)
            + spec.num_layers * efficiency.weight_load_layer_s)


def lora_merge_time(merged_bytes: float, rank: int, element: int, device: Accelerator, efficiency: Efficiency) -> float:
    """Merging the adapters into a generation shard's adapted linears (``merged_bytes`` of them): the base read
    and the sum written through memory, and B A's 2 x rank FLOPs per weight."""
    if merged_bytes <= 0:
        return 0.0
    weights = merged_bytes / element
    return (2 * merged_bytes / (device.memory_bandwidth * efficiency.memory)
            + 2 * rank * weights / (device.flops("bf16" if element == 2 else "fp32") * efficiency.forward))
