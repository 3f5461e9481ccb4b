"""VisionSpec: a vision-language checkpoint's image side (Qwen2.5-VL), read from its ``config.json``.

A Qwen2.5-VL image is cut into ``patch_size`` x ``patch_size`` patches over
``temporal_patch_size`` frames (an image is its own frame twice); a grid of
``(t, h, w)`` patches goes through the vision tower (``depth`` blocks, window
attention but in ``fullatt_block_indexes``) and its merger, which joins each
``spatial_merge_size`` x ``spatial_merge_size`` square into one language-model
token. So an image of grid (t, h, w) stands for ``t * h * w / merge**2``
``<|image_pad|>`` tokens in the prompt, at 3-D (mrope) positions.

Pure data: the sizes the planner counts and the loader checks. The tower
itself is transformers' module (``workers.megatron.vision_tower``).
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["VisionSpec", "VISION_LANGUAGE_ARCHITECTURES", "read_vision"]

# architecture -> its language model's family (the decoder layers are that family's)
VISION_LANGUAGE_ARCHITECTURES = {"Qwen2_5_VLForConditionalGeneration": "qwen2"}


@dataclass(frozen=True)
class VisionSpec:
    depth: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    out_hidden_size: int  # the merger's output: the language model's hidden size
    patch_size: int
    spatial_merge_size: int
    temporal_patch_size: int
    window_size: int
    fullatt_block_indexes: tuple[int, ...]
    in_channels: int
    image_token_id: int
    video_token_id: int
    vision_start_token_id: int
    vision_end_token_id: int
    tokens_per_second: int = 2

    @property
    def patch_features(self) -> int:
        """Values per patch in the processor's ``pixel_values`` rows: channels x frames x patch x patch."""
        return self.in_channels * self.temporal_patch_size * self.patch_size ** 2

    def image_tokens(self, grid_thw: tuple[int, int, int]) -> int:
        """The ``<|image_pad|>`` tokens that stand for an image of patch grid ``grid_thw``."""
        t, h, w = grid_thw
        return t * h * w // self.spatial_merge_size ** 2

    @property
    def parameter_count(self) -> int:
        """The tower's and merger's parameters (what the planner adds to the language model's)."""
        d, f, merged = self.hidden_size, self.intermediate_size, self.hidden_size * self.spatial_merge_size ** 2
        block = 2 * d + (3 * d * d + 3 * d) + (d * d + d) + 2 * (f * d + f) + (d * f + d)  # norms, qkv, proj, MLP
        merger = d + (merged * merged + merged) + (self.out_hidden_size * merged + self.out_hidden_size)
        return self.patch_features * d + self.depth * block + merger


def read_vision(config: dict, source: str) -> VisionSpec:
    """The image side of a vision-language ``config.json``."""
    from hybridengine.model.spec import ModelConfigError

    vision = config.get("vision_config")
    if not isinstance(vision, dict):
        raise ModelConfigError(f"{source}: a vision-language model needs a vision_config mapping")
    if vision.get("hidden_act", "silu") != "silu":
        raise ModelConfigError(f"{source}: vision_config.hidden_act {vision.get('hidden_act')!r} is not supported; "
                               "only 'silu' (Qwen2.5-VL's)")
    try:
        return VisionSpec(
            depth=int(vision["depth"]), hidden_size=int(vision["hidden_size"]),
            intermediate_size=int(vision["intermediate_size"]), num_heads=int(vision["num_heads"]),
            out_hidden_size=int(vision["out_hidden_size"]), patch_size=int(vision.get("patch_size", 14)),
            spatial_merge_size=int(vision.get("spatial_merge_size", 2)),
            temporal_patch_size=int(vision.get("temporal_patch_size", 2)),
            window_size=int(vision.get("window_size", 112)),
            fullatt_block_indexes=tuple(int(i) for i in vision.get("fullatt_block_indexes", ())),
            in_channels=int(vision.get("in_channels", vision.get("in_chans", 3))),
            image_token_id=int(config["image_token_id"]), video_token_id=int(config["video_token_id"]),
            vision_start_token_id=int(config["vision_start_token_id"]),
            vision_end_token_id=int(config["vision_end_token_id"]),
            tokens_per_second=int(vision.get("tokens_per_second", 2)),
        )
    except KeyError as exc:
        raise ModelConfigError(f"{source}: a vision-language config needs {exc.args[0]!r}") from None
