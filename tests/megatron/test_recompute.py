"""megatron's activation recomputation (engine.recompute_granularity) trades time for memory, never numbers:
full and selective recomputation give the update of keeping every activation (DP2, gloo)."""

import pytest
import torch

from conftest import TESTS, run_torchrun
from tiny_models import make_llama
from workers.megatron.config import EngineConfig


def test_recomputation_gives_the_same_update(tmp_path):
    model = make_llama(tmp_path / "model")
    proc = run_torchrun(TESTS / "megatron" / "recompute_program.py", [str(model), str(tmp_path)], 2, timeout=400)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-5000:]
    result = torch.load(tmp_path / "result.pt", weights_only=False)
    keep = result["none"]
    for name in ("full", "selective"):
        for ours, theirs in zip(result[name]["metrics"], keep["metrics"]):
            for key in ("actor/pg_loss", "actor/grad_norm", "actor/entropy"):
                assert ours[key] == pytest.approx(theirs[key], abs=1e-6), (name, key)
        for weight, tensor in keep["weights"].items():
            torch.testing.assert_close(result[name]["weights"][weight], tensor, atol=1e-6, rtol=0)


def test_an_unknown_recompute_setting_names_the_valid_ones():
    with pytest.raises(ValueError, match=r"recompute_granularity must be one of \('full', 'selective'\) or null, got 'some'"):
        EngineConfig(recompute_granularity="some")
    with pytest.raises(ValueError, match="recompute_num_layers must be a positive integer, got 0"):
        EngineConfig(recompute_num_layers=0)
