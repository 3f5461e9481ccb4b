"""``device_map="auto"``: a role's TP x PP (and the rollout's generation TP) from the model and the devices.

The rule, until the planner replaces it:

- Bytes per parameter: a role that trains keeps its weights, fp32 gradients and Adam's fp32 master
  weights and two moments (bf16: 2 + 4 + 4 + 8 = 18 bytes; fp32: 4 + 4 + 8 = 16); a role that only
  runs forward keeps its weights (2 or 4).
- The model-parallel size is the smallest TP x PP whose share of that fits ``FIT_FRACTION`` of one
  device's memory (the rest is for activations). TP grows first, over the divisors of the world size
  that divide the attention heads, the KV heads, the FFN and the vocabulary, up to one node's
  devices; then PP over the divisors of the layers. The rest of the world is DP.
- Generation (the rollout): the smallest TP dividing the actor's training TP whose bf16 (or fp32)
  weights fit half a device, the other half for the KV cache; PP 1.
- An explicit ``tensor_parallel=`` / ``pipeline_parallel=`` always wins.

Nothing fits: a ValueError naming the model's size, the device's memory and the largest layout tried.
"""

from __future__ import annotations

from dataclasses import dataclass

from hybridengine.model.spec import ModelConfigError, ModelSpec
from hybridengine.parallel.layout import divisors

__all__ = ["FIT_FRACTION", "AutoLayout", "apply_device_map", "auto_generation_tp", "auto_layout", "device_map_layouts",
           "parameter_count", "role_bytes"]

FIT_FRACTION = 0.8
_TRAIN_BYTES = {"bf16": 18, "fp32": 16}
_WEIGHT_BYTES = {"bf16": 2, "fp32": 4}


@dataclass(frozen=True)
class AutoLayout:
    tensor_parallel: int
    pipeline_parallel: int


def parameter_count(spec: ModelSpec) -> int:
    """Parameters of a supported model from its config: embeddings, output layer (or value head), layers."""
    h, d = spec.hidden_size, spec.head_dim
    attention = h * (spec.num_attention_heads + 2 * spec.num_query_groups) * d + spec.num_attention_heads * d * h
    if spec.qkv_bias:
        attention += (spec.num_attention_heads + 2 * spec.num_query_groups) * d
    layer = attention + 3 * h * spec.ffn_hidden_size + 2 * h
    output = spec.num_labels * h if spec.is_value_model else (0 if spec.tie_word_embeddings else spec.vocab_size * h)
    return spec.vocab_size * h + spec.num_layers * layer + h + output


def role_bytes(spec: ModelSpec, precision: str, trains: bool) -> int:
    """What a role holds for the whole model, before any split."""
    table = _TRAIN_BYTES if trains else _WEIGHT_BYTES
    if precision not in table:
        raise ValueError(f"precision {precision!r} is not one of {sorted(table)}")
    return parameter_count(spec) * table[precision]


