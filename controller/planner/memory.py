"""Memory per device of one role at one layout: model state to the byte, activations and KV cache by formula.

**Model state** follows the training engine (``workers.megatron.engine``) as
megatron-core lays it out, so it is predicted to the byte:

- weights: the stage's parameters (``hybridengine.model.catalogue.stage_params``
  at the vocabulary padding the engine uses) in the parameter dtype;
- gradients: megatron's DDP buffer in fp32 (``grad_reduce_in_fp32``); with the
  distributed optimizer every parameter starts at a multiple of 64 elements,
  each bucket ends at a multiple of lcm(DP, 128), the shared embedding of a
  pipelined tied model is a bucket of its own, and the parameters move into
  one bf16 (or fp32) buffer of the same length;
- optimizer: Adam's two fp32 moments per element and a 4-byte step
  counter per parameter, and for bf16 an fp32 master copy; with the
  distributed optimizer each DP rank holds the elements of its 1/DP of
  every bucket only.

Of several pipeline stages the largest is reported (the device that runs out
first).

**Activations** of one micro-batch per layer are the tensors megatron's
layers keep for backward (``layer_activation_bytes``: the CPU path's as
autograd's hooks count them, the GPU's fused kernels' by their saved
inputs); 1F1B keeps up to PP micro-batches in flight on the first stage; full recomputation keeps
each block's input and one block's activations. **KV cache** per token is
2 x layers x KV heads per rank x head_dim in the generation dtype.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from functools import lru_cache

from hybridengine.model.catalogue import EMBEDDING, OUTPUT_LAYER, ExpertShard, projections, stage_params
from hybridengine.model.spec import ModelSpec
from hybridengine.model.vision_catalogue import vision_shapes
from hybridengine.parallel.layout import ParallelLayout

__all__ = ["ActivationShape", "StateMemory", "activation_bytes", "dtype_bytes", "expert_weight_bytes", "kv_bytes_per_token",
           "kv_bytes_per_sequence", "kv_cache_bytes", "layer_activation_bytes", "lora_adapter_bytes", "lora_gather_bytes", "lora_merged_bytes", "lora_numels", "lora_state", "megatron_order",
           "stage_activation_bytes", "stage_state", "state_memory", "weight_bytes"]

_DTYPE_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}
_PARAM_ALIGN = 64  # megatron: with the distributed optimizer each parameter starts 128-byte aligned
_BUCKET_ALIGN = 128


def dtype_bytes(precision: str) -> int:
    if precision not in _DTYPE_BYTES:
        raise ValueError(f"precision {precision!r} is not one of {sorted(_DTYPE_BYTES)}")
    return _DTYPE_BYTES[precision]


@dataclass(frozen=True)
class StateMemory:
    """Bytes one device holds for a role's model state (the largest pipeline stage)."""

    weights: int
    gradients: int = 0
    optimizer: int = 0

    @property
    def total(self) -> int:
        return self.weights + self.gradients + self.optimizer


# megatron-core's local GPT layer registers its parameters in this order (the module's named_parameters());
# a mixture of experts' MLP: the router, the routed experts (local order, fc1 then fc2), the shared expert.
_LAYER_ORDER = ("input_layernorm.weight", "self_attention.linear_proj.weight", "self_attention.linear_qkv.weight",
                "self_attention.linear_qkv.bias", "self_attention.q_layernorm.weight",
                "self_attention.k_layernorm.weight", "pre_mlp_layernorm.weight", "mlp.linear_fc1.weight",
                "mlp.linear_fc2.weight", "mlp.router.weight", "mlp.experts", "mlp.shared_experts.linear_fc1.weight",
                "mlp.shared_experts.linear_fc2.weight", "mlp.shared_experts.gate_weight")


