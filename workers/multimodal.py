"""A batch's images: the two per-row entries of a vision-language batch's non-tensor fields.

- ``multi_modal_data``: per row ``{"image": [PIL images]}`` (None: no images), what a generation engine
  takes (vLLM's ``multi_modal_data``, which runs the image processor itself);
- ``multi_modal_inputs``: per row the image processor's outputs, ``{"pixel_values": [patches, C*T*P*P],
  "image_grid_thw": [images, 3]}`` (None: no images), what the training engine's vision tower takes.

A row's token ids hold each image as its full run of ``<|image_pad|>`` tokens (grid t*h*w / merge_size**2),
as transformers' processor writes them; an engine that expands the placeholder itself (vLLM) is handed one
``<|image_pad|>`` per image (``collapse_image_tokens``) and must give back the same run.
"""

from __future__ import annotations

from typing import Sequence

__all__ = ["MULTI_MODAL_DATA", "MULTI_MODAL_INPUTS", "collapse_image_tokens"]

MULTI_MODAL_DATA = "multi_modal_data"
MULTI_MODAL_INPUTS = "multi_modal_inputs"


def collapse_image_tokens(ids: Sequence[int], image_token_id: int, images: int) -> list[int]:
    """``ids`` with each of its first ``images`` runs of ``image_token_id`` cut to one token (one placeholder per
    image); later ones (sampled by the model in its response) stay."""
    out: list[int] = []
    runs = 0
    for token in ids:
        if token == image_token_id and out and out[-1] == image_token_id and runs <= images:
            continue
        if token == image_token_id and (not out or out[-1] != image_token_id):
            runs += 1
        out.append(token)
    return out
