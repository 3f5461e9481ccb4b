"""LoRA adapters in PEFT's format: a megatron stage's adapters gathered whole under PEFT's names, written as a
PEFT adapter directory (``adapter_config.json``, ``adapter_model.safetensors``) that
``peft.PeftModel.from_pretrained(base, folder)`` loads, and read back into a stage, cut for its TP rank."""

from __future__ import annotations

import torch

from hybridengine.model.catalogue import layer_index
from workers.megatron.lora import LoRAConfig, adapted_linears, cut_adapter, whole_adapters

__all__ = ["full_adapters", "load_peft_adapter", "peft_adapter_problems", "peft_tensors", "save_peft_adapter"]

# PEFT adapter settings that change what the adapter computes, which these adapters do not do: scaling
# alpha / sqrt(r) (rsLoRA), a magnitude vector (DoRA), a rank or alpha of its own per module. Loaded as plain
# LoRA, such an adapter would run at the wrong scale or without its magnitudes, silently: each is refused.
_UNSUPPORTED = {
    "use_rslora": "rsLoRA's scaling alpha / sqrt(r), where these adapters scale by alpha / r",
    "use_dora": "DoRA's magnitude vectors, which these adapters do not hold",
    "alpha_pattern": "a lora_alpha per module, where these adapters have one alpha",
    "rank_pattern": "a rank per module, where these adapters have one rank",
}

_HF_MODULES = {"q": "self_attn.q_proj", "k": "self_attn.k_proj", "v": "self_attn.v_proj", "o": "self_attn.o_proj",
               "gate": "mlp.gate_proj", "up": "mlp.up_proj", "down": "mlp.down_proj"}


def full_adapters(module: torch.nn.Module, spec, tp: int, tp_group, pp_rank: int = 0, pp: int = 1
                  ) -> dict[str, torch.Tensor]:
    """This stage's adapters whole (gathered over TP), on the CPU under PEFT's names
    (``base_model.model.model.layers.{l}.self_attn.q_proj.lora_A.weight``); collective over the TP group."""
    return peft_tensors(whole_adapters(module, spec, tp, tp_group, pp_rank, pp))


def peft_tensors(adapters: dict[tuple[int, str, str], tuple[torch.Tensor, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Whole adapters by (layer, linear, part) as PEFT names them, on the CPU."""
    out = {}
    for (layer, _, part), (a, b) in adapters.items():
        prefix = f"base_model.model.model.layers.{layer}.{_HF_MODULES[part]}"
        out[f"{prefix}.lora_A.weight"], out[f"{prefix}.lora_B.weight"] = a.cpu().clone(), b.cpu().clone()
    return out


def peft_adapter_problems(saved: dict, folder) -> list[str]:
    """What in a PEFT adapter's ``adapter_config.json`` (``saved``) these adapters cannot run as it was trained,
    each naming the field; empty when none."""
    return [f"lora.adapter_path {folder}: {field} is {saved[field]!r} in its adapter_config.json: {why}; "
            f"train it without, or merge it into the model (PEFT's merge_and_unload) and start from that"
            for field, why in _UNSUPPORTED.items() if saved.get(field)]


def load_peft_adapter(module: torch.nn.Module, spec, config: LoRAConfig, tp: int, tp_rank: int, pp_rank: int = 0,
                      pp: int = 1) -> None:
    """Set this stage's adapters from the PEFT adapter directory ``config.adapter_path``, each cut to this TP
    rank's shard; its rank, alpha and targets must be ``config``'s."""
    import json
    from pathlib import Path

    from safetensors.torch import load_file

    folder = Path(config.adapter_path)
    if not (folder / "adapter_config.json").is_file() or not (folder / "adapter_model.safetensors").is_file():
        raise FileNotFoundError(f"lora.adapter_path {folder} is not a PEFT adapter directory (adapter_config.json "
                                f"and adapter_model.safetensors)")
    saved = json.loads((folder / "adapter_config.json").read_text())
    problems = peft_adapter_problems(saved, folder)
    if problems:
        raise ValueError("; ".join(problems))
    whole = load_file(str(folder / "adapter_model.safetensors"))
    # the targets as the tensors name them (a saved target_modules may list full module paths, or a regex)
    targets = sorted({key.split(".lora_A.")[0].rsplit(".", 1)[-1] for key in whole if ".lora_A." in key})
    if (saved.get("r"), float(saved.get("lora_alpha", 0)), targets) != (config.rank, float(config.alpha),
                                                                           sorted(config.targets)):
        raise ValueError(f"lora.adapter_path {folder} holds rank {saved.get('r')}, alpha {saved.get('lora_alpha')}, "
                         f"targets {targets}; this job's lora is rank {config.rank}, alpha {config.alpha}, targets "
                         f"{sorted(config.targets)}: set them to the adapter's")
    layers = spec.layers_of_stage(pp_rank, pp)
    with torch.no_grad():
        for name, _, adapter in adapted_linears(module):
            prefix = f"base_model.model.model.layers.{layers[layer_index(name)]}"
            for part in adapter.lora_A:
                for which, params in (("lora_A", adapter.lora_A), ("lora_B", adapter.lora_B)):
                    key = f"{prefix}.{_HF_MODULES[part]}.{which}.weight"
                    if key not in whole:
                        raise KeyError(f"lora.adapter_path {folder} has no {key}")
                    a_or_b = cut_adapter(adapter.row_parallel, whole[key], whole[key], tp, tp_rank)
                    params[part].copy_(a_or_b[0 if which == "lora_A" else 1].to(params[part].dtype))


def save_peft_adapter(adapters: dict[str, torch.Tensor], config: LoRAConfig, out_dir, base_model: str | None = None,
                      value_head: torch.Tensor | None = None) -> None:
    """A PEFT adapter directory (``adapter_config.json``, ``adapter_model.safetensors``) that
    ``peft.PeftModel.from_pretrained(base, out_dir)`` loads. ``value_head``: a value model's trained head,
    saved as PEFT saves a sequence classifier's ``score`` (``modules_to_save``)."""
    from pathlib import Path

    from peft import LoraConfig
    from safetensors.torch import save_file

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    head = {} if value_head is None else {"base_model.model.score.weight": value_head.detach().cpu().clone()}
    LoraConfig(r=config.rank, lora_alpha=config.alpha, lora_dropout=config.dropout, target_modules=list(config.targets),
               task_type="CAUSAL_LM" if value_head is None else "SEQ_CLS",
               modules_to_save=None if value_head is None else ["score"],
               base_model_name_or_path=base_model).save_pretrained(str(out))
    save_file({k: v.contiguous() for k, v in {**adapters, **head}.items()}, str(out / "adapter_model.safetensors"))