def auto_layout(spec: ModelSpec, world_size: int, device_bytes: int, precision: str = "bf16", trains: bool = True,
                devices_per_node: int | None = None) -> AutoLayout:
    """The smallest TP x PP (TP first) under which one rank's share fits ``FIT_FRACTION`` of a device."""
    need = role_bytes(spec, precision, trains)
    budget = FIT_FRACTION * device_bytes
    node = devices_per_node or world_size
    candidates = []
    for tp in divisors(world_size):
        if tp > node:
            continue
        try:
            spec.check_layout(tp, 1)
        except ModelConfigError:
            continue
        for pp in divisors(world_size // tp):
            if spec.num_layers % pp == 0:
                candidates.append((tp * pp, pp, tp))
    candidates.sort()  # smallest model-parallel size, then the fewest pipeline stages (TP first)
    for _, pp, tp in candidates:
        if need / (tp * pp) <= budget:
            return AutoLayout(tp, pp)
    largest = candidates[-1] if candidates else (1, 1, 1)
    raise ValueError(
        f'device_map="auto": {spec.architecture} ({parameter_count(spec) / 1e9:.2f}B parameters, {need / 2**30:.1f} GiB '
        f'to {"train" if trains else "run"} in {precision}) does not fit {FIT_FRACTION:.0%} of one device '
        f"({device_bytes / 2**30:.1f} GiB) even at TP {largest[2]} x PP {largest[1]} over {world_size} devices; "
        f"use more devices, or set tensor_parallel= / pipeline_parallel= yourself")


def auto_generation_tp(spec: ModelSpec, training_tp: int, device_bytes: int, precision: str = "bf16") -> int:
    """The smallest generation TP dividing the training TP whose weights fit half a device."""
    weights = role_bytes(spec, precision, trains=False)
    for tp in divisors(training_tp):
        if weights / tp <= 0.5 * device_bytes:
            return tp
    return training_tp


def _engine(spec) -> dict:
    engine = spec.kwargs.get("engine") or {}
    return engine if isinstance(engine, dict) else {f: getattr(engine, f) for f in engine.__dataclass_fields__}


def device_map_layouts(specs: dict, placement: dict[str, str], pool_world: dict[str, int], device_bytes: int,
                       devices_per_node: int | None = None) -> dict[str, AutoLayout]:
    """The layout of every ``device_map="auto"`` role of ``specs`` (role -> RoleSpec) by the rule above;
    the rollout's is its generation TP x 1.

    Megatron roles that share a pool share one TP x PP (the engine's colocation rule): a role given its
    layout explicitly sets it for the pool, otherwise the largest of the auto roles' layouts does. The
    rollout then takes the generation TP for the actor's training TP.
    """
    layouts: dict[str, AutoLayout] = {}
    megatron = {role: s for role, s in specs.items() if "engine" in s.kwargs and role != "rollout"}
    for pool in sorted({placement[r] for r in megatron}):
        roles = [r for r in megatron if placement[r] == pool]
        auto = [r for r in roles if specs[r].device_map == "auto" and not specs[r].explicit_parallelism]
        if not auto:
            continue
        fixed = [r for r in roles if r not in auto]
        if fixed:
            engine = _engine(specs[fixed[0]])
            layout = AutoLayout(engine.get("tensor_parallel", 1), engine.get("pipeline_parallel", 1))
        else:
            candidates = [auto_layout(ModelSpec.from_pretrained(specs[r].model_path), pool_world[pool], device_bytes,
                                      _engine(specs[r]).get("precision", "bf16"), trains=r in ("actor", "critic"),
                                      devices_per_node=devices_per_node) for r in auto]
            layout = max(candidates, key=lambda l: (l.tensor_parallel * l.pipeline_parallel, l.tensor_parallel))
        layouts.update({role: layout for role in auto})
    rollout = specs.get("rollout")
    if rollout is not None and rollout.device_map == "auto" and not rollout.explicit_parallelism:
        actor_engine = _engine(specs["actor"])
        training_tp = (pool_world[placement["rollout"]] if placement["rollout"] != placement["actor"]
                       else layouts.get("actor", AutoLayout(actor_engine.get("tensor_parallel", 1), 1)).tensor_parallel)
        tp = auto_generation_tp(ModelSpec.from_pretrained(rollout.model_path), training_tp, device_bytes,
                                actor_engine.get("precision", "bf16"))
        layouts["rollout"] = AutoLayout(tp, 1)
    return layouts


def apply_device_map(specs: dict, placement: dict[str, str], pool_world: dict[str, int], device_bytes: int,
                     devices_per_node: int | None = None) -> dict:
    """``specs`` with every ``device_map="auto"`` role laid out as ``device_map_layouts`` says."""
    from dataclasses import replace

    specs = dict(specs)
    for role, layout in device_map_layouts(specs, placement, pool_world, device_bytes, devices_per_node).items():
        spec = specs[role]
        if role == "rollout":
            config = {**(spec.kwargs.get("config") or {}), "tensor_parallel": layout.tensor_parallel,
                      "pipeline_parallel": layout.pipeline_parallel}
            specs[role] = replace(spec, kwargs={**spec.kwargs, "config": config}, explicit_parallelism=True)
        else:
            specs[role] = spec.with_parallelism(layout.tensor_parallel, layout.pipeline_parallel)
    return specs