def megatron_order(params: list) -> list:
    """``stage_params``' entries in the order of the megatron module's ``named_parameters()``."""
    def key(p):
        if p.name == EMBEDDING:
            return (0, 0, 0, 0)
        if p.layer is None:
            return (2, 0 if p.name != OUTPUT_LAYER else 1, 0, 0)
        suffix = p.name.split(".", 3)[3]
        if p.expert is not None:  # mlp.experts.local_experts.{j}.linear_fc{1,2}.weight
            local, which = suffix.split(".")[3], suffix.split(".")[4]
            return (1, p.layer, _LAYER_ORDER.index("mlp.experts"), 2 * int(local) + (which == "linear_fc2"))
        return (1, p.layer, _LAYER_ORDER.index(suffix), 0)
    return sorted(params, key=key)


Numels = tuple[tuple[int, bool], ...]  # (numel, is the shared embedding) per parameter, in megatron's order


@lru_cache(maxsize=4096)
def _stage_buffers(spec: ModelSpec, tp: int, pp: int, pp_rank: int, ep: int = 1,
                   etp: int | None = None) -> tuple[Numels, Numels]:
    """The stage's dense parameters and its routed experts' (those of one expert-parallel rank, at ETP
    ``etp``), each as megatron's DDP buffers them: two buffers, reduced over DP and expert-DP."""
    shared = spec.tie_word_embeddings and not spec.is_value_model and pp > 1
    params = megatron_order(stage_params(spec, tp, pp, pp_rank, ExpertShard(ep, 0, etp)))
    dense = tuple((p.numel, shared and p.name in (EMBEDDING, OUTPUT_LAYER)) for p in params if p.expert is None)
    return dense, tuple((p.numel, False) for p in params if p.expert is not None)


def _vision_numels(spec: ModelSpec, pp_rank: int) -> Numels:
    """A vision-language model's tower and merger on the first stage (replicated over TP), in the module's order:
    registered after the language model's parameters."""
    if spec.vision is None or pp_rank != 0:
        return ()
    return tuple((math.prod(shape), False) for shape in vision_shapes(spec).values())


def _stage_numels(spec: ModelSpec, tp: int, pp: int, pp_rank: int, ep: int = 1, etp: int | None = None) -> Numels:
    """(numel, is the shared embedding) of each parameter of the stage, in megatron's order."""
    dense, experts = _stage_buffers(spec, tp, pp, pp_rank, ep, etp)
    return dense + experts + _vision_numels(spec, pp_rank)


