"""tools/algorithm_curves.py's pairings and arithmetic (pure: no job runs).

Each algorithm that TRL implements must reach TRL's GRPOTrainer as the same objective: the loss type and
importance-sampling level that match hybridflow's algorithm and aggregation, the same clip ranges (TRL's
CISPO cap is absolute, hybridflow's 1 + clip_ratio_high) and the same advantage scaling.
"""

from __future__ import annotations

import pytest

from tools import algorithm_curves as curves
from tools import bench_e2e as e2e
from tools import bench_e2e_trl as trl_side

# algorithm -> (TRL loss_type, importance_sampling_level, scale_rewards)
EXPECTED = {
    "grpo": ("dapo", "token", "group"),
    "dapo": ("dapo", "token", "group"),
    "dr_grpo": ("dr_grpo", "token", "none"),
    "gspo": ("grpo", "sequence", "group"),
    "cispo": ("cispo", "token", "group"),
}


def both(tmp_path, algorithm):
    s = curves.settings_for(algorithm, steps=30, seed=1)
    cfg = e2e.hybridflow_config(s, str(tmp_path / "m"), str(tmp_path / "t.parquet"), str(tmp_path / "r"), "fp32", 48,
                                256 << 20)
    spec = e2e.trl_spec(s, str(tmp_path / "m"), str(tmp_path / "t.parquet"), str(tmp_path / "trl"), "fp32", "autocast",
                        2, [[1]])
    return s, cfg, trl_side.grpo_config_kwargs(spec)


@pytest.mark.parametrize("algorithm", sorted(EXPECTED))
def test_each_paired_algorithm_is_the_same_objective_on_both_sides(tmp_path, algorithm):
    s, cfg, g = both(tmp_path, algorithm)
    assert cfg["algorithm"]["name"] == algorithm
    assert (g["loss_type"], g["importance_sampling_level"], g["scale_rewards"]) == EXPECTED[algorithm]
    assert cfg["algorithm"]["norm_adv_by_std"] == (g["scale_rewards"] == "group")
    ppo = cfg["ppo"]
    assert ppo["loss_agg_mode"] == s.loss_agg_mode
    assert g["epsilon"] == ppo["clip_ratio_low"]
    assert g["epsilon_high"] == ppo["clip_ratio_high"] + (1.0 if algorithm == "cispo" else 0.0)
    assert (cfg["reward"]["fn"], cfg["actor"]["optim"]["lr"], cfg["trainer"]["seed"]) == ("arithmetic_shaped", 5e-3, 1)
    assert (g["learning_rate"], g["seed"], g["max_completion_length"]) == (5e-3, 1, 4)
    if algorithm == "dapo":  # TRL has neither: off on hybridflow's side too
        assert cfg["algorithm"]["dynamic_sampling"] is False and cfg["algorithm"]["overlong_buffer_len"] == 0
    if algorithm == "gspo":
        assert (ppo["clip_ratio_low"], ppo["clip_ratio_high"]) == (3e-4, 4e-4)


def test_unpaired_algorithms_are_refused_on_the_trl_side(tmp_path):
    s = curves.settings_for("gspo_token", steps=30, seed=0)
    spec = e2e.trl_spec(s, "m", "t", str(tmp_path), "fp32", "autocast", 2, [[1]])
    with pytest.raises(ValueError, match="TRL has no counterpart of algorithm 'gspo_token'"):
        trl_side.grpo_config_kwargs(spec)
    assert not curves.ALGORITHMS["gspo_token"][1]


def test_gains_means_and_spread():
    rise = [0.0] * 5 + [0.5] * 20 + [1.0] * 5
    assert curves.gain(rise) == pytest.approx(1.0)
    runs = [
        {"algorithm": "grpo", "framework": "hybridflow", "status": "ok", "rewards": rise},
        {"algorithm": "grpo", "framework": "hybridflow", "status": "ok", "rewards": [0.2] * 25 + [0.6] * 5},
        {"algorithm": "grpo", "framework": "trl", "status": "ok", "rewards": [0.1] * 25 + [0.8] * 5},
        {"algorithm": "grpo", "framework": "trl", "status": "failed", "rewards": None},
    ]
    summary = {(e["algorithm"], e["framework"]): e for e in curves.summarize_curves(runs)}
    h, t = summary["grpo", "hybridflow"], summary["grpo", "trl"]
    assert h["gains"] == pytest.approx([1.0, 0.4]) and h["mean_gain"] == pytest.approx(0.7)
    assert h["spread"] == pytest.approx(0.6) and t["gains"] == pytest.approx([0.7]) and t["spread"] == 0.0
    assert h["curve_means"] == pytest.approx([0.5, 0.2 * 25 / 30 + 0.6 * 5 / 30])
    assert t["mean_curve"] == pytest.approx(0.1 * 25 / 30 + 0.8 * 5 / 30) and t["curve_spread"] == 0.0
    text = curves.format_summary(list(summary.values()))
    assert "grpo: hybridflow - TRL mean gain " in text and "(run-to-run spread up to 0.600)" in text
