"""Images of vision-language prompts: read from a row, checked, sized and turned into the model's inputs.

A row's images column (``data.image_key``, default ``images``) holds a list of images as ``datasets``
writes its Image feature (``{"bytes": ...}`` or ``{"path": ...}``), PIL images, or paths. A prompt names
where each goes with an ``<image>`` placeholder, as verl's rows do; the placeholder becomes Qwen's
``<|vision_start|><|image_pad|><|vision_end|>`` and, once tokenized, the image pad becomes the image's
full run of tokens: ``t * h * w / merge_size**2`` for its patch grid, which the checkpoint's image
processor (``preprocessor_config.json``) decides by resizing within its pixel bounds. transformers' PIL
image processor does the processing: no torchvision.

Every image is opened and sized when the data is loaded, so an unreadable one, a missing path, or a
shape the processor cannot take is refused with its row before any process starts.
"""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any, Sequence

from hybridengine.model.vision import VisionSpec

__all__ = ["IMAGE_PLACEHOLDER", "VISION_PLACEHOLDER", "ImageProcessing", "load_image", "row_images"]

IMAGE_PLACEHOLDER = "<image>"  # verl's placeholder in a prompt's text
VIDEO_PLACEHOLDER = "<video>"
VISION_PLACEHOLDER = "<|vision_start|><|image_pad|><|vision_end|>"  # what Qwen's chat template writes for an image


def load_image(item: Any, where: str):
    """One image of a row as an RGB PIL image, decoded (a truncated file fails here, not in a worker)."""
    from PIL import Image, UnidentifiedImageError

    try:
        if isinstance(item, Image.Image):
            image = item
        elif isinstance(item, (str, Path)):
            image = Image.open(Path(item))
        elif isinstance(item, dict) and item.get("bytes") is not None:
            image = Image.open(io.BytesIO(item["bytes"]))
        elif isinstance(item, dict) and item.get("path"):
            image = Image.open(Path(item["path"]))
        else:
            raise ValueError(f"{where}: an image must be a datasets Image ({{'bytes': ...}} or {{'path': ...}}), "
                             f"a PIL image or a path; got {type(item).__name__} {str(item)[:80]!r}")
        image.load()
    except FileNotFoundError as exc:
        raise ValueError(f"{where}: image file {exc.filename} does not exist") from None
    except (UnidentifiedImageError, OSError, SyntaxError) as exc:
        raise ValueError(f"{where}: the image cannot be read ({type(exc).__name__}: {exc})") from None
    return image.convert("RGB") if image.mode != "RGB" else image


def row_images(row: dict[str, Any], key: str, where: str) -> tuple | None:
    """The row's images (decoded), None when it has no images column; videos are refused."""
    if row.get("videos") or row.get("video"):
        raise ValueError(f"{where}: videos are not supported (images only); drop the row's videos column")
    if key not in row or row[key] is None:
        return None
    items = row[key]
    if not isinstance(items, (list, tuple)):
        items = [items]
    return tuple(load_image(item, f"{where} image {i}") for i, item in enumerate(items))


class ImageProcessing:
    """A vision-language checkpoint's image processor (transformers' PIL one, from its
    ``preprocessor_config.json``) and image tokens."""

    def __init__(self, model_path: str | Path, vision: VisionSpec) -> None:
        from transformers import Qwen2VLImageProcessorPil

        self.vision = vision
        self.processor = Qwen2VLImageProcessorPil.from_pretrained(str(model_path))
        size = self.processor.size
        self.min_pixels, self.max_pixels = int(size["shortest_edge"]), int(size["longest_edge"])
        self.patch = int(self.processor.patch_size)
        self.merge = int(self.processor.merge_size)
        if (self.patch, self.merge) != (vision.patch_size, vision.spatial_merge_size):
            raise ValueError(f"{model_path}: preprocessor_config.json cuts {self.patch}-pixel patches merged "
                             f"{self.merge} x {self.merge}, the vision tower takes {vision.patch_size} and "
                             f"{vision.spatial_merge_size}")

    @classmethod
    def for_model(cls, model_path: str | Path) -> "ImageProcessing | None":
        """The checkpoint's image processing, or None for a text model."""
        from hybridengine.model.spec import ModelSpec

        spec = ModelSpec.from_pretrained(model_path)
        return None if spec.vision is None else cls(model_path, spec.vision)

    def grid(self, image, where: str = "image") -> tuple[int, int, int]:
        """The patch grid (t, h, w) the processor makes of ``image``: resized within its pixel bounds."""
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize

        width, height = image.size
        try:
            h, w = smart_resize(height, width, self.patch * self.merge, self.min_pixels, self.max_pixels)
        except ValueError as exc:
            raise ValueError(f"{where}: {width} x {height} pixels is past the image processor's bounds ({exc})") from None
        return 1, h // self.patch, w // self.patch

    def tokens(self, image, where: str = "image") -> int:
        """The image tokens that stand for ``image`` in a prompt."""
        return self.vision.image_tokens(self.grid(image, where))

    def inputs(self, images: Sequence) -> dict[str, Any]:
        """The vision tower's inputs for one row's images: ``pixel_values`` and ``image_grid_thw``."""
        out = self.processor(images=list(images), return_tensors="pt")
        return {"pixel_values": out["pixel_values"], "image_grid_thw": out["image_grid_thw"]}

    def placeholders(self, text: str, count: int, where: str) -> str:
        """``text`` with its ``<image>`` placeholders as the vision tokens; their number must be ``count``."""
        if VIDEO_PLACEHOLDER in text:
            raise ValueError(f"{where}: videos are not supported (images only); the prompt holds {VIDEO_PLACEHOLDER}")
        found = text.count(IMAGE_PLACEHOLDER)
        if found != count:
            raise ValueError(f"{where}: the prompt holds {found} {IMAGE_PLACEHOLDER} placeholder(s) for its {count} "
                             "image(s); put one where each image goes")
        return text.replace(IMAGE_PLACEHOLDER, VISION_PLACEHOLDER)

    def expand(self, ids: Sequence[int], images: Sequence, where: str) -> list[int]:
        """``ids`` with each image's single ``<|image_pad|>`` as its full run of image tokens."""
        pad = self.vision.image_token_id
        at = [i for i, token in enumerate(ids) if token == pad]
        if len(at) != len(images):
            raise ValueError(f"{where}: the rendered prompt holds {len(at)} image tokens for {len(images)} image(s)")
        out: list[int] = []
        last = 0
        for position, image in zip(at, images):
            out += list(ids[last:position]) + [pad] * self.tokens(image, where)
            last = position + 1
        return out + list(ids[last:])