def _pad(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def _buckets(numels: tuple[tuple[int, bool], ...], dp: int, distributed: bool) -> list[list[tuple[int, int]]]:
    """megatron's buffer: per bucket, the (start, end) of each parameter; the last entry's end is padded by the caller."""
    buckets: list[list[tuple[int, int]]] = []
    current: list[tuple[int, int]] = []
    start = 0
    bucket_start = 0
    ends = []  # each bucket's padded end

    def close(end: int) -> int:
        nonlocal current, bucket_start
        padded = _pad(end, math.lcm(dp, _BUCKET_ALIGN)) if distributed else end
        buckets.append(current)
        ends.append(padded)
        current, bucket_start = [], padded
        return padded

    for numel, shared in reversed(numels):  # megatron fills the buffer in reverse (backprop) order
        if distributed:
            start = _pad(start, _PARAM_ALIGN)
        needs_own = shared and distributed
        if needs_own and current:
            start = close(start)
        current.append((start, start + numel))
        if needs_own:
            start = close(start + numel)
        else:
            start += numel
    if current:
        close(start)
    return [bucket + [(ends[i], ends[i])] for i, bucket in enumerate(buckets)]  # a sentinel carries the padded end


def _owned(bucket: list[tuple[int, int]], bucket_start: int, dp: int, dp_rank: int) -> tuple[int, int]:
    """(elements, parameters) of the bucket in DP rank ``dp_rank``'s 1/DP of it."""
    end = bucket[-1][1]
    size = (end - bucket_start) // dp
    lo, hi = bucket_start + dp_rank * size, bucket_start + (dp_rank + 1) * size
    overlaps = [max(0, min(e, hi) - max(s, lo)) for s, e in bucket[:-1]]
    return sum(overlaps), sum(1 for o in overlaps if o)


def weight_bytes(spec: ModelSpec, tp: int, pp: int, precision: str, ep: int = 1, etp: int | None = None) -> int:
    """The largest stage's parameters in ``precision`` (the engine's module, nothing else); a mixture of experts'
    routed experts those of one rank at EP ``ep`` x ETP ``etp`` (None: TP)."""
    size = dtype_bytes(precision)
    return max(sum(n for n, _ in _stage_numels(spec, tp, pp, r, ep, etp)) for r in range(pp)) * size


def expert_weight_bytes(spec: ModelSpec, tp: int, pp: int, precision: str, ep: int = 1, etp: int | None = None) -> int:
    """Of ``weight_bytes``, the routed experts' part on the stage with the most (0 for a dense model)."""
    if spec.moe is None:
        return 0
    return max(sum(n for n, _ in _stage_buffers(spec, tp, pp, r, ep, etp)[1]) for r in range(pp)) * dtype_bytes(precision)


_STEP_COUNTER = 4  # torch's Adam keeps a float32 step counter per parameter it updates
_MOMENTS = 8  # exp_avg and exp_avg_sq, fp32


def stage_state(spec: ModelSpec, tp: int, pp: int, pp_rank: int, dp: int, dp_rank: int, precision: str, trains: bool,
                distributed_optimizer: bool = False, ep: int = 1, etp: int | None = None,
                edp_rank: int = 0, train_vision: bool = False) -> StateMemory:
    """The model state of the rank at pipeline stage ``pp_rank`` and DP rank ``dp_rank`` (any TP rank: they hold
    alike). A mixture of experts' routed experts are those of one rank at EP ``ep`` x ETP ``etp`` (None: TP), in
    a buffer of their own that the distributed optimizer shards over the expert-DP ranks (``edp_rank``). A
    vision-language model's tower trains with the rest when ``train_vision``; frozen, it holds weights only."""
    size = dtype_bytes(precision)
    dense, experts = _stage_buffers(spec, tp, pp, pp_rank, ep, etp)
    vision = _vision_numels(spec, pp_rank)
    if not trains:
        return StateMemory(sum(n for n, _ in dense + experts + vision) * size)
    frozen = 0 if train_vision else sum(n for n, _ in vision) * size
    if train_vision:
        dense = dense + vision
    count = sum(n for n, _ in dense + experts)
    state = _trained_state(dense, experts, count, size, tp, dp, dp_rank, distributed_optimizer, ep, etp, edp_rank)
    return StateMemory(state.weights + frozen, state.gradients, state.optimizer)


def _trained_state(dense: Numels, experts: Numels, count: int, size: int, tp: int, dp: int, dp_rank: int,
                   distributed_optimizer: bool, ep: int, etp: int | None, edp_rank: int) -> StateMemory:
    """What megatron's DDP buffers and optimizer hold for the trained parameters ``dense`` and ``experts``."""
    master = 4 if size == 2 else 0  # bf16: an fp32 master copy; fp32: the parameter itself
    if not distributed_optimizer:
        params = len(dense) + len(experts)
        return StateMemory(count * size, count * 4, count * (master + _MOMENTS) + params * _STEP_COUNTER)
    edp = tp * dp // ((tp if etp is None else etp) * ep)
    padded = owned = params = 0
    for numels, ranks, rank in ((dense, dp, dp_rank), (experts, edp, edp_rank)):
        if not numels:
            continue
        buckets = _buckets(numels, ranks, distributed=True)
        padded += buckets[-1][-1][1]
        start = 0
        for bucket in buckets:
            elements, touched = _owned(bucket, start, ranks, rank)
            owned, params, start = owned + elements, params + touched, bucket[-1][1]
    return StateMemory(padded * size, padded * 4, owned * (master + _MOMENTS) + params * _STEP_COUNTER)


def lora_numels(spec: ModelSpec, tp: int, pp: int, pp_rank: int, rank: int, targets: tuple[str, ...]) -> Numels:
    """(numel, False) of each LoRA adapter parameter (A and B of every targeted part of every layer) that stage
    ``pp_rank`` holds on one TP rank: a column linear's B cut over TP, a row linear's A; and a value model's
    head, which trains beside them (``workers.megatron.lora``)."""
    shapes = projections(spec)
    per_layer = []
    for target in targets:
        fan_in, fan_out, row = shapes[target].fan_in, shapes[target].fan_out, shapes[target].row_parallel
        per_layer += [(rank * (fan_in // tp if row else fan_in), False), ((fan_out if row else fan_out // tp) * rank, False)]
    head = ((spec.hidden_size * spec.num_labels, False),) if spec.is_value_model and pp_rank == pp - 1 else ()
    return tuple(per_layer) * len(spec.layers_of_stage(pp_rank, pp)) + head


def lora_adapter_bytes(spec: ModelSpec, tp: int, pp: int, precision: str, rank: int, targets: tuple[str, ...]) -> int:
    """The adapters one rank of the busiest stage holds at TP ``tp`` x PP ``pp`` in ``precision`` (no value head):
    at TP 1 and PP 1, the adapters whole (what crosses to a rollout pool each step); at a generation layout,
    what an engine serving them keeps (vLLM cuts them as the training engine does)."""
    size = dtype_bytes(precision)
    body = spec if not spec.is_value_model else replace(spec, num_labels=0)
    return max(sum(n for n, _ in lora_numels(body, tp, pp, s, rank, targets)) for s in range(pp)) * size


def lora_gather_bytes(spec: ModelSpec, tp: int, pp: int, precision: str, rank: int, targets: tuple[str, ...]) -> int:
    """What the rank that receives most gets when a LoRA engine at TP ``tp`` x PP ``pp`` gathers its adapters whole
    for a sync (their group's pieces, ``hybridengine.reshard.adapter_group``): the other TP ranks' pieces of its stage's cut sides (a
    column linear's B, a row linear's A), and the other stages' adapters whole."""
    shapes = projections(spec)
    cut = whole = 0
    for target in targets:
        fan_in, fan_out = shapes[target].fan_in, shapes[target].fan_out
        cut += rank * (fan_in if shapes[target].row_parallel else fan_out)
        whole += rank * (fan_in + fan_out)
    layers = [len(spec.layers_of_stage(s, pp)) for s in range(pp)]
    return max(cut * n * (tp - 1) // tp + whole * (sum(layers) - n) for n in layers) * dtype_bytes(precision)


def lora_merged_bytes(spec: ModelSpec, tp: int, pp: int, precision: str, targets: tuple[str, ...]) -> int:
    """The adapted linears of one generation shard (busiest stage, TP ``tp``): what merging the adapters
    writes every step (``workers.megatron.lora_merge.merge_into``), kept in a buffer of its own."""
    shapes = projections(spec)
    per_layer = sum(shapes[t].fan_in * shapes[t].fan_out for t in targets) // tp
    layers = max(len(spec.layers_of_stage(s, pp)) for s in range(pp))
    return per_layer * layers * dtype_bytes(precision)


def lora_state(spec: ModelSpec, tp: int, pp: int, pp_rank: int, dp: int, dp_rank: int, precision: str,
               distributed_optimizer: bool, rank: int, targets: tuple[str, ...]) -> StateMemory:
    """A LoRA role's state on one rank: the frozen base's weights and the adapters', and gradients and optimizer
    state for the adapters only (megatron's DDP and optimizer skip what takes no gradient)."""
    size = dtype_bytes(precision)
    base = sum(n for n, _ in _stage_numels(spec, tp, pp, pp_rank))
    adapters = lora_numels(spec, tp, pp, pp_rank, rank, targets)
    count = sum(n for n, _ in adapters)
    master = 4 if size == 2 else 0
    if not distributed_optimizer:
        return StateMemory((base + count) * size, count * 4, count * (master + _MOMENTS) + len(adapters) * _STEP_COUNTER)
    buckets = _buckets(adapters, dp, distributed=True)
    padded, owned, params, start = buckets[-1][-1][1], 0, 0, 0
    for bucket in buckets:
        elements, touched = _owned(bucket, start, dp, dp_rank)
        owned, params, start = owned + elements, params + touched, bucket[-1][1]
    return StateMemory((base + padded) * size, padded * 4, owned * (master + _MOMENTS) + params * _STEP_COUNTER)


@lru_cache(maxsize=8192)
def state_memory(spec: ModelSpec, tp: int, pp: int, dp: int, precision: str, trains: bool,
                 distributed_optimizer: bool = False, ep: int = 1, etp: int | None = None, lora_rank: int = 0,
                 lora_targets: tuple[str, ...] = (), train_vision: bool = False) -> StateMemory:
    """The largest model state any rank holds for a role at TP ``tp`` x PP ``pp`` x DP ``dp`` (a mixture of
    experts' at EP ``ep`` x ETP ``etp``; ``spec`` padded as the engine pads it); with ``lora_rank``, a role
    training LoRA adapters on ``lora_targets`` over its frozen base; ``train_vision``: a vision-language model's
    tower trained too."""
    if trains and lora_rank:
        return max((lora_state(spec, tp, pp, s, dp, d, precision, distributed_optimizer, lora_rank, lora_targets)
                    for s in range(pp) for d in (range(dp) if distributed_optimizer else (0,))),
                   key=lambda m: m.total)
    if not (trains and distributed_optimizer):
        return max((stage_state(spec, tp, pp, s, dp, 0, precision, trains, False, ep, etp, 0, train_vision)
                    for s in range(pp)), key=lambda m: m.total)
    layout = ParallelLayout(tp, pp, dp, ep, etp)
    return max((stage_state(spec, tp, pp, layout.coordinate(r).pp_rank, dp, layout.coordinate(r).dp_rank, precision,
                            trains, True, ep, etp, layout.expert_coordinate(r).edp_rank, train_vision)
                for r in range(layout.world_size)), key=lambda m: m.total)


# ------------------------------------------------------------------ activations and KV
@dataclass(frozen=True)
class ActivationShape:
    micro_batch: int  # sequences per micro-batch
    seq_len: int  # tokens per sequence (the micro-batch's longest row)
    precision: str = "bf16"
    flash_attention: bool = False  # True: no [heads, s, s] scores are kept (GPU attention kernels)
    recompute: str | None = None  # None, "full" or "selective" (megatron's recompute_granularity)
    recompute_num_layers: int = 1
    # a vision-language model: the image patches per micro-batch through a trained vision tower (a frozen
    # tower keeps nothing for backward)
    vision_patches: int = 0
    context_parallel: int = 1  # CP: each rank holds a CP-th of every sequence's tokens
    packed: bool = False  # packed sequences (the engine's own attention; CP > 1 runs packed too)

    @property
    def tokens(self) -> int:
        """Tokens of one micro-batch on one rank (a CP-th of each sequence, its length rounded up to 2 x CP)."""
        cp = self.context_parallel
        length = self.seq_len if cp == 1 else -(-self.seq_len // (2 * cp)) * 2
        return self.micro_batch * length

    def mask_bytes(self, element: int) -> int:
        """The packed attention's masks on the CPU path, kept once per micro-batch (every layer shares them) on
        the busiest CP rank: the last, whose two middle chunks (2c queries) see (CP + 1) c keys, c = s / 2CP.
        CP 1 needs none (plain causal attention)."""
        cp = self.context_parallel
        if not self.packed or cp == 1 or self.flash_attention:
            return 0
        chunk = -(-self.seq_len // (2 * cp))
        return self.micro_batch * 2 * chunk * (cp + 1) * chunk * element


def vision_activation_bytes(spec: ModelSpec, patches: int, precision: str) -> int:
    """What a trained vision tower and merger (transformers' Qwen2.5-VL modules) keep for backward over ``patches``
    image patches, as measured with autograd's saved-tensor hooks: linear in the patches (window attention and
    the full-attention blocks keep no [s, s] scores on the CPU and GPU kernels alike).

    Per patch: the patch embedding's input and the merger's tensors (F b + 6 d b, and the RMSNorms' fp32 copies in
    bf16: 4 d), and per block 4 f b for the SwiGLU MLP, 13 d b for attention and the norms (and 4 d of fp32 in
    bf16), and each head's log-sum-exp."""
    if spec.vision is None or patches <= 0:
        return 0
    v, b = spec.vision, dtype_bytes(precision)
    fp32_norms = 4 if b < 4 else 0
    d, f = v.hidden_size, v.intermediate_size
    base = v.patch_features * b + d * (6 * b + fp32_norms) + 8
    block = 4 * f * b + d * (13 * b + fp32_norms) + 4 * (v.num_heads + 2)
    return patches * (base + v.depth * block)


def layer_activation_bytes(spec: ModelSpec, tp: int, shape: ActivationShape) -> int:
    """What one decoder layer keeps for backward for one micro-batch on one TP rank.

    Tokens T = micro-batch x sequence; per TP rank the heads, KV groups and FFN split, the hidden states
    do not (no sequence parallelism). Two kernel sets, as measured with autograd's saved-tensor hooks
    (``MegatronEngine.saved_activation_bytes``):

    - unfused (megatron's local layers, the CPU path): each RMSNorm keeps its input and the normalized
      input in fp32 and its output in the model's dtype (T h, twice); attention keeps q, k and v at every
      query head (grouped k and v repeated) and the context (4 T a d), the softmax's [heads, s, s]
      probabilities in fp32 (and, in bf16, their bf16 copy) and the causal mask; the MLP keeps fc1's
      output (gate and up), both SwiGLU halves and fc2's input (5 T f);
    - fused (``flash_attention``: the GPU's kernels): each norm its input and output (2 T h, twice);
      attention q, k, v at their own heads and the output ((2a + 2g) d); the MLP fc1's output and fc2's
      input (3 T f); no [heads, s, s] scores.

    Per-head q/k norms (Qwen3) keep what a norm keeps over every query and key head.

    Packed sequences and context parallelism (the engine's own attention, ``workers.megatron.context_attention``):
    T is a CP-th of the tokens; attention keeps q, each row's keys and values in position order (gathered from
    the CP ranks: CP x the local ones; on the CPU repeated to every query head), its output, the context, the
    log-sum-exp per head and RoPE's cos and sin for q and k (4 d), and no [heads, s, s] scores on either
    kernel set (on the CPU its masks, kept once per micro-batch: ``ActivationShape.mask_bytes``).
    """
    t_tokens = shape.tokens
    b = dtype_bytes(shape.precision)
    cp = shape.context_parallel
    heads = spec.num_attention_heads // tp
    groups = max(spec.num_query_groups // tp, 1)
    d, h, f = spec.head_dim, spec.hidden_size, spec.ffn_hidden_size // tp
    if spec.moe is not None:  # a mixture of experts' MLP, by formula (balanced routing; not measured to the byte)
        return _moe_layer_activation_bytes(spec, tp, shape)
    qk = (heads + groups) * d if spec.qk_layernorm else 0  # the elements the per-head q/k norms see
    if shape.flash_attention:
        per_token = 4 * h + (2 * heads + 2 * cp * groups) * d + 3 * f + 2 * qk
        scores = 0
    elif shape.packed:  # the CPU's fused attention takes K/V at every query head: grouped ones are repeated
        norms = (2 * h + qk) * (8 + b)
        return t_tokens * (norms + (((3 + 2 * cp) * heads + 4) * d + 5 * f) * b + 4 * heads)
    else:
        # two norms (and the q/k norms): input and normalized input in fp32, output in the model's dtype
        norms = (2 * h + qk) * (8 + b)
        scores = 0 if shape.recompute == "selective" else (
            shape.micro_batch * heads * shape.seq_len * shape.seq_len * (4 + (b if b < 4 else 0))
            + shape.seq_len * shape.seq_len)
        return t_tokens * (norms + (4 * heads * d + 5 * f) * b) + scores
    return t_tokens * per_token * b + scores


def _moe_layer_activation_bytes(spec: ModelSpec, tp: int, shape: ActivationShape) -> int:
    """One MoE layer's saved activations per TP rank: attention as a dense layer's, and in place of the MLP the
    router's fp32 logits and probabilities, each token's k dispatched copies in and out of the experts, the
    experts' own MLP tensors over those copies, and a shared expert's. Under balanced routing every rank's
    experts see k copies of its share of the tokens, whatever the expert parallelism (megatron runs an MoE
    with TP > 1 sequence-parallel, so the hidden states split over TP too)."""
    moe = spec.moe
    # (its q/k norms are not counted apart: this formula is held to the measured MoE layers as a whole)
    dense = replace(spec, moe=None, ffn_hidden_size=0, qk_layernorm=False)
    attention = layer_activation_bytes(dense, tp, shape)
    t_tokens = shape.tokens
    b = dtype_bytes(shape.precision)
    mlp_factor = 3 if shape.flash_attention else 5
    h, k = spec.hidden_size, moe.topk
    per_token = (k * (2 * h + mlp_factor * moe.expert_ffn_hidden_size)
                 + mlp_factor * moe.shared_expert_ffn_hidden_size) * b / tp + 2 * moe.num_experts * 4
    return attention + int(t_tokens * per_token)


def stage_activation_bytes(spec: ModelSpec, tp: int, pp: int, pp_rank: int, shape: ActivationShape) -> int:
    """One micro-batch's activations on stage ``pp_rank``: its layers, the embedding's output on the first
    stage, the final norm's on the last."""
    hidden = shape.tokens * spec.hidden_size * dtype_bytes(shape.precision)
    total = len(spec.layers_of_stage(pp_rank, pp)) * layer_activation_bytes(spec, tp, shape)
    total += shape.mask_bytes(dtype_bytes(shape.precision))
    if pp_rank == 0:
        total += hidden + vision_activation_bytes(spec, shape.vision_patches, shape.precision)
    if pp_rank == pp - 1:  # the final norm
        b = dtype_bytes(shape.precision)
        total += 2 * hidden if shape.flash_attention else hidden * (8 + b) // b
    return total


def activation_bytes(spec: ModelSpec, tp: int, pp: int, shape: ActivationShape, micro_batches: int,
                     trains: bool = True) -> int:
    """The first pipeline stage's activation peak: a training pass under 1F1B, or a forward pass.

    A forward-only pass keeps one layer's working set. Training keeps min(PP, micro-batches)
    micro-batches in flight on the first stage (1F1B's warm-up), each with every layer of the stage;
    full recomputation keeps each block's input and recomputes one block at a time.
    """
    per_layer = layer_activation_bytes(spec, tp, shape)
    if not trains:
        return per_layer
    in_flight = min(pp, micro_batches)
    if shape.recompute == "full":
        layers = math.ceil(spec.num_layers / pp)
        blocks = math.ceil(layers / shape.recompute_num_layers)
        block_input = shape.tokens * spec.hidden_size * dtype_bytes(shape.precision)
        return in_flight * blocks * block_input + shape.recompute_num_layers * per_layer
    return in_flight * max(stage_activation_bytes(spec, tp, pp, r, shape) for r in range(pp))


def kv_bytes_per_token(spec: ModelSpec, tp: int, precision: str = "bf16") -> int:
    """The KV cache one token takes on one generation TP rank (KV heads are replicated when TP exceeds them)."""
    groups = max(spec.num_query_groups // tp, 1)
    return 2 * spec.num_layers * groups * spec.head_dim * dtype_bytes(precision)


KV_BLOCK_TOKENS = 16  # vLLM's block size on GPUs (its CPU backend's is 128): a sequence's cache is whole blocks


def kv_bytes_per_sequence(spec: ModelSpec, tp: int, seq_len: int, precision: str = "bf16",
                          block_tokens: int = KV_BLOCK_TOKENS) -> int:
    """The KV cache one sequence of ``seq_len`` tokens takes on one generation TP rank, in whole blocks."""
    return -(-seq_len // block_tokens) * block_tokens * kv_bytes_per_token(spec, tp, precision)


def kv_cache_bytes(spec: ModelSpec, tp: int, seq_len: int, sequences: int, precision: str = "bf16",
                   block_tokens: int = KV_BLOCK_TOKENS) -> int:
    """The cache an engine needs to run ``sequences`` at once: theirs, and the one block vLLM holds back."""
    block = block_tokens * kv_bytes_per_token(spec, tp, precision)
    return sequences * kv_bytes_per_sequence(spec, tp, seq_len, precision, block_tokens) + block
