"""Checkpoints: resume reproduces an uninterrupted run, exactly at the same layout, and loads at another TP/PP/DP.

Every case runs once uninterrupted (three PPO updates, a checkpoint after the
first) and is resumed from that checkpoint in fresh processes, at the saved
layout and at another one; the resumed updates are compared with the
uninterrupted ones. Cases: fp32 / bf16 x the plain / the distributed optimizer. Two cases that differ in
precision alone share their launches (each a worker group of its own on the same processes).
"""

from dataclasses import dataclass, fields

import pytest
import torch

from conftest import TESTS, run_torchrun
from tiny_models import all_tensors, make_llama
from workers.megatron.config import EngineConfig

PROGRAM = TESTS / "megatron" / "resume_program.py"
HAS_PRECISION = "precision" in {f.name for f in fields(EngineConfig)}


@dataclass(frozen=True)
class Case:
    precision: str
    dist_opt: bool
    saved_at: tuple[int, int, int]  # tp, pp, processes (DP = processes / (tp x pp))
    other: tuple[int, int, int] | None  # None: not loaded at another layout (test time)
    # With the distributed optimizer the DP size changes, so one mini-batch per epoch (all 8 sequences): then
    # the DP split does not change which sequences share an optimizer step, and the runs stay comparable.
    mini_batch: int

    def args(self, tp: int, pp: int) -> list[str]:
        args = ["--tp", str(tp), "--pp", str(pp), "--mini-batch", str(self.mini_batch)]
        args += ["--dist-opt"] if self.dist_opt else []
        return args + (["--precision", self.precision] if HAS_PRECISION else [])


CASES = {
    "fp32-plain": Case("fp32", False, saved_at=(2, 1, 2), other=(1, 2, 2), mini_batch=4),  # TP2 -> PP2
    "bf16-plain": Case("bf16", False, saved_at=(2, 1, 2), other=None, mini_batch=4),  # resharded as fp32-plain
    "fp32-distopt": Case("fp32", True, saved_at=(1, 1, 2), other=(2, 1, 4), mini_batch=8),  # DP2 -> TP2 x DP2
    "bf16-distopt": Case("bf16", True, saved_at=(1, 1, 2), other=(1, 1, 1), mini_batch=8),  # DP2 -> DP1
}
# Loaded at another layout the later steps agree to the reduction order: fp32 to ~1e-6; bf16 only as far as
# bf16 rounding at another TP / DP split allows: weights within an ulp or two, most of them bit-equal (there the
# re-saved checkpoint is the exact check).
TOLERANCE = {"fp32": dict(loss=1e-6, rel=1e-5, weight=dict(rtol=0, atol=1e-6), equal=0.0),
             "bf16": dict(loss=5e-3, rel=3e-2, weight=dict(rtol=1.6e-2, atol=2e-3), equal=0.9)}
STATISTICS = ("actor/pg_loss", "actor/grad_norm", "actor/lr", "actor/ppo_kl", "actor/pg_clipfrac")


def case_param(name):
    marks = [] if HAS_PRECISION or CASES[name].precision == "fp32" else [
        pytest.mark.skip(reason="EngineConfig has no precision field yet: bf16 cannot be asked for")]
    return pytest.param(name, marks=marks, id=name)


ALL_CASES = [case_param(name) for name in CASES]
RESHARDED_CASES = [case_param(name) for name in CASES if CASES[name].other is not None]


def run(model, root, out, case: Case, layout, phase, also: tuple[Case, object, object] | None = None):
    """One launch of ``case`` at ``layout``; ``also`` (a case, its root, its output dir): a second case at another
    precision in the same processes, after it. Returns the first case's metrics."""
    tp, pp, nproc = layout
    extra = ["--also-precision", also[0].precision, "--also-root", str(also[1]), "--also-out", str(also[2])] if also else []
    proc = run_torchrun(PROGRAM, [str(model), str(root), str(out), *case.args(tp, pp), "--phase", phase, *extra], nproc,
                        timeout=400)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-5000:]
    return torch.load(out / f"metrics_{phase}.pt")


def partner(name: str) -> str | None:
    """The case that differs from ``name`` in precision alone (it runs in the same launch), or None."""
    case = CASES[name]
    return next((other for other, c in CASES.items() if other != name and HAS_PRECISION and
                 (c.dist_opt, c.saved_at, c.mini_batch) == (case.dist_opt, case.saved_at, case.mini_batch)), None)


