"""LR warmup and decay against the formulas, stepping as the engine does (schedule first)."""

import math

import pytest
import torch

from workers.megatron.config import OptimConfig
from workers.megatron.lr_schedule import build_lr_scheduler


def lrs(optim: OptimConfig, steps: int) -> list[float]:
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=optim.lr)
    scheduler = build_lr_scheduler(optimizer, optim)
    out = []
    for _ in range(steps):
        scheduler.step(increment=1)
        out.append(optimizer.param_groups[0]["lr"])
    return out


def test_warmup_then_cosine_decay():
    got = lrs(OptimConfig(lr=1e-3, min_lr=1e-4, lr_warmup_steps=4, lr_decay_steps=12, lr_decay_style="cosine"), 14)
    for k, lr in enumerate(got, start=1):
        if k <= 4:
            expected = 1e-3 * k / 4
        elif k <= 12:
            expected = 1e-4 + 0.5 * (math.cos(math.pi * (k - 4) / 8) + 1) * (1e-3 - 1e-4)
        else:
            expected = 1e-4
        assert lr == pytest.approx(expected, rel=1e-9), k


def test_linear_decay_and_constant():
    got = lrs(OptimConfig(lr=2e-3, lr_decay_steps=10, lr_decay_style="linear"), 10)
    assert got == pytest.approx([2e-3 * (1 - k / 10) for k in range(1, 11)], rel=1e-9)
    assert lrs(OptimConfig(lr=5e-6), 3) == [5e-6] * 3
