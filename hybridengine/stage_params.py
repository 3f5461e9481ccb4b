"""The parameters of one megatron pipeline stage at a TP size: names, shard shapes, mapping kinds.

A pure catalogue derived from the ModelSpec (megatron-core local layer
spec). The resharder uses it to know, for every parameter of a generation
stage, which training shards it is made of and how they join.
"""

from __future__ import annotations

from dataclasses import dataclass

from hybridengine.hf_mapping import COLUMNS, FC1, QKV, REPLICATED, VOCAB_ROWS
from hybridengine.model_spec import ModelSpec

__all__ = ["StageParam", "stage_params", "global_layer"]


@dataclass(frozen=True)
class StageParam:
    name: str  # megatron name, layers numbered locally within the stage
    shape: tuple[int, ...]  # the shard's shape at this TP size
    kind: str  # how TP shards join: vocab_rows / qkv / columns / fc1 / replicated
    layer: int | None = None  # global layer index, None for embedding / final norm / output layer

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n


_LAYER_PARAMS = (
    # (suffix, kind, shape(spec, tp))
    ("input_layernorm.weight", REPLICATED, lambda s, t: (s.hidden_size,)),
    ("self_attention.linear_qkv.weight", QKV,
     lambda s, t: ((s.num_attention_heads + 2 * s.num_query_groups) * s.head_dim // t, s.hidden_size)),
    ("self_attention.linear_qkv.bias", QKV, lambda s, t: ((s.num_attention_heads + 2 * s.num_query_groups) * s.head_dim // t,)),
    ("self_attention.linear_proj.weight", COLUMNS, lambda s, t: (s.hidden_size, s.num_attention_heads * s.head_dim // t)),
    ("pre_mlp_layernorm.weight", REPLICATED, lambda s, t: (s.hidden_size,)),
    ("mlp.linear_fc1.weight", FC1, lambda s, t: (2 * s.ffn_hidden_size // t, s.hidden_size)),
    ("mlp.linear_fc2.weight", COLUMNS, lambda s, t: (s.hidden_size, s.ffn_hidden_size // t)),
)


def global_layer(spec: ModelSpec, pipeline_parallel: int, pp_rank: int, local_layer: int) -> int:
    return pp_rank * (spec.num_layers // pipeline_parallel) + local_layer


def stage_params(spec: ModelSpec, tp: int, pp: int, pp_rank: int) -> list[StageParam]:
    """Every parameter of stage ``pp_rank`` of ``pp`` at TP size ``tp``, in a fixed order."""
    params: list[StageParam] = []
    if pp_rank == 0:
        params.append(StageParam("embedding.word_embeddings.weight", (spec.vocab_size // tp, spec.hidden_size), VOCAB_ROWS))
    for local in range(spec.num_layers // pp):
        layer = global_layer(spec, pp, pp_rank, local)
        for suffix, kind, shape in _LAYER_PARAMS:
            if suffix.endswith(".bias") and not spec.qkv_bias:
                continue
            params.append(StageParam(f"decoder.layers.{local}.{suffix}", shape(spec, tp), kind, layer))
    if pp_rank == pp - 1:
        params.append(StageParam("decoder.final_layernorm.weight", (spec.hidden_size,), REPLICATED))
        if spec.is_value_model:
            params.append(StageParam("output_layer.weight", (spec.num_labels, spec.hidden_size), REPLICATED))
        elif not spec.tie_word_embeddings or pp > 1:
            # With tied embeddings the last of several stages keeps its own copy.
            params.append(StageParam("output_layer.weight", (spec.vocab_size // tp, spec.hidden_size), VOCAB_ROWS))
    return params