def checkpoint_tensors(path, tmp_path) -> dict[str, torch.Tensor]:
    """Every tensor of a dist-checkpoint directory, whole (as saved, independent of any layout)."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    target = tmp_path / f"{path.parent.name}_{path.name}.pt"
    dcp_to_torch_save(str(path), str(target))
    return {k: v for k, v in torch.load(target, weights_only=False).items() if isinstance(v, torch.Tensor)}


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return make_llama(tmp_path_factory.mktemp("model"))


@pytest.fixture(scope="module")
def uninterrupted(model, tmp_path_factory):
    """name -> (checkpoint root, output dir, metrics of the three updates); each case runs once, with the case
    that differs from it in precision alone, in one launch."""
    done = {}

    def get(name):
        if name not in done:
            dirs = {n: (tmp_path_factory.mktemp(f"ckpt-{n}"), tmp_path_factory.mktemp(f"full-{n}"))
                    for n in filter(None, (name, partner(name)))}
            other = partner(name)
            root, out = dirs[name]
            run(model, root, out, CASES[name], CASES[name].saved_at, "full",
                also=(CASES[other], *dirs[other]) if other else None)
            for n, (root, out) in dirs.items():
                done[n] = root, out, torch.load(out / "metrics_full.pt")
        return done[name]

    return get


@pytest.fixture(scope="module")
def resumed_at_saved_layout(model, uninterrupted, tmp_path_factory):
    """name -> (output dir, metrics of the two resumed updates): each case resumed from its checkpoint at the
    layout it was saved at, in fresh processes, with its precision partner in the same launch."""
    done = {}

    def get(name):
        if name not in done:
            other = partner(name)
            dirs = {n: tmp_path_factory.mktemp(f"resumed-{n}") for n in filter(None, (name, other))}
            run(model, uninterrupted(name)[0], dirs[name], CASES[name], CASES[name].saved_at, "resume",
                also=(CASES[other], uninterrupted(other)[0], dirs[other]) if other else None)
            for n, out in dirs.items():
                done[n] = out, torch.load(out / "metrics_resume.pt")
        return done[name]

    return get


def assert_same_checkpoint(saved, resaved):
    assert saved.keys() == resaved.keys()
    for key in saved:
        assert saved[key].dtype == resaved[key].dtype and torch.equal(saved[key], resaved[key]), key


@pytest.mark.parametrize("name", ALL_CASES)
def test_resume_at_the_same_layout_is_exact(name, uninterrupted, resumed_at_saved_layout, tmp_path):
    root, out, full = uninterrupted(name)
    assert (root / "latest").read_text() == "step_00000001"
    target, resumed = resumed_at_saved_layout(name)
    assert len(resumed) == 2
    for got, expected in zip(resumed, full[1:]):  # exact: same layout, same RNG, same order
        for key in STATISTICS:
            assert got[key] == expected[key], key
    assert full[1]["actor/lr"] != full[2]["actor/lr"]  # the schedule moved on and was restored
    saved, final = all_tensors(out / "weights_final"), all_tensors(target / "weights_final")
    assert saved.keys() == final.keys()
    for key in saved:
        assert torch.equal(saved[key], final[key]), key
    # What was loaded, written again, is the checkpoint bit for bit: weights, fp32 master weights, moments.
    assert_same_checkpoint(checkpoint_tensors(root / "step_00000001", tmp_path),
                           checkpoint_tensors(target / "resaved" / "step_00000001", tmp_path))


@pytest.mark.parametrize("name", RESHARDED_CASES)
def test_checkpoint_loads_at_another_layout(name, model, uninterrupted, tmp_path):
    case = CASES[name]
    root, out, full = uninterrupted(name)
    resumed = run(model, root, tmp_path, case, case.other, "resume")
    saved, loaded = all_tensors(out / "weights_after_0"), all_tensors(tmp_path / "weights_loaded")
    assert saved.keys() == loaded.keys()
    for key in saved:
        assert torch.equal(saved[key], loaded[key]), key
    # The whole state was resharded losslessly: re-saved at the new layout it is the saved checkpoint.
    assert_same_checkpoint(checkpoint_tensors(root / "step_00000001", tmp_path),
                           checkpoint_tensors(tmp_path / "resaved" / "step_00000001", tmp_path))
    tol = TOLERANCE[case.precision]
    for got, expected in zip(resumed, full[1:]):  # optimizer moments, master weights and schedule came along
        assert got["actor/lr"] == expected["actor/lr"]
        assert got["actor/pg_loss"] == pytest.approx(expected["actor/pg_loss"], abs=tol["loss"])
        assert got["actor/grad_norm"] == pytest.approx(expected["actor/grad_norm"], rel=tol["rel"])
    final, expected = all_tensors(tmp_path / "weights_final"), all_tensors(out / "weights_final")
    assert final.keys() == expected.keys()
    for key in expected:
        torch.testing.assert_close(final[key], expected[key], **tol["weight"], msg=key)
    equal = sum(int((final[k] == expected[k]).sum()) for k in expected) / sum(t.numel() for t in expected.values())
    assert equal >= tol["equal"]


@pytest.mark.parametrize("name", ALL_CASES)
def test_checkpoint_keeps_fp32_optimizer_state(name, uninterrupted, tmp_path):
    """Adam's moments, and every weight's fp32 master copy where the optimizer keeps one, are in the checkpoint."""
    case = CASES[name]
    root, _, _ = uninterrupted(name)
    tensors = checkpoint_tensors(root / "step_00000001", tmp_path)
    weights = [k[len("optimizer.state.exp_avg."):] for k in tensors if k.startswith("optimizer.state.exp_avg.")]
    assert len(weights) == 9  # embedding, output layer, final norm, 6 stacked layer tensors
    dtype = torch.bfloat16 if case.precision == "bf16" else torch.float32
    # The distributed optimizer keeps its own copy in fp32 too; megatron's fp32 optimizer steps the weights.
    master = "param" if case.dist_opt else "fp32_param" if case.precision == "bf16" else None
    if master is None:
        assert not any(k.startswith(("optimizer.state.param.", "optimizer.state.fp32_param.")) for k in tensors)
    finer = 0
    for weight in weights:
        assert tensors[weight].dtype == dtype, weight
        for moment in ("exp_avg", "exp_avg_sq"):
            state = tensors[f"optimizer.state.{moment}.{weight}"]
            assert state.dtype == torch.float32 and state.shape == tensors[weight].shape and state.abs().sum() > 0
        if master is None:
            continue
        main = tensors[f"optimizer.state.{master}.{weight}"]
        assert main.dtype == torch.float32, weight
        assert torch.equal(main.to(dtype), tensors[weight]), weight  # the weights are the masters, rounded
        finer += int((main != tensors[weight].float()).sum())
    if case.precision == "bf16":
        assert finer > 0.5 * sum(tensors[w].numel() for w in weights)  # bits that bf16 weights alone would lose
    else:
        assert finer == 0


def test_a_crash_mid_save_leaves_the_previous_checkpoint(uninterrupted, tmp_path):
    from workers.megatron.checkpoint import CheckpointNotFound, latest_checkpoint

    root, _, _ = uninterrupted("fp32-plain")
    (root / ".step_00000002.tmp").mkdir(exist_ok=True)  # what a save killed halfway leaves behind
    assert latest_checkpoint(root).name == "step_00000001"
    with pytest.raises(CheckpointNotFound, match="no checkpoint in"):
        latest_checkpoint(tmp_path)


def test_an_optimizer_of_another_kind_is_refused_by_name(model, uninterrupted, tmp_path):
    root, _, _ = uninterrupted("fp32-plain")
    args = ["--dist-opt"] + (["--precision", "bf16"] if HAS_PRECISION else [])
    proc = run_torchrun(PROGRAM, [str(model), str(root), str(tmp_path), *args, "--phase", "resume"], 1)
    assert proc.returncode != 0
    assert "was saved with use_distributed_optimizer=False" in proc.stderr
    assert "this job has use_distributed_optimizer=True" in proc.stderr
    if HAS_PRECISION:
        assert "precision='fp32'" in proc.stderr and "precision='bf16'" in proc.stderr
    assert not (tmp_path / "metrics_resume.pt").exists()


def test_moe_resume_is_exact_and_loads_at_another_expert_split(tmp_path_factory, tmp_path):
    """A Qwen3-MoE saved at EP2 (x DP4) resumes exactly at EP2, and loads at EP4 (in the same processes), each
    rank then holding other experts: the weights and the re-saved checkpoint are the saved ones, bit for bit."""
    from tiny_models import make_qwen3_moe

    moe = make_qwen3_moe(tmp_path_factory.mktemp("moe"))
    root, out, same = tmp_path / "root", tmp_path / "full", tmp_path / "same"

    def launch(target, phase, *extra):
        target.mkdir(exist_ok=True)
        proc = run_torchrun(PROGRAM, [str(moe), str(root), str(target), "--mini-batch", "8", "--precision", "fp32",
                                      "--ep", "2", "--phase", phase, *extra], 4, timeout=400)
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-5000:]
        return torch.load(target / f"metrics_{phase}.pt")

    full = launch(out, "full")
    resumed = launch(same, "resume", "--also-ep", "4")
    for got, expected in zip(resumed, full[1:]):
        for key in STATISTICS:
            assert got[key] == expected[key], key
    for a, b in ((out / "weights_final", same / "weights_final"), (out / "weights_after_0", same / "weights_loaded"),
                 (out / "weights_after_0", same / "ep4" / "weights_loaded")):
        saved, got = all_tensors(a), all_tensors(b)
        assert saved.keys() == got.keys() and all(torch.equal(saved[k], got[k]) for k in saved), b
    assert_same_checkpoint(checkpoint_tensors(root / "step_00000001", tmp_path),
                           checkpoint_tensors(same / "ep4" / "resaved" / "step_00000001", tmp_path))
