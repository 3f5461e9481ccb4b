"""A vision-language model's image side on the first stage: transformers' Qwen2.5-VL vision tower and merger.

megatron-core has no Qwen vision tower (its ``models/vision`` holds CLIP and
RADIO), so the tower is transformers' own module, built from the checkpoint's
``vision_config`` and loaded from its ``visual.*`` tensors. It is replicated
on every rank of the first stage (each data-parallel rank runs its own
images; the TP ranks of a replica run the same ones, so the tower's gradient
is the same on each and megatron counts it once in the gradient norm). Frozen
(``freeze_vision_tower``, the default) or trained with the language model.

A micro-batch's rows carry their images as ``multi_modal_inputs``: per row a
mapping with ``pixel_values`` [patches, C * T * P * P] and ``image_grid_thw``
[images, 3], as the processor makes them (None: a row without images). The
tower's merged embeddings take the place of the token embeddings at the
``<|image_pad|>`` positions, in row and image order, as transformers'
``masked_scatter`` places them.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

from hybridengine.model.spec import ModelSpec
from hybridengine.model.vision_catalogue import VISION_PREFIX
from workers.multimodal import MULTI_MODAL_INPUTS

__all__ = ["MULTI_MODAL_INPUTS", "VISION_MODULE", "build_vision_tower", "row_grids", "image_embeddings",
           "image_token_mask", "scatter_image_embeddings"]

VISION_MODULE = VISION_PREFIX.rstrip(".")  # the tower's attribute on the first stage's GPTModel


def build_vision_tower(spec: ModelSpec, dtype: torch.dtype, device: torch.device) -> torch.nn.Module:
    """transformers' Qwen2.5-VL vision tower and merger for ``spec.vision`` (weights loaded afterwards)."""
    from transformers.models.qwen2_5_vl.configuration_qwen2_5_vl import Qwen2_5_VLVisionConfig
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VisionTransformerPretrainedModel

    v = spec.vision
    config = Qwen2_5_VLVisionConfig(
        depth=v.depth, hidden_size=v.hidden_size, intermediate_size=v.intermediate_size, num_heads=v.num_heads,
        out_hidden_size=v.out_hidden_size, patch_size=v.patch_size, spatial_merge_size=v.spatial_merge_size,
        temporal_patch_size=v.temporal_patch_size, window_size=v.window_size,
        fullatt_block_indexes=list(v.fullatt_block_indexes), in_channels=v.in_channels, hidden_act="silu",
        tokens_per_second=v.tokens_per_second)
    config._attn_implementation = "sdpa"
    tower = Qwen2_5_VisionTransformerPretrainedModel._from_config(config, dtype=dtype)
    return tower.to(device=device, dtype=dtype)


def row_grids(inputs: Sequence[Any]) -> list[list[tuple[int, int, int]]]:
    """Each row's image grids (t, h, w), in order; [] for a row without images."""
    return [[] if row is None else [tuple(int(x) for x in g) for g in row["image_grid_thw"].tolist()]
            for row in inputs]


def image_embeddings(tower: torch.nn.Module, inputs: Sequence[Any], device: torch.device) -> torch.Tensor | None:
    """The merged embeddings [image tokens, hidden] of every image of ``inputs`` (rows in order), or None."""
    rows = [row for row in inputs if row is not None and len(row["image_grid_thw"])]
    if not rows:
        return None
    dtype = next(tower.parameters()).dtype
    pixels = torch.cat([row["pixel_values"] for row in rows]).to(device=device, dtype=dtype)
    grids = torch.cat([row["image_grid_thw"] for row in rows]).to(device=device)
    return tower(pixels, grid_thw=grids).pooler_output


def image_token_mask(ids: torch.Tensor, counts: Sequence[int], image_token_id: int) -> torch.Tensor:
    """[B, S]: the image tokens of each row's images, the first ``counts[row]`` of its ``image_token_id`` tokens
    (its prompt's image runs); one the model sampled in its response is text."""
    mask = ids == image_token_id
    seen = mask.long().cumsum(-1)
    return mask & (seen <= torch.tensor(counts, device=ids.device).unsqueeze(-1))


def scatter_image_embeddings(embeddings: torch.Tensor, mask: torch.Tensor, features: torch.Tensor | None) -> torch.Tensor:
    """``embeddings`` [S, B, H] (megatron's order) with ``features`` in place where ``mask`` [B, S] is set (row
    after row, as the rows' images come)."""
    count = int(mask.sum())
    have = 0 if features is None else features.shape[0]
    if count != have:
        raise ValueError(f"the micro-batch holds {count} image tokens and its images make {have} embeddings; "
                         "each <|image_pad|> run must be its image's count (grid t*h*w / merge_size**2)")
    if features is None:
        return embeddings
    by_row = embeddings.transpose(0, 1).masked_scatter(mask.unsqueeze(-1), features.to(embeddings.dtype))
    return by_row.transpose(0, 1).contiguous()
