"""Tiny Llama-family checkpoints made on the spot, their tensors read back, and RL batches for them."""

import json
from pathlib import Path

import torch


def make_llama(path: Path, tie: bool = False, qkv_bias: bool = False, layers: int = 4, seed: int = 0,
               classification: bool = False, heads: int = 4, kv_heads: int = 2, head_dim: int = 32) -> Path:
    """A random Llama (or Qwen2 when ``qkv_bias``) checkpoint in HF format, saved as safetensors."""
    from transformers import LlamaConfig, LlamaForCausalLM, LlamaForSequenceClassification, Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    common = dict(
        vocab_size=256, hidden_size=head_dim * heads, intermediate_size=256, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=128, rms_norm_eps=1e-6,
        rope_theta=10000.0, tie_word_embeddings=tie, initializer_range=0.05,
    )
    if qkv_bias:
        model = Qwen2ForCausalLM(Qwen2Config(**common))
    elif classification:
        model = LlamaForSequenceClassification(LlamaConfig(num_labels=1, pad_token_id=0, **common))
    else:
        model = LlamaForCausalLM(LlamaConfig(**common))
    return _perturb_norms_and_save(model, path)


def all_tensors(path: Path) -> dict[str, torch.Tensor]:
    """Every tensor of an HF checkpoint directory (one safetensors file or an index of several)."""
    from safetensors.torch import load_file

    index = path / "model.safetensors.index.json"
    files = sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.exists() else ["model.safetensors"]
    return {name: t for f in files for name, t in load_file(str(path / f)).items()}


def make_rl_batch(batch_size: int = 8, prompt_length: int = 6, response_length: int = 5, seed: int = 0):
    """Left-padded prompts, right-padded responses, as rollout hands them over."""
    from workers import DataProto

    g = torch.Generator().manual_seed(seed)
    prompts = torch.randint(1, 256, (batch_size, prompt_length), generator=g)
    responses = torch.randint(1, 256, (batch_size, response_length), generator=g)
    prompt_mask = torch.ones(batch_size, prompt_length, dtype=torch.long)
    response_mask = torch.ones(batch_size, response_length, dtype=torch.long)
    for i in range(batch_size):
        prompt_mask[i, : i % 3] = 0  # 0-2 pads on the left
        cut = response_length - (i % 4)  # 0-3 pads on the right
        response_mask[i, cut:] = 0
    prompts = prompts * prompt_mask
    responses = responses * response_mask
    attention_mask = torch.cat([prompt_mask, response_mask], dim=1)
    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    return DataProto({
        "input_ids": torch.cat([prompts, responses], dim=1),
        "attention_mask": attention_mask,
        "position_ids": position_ids,
        "responses": responses,
        "response_mask": response_mask,
    })


def make_vl_rl_batch(model_dir: Path, response_length: int = 5, seed: int = 0):
    """A vision-language rollout batch of 8 rows for ``make_qwen2_5_vl``'s model: left-padded prompts holding
    an image (two sizes: 4 and 12 image tokens; two rows text only), right-padded responses, and each row's
    processor outputs (``multi_modal_inputs``) from transformers' PIL image processor."""
    import numpy as np
    from PIL import Image
    from transformers import Qwen2VLImageProcessorPil

    from workers import DataProto

    processor = Qwen2VLImageProcessorPil.from_pretrained(model_dir)
    config = json.loads((Path(model_dir) / "config.json").read_text())
    start, end, pad = config["vision_start_token_id"], config["vision_end_token_id"], config["image_token_id"]
    rng = np.random.RandomState(seed)
    g = torch.Generator().manual_seed(seed)
    sizes = [(56, 56), (84, 112), None, (112, 84)] * 2
    prompts, inputs = [], []
    for size in sizes:
        text = torch.randint(3, 256, (3,), generator=g).tolist()
        if size is None:
            prompts.append(text + torch.randint(3, 256, (2,), generator=g).tolist())
            inputs.append(None)
            continue
        image = Image.fromarray((rng.rand(size[1], size[0], 3) * 255).astype("uint8"))
        out = processor(images=[image], return_tensors="pt")
        count = int(out["image_grid_thw"].prod()) // 4
        prompts.append(text[:2] + [start] + [pad] * count + [end] + text[2:])
        inputs.append({"pixel_values": out["pixel_values"], "image_grid_thw": out["image_grid_thw"]})
    width = max(map(len, prompts))
    rows = len(prompts)
    prompt_ids = torch.zeros(rows, width, dtype=torch.long)
    prompt_mask = torch.zeros(rows, width, dtype=torch.long)
    for i, p in enumerate(prompts):
        prompt_ids[i, width - len(p):] = torch.tensor(p)
        prompt_mask[i, width - len(p):] = 1
    responses = torch.randint(3, 256, (rows, response_length), generator=g)
    response_mask = torch.ones(rows, response_length, dtype=torch.long)
    for i in range(rows):
        response_mask[i, response_length - (i % 3):] = 0
    responses = responses * response_mask
    attention_mask = torch.cat([prompt_mask, response_mask], dim=1)
    return DataProto.from_dict({
        "input_ids": torch.cat([prompt_ids, responses], dim=1),
        "attention_mask": attention_mask,
        "position_ids": (attention_mask.cumsum(-1) - 1).clamp(min=0),
        "responses": responses,
        "response_mask": response_mask,
    }, non_tensors={"multi_modal_inputs": inputs})


