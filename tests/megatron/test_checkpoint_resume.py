"""Checkpoints: resume reproduces an uninterrupted run exactly, and loads at another TP/PP."""

import pytest
import torch

from conftest import TESTS, run_torchrun
from test_hf_roundtrip import all_tensors
from tiny_models import make_llama

PROGRAM = TESTS / "megatron" / "resume_program.py"


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """Three updates at TP2, with a checkpoint after the first."""
    model = make_llama(tmp_path_factory.mktemp("model"))
    root, out = tmp_path_factory.mktemp("ckpt"), tmp_path_factory.mktemp("full")
    proc = run_torchrun(PROGRAM, [str(model), str(root), str(out), "--tp", "2", "--phase", "full"], 2, timeout=400)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-5000:]
    return model, root, out, torch.load(out / "metrics_full.pt")


def resume(uninterrupted, tmp_path, tp, pp, nproc):
    model, root, _, _ = uninterrupted
    proc = run_torchrun(PROGRAM, [str(model), str(root), str(tmp_path), "--tp", str(tp), "--pp", str(pp),
                                  "--phase", "resume"], nproc, timeout=400)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-5000:]
    return torch.load(tmp_path / "metrics_resume.pt")


def test_resume_at_the_same_layout_reproduces_losses_exactly(uninterrupted, tmp_path):
    _, root, out, full = uninterrupted
    assert (root / "latest").read_text() == "step_00000001"
    resumed = resume(uninterrupted, tmp_path, 2, 1, 2)
    for key in ("actor/pg_loss", "actor/grad_norm", "actor/lr", "actor/ppo_kl", "actor/pg_clipfrac"):
        assert resumed[0][key] == full[1][key], key  # exact: same layout, same RNG, same order
        assert resumed[1][key] == full[2][key], key
    assert full[1]["actor/lr"] != full[2]["actor/lr"]  # the schedule moved on and was restored


def test_checkpoint_loads_at_another_layout(uninterrupted, tmp_path):
    _, _, out, full = uninterrupted
    resumed = resume(uninterrupted, tmp_path, 1, 2, 2)  # saved at TP2, loaded at PP2
    saved, loaded = all_tensors(out / "weights_after_0"), all_tensors(tmp_path / "weights_loaded")
    assert saved.keys() == loaded.keys()
    for name in saved:
        assert torch.equal(saved[name], loaded[name]), name
    for got, expected in zip(resumed, full[1:]):  # optimizer moments and schedule came along too
        assert got["actor/lr"] == expected["actor/lr"]
        for key in ("actor/pg_loss", "actor/grad_norm"):
            assert got[key] == pytest.approx(expected[key], abs=1e-5), key


def test_a_crash_mid_save_leaves_the_previous_checkpoint(uninterrupted, tmp_path):
    from workers.megatron.checkpoint import CheckpointNotFound, latest_checkpoint

    _, root, _, _ = uninterrupted
    (root / ".step_00000002.tmp").mkdir(exist_ok=True)  # what a save killed halfway leaves behind
    assert latest_checkpoint(root).name == "step_00000001"
    with pytest.raises(CheckpointNotFound, match="no checkpoint in"):
        latest_checkpoint(tmp_path)


def test_distributed_optimizer_checkpoint_is_refused_clearly(tmp_path):
    model = make_llama(tmp_path / "model")
    proc = run_torchrun(PROGRAM, [str(model), str(tmp_path / "ckpt"), str(tmp_path), "--phase", "full", "--dist-opt"], 2)
    assert proc.returncode != 0
    assert "checkpoints of the distributed optimizer are not supported yet" in proc.stderr
    assert not (tmp_path / "ckpt" / "latest").exists()
