"""PEFT as the LoRA tests' reference: adapters on every linear whose B is random (PEFT starts B at zero, which
would leave the output unchanged and A without a gradient)."""

import torch


def peft_with_random_b(model, rank: int, alpha: float, task_type: str | None = None, seed: int = 3):
    """``model`` (an HF model) under PEFT's LoRA on every linear, B drawn from N(0, 0.1^2) with ``seed``."""
    from peft import LoraConfig, get_peft_model

    peft = get_peft_model(model, LoraConfig(r=rank, lora_alpha=alpha, lora_dropout=0.0, target_modules="all-linear",
                                            task_type=task_type))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in peft.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    return peft
