"""3-D (mrope) position ids of a vision-language sequence, as Qwen2.5-VL numbers them.

A text token's three streams (temporal, height, width) are one position,
counting up (an image token the model sampled in its response is text, as it
is to transformers and vLLM). An image's ``t * h * w / merge**2`` tokens take the position
where the image starts plus their cell in the merged grid: temporal index,
row, column. The text after it resumes at that start plus the merged grid's
longer side. transformers' ``get_rope_index`` and vLLM's
``get_mrope_input_positions`` number the same way; a test holds this to the
first.
"""

from __future__ import annotations

from typing import Sequence

import torch

from hybridengine.model.vision import VisionSpec

__all__ = ["mrope_positions", "batch_mrope_positions"]


def mrope_positions(ids: torch.Tensor, grids: Sequence[Sequence[int]], vision: VisionSpec) -> torch.Tensor:
    """[3, len(ids)] positions of one sequence ``ids`` (its real tokens, no padding) holding images of patch
    grids ``grids`` (t, h, w), in order."""
    positions = torch.empty(3, len(ids), dtype=torch.long, device=ids.device)
    counts = [vision.image_tokens(tuple(int(x) for x in grid)) for grid in grids]
    # the prompt's image runs come first; an <|image_pad|> the model sampled later is text
    image_at = (ids == vision.image_token_id).nonzero()[:, 0].tolist()[:sum(counts)]
    if len(image_at) != sum(counts):
        raise ValueError(f"the sequence holds {len(image_at)} image tokens, its {len(counts)} images stand for "
                         f"{sum(counts)} ({counts}); a prompt's <|image_pad|> tokens must be its images' counts")
    token = current = used = 0
    merge = vision.spatial_merge_size
    for grid, count in zip(grids, counts):
        start = image_at[used]
        if image_at[used + count - 1] != start + count - 1:
            raise ValueError(f"image tokens at {start}..: an image's {count} tokens must be consecutive")
        positions[:, token:start] = torch.arange(start - token, device=ids.device) + current
        current += start - token
        t, h, w = int(grid[0]), int(grid[1]) // merge, int(grid[2]) // merge
        cells = torch.stack(torch.meshgrid(torch.arange(t), torch.arange(h), torch.arange(w), indexing="ij"))
        positions[:, start:start + count] = cells.reshape(3, -1).to(ids.device) + current
        current += max(h, w)
        token, used = start + count, used + count
    positions[:, token:] = torch.arange(len(ids) - token, device=ids.device) + current
    return positions


def batch_mrope_positions(ids: torch.Tensor, lengths: Sequence[int], grids: Sequence[Sequence[Sequence[int]]],
                          vision: VisionSpec) -> torch.Tensor:
    """[3, B, S] positions of a micro-batch ``ids`` [B, S] whose rows are left-aligned (row i's first
    ``lengths[i]`` tokens are real); past a row's end the positions count on (padding, never attended from a real
    token)."""
    out = torch.empty(3, *ids.shape, dtype=torch.long, device=ids.device)
    for row, (length, row_grids) in enumerate(zip(lengths, grids)):
        real = mrope_positions(ids[row, :length], row_grids, vision)
        out[:, row, :length] = real
        after = (int(real.max()) + 1) if length else 0
        out[:, row, length:] = torch.arange(ids.shape[1] - length, device=ids.device) + after
    return out
