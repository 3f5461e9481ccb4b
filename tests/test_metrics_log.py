"""MetricsLogger backends, read_metrics, format_step_line, resume truncation and the PNG plots."""

from __future__ import annotations

import json
import math
import subprocess
import sys
import types
from pathlib import Path

import pytest

from controller.metrics.log import MetricsLogger, format_step_line, read_metrics, validation_summary
from controller.metrics.plots import plot_run

ROOT = Path(__file__).resolve().parent.parent
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def step_metrics(step: int, offset: float = 0.0) -> dict:
    return {
        "actor/pg_loss": -0.02 * step + offset,
        "actor/ppo_kl": 0.001 * step + offset,
        "critic/vf_loss": 0.5 - 0.05 * step + offset,
        "critic/score/mean": 0.1 * step + offset,
        "response_length/mean": 10.0 + step,
        "timing_s/gen": 1.0 + step,
        "timing_s/step": 2.0 + step,
    }


def tensorboard_scalars(run_dir: Path, tag: str) -> list[tuple[int, float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    accumulator = EventAccumulator(str(run_dir / "tensorboard"))
    accumulator.Reload()
    return [(event.step, event.value) for event in accumulator.Scalars(tag)]


def test_log_jsonl_tensorboard_console(tmp_path, capsys):
    with MetricsLogger(tmp_path, backends=("console", "jsonl", "tensorboard"), total_steps=5) as logger:
        for step in range(5):
            logger.log(step, step_metrics(step))
    records = read_metrics(tmp_path)
    assert records == [{"step": step, **step_metrics(step)} for step in range(5)]
    for tag in step_metrics(0):
        scalars = tensorboard_scalars(tmp_path, tag)
        assert [s for s, _ in scalars] == list(range(5))
        assert [v for _, v in scalars] == pytest.approx([step_metrics(s)[tag] for s in range(5)], rel=1e-6, abs=1e-7)
    err = capsys.readouterr().err
    assert "step 4/5 | reward 0.4 | kl 0.004" in err


def test_read_metrics_skips_partial_last_line_only(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 0, "a": 1}\n{"step": 1, "a": 2}\n{"step": 2, "a"')
    assert read_metrics(tmp_path) == [{"step": 0, "a": 1}, {"step": 1, "a": 2}]
    path.write_text('{"step": 0, "a": 1}\n{"step": 1, "a\n{"step": 2, "a": 3}\n')
    with pytest.raises(ValueError, match="line 2"):
        read_metrics(tmp_path)
    with pytest.raises(FileNotFoundError, match="metrics.jsonl"):
        read_metrics(tmp_path / "missing")


def test_resume_truncates_and_rewrites(tmp_path):
    with MetricsLogger(tmp_path, backends=("jsonl", "tensorboard")) as logger:
        for step in range(5):
            logger.log(step, step_metrics(step))
    with MetricsLogger(tmp_path, backends=("jsonl", "tensorboard"), resume=True) as logger:
        assert logger.truncate_after(3) == 3
        assert [r["step"] for r in read_metrics(tmp_path)] == [0, 1, 2]
        for step in (3, 4):
            logger.log(step, step_metrics(step, offset=100.0))
    records = read_metrics(tmp_path)
    assert [r["step"] for r in records] == [0, 1, 2, 3, 4]
    assert records[2] == {"step": 2, **step_metrics(2)}
    assert records[3] == {"step": 3, **step_metrics(3, offset=100.0)}
    assert records[4] == {"step": 4, **step_metrics(4, offset=100.0)}
    assert not list(tmp_path.glob("*.tmp"))
    # TensorBoard hides the first run's steps 3 and 4 in favour of the new ones.
    values = dict(tensorboard_scalars(tmp_path, "critic/score/mean"))
    assert sorted(values) == [0, 1, 2, 3, 4]
    assert values[3] == pytest.approx(100.3) and values[2] == pytest.approx(0.2)


def test_fresh_logger_starts_an_empty_file(tmp_path):
    with MetricsLogger(tmp_path, backends=("jsonl",)) as logger:
        logger.log(0, {"a": 1.0})
    with MetricsLogger(tmp_path, backends=("jsonl",)) as logger:
        logger.log(0, {"a": 2.0})
    assert read_metrics(tmp_path) == [{"step": 0, "a": 2.0}]


def test_format_step_line():
    metrics = {
        "critic/score/mean": 0.4123,
        "actor/ppo_kl": 0.0031,
        "actor/pg_loss": -0.021,
        "critic/vf_loss": 0.18,
        "response_length/mean": 12.5,
        "timing_s/gen": 1.2,
        "timing_s/reshard": 0.01,
        "timing_s/update_actor": 2.31,
        "timing_s/step": 4.02,
        "note": "text is left out",
    }
    assert format_step_line(3, 20, metrics) == (
        "step 3/20 | reward 0.412 | kl 0.0031 | pg_loss -0.021 | vf_loss 0.18 | resp_len 12.5 | "
        "gen 1.20s reshard 0.01s update_actor 2.31s step 4.02s"
    )
    assert format_step_line(7, None, {"critic/rewards/mean": 1.0}) == "step 7 | reward 1"
    assert format_step_line(0, 5, {}) == "step 0/5"
    assert format_step_line(1, 5, {"actor/ppo_kl": math.nan}) == "step 1/5 | kl nan"


def test_non_finite_and_non_numeric_values(tmp_path):
    np = pytest.importorskip("numpy")
    torch = pytest.importorskip("torch")
    metrics = {
        "actor/ppo_kl": math.nan,
        "actor/grad_norm": math.inf,
        "np": np.float32(0.5),
        "tensor": torch.tensor(2.0),
        "flag": True,
        "name": "run-a",
        "hist": [1.0, math.nan],
        "object": object(),
    }
    with MetricsLogger(tmp_path, backends=("jsonl", "tensorboard")) as logger:
        logger.log(0, metrics)
    line = (tmp_path / "metrics.jsonl").read_text()
    assert "NaN" not in line and "Infinity" not in line
    assert json.loads(line) == {"step": 0, "actor/ppo_kl": None, "actor/grad_norm": None, "np": 0.5,
                                "tensor": 2.0, "flag": True, "name": "run-a", "hist": [1.0, None]}
    assert math.isnan(tensorboard_scalars(tmp_path, "actor/ppo_kl")[0][1])
    assert tensorboard_scalars(tmp_path, "tensor") == [(0, 2.0)]


def test_bad_arguments(tmp_path):
    with pytest.raises(ValueError, match=r"'mlflow'.*console.*jsonl.*tensorboard.*wandb"):
        MetricsLogger(tmp_path, backends=("jsonl", "mlflow"))
    with pytest.raises(ValueError, match="total_steps"):
        MetricsLogger(tmp_path, backends=("jsonl",), total_steps=0)
    with MetricsLogger(tmp_path, backends=("jsonl",)) as logger:
        with pytest.raises(ValueError, match="'step'"):
            logger.log(0, {"step": 1})
        with pytest.raises(TypeError, match="step must be an int"):
            logger.log(1.5, {})
    with pytest.raises(RuntimeError, match="closed"):
        logger.log(0, {})


def test_wandb_missing(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # import wandb now raises ImportError
    message = "wandb was asked for in logger backends but is not installed: pip install wandb"
    with pytest.raises(ImportError, match=message):
        MetricsLogger(tmp_path / "run", backends=("jsonl", "wandb"))
    assert not (tmp_path / "run").exists()


def test_wandb_backend_with_stub(tmp_path, monkeypatch):
    calls: list[tuple] = []

    class Run:
        def log(self, metrics, step):
            calls.append(("log", metrics, step))

        def finish(self):
            calls.append(("finish",))

    def init(**kwargs):
        calls.append(("init", kwargs))
        return Run()

    monkeypatch.setitem(sys.modules, "wandb", types.SimpleNamespace(init=init))
    with MetricsLogger(tmp_path, backends=("wandb",), run_name="r1", config={"lr": 1e-6}, resume=True) as logger:
        logger.log(2, {"actor/pg_loss": 0.5, "name": "x"})
    assert calls == [
        ("init", {"project": "hybridflow", "name": "r1", "config": {"lr": 1e-6}, "dir": str(tmp_path),
                  "resume": "allow"}),
        ("log", {"actor/pg_loss": 0.5}, 2),
        ("finish",),
    ]


def assert_png(path: Path) -> None:
    assert path.is_file() and path.read_bytes()[:8] == PNG_SIGNATURE and path.stat().st_size > 1000


def test_plot_run_default_figures(tmp_path):
    with MetricsLogger(tmp_path, backends=("jsonl",)) as logger:
        for step in range(40):
            metrics = step_metrics(step)
            if step % 10 == 0:
                metrics["val/reward/mean"] = 0.05 * step
            if step == 7:
                metrics["actor/ppo_kl"] = math.nan
            logger.log(step, metrics)
    paths = plot_run(tmp_path)
    names = [p.name for p in paths]
    assert names == ["reward.png", "losses.png", "kl.png", "timing.png", "response_length.png"]
    for path in paths:
        assert path.parent == tmp_path / "plots"
        assert_png(path)


def test_plot_run_skips_absent_figures_and_plots_keys(tmp_path):
    with MetricsLogger(tmp_path, backends=("jsonl",)) as logger:
        for step in range(5):
            logger.log(step, {"actor/pg_loss": 0.1 * step, "timing_s/gen": 1.0})
    out = tmp_path / "figs"
    paths = plot_run(tmp_path, out_dir=out)
    assert [p.name for p in paths] == ["losses.png", "timing.png"]
    assert not (out / "reward.png").exists()
    for path in paths:
        assert_png(path)
    [path] = plot_run(tmp_path, out_dir=out, keys=["actor/pg_loss"])
    assert path == out / "actor_pg_loss.png"
    assert_png(path)
    with pytest.raises(ValueError, match=r"\['critic/vf_loss'\].*actor/pg_loss"):
        plot_run(tmp_path, keys=["critic/vf_loss"])


def test_plot_run_without_metrics(tmp_path):
    with pytest.raises(FileNotFoundError, match=str(tmp_path / "metrics.jsonl")):
        plot_run(tmp_path)
    (tmp_path / "metrics.jsonl").write_text("")
    with pytest.raises(ValueError, match="no steps"):
        plot_run(tmp_path)


def test_plot_metrics_cli(tmp_path):
    with MetricsLogger(tmp_path, backends=("jsonl",)) as logger:
        for step in range(3):
            logger.log(step, {"critic/score/mean": 0.1 * step})
    script = ROOT / "tools" / "plot_metrics.py"
    done = subprocess.run([sys.executable, str(script), str(tmp_path), "--out", str(tmp_path / "o")],
                          check=False, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == [str(tmp_path / "o" / "reward.png")]
    missing = subprocess.run([sys.executable, str(script), str(tmp_path / "nope")],
                             check=False, capture_output=True, text=True, timeout=120)
    assert missing.returncode == 1 and "metrics.jsonl" in missing.stderr


def test_step_zero_is_logged_before_the_steps(tmp_path, capsys):
    """Validation before the first step is logged at step 0, kept on resume, and shown on the console."""
    with MetricsLogger(tmp_path, backends=("console", "jsonl"), total_steps=2) as logger:
        logger.log(0, {"val/reward/mean": 0.25})
        logger.log(1, step_metrics(1))
    assert "step 0/2 | val 0.25" in capsys.readouterr().err
    with MetricsLogger(tmp_path, backends=("console", "jsonl"), total_steps=2, resume=True) as logger:
        assert logger.truncate_after(2) == 2  # the records of step 0 and step 1
    assert [r["step"] for r in read_metrics(tmp_path)] == [0, 1]


def test_validation_summary_quotes_the_first_and_last_validation():
    records = [{"step": 0, "val/reward/mean": 0.390625}, {"step": 1, "critic/score/mean": 0.2},
               {"step": 10, "val/reward/mean": 0.5}, {"step": 11, "critic/score/mean": 0.3},
               {"step": 20, "val/reward/mean": 0.625, "critic/score/mean": 0.4}]
    assert validation_summary(records) == "val/reward/mean 0.391 at step 0 -> 0.625 at step 20 (+0.234)"
    assert validation_summary(records[:2]) == "val/reward/mean 0.391 at step 0"
    assert validation_summary(records, "val/missing") is None
    assert validation_summary([{"step": 3, "val/reward/mean": "n/a"}]) is None  # not a number: not quoted
    assert (validation_summary(records, labels=("after SFT", "after RL"))
            == "val/reward/mean 0.391 at step 0 (after SFT) -> 0.625 at step 20 (after RL) (+0.234)")
    sft = [{"step": 5, "sft/val_loss": 2.5}, {"step": 6, "sft/loss": 2.0}, {"step": 10, "sft/val_loss": 0.75}]
    assert validation_summary(sft, "sft/val_loss") == "sft/val_loss 2.500 at step 5 -> 0.750 at step 10 (-1.750)"
