"""The engine steps torch's Adam over CPU parameters with the fused kernel (no process group).

megatron's optimizer wrappers hold torch's Adam as ``.optimizer`` (and a ChainedOptimizer holds them as
``.chained_optimizers``); ``fuse_cpu_adam`` flips those param groups to the fused kernel, which must step
the parameters as the default per-tensor loop does, to float rounding.
"""

from types import SimpleNamespace

import torch

from workers.megatron.megatron_compat import fuse_cpu_adam


def _params(seed: int):
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(shape, generator=g)) for shape in ((64, 32), (32,), (7, 5, 3))]


def _run(fused: bool, steps: int = 5):
    params = _params(0)
    adam = torch.optim.Adam(params, lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    wrapper = SimpleNamespace(optimizer=adam)
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        for p in params:
            p.grad = torch.randn(p.shape, generator=g)
        if fused:
            fuse_cpu_adam(SimpleNamespace(chained_optimizers=[wrapper]))
        adam.step()
    return adam, params


def test_fused_cpu_adam_steps_as_the_default_loop():
    looped, expected = _run(fused=False)
    fused, got = _run(fused=True)
    assert looped.param_groups[0]["fused"] is None
    assert fused.param_groups[0]["fused"] is True and fused.param_groups[0]["foreach"] is False
    for a, b, start in zip(got, expected, _params(0)):
        assert (a - start).abs().max() > 1e-2  # five steps moved every parameter
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
        for key in ("exp_avg", "exp_avg_sq"):  # and the Adam state matches
            torch.testing.assert_close(fused.state[a][key], looped.state[b][key], rtol=1e-6, atol=1e-9)


def test_non_adam_and_empty_groups_are_left_alone():
    sgd = torch.optim.SGD(_params(0), lr=0.1)
    adam = torch.optim.AdamW(_params(0), lr=0.1)
    adam.add_param_group({"params": []})
    fuse_cpu_adam(SimpleNamespace(chained_optimizers=[SimpleNamespace(optimizer=sgd), SimpleNamespace(optimizer=adam)]))
    assert sgd.param_groups[0].get("fused") is None
    assert adam.param_groups[0]["fused"] is True and adam.param_groups[1]["fused"] is None