def _perturb_norms_and_save(model, path: Path) -> Path:
    with torch.no_grad():  # norms away from 1 and non-zero biases, so a mapping slip shows
        for name, p in model.named_parameters():
            if "norm" in name or "bias" in name:
                p.add_(0.1 * torch.randn_like(p))
    model.save_pretrained(path, safe_serialization=True)
    return path


def make_qwen3(path: Path, layers: int = 2, vocab: int = 256, head_dim: int = 64, heads: int = 4, kv_heads: int = 2,
               hidden: int = 128, tie: bool = False, seed: int = 0) -> Path:
    """A random Qwen3 checkpoint: q/k norm, and a head_dim other than hidden / heads (64 x 4 heads vs hidden 128)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(seed)
    config = Qwen3Config(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=256, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim, max_position_embeddings=128,
        rms_norm_eps=1e-6, rope_theta=1000000.0, tie_word_embeddings=tie, initializer_range=0.05,
        attention_bias=False, bos_token_id=1, eos_token_id=2, pad_token_id=0,
    )
    return _perturb_norms_and_save(Qwen3ForCausalLM(config), path)


def make_llama3(path: Path, layers: int = 2, vocab: int = 256, head_dim: int = 32, heads: int = 4, kv_heads: int = 2,
                factor: float = 8.0, low_freq_factor: float = 2.0, high_freq_factor: float = 8.0,
                original_max_position_embeddings: int = 64, tie: bool = False, seed: int = 0) -> Path:
    """A random Llama 3.x checkpoint with ``rope_type: llama3`` scaling.

    The defaults put the frequency bounds where a tiny model's wavelengths
    fall in all three bands (kept, ramped, divided), and away from megatron's
    hard-coded 1 / 4 / 8192.
    """
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=vocab, hidden_size=head_dim * heads, intermediate_size=256, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=256, rms_norm_eps=1e-5,
        tie_word_embeddings=tie, initializer_range=0.05, bos_token_id=1, eos_token_id=2,
        rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": factor,
                         "low_freq_factor": low_freq_factor, "high_freq_factor": high_freq_factor,
                         "original_max_position_embeddings": original_max_position_embeddings},
    )
    return _perturb_norms_and_save(LlamaForCausalLM(config), path)


def make_qwen3_moe(path: Path, layers: int = 2, experts: int = 8, topk: int = 2, vocab: int = 256, hidden: int = 64,
                   expert_ffn: int = 32, heads: int = 4, kv_heads: int = 2, head_dim: int = 16,
                   norm_topk_prob: bool = True, seed: int = 0, max_positions: int = 128) -> Path:
    """A random Qwen3-MoE checkpoint (q/k norm, ``experts`` routed experts, top-``topk`` renormalized).

    The router is scaled up so that routing is decisive: near-ties between the k-th and (k+1)-th expert
    would let rounding noise choose differently in HF and megatron.
    """
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(seed)
    config = Qwen3MoeConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=4 * hidden, moe_intermediate_size=expert_ffn,
        num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim,
        num_experts=experts, num_experts_per_tok=topk, norm_topk_prob=norm_topk_prob,
        max_position_embeddings=max_positions,
        rms_norm_eps=1e-6, rope_theta=1000000.0, initializer_range=0.05, router_aux_loss_coef=0.0,
        bos_token_id=1, eos_token_id=2, pad_token_id=0,
    )
    return _perturb_norms_and_save(_decisive_router(Qwen3MoeForCausalLM(config)), path)


def make_qwen2_moe(path: Path, layers: int = 2, experts: int = 4, topk: int = 2, vocab: int = 256, hidden: int = 64,
                   expert_ffn: int = 32, shared_ffn: int = 48, heads: int = 4, kv_heads: int = 2, seed: int = 0) -> Path:
    """A random Qwen2-MoE checkpoint: QKV bias, routed experts without renormalization, and a shared expert
    behind a sigmoid gate."""
    from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM

    torch.manual_seed(seed)
    config = Qwen2MoeConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=4 * hidden, moe_intermediate_size=expert_ffn,
        shared_expert_intermediate_size=shared_ffn, num_hidden_layers=layers, num_attention_heads=heads,
        num_key_value_heads=kv_heads, num_experts=experts, num_experts_per_tok=topk, norm_topk_prob=False,
        max_position_embeddings=128, rms_norm_eps=1e-6, rope_theta=10000.0, initializer_range=0.05,
        router_aux_loss_coef=0.0, bos_token_id=1, eos_token_id=2, pad_token_id=0,
    )
    return _perturb_norms_and_save(_decisive_router(Qwen2MoeForCausalLM(config)), path)


def _decisive_router(model):
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("mlp.gate.weight"):
                p.mul_(20)
    return model


def projection_shapes(spec) -> dict[str, tuple[int, int]]:
    """(in, out) features of each of a dense layer's linear projections, unsharded, by part (q, k, v, o, gate, up,
    down), from the model's dimensions: the formula the catalogue's ``projections`` is checked against."""
    h, d, f = spec.hidden_size, spec.head_dim, spec.ffn_hidden_size
    q, kv = spec.num_attention_heads * d, spec.num_query_groups * d
    return {"q": (h, q), "k": (h, kv), "v": (h, kv), "o": (q, h), "gate": (h, f), "up": (h, f), "down": (f, h)}


VISION_TOKENS = ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")


def make_qwen2_5_vl(path: Path, layers: int = 2, seed: int = 0) -> Path:
    """A tiny random Qwen2.5-VL as a hub repository holds one: weights, the character tokenizer with Qwen's
    vision tokens, and the image processor's ``preprocessor_config.json`` (written by transformers' PIL image
    processor; no processor object, which needs torchvision). Text head_dim 32 (vLLM's CPU attention), mrope
    sections 4 + 6 + 6; a two-block vision tower (head_dim 32) merging 2 x 2 patches of 14 pixels."""
    from transformers import (AutoTokenizer, Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration,
                              Qwen2VLImageProcessorPil)

    from controller.models.char_tokenizer import save_char_tokenizer

    path = Path(path)
    save_char_tokenizer(path, 256)
    tokenizer = AutoTokenizer.from_pretrained(path)
    tokenizer.add_special_tokens({"additional_special_tokens": list(VISION_TOKENS)})
    tokenizer.save_pretrained(path)
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in VISION_TOKENS}
    specials = dict(bos_token_id=1, eos_token_id=2, pad_token_id=0)
    config = Qwen2_5_VLConfig(
        text_config=dict(vocab_size=320, hidden_size=128, intermediate_size=256, num_hidden_layers=layers,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                         rope_scaling={"type": "mrope", "mrope_section": [4, 6, 6]}, tie_word_embeddings=False,
                         **specials),
        vision_config=dict(depth=2, hidden_size=64, intermediate_size=128, num_heads=2, out_hidden_size=128,
                           patch_size=14, spatial_merge_size=2, temporal_patch_size=2, window_size=56,
                           fullatt_block_indexes=[1]),
        image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"], vocab_size=320,
        tie_word_embeddings=False, **specials)
    torch.manual_seed(seed)
    _perturb_norms_and_save(Qwen2_5_VLForConditionalGeneration(config), path)
    Qwen2VLImageProcessorPil(min_pixels=56 * 56, max_pixels=112 * 112, patch_size=14, merge_size=2,
                             temporal_patch_size=2).save_pretrained(path)
    return path
