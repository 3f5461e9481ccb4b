"""`hybridflow plot` and `hybridflow train`'s refusals, in-process (no worker starts)."""

from conftest import ROOT

from controller.cli import main
from controller.metrics.log import MetricsLogger


def test_plot_command_writes_the_reward_curve(tmp_path, capsys):
    with MetricsLogger(tmp_path, backends=("jsonl",)) as logger:
        for step in range(1, 6):
            logger.log(step, {"critic/score/mean": 0.1 * step, "timing_s/step": 1.0})
    assert main(["plot", str(tmp_path)]) == 0
    printed = capsys.readouterr().out.split()
    assert str(tmp_path / "plots" / "reward.png") in printed
    assert (tmp_path / "plots" / "reward.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_train_refuses_a_bad_config_before_any_process(tmp_path, capsys):
    code = main(["train", "--config", str(ROOT / "examples" / "ppo_tiny.yaml"), f"trainer.run_dir={tmp_path}",
                 "algorithm.name=grpo", "trainer.nproc=3"])
    err = capsys.readouterr().err
    assert code == 2
    assert "grpo compares samples of one prompt: rollout.sampling.n must be >= 2, got 1" in err
    assert "does not divide trainer.nproc 3" in err
    assert not (tmp_path / "metrics.jsonl").exists()
