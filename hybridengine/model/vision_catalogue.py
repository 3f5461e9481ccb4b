"""The vision tower's parameters (Qwen2.5-VL), a parameter group of the first stage beside the language model's.

The tower is replicated over tensor-parallel ranks, so each parameter is a
whole HF tensor: megatron name ``vision_model.<name>``, HF name
``visual.<name>``, shapes from the ``VisionSpec``. The language model's
parameters stay in ``hybridengine.model.catalogue``; ``lookup`` there answers
for these names too.

vLLM holds the tower whole on every generation rank (its encoder
data-parallel, ``mm_encoder_tp_mode="data"``) under the HF names, each MLP's
gate and up projections fused into ``gate_up_proj`` ([gate; up]), as it
fuses the language model's.
"""

from __future__ import annotations

import re

import torch

from hybridengine.model.spec import ModelSpec

__all__ = ["VISION_PREFIX", "HF_VISION_PREFIX", "vision_shapes", "vision_shape", "is_vision_param", "to_vllm_vision"]

VISION_PREFIX = "vision_model."  # on the first stage's GPTModel (workers.megatron.vision_tower)
HF_VISION_PREFIX = "visual."


def vision_shapes(spec: ModelSpec) -> dict[str, tuple[int, ...]]:
    """Every tower parameter's name (after the prefix) and shape, in the module's order."""
    v = spec.vision
    d, f, out = v.hidden_size, v.intermediate_size, v.out_hidden_size
    merged = d * v.spatial_merge_size ** 2
    shapes = {"patch_embed.proj.weight": (d, v.in_channels, v.temporal_patch_size, v.patch_size, v.patch_size)}
    for i in range(v.depth):
        shapes.update({
            f"blocks.{i}.norm1.weight": (d,), f"blocks.{i}.norm2.weight": (d,),
            f"blocks.{i}.attn.qkv.weight": (3 * d, d), f"blocks.{i}.attn.qkv.bias": (3 * d,),
            f"blocks.{i}.attn.proj.weight": (d, d), f"blocks.{i}.attn.proj.bias": (d,),
            f"blocks.{i}.mlp.gate_proj.weight": (f, d), f"blocks.{i}.mlp.gate_proj.bias": (f,),
            f"blocks.{i}.mlp.up_proj.weight": (f, d), f"blocks.{i}.mlp.up_proj.bias": (f,),
            f"blocks.{i}.mlp.down_proj.weight": (d, f), f"blocks.{i}.mlp.down_proj.bias": (d,),
        })
    shapes.update({"merger.ln_q.weight": (d,), "merger.mlp.0.weight": (merged, merged), "merger.mlp.0.bias": (merged,),
                   "merger.mlp.2.weight": (out, merged), "merger.mlp.2.bias": (out,)})
    return shapes


_GATE = re.compile(r"^(blocks\.\d+\.mlp)\.gate_proj\.(weight|bias)$")


def is_vision_param(name: str) -> bool:
    return name.startswith(VISION_PREFIX)


def vision_shape(name: str, spec: ModelSpec) -> tuple[int, ...]:
    """The shape of megatron parameter ``name`` (``vision_model.…``) of ``spec``'s tower."""
    if spec.vision is None:
        raise KeyError(f"megatron parameter {name!r}: {spec.architecture} has no vision tower")
    shape = vision_shapes(spec).get(name.removeprefix(VISION_PREFIX))
    if shape is None:
        raise KeyError(f"megatron parameter {name!r} is not a parameter of the vision tower "
                       f"(depth {spec.vision.depth})")
    return shape


def to_vllm_vision(weights: dict[str, torch.Tensor], spec: ModelSpec) -> dict[str, torch.Tensor]:
    """The tower's tensors among ``weights`` (megatron names) under vLLM's names and fusion; a block's gate and up
    projections come together or not at all."""
    out = {}
    for name, tensor in weights.items():
        if not is_vision_param(name):
            continue
        local = name.removeprefix(VISION_PREFIX)
        vision_shape(name, spec)  # a known tower parameter
        gate = _GATE.match(local)
        if gate is not None:
            up = f"{VISION_PREFIX}{gate.group(1)}.up_proj.{gate.group(2)}"
            if up not in weights:
                raise ValueError(f"{name} came without {up}: vLLM fuses them into one tensor")
            out[f"{HF_VISION_PREFIX}{gate.group(1)}.gate_up_proj.{gate.group(2)}"] = torch.cat([tensor, weights[up]])
        elif ".mlp.up_proj." not in local:
            out[HF_VISION_PREFIX + local] = tensor
    return out
