"""A visual task and a tiny vision-language model made on the spot, with transformers, tokenizers and datasets
alone (no hybridflow import, no download, no processor object: torchvision is not needed).

Each image shows a coloured square beside a circle of another colour; the prompt asks which colour the square
is. The rows follow verl's schema: a chat ``prompt`` with an ``<image>`` placeholder, the ``images`` column as
datasets' Image feature, ``reward_model.ground_truth`` the colour's name. ``response`` is the pair a supervised warm
start learns from: the colour of either shape at random, so that it learns the answer's form (a colour of the
picture) and leaves which shape is asked about to RL.

    python examples/vision/colour_task.py --out DIR [--train 256] [--val 32] [--seed 0]

writes DIR/model (a random Qwen2.5-VL: two decoder layers, a two-block vision tower), DIR/train.parquet and
DIR/val.parquet. Score with ``examples/vision/colour_reward.py:square_colour``.
"""

from __future__ import annotations

import argparse
import random
from pathlib import Path

COLOURS = {"red": (220, 30, 30), "green": (30, 180, 60), "blue": (40, 70, 220), "yellow": (235, 210, 40)}
QUESTION = "<image>What colour is the square?"
SIZE = (112, 56)  # width x height: 8 x 4 patches of 14 pixels, 4 x 2 = 8 image tokens after the 2 x 2 merge
VISION_TOKENS = ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>", "<|im_start|>", "<|im_end|>")
CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def draw(square: str, circle: str, square_left: bool):
    """One image: the square on one half, the circle on the other, on a grey ground."""
    from PIL import Image, ImageDraw

    image = Image.new("RGB", SIZE, (128, 128, 128))
    pen = ImageDraw.Draw(image)
    half = SIZE[0] // 2
    left, right = (0, half) if square_left else (half, 0)
    pen.rectangle([left + 8, 8, left + half - 8, SIZE[1] - 8], fill=COLOURS[square])
    pen.ellipse([right + 8, 8, right + half - 8, SIZE[1] - 8], fill=COLOURS[circle])
    return image


def rows(count: int, seed: int, split: str) -> list[dict]:
    import io

    rng = random.Random(seed)
    out = []
    for index in range(count):
        square, circle = rng.sample(sorted(COLOURS), 2)
        buffer = io.BytesIO()
        draw(square, circle, rng.random() < 0.5).save(buffer, format="PNG")
        either = rng.choice((square, circle))
        out.append({"prompt": [{"role": "user", "content": QUESTION}], "images": [{"bytes": buffer.getvalue(),
                                                                                  "path": None}],
                    "response": either,  # SFT's pair: a colour of the picture, either shape's; RL's truth: the square's
                    "data_source": "colour_square", "reward_model": {"style": "rule", "ground_truth": square},
                    "extra_info": {"split": split, "index": index, "circle": circle}})
    return out


def write_parquet(path: Path, data: list[dict]) -> None:
    from datasets import Dataset, Features, Image, Sequence, Value

    features = Features({
        "prompt": [{"role": Value("string"), "content": Value("string")}],
        "images": Sequence(Image()),
        "response": Value("string"),
        "data_source": Value("string"),
        "reward_model": {"style": Value("string"), "ground_truth": Value("string")},
        "extra_info": {"split": Value("string"), "index": Value("int64"), "circle": Value("string")},
    })
    Dataset.from_list(data, features=features).to_parquet(str(path))


def character_tokenizer(path: Path):
    """Printable ASCII one id each, then Qwen's chat and vision tokens (a tokenizer with a chat template)."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2}
    for code in range(32, 127):
        vocab[chr(code)] = len(vocab)
    vocab["\n"] = len(vocab)
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tokenizer.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, pad_token="<pad>", bos_token="<s>", eos_token="<|im_end|>",
                                   unk_token="<pad>", additional_special_tokens=list(VISION_TOKENS))
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(str(path))
    return fast


def tiny_model(path: Path, seed: int) -> None:
    import torch
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration, Qwen2VLImageProcessorPil

    tokenizer = character_tokenizer(path)
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in VISION_TOKENS}
    specials = dict(bos_token_id=1, eos_token_id=ids["<|im_end|>"], pad_token_id=0)
    config = Qwen2_5_VLConfig(
        text_config=dict(vocab_size=128, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                         rope_scaling={"type": "mrope", "mrope_section": [4, 6, 6]}, tie_word_embeddings=False,
                         **specials),
        vision_config=dict(depth=2, hidden_size=64, intermediate_size=128, num_heads=2, out_hidden_size=128,
                           patch_size=14, spatial_merge_size=2, temporal_patch_size=2, window_size=56,
                           fullatt_block_indexes=[1]),
        image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"], vocab_size=128,
        tie_word_embeddings=False, **specials)
    torch.manual_seed(seed)
    Qwen2_5_VLForConditionalGeneration(config).save_pretrained(str(path))
    Qwen2VLImageProcessorPil(min_pixels=56 * 56, max_pixels=112 * 112, patch_size=14, merge_size=2,
                             temporal_patch_size=2).save_pretrained(str(path))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--train", type=int, default=256)
    parser.add_argument("--val", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-model", action="store_true", help="the data only")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    if not args.no_model:
        tiny_model(args.out / "model", args.seed)
    write_parquet(args.out / "train.parquet", rows(args.train, args.seed, "train"))
    write_parquet(args.out / "val.parquet", rows(args.val, args.seed + 1, "val"))
    print(f"wrote {args.out / 'model'}, {args.train} training and {args.val} validation rows")


if __name__ == "__main__":
    main()
