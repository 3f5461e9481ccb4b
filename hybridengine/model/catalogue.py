"""One table of every megatron parameter of a pipeline stage: shard geometry, shard shape, HF names, vLLM name.

The HF mapping (``hf_mapping``), the resharder and its baselines, the
cross-pool transfer and the vLLM layout (``vllm_layout``) all read this
table, so a new family (q/k norm, a padded vocabulary) is one edit here.
How each parameter splits over TP ranks is data, a ``ShardGeometry``
(``hybridengine.model.geometry``), from which every cut and join follows.
Which layers a stage holds comes from ``ModelSpec.layers_of_stage`` only.

Names follow megatron-core's local layer spec; decoder-layer entries carry
the suffix after ``decoder.layers.{i}.`` (HF: after ``model.layers.{i}.``,
vLLM: after ``model.layers.{i}.`` with the global layer index). Shapes are
those of one TP rank's shard.

A mixture of experts' layer has a router and, per expert, an fc1 / fc2 pair
(``EXPERT_ENTRIES``; megatron numbers a rank's experts locally, HF
globally). A rank holds the experts of its expert-parallel rank, each cut
over the expert-tensor-parallel ranks (``ExpertShard``); the router and a
shared expert split over TP as the dense MLP does.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from enum import Enum
from typing import Callable

from hybridengine.model.geometry import ShardGeometry
from hybridengine.model.spec import ModelSpec
from hybridengine.model.vision_catalogue import HF_VISION_PREFIX, VISION_PREFIX, is_vision_param, vision_shape

__all__ = [
    "ShardKind", "ShardGeometry", "CatalogueEntry", "REPLICATED", "COLUMNS", "FC1", "StageParam", "LAYER_ENTRIES", "TRANSFORMER_ENGINE_ALIASES",
    "EMBEDDING", "FINAL_NORM", "OUTPUT_LAYER", "stage_params", "lookup", "ExpertShard", "EXPERT_ENTRIES", "layer_index",
    "Projection", "projections",
]


class ShardKind(str, Enum):
    """The names of the built-in shard geometries (a str, so ``kind == "qkv"`` keeps working)."""

    VOCAB_ROWS = "vocab_rows"  # rows of the (padded) vocabulary, contiguous per TP rank
    REPLICATED = "replicated"  # the same tensor on every TP rank
    QKV = "qkv"  # group-major [q_g, k_g, v_g] rows per query group, contiguous groups per rank
    COLUMNS = "columns"  # the input dimension (dim 1) split contiguously
    FC1 = "fc1"  # SwiGLU [gate_r; up_r] per TP rank

    def __str__(self) -> str:
        return self.value


Shape = Callable[[ModelSpec, int], tuple[int, ...]]  # (spec, tp) -> the shard's shape
Geometry = Callable[[ModelSpec], ShardGeometry]

REPLICATED = ShardGeometry(ShardKind.REPLICATED, dim=None)
COLUMNS = ShardGeometry(ShardKind.COLUMNS, dim=1)
FC1 = ShardGeometry(ShardKind.FC1, dim=0, parts=(1, 1), interleave="shard")  # [gate_r; up_r]


def _qkv(s: ModelSpec) -> ShardGeometry:
    """Per query group: its query heads, its key head, its value head."""
    d = s.head_dim
    return ShardGeometry(ShardKind.QKV, dim=0, parts=(s.num_attention_heads // s.num_query_groups * d, d, d))


def _vocab(s: ModelSpec) -> ShardGeometry:
    """Rows of the padded vocabulary; the rows past the real vocabulary are padding."""
    return ShardGeometry(ShardKind.VOCAB_ROWS, dim=0, real_units=s.vocab_size)


@dataclass(frozen=True)
class CatalogueEntry:
    suffix: str  # megatron name (after "decoder.layers.{i}." for layer parameters)
    geometry: Geometry  # how it splits over TP ranks
    hf_names: tuple[str, ...]  # HF tensors it is made of, its parts (after "model.layers.{i}." for layer parameters)
    vllm_name: str | None  # vLLM's (fused) name; None where vLLM has no such tensor (a value head)
    shape: Shape
    present: Callable[[ModelSpec], bool] = lambda spec: True


def _same(geometry: ShardGeometry) -> Geometry:
    return lambda spec: geometry


def _qkv_rows(s: ModelSpec, t: int) -> int:
    return (s.num_attention_heads + 2 * s.num_query_groups) * s.head_dim // t


def _has_qk_norm(s: ModelSpec) -> bool:
    return s.qk_layernorm


def _dense_mlp(s: ModelSpec) -> bool:
    return s.moe is None


def _routed(s: ModelSpec) -> bool:
    return s.moe is not None


def _shared_expert(s: ModelSpec) -> bool:
    return s.moe is not None and s.moe.has_shared_expert


LAYER_ENTRIES: tuple[CatalogueEntry, ...] = (
    CatalogueEntry("input_layernorm.weight", _same(REPLICATED), ("input_layernorm.weight",),
                   "input_layernorm.weight", lambda s, t: (s.hidden_size,)),
    CatalogueEntry("self_attention.linear_qkv.weight", _qkv,
                   ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"),
                   "self_attn.qkv_proj.weight", lambda s, t: (_qkv_rows(s, t), s.hidden_size)),
    CatalogueEntry("self_attention.linear_qkv.bias", _qkv,
                   ("self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias"),
                   "self_attn.qkv_proj.bias", lambda s, t: (_qkv_rows(s, t),), lambda s: s.qkv_bias),
    # Qwen3: one RMSNorm weight of head_dim shared by every query (key) head, so replicated.
    CatalogueEntry("self_attention.q_layernorm.weight", _same(REPLICATED), ("self_attn.q_norm.weight",),
                   "self_attn.q_norm.weight", lambda s, t: (s.head_dim,), _has_qk_norm),
    CatalogueEntry("self_attention.k_layernorm.weight", _same(REPLICATED), ("self_attn.k_norm.weight",),
                   "self_attn.k_norm.weight", lambda s, t: (s.head_dim,), _has_qk_norm),
    CatalogueEntry("self_attention.linear_proj.weight", _same(COLUMNS), ("self_attn.o_proj.weight",),
                   "self_attn.o_proj.weight", lambda s, t: (s.hidden_size, s.num_attention_heads * s.head_dim // t)),
    CatalogueEntry("pre_mlp_layernorm.weight", _same(REPLICATED), ("post_attention_layernorm.weight",),
                   "post_attention_layernorm.weight", lambda s, t: (s.hidden_size,)),
    CatalogueEntry("mlp.linear_fc1.weight", _same(FC1), ("mlp.gate_proj.weight", "mlp.up_proj.weight"),
                   "mlp.gate_up_proj.weight", lambda s, t: (2 * s.ffn_hidden_size // t, s.hidden_size), _dense_mlp),
    CatalogueEntry("mlp.linear_fc2.weight", _same(COLUMNS), ("mlp.down_proj.weight",),
                   "mlp.down_proj.weight", lambda s, t: (s.hidden_size, s.ffn_hidden_size // t), _dense_mlp),
    # A mixture of experts: the router (every TP rank scores every expert) and the shared expert (Qwen2-MoE).
    CatalogueEntry("mlp.router.weight", _same(REPLICATED), ("mlp.gate.weight",), "mlp.gate.weight",
                   lambda s, t: (s.moe.num_experts, s.hidden_size), _routed),
    CatalogueEntry("mlp.shared_experts.linear_fc1.weight", _same(FC1),
                   ("mlp.shared_expert.gate_proj.weight", "mlp.shared_expert.up_proj.weight"),
                   "mlp.shared_expert.gate_up_proj.weight",
                   lambda s, t: (2 * s.moe.shared_expert_ffn_hidden_size // t, s.hidden_size), _shared_expert),
    CatalogueEntry("mlp.shared_experts.linear_fc2.weight", _same(COLUMNS), ("mlp.shared_expert.down_proj.weight",),
                   "mlp.shared_expert.down_proj.weight",
                   lambda s, t: (s.hidden_size, s.moe.shared_expert_ffn_hidden_size // t), _shared_expert),
    CatalogueEntry("mlp.shared_experts.gate_weight", _same(REPLICATED), ("mlp.shared_expert_gate.weight",),
                   "mlp.shared_expert_gate.weight", lambda s, t: (1, s.hidden_size), _shared_expert),
)
_LAYER_BY_SUFFIX = {e.suffix: e for e in LAYER_ENTRIES}

# One routed expert: "{expert}" is its local index in megatron's names, its global one in HF's. Shapes are
# those of one expert-tensor-parallel shard (``t``: the ETP size). vLLM stacks every expert into one tensor,
# so there is no per-expert vLLM name.
EXPERT_ENTRIES: tuple[CatalogueEntry, ...] = (
    CatalogueEntry("mlp.experts.local_experts.{expert}.linear_fc1.weight", _same(FC1),
                   ("mlp.experts.{expert}.gate_proj.weight", "mlp.experts.{expert}.up_proj.weight"), None,
                   lambda s, t: (2 * s.moe.expert_ffn_hidden_size // t, s.hidden_size), _routed),
    CatalogueEntry("mlp.experts.local_experts.{expert}.linear_fc2.weight", _same(COLUMNS),
                   ("mlp.experts.{expert}.down_proj.weight",), None,
                   lambda s, t: (s.hidden_size, s.moe.expert_ffn_hidden_size // t), _routed),
)
_EXPERT_NAME = re.compile(r"^mlp\.experts\.local_experts\.(\d+)\.(linear_fc[12]\.weight)$")
_EXPERT_BY_SUFFIX = {e.suffix.split("}.", 1)[1]: e for e in EXPERT_ENTRIES}

# The transformer-engine spec fuses each norm into the linear layer after it: same tensor, other name.
TRANSFORMER_ENGINE_ALIASES = {
    "self_attention.linear_qkv.layer_norm_weight": "input_layernorm.weight",
    "mlp.linear_fc1.layer_norm_weight": "pre_mlp_layernorm.weight",
}
# ... and its grouped expert MLP numbers the experts' weights in the parameter name.
_GROUPED_EXPERT_NAME = re.compile(r"^mlp\.experts\.(linear_fc[12])\.weight(\d+)$")


@dataclass(frozen=True)
class ExpertShard:
    """The routed experts one rank holds: expert-parallel rank ``ep_rank`` of ``ep`` holds experts
    [ep_rank E / ep, (ep_rank + 1) E / ep), each split over ``etp`` expert-tensor-parallel ranks
    (None: as many as the dense TP size)."""

    ep: int = 1
    ep_rank: int = 0
    etp: int | None = None

    def __post_init__(self) -> None:
        if not 0 <= self.ep_rank < self.ep:
            raise ValueError(f"expert-parallel rank {self.ep_rank} outside EP size {self.ep}")

    def size(self, tp: int) -> int:
        """The ETP size at dense TP size ``tp``."""
        return tp if self.etp is None else self.etp

    def experts(self, spec: ModelSpec) -> range:
        """The global indices of the experts this rank holds."""
        per_rank = spec.moe.num_experts // self.ep
        return range(self.ep_rank * per_rank, (self.ep_rank + 1) * per_rank)

@dataclass(frozen=True)
class Projection:
    """One of a decoder layer's HF linear projections (``q_proj`` ... ``down_proj``) as the catalogue places it:
    the megatron linear that holds it, its part there, its whole (input, output) features, and whether TP
    cuts its input (a row-parallel linear) rather than its output. What an adapter on it is shaped by."""

    hf_name: str  # "q_proj"
    linear: str  # megatron's linear, "self_attention.linear_qkv"
    part: str  # its part of that linear: "q" (the HF name without "_proj")
    fan_in: int
    fan_out: int
    row_parallel: bool


def projections(spec: ModelSpec) -> dict[str, Projection]:
    """The dense decoder layer's linear projections by HF name, from the catalogue's entries: each fused part's
    output features are its share of the fused rows (the geometry's parts), at TP 1."""
    out = {}
    for entry in LAYER_ENTRIES:
        geometry = entry.geometry(spec)
        if not entry.present(spec) or geometry.replicated or not entry.suffix.endswith(".weight"):
            continue
        rows, cols = entry.shape(spec, 1)
        linear = entry.suffix.removesuffix(".weight")
        for hf, size in zip(entry.hf_names, geometry.parts):
            name = hf.removesuffix(".weight").rsplit(".", 1)[1]
            if geometry.dim == 0:
                fan_out = rows // geometry.unit_size * size
                out[name] = Projection(name, linear, name.removesuffix("_proj"), cols, fan_out, False)
            else:
                out[name] = Projection(name, linear, name.removesuffix("_proj"), cols, rows, True)
    return out


EMBEDDING = "embedding.word_embeddings.weight"
FINAL_NORM = "decoder.final_layernorm.weight"
OUTPUT_LAYER = "output_layer.weight"


def _vocab_shape(s: ModelSpec, t: int) -> tuple[int, ...]:
    return (s.vocab_rows // t, s.hidden_size)


def _stage_entry(name: str, spec: ModelSpec) -> CatalogueEntry:
    """The entries outside the decoder layers; the output layer depends on the head and on tying."""
    if name == EMBEDDING:
        return CatalogueEntry(EMBEDDING, _vocab, ("model.embed_tokens.weight",),
                              "model.embed_tokens.weight", _vocab_shape)
    if name == FINAL_NORM:
        return CatalogueEntry(FINAL_NORM, _same(REPLICATED), ("model.norm.weight",), "model.norm.weight",
                              lambda s, t: (s.hidden_size,))
    if name == OUTPUT_LAYER:
        if spec.is_value_model:
            return CatalogueEntry(OUTPUT_LAYER, _same(REPLICATED), ("score.weight",), None,
                                  lambda s, t: (s.num_labels, s.hidden_size))
        hf = "model.embed_tokens.weight" if spec.tie_word_embeddings else "lm_head.weight"
        return CatalogueEntry(OUTPUT_LAYER, _vocab, (hf,), "lm_head.weight", _vocab_shape)
    raise KeyError(name)


@dataclass(frozen=True)
class StageParam:
    name: str  # megatron name, layers numbered locally within the stage
    shape: tuple[int, ...]  # the shard's shape at this TP size
    kind: str  # its geometry's name (a ShardKind for the built-in ones)
    layer: int | None = None  # global layer index, None for embedding / final norm / output layer
    hf_names: tuple[str, ...] = field(default=(), compare=False)  # HF tensors, global layer index
    vllm_name: str | None = field(default=None, compare=False)  # vLLM's name, global layer index
    geometry: ShardGeometry | None = field(default=None, compare=False)  # how TP shards are cut and join
    expert: int | None = None  # a routed expert's global index: split over the ETP ranks, not the TP ranks

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


def _param(entry: CatalogueEntry, spec: ModelSpec, tp: int, name: str, layer: int | None,
           expert: int | None = None) -> StageParam:
    prefix_hf = "" if layer is None else f"model.layers.{layer}."
    vllm = None if entry.vllm_name is None else prefix_hf + entry.vllm_name
    geometry = entry.geometry(spec)
    hf_names = tuple(prefix_hf + (n if expert is None else n.format(expert=expert)) for n in entry.hf_names)
    return StageParam(name, entry.shape(spec, tp), geometry.kind, layer, hf_names, vllm, geometry, expert)


def _expert_params(spec: ModelSpec, tp: int, experts: ExpertShard, local_layer: int, layer: int) -> list[StageParam]:
    """The routed experts' parameters of one layer on a rank of ``experts``, local expert after local expert."""
    etp = experts.size(tp)
    return [_param(entry, spec, etp, f"decoder.layers.{local_layer}.{entry.suffix.format(expert=local)}", layer, expert)
            for local, expert in enumerate(experts.experts(spec)) for entry in EXPERT_ENTRIES]


def stage_params(spec: ModelSpec, tp: int, pp: int, pp_rank: int, experts: ExpertShard | None = None,
                 routed: bool = True) -> list[StageParam]:
    """Every parameter of stage ``pp_rank`` of ``pp`` at TP size ``tp``, in a fixed order; a mixture of experts'
    routed experts those of ``experts`` (None: every expert, split as the dense TP), or none (``routed=False``:
    the dense part, which the micro-DP reshard plan moves)."""
    experts = experts or ExpertShard()
    params: list[StageParam] = []
    if pp_rank == 0:
        params.append(_param(_stage_entry(EMBEDDING, spec), spec, tp, EMBEDDING, None))
    for local, layer in enumerate(spec.layers_of_stage(pp_rank, pp)):
        for entry in LAYER_ENTRIES:
            if entry.present(spec):
                params.append(_param(entry, spec, tp, f"decoder.layers.{local}.{entry.suffix}", layer))
        if spec.moe is not None and routed:
            params += _expert_params(spec, tp, experts, local, layer)
    if pp_rank == pp - 1:
        params.append(_param(_stage_entry(FINAL_NORM, spec), spec, tp, FINAL_NORM, None))
        # With tied embeddings a single stage has no output layer of its own; the last of several keeps a copy.
        if spec.is_value_model or not spec.tie_word_embeddings or pp > 1:
            params.append(_param(_stage_entry(OUTPUT_LAYER, spec), spec, tp, OUTPUT_LAYER, None))
    return params


_LAYER_NAME = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")


def layer_index(name: str) -> int:
    """The decoder layer (within its stage) of a megatron parameter or module name, whatever wraps the model
    (``module.decoder.layers.3.mlp.router`` -> 3)."""
    return int(name.split("decoder.layers.", 1)[1].split(".", 1)[0])


def lookup(name: str, spec: ModelSpec, pp_rank: int, pp: int, tp: int = 1,
           experts: ExpertShard | None = None) -> StageParam:
    """The catalogue's description of megatron parameter ``name`` on stage ``pp_rank`` (at TP ``tp``; a routed
    expert's on a rank of ``experts``).

    Accepts the transformer-engine names of the fused norms and grouped experts as well.
    """
    match = _LAYER_NAME.match(name)
    if match:
        suffix = TRANSFORMER_ENGINE_ALIASES.get(match.group(2), match.group(2))
        grouped = _GROUPED_EXPERT_NAME.match(suffix)
        if grouped:
            suffix = f"mlp.experts.local_experts.{grouped.group(2)}.{grouped.group(1)}.weight"
        routed = _EXPERT_NAME.match(suffix) if spec.moe is not None else None
        entry = _EXPERT_BY_SUFFIX[routed.group(2)] if routed else _LAYER_BY_SUFFIX.get(suffix)
        if entry is not None and entry.present(spec):
            layers = spec.layers_of_stage(pp_rank, pp)
            local = int(match.group(1))
            if local >= len(layers):
                raise KeyError(f"megatron parameter {name!r}: stage {pp_rank} of {pp} holds {len(layers)} layers")
            if routed is None:
                return _param(entry, spec, tp, name, layers[local])
            experts = experts or ExpertShard()
            held = experts.experts(spec)
            if int(routed.group(1)) >= len(held):
                raise KeyError(f"megatron parameter {name!r}: an expert-parallel rank of {experts.ep} holds "
                               f"{len(held)} of the {spec.moe.num_experts} experts")
            return _param(entry, spec, experts.size(tp), name, layers[local], held[int(routed.group(1))])
    elif name in (EMBEDDING, FINAL_NORM, OUTPUT_LAYER):
        return _param(_stage_entry(name, spec), spec, tp, name, None)
    elif is_vision_param(name) and pp_rank == 0:
        hf = HF_VISION_PREFIX + name.removeprefix(VISION_PREFIX)
        return StageParam(name, vision_shape(name, spec), REPLICATED.kind, None, (hf,), None, REPLICATED)
    raise KeyError(f"no Hugging Face source known for megatron parameter {name!r}")
