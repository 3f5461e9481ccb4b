"""The timeline of a step (controller/metrics/timeline.py): parsing a record's per-pool phase timings and idle
shares, choosing the step, and timeline.png through `hybridflow plot RUN_DIR --step N`."""

import numpy as np
import pytest
from matplotlib import colormaps
from matplotlib.image import imread

from controller.cli import main
from controller.metrics import plots
from controller.metrics.log import MetricsLogger
from controller.metrics.plots import plot_run
from controller.metrics.timeline import (
    busy_seconds,
    choose_record,
    has_phase_timings,
    is_timeline_key,
    parse_timeline,
)


def phases(pool_phases: dict[str, dict[str, tuple[float, float]]]) -> dict[str, float]:
    """The timing_s/phase/<pool>/<phase>/start|end keys of {pool: {phase: (start, end)}}."""
    keys = {}
    for pool, spans in pool_phases.items():
        for phase, (start, end) in spans.items():
            keys[f"timing_s/phase/{pool}/{phase}/start"] = start
            keys[f"timing_s/phase/{pool}/{phase}/end"] = end
    return keys


# A split-placement PPO step of 10 s: the rollout on a pool of its own, then old_log_prob and ref on the actor's
# pool while the critic computes values on its own, the driver's advantages, then both updates at once.
SPLIT_STEP = {
    "driver": {"adv": (6.0, 6.2)},  # logged first, drawn last
    "rollout": {"rollout": (0.0, 4.0)},
    "actor": {"update_actor": (6.2, 9.8), "old_log_prob": (4.2, 5.0), "ref": (5.0, 6.0)},
    "critic": {"values": (4.2, 5.5), "reward": (5.0, 6.0), "update_critic": (6.2, 9.0)},  # reward overlaps values
}


def split_record(step: int = 1) -> dict:
    return {"step": step, "timing_s/step": 10.0, "timing_s/update": 3.6, "critic/score/mean": 0.5,
            **phases(SPLIT_STEP)}


def write_run(run_dir, records) -> None:
    """metrics.jsonl of the records, written by the logger as training writes it."""
    with MetricsLogger(run_dir, backends=("jsonl",)) as logger:
        for record in records:
            logger.log(record["step"], {key: value for key, value in record.items() if key != "step"})


def idle_by_sampling(spans, step_s: float, samples: int = 200_000) -> float:
    """The share of [0, step_s) covered by no span, counted on a fine grid (a check independent of the union)."""
    t = (np.arange(samples) + 0.5) * step_s / samples
    busy = np.zeros(samples, dtype=bool)
    for start, end in spans:
        busy |= (t >= start) & (t < end)
    return float((~busy).mean())


def test_parse_timeline_two_pools_at_once_and_idle_from_the_intervals():
    timeline = parse_timeline(split_record(step=3))
    assert timeline.step == 3 and timeline.step_s == 10.0
    assert list(timeline.pools) == ["rollout", "actor", "critic", "driver"]  # record order, driver last
    assert timeline.pools == {
        "rollout": [("rollout", 0.0, 4.0)],
        "actor": [("old_log_prob", 4.2, 5.0), ("ref", 5.0, 6.0), ("update_actor", 6.2, 9.8)],  # sorted by start
        "critic": [("values", 4.2, 5.5), ("reward", 5.0, 6.0), ("update_critic", 6.2, 9.0)],
        "driver": [("adv", 6.0, 6.2)],
    }
    # the two pools overlap: both updates start at 6.2, values runs beside old_log_prob and ref
    (_, a_start, a_end), (_, c_start, c_end) = timeline.pools["actor"][-1], timeline.pools["critic"][-1]
    assert a_start == c_start == 6.2 and a_end > c_end
    # no timing_s/idle/<pool> logged: the step minus the union of the pool's intervals, by hand
    expected = {
        "rollout": (10.0 - 4.0) / 10.0,                    # 0.6
        "actor": (10.0 - (0.8 + 1.0 + 3.6)) / 10.0,        # 0.46
        "critic": (10.0 - ((6.0 - 4.2) + 2.8)) / 10.0,     # values and reward overlap: 4.2..6.0 counted once; 0.54
        "driver": (10.0 - 0.2) / 10.0,                     # 0.98
    }
    assert timeline.idle_share == pytest.approx(expected)
    for pool, share in timeline.idle_share.items():
        spans = [(start, end) for _, start, end in timeline.pools[pool]]
        assert share == pytest.approx(idle_by_sampling(spans, 10.0), abs=1e-4)


def test_parse_timeline_logged_idle_wins_and_a_pool_idle_all_step_has_a_row():
    record = {"step": 2, "timing_s/step": 8.0,
              **phases({"default": {"rollout": (0.0, 3.0), "update_actor": (5.0, 7.0)}}),
              "timing_s/idle/default": 2.0,   # the trainer's own count (here less than 8 - 5: it saw more work)
              "timing_s/idle/reward_pool": 8.0}
    timeline = parse_timeline(record)
    assert timeline.pools == {"default": [("rollout", 0.0, 3.0), ("update_actor", 5.0, 7.0)], "reward_pool": []}
    assert timeline.idle_share == pytest.approx({"default": 2.0 / 8.0, "reward_pool": 1.0})
    # without timing_s/step the step lasts until the last phase ends; shares stay within 0..1
    del record["timing_s/step"]
    timeline = parse_timeline(record)
    assert timeline.step_s == 7.0
    assert timeline.idle_share == pytest.approx({"default": 2.0 / 7.0, "reward_pool": 1.0})


def test_parse_timeline_without_phase_timings_and_malformed_keys():
    assert parse_timeline({"step": 1, "timing_s/step": 2.0, "timing_s/gen": 1.0}) is None
    assert parse_timeline({"step": 1, "timing_s/idle/actor": 1.0}) is None  # idle alone is no timeline
    record = {
        "step": 1,
        "timing_s/phase/actor/ref/start": 1.0,                      # no end: skipped
        "timing_s/phase/actor/values/start": None,                  # logged NaN: skipped
        "timing_s/phase/actor/values/end": 2.0,
        "timing_s/phase/actor/sub/phase/start": 0.0,                # a / too many: skipped
        "timing_s/phase/actor/sub/phase/end": 1.0,
        "timing_s/phase/actor/backwards/start": 3.0,                # ends before it starts: skipped
        "timing_s/phase/actor/backwards/end": 2.0,
    }
    assert parse_timeline(record) is None and not has_phase_timings(record)
    record.update(phases({"actor": {"rollout": (0.0, 1.5)}}))
    assert parse_timeline(record).pools == {"actor": [("rollout", 0.0, 1.5)]}
    assert has_phase_timings(record)


def test_busy_seconds_is_the_union():
    assert busy_seconds([]) == 0.0
    assert busy_seconds([(0.0, 1.0), (2.0, 3.0)]) == pytest.approx(2.0)
    assert busy_seconds([(0.0, 4.0), (1.0, 2.0)]) == pytest.approx(4.0)          # nested
    assert busy_seconds([(1.0, 3.0), (0.0, 2.0), (3.0, 5.0)]) == pytest.approx(5.0)  # overlapping and touching


def test_timeline_keys_are_not_in_timing_png(tmp_path, monkeypatch):
    assert is_timeline_key("timing_s/phase/actor/ref/start") and is_timeline_key("timing_s/idle/actor")
    assert not is_timeline_key("timing_s/step") and not is_timeline_key("timing_s/update")
    drawn = {}
    save = plots._save

    def spy(path, title, panels, smooth):
        drawn[path.name] = [key for panel in panels for key, _ in panel]
        return save(path, title, panels, smooth)

    monkeypatch.setattr(plots, "_save", spy)
    write_run(tmp_path, [{**split_record(), "timing_s/idle/actor": 4.6}])
    names = [path.name for path in plot_run(tmp_path)]
    assert names == ["reward.png", "timing.png", "timeline.png"]
    assert drawn["timing.png"] == ["timing_s/step", "timing_s/update"]


def step_records() -> list[dict]:
    """Steps 0-4: step 0 (validation) and 4 have no phase timings; step 1 has three pools, steps 2-3 two."""
    records = [{"step": 0, "val/reward/mean": 0.1}]
    records.append({"step": 1, "timing_s/step": 10.0, **phases({k: SPLIT_STEP[k] for k in ("rollout", "actor",
                                                                                            "critic")})})
    for step in (2, 3):
        records.append({"step": step, "timing_s/step": 6.0,
                        **phases({"default": {"rollout": (0.0, 3.0)}, "driver": {"adv": (3.0, 3.5)}})})
    records.append({"step": 4, "timing_s/step": 5.0})
    return records


def test_choose_record():
    records = step_records()
    assert choose_record(records)["step"] == 3  # the last with phase timings, not the last logged
    assert choose_record(records, 1)["step"] == 1
    assert choose_record([{"step": 0, "timing_s/step": 1.0}]) is None
    with pytest.raises(ValueError, match=r"step 7 is not in the run's metrics: steps logged: 0-4; "
                                         r"steps with phase timings: 1-3"):
        choose_record(records, 7)
    with pytest.raises(ValueError, match=r"step 4 has no phase timings .*steps with phase timings: 1-3"):
        choose_record(records, 4)
    with pytest.raises(ValueError, match=r"step 1 is not .*steps logged: 0; steps with phase timings: none"):
        choose_record([{"step": 0}], 1)


def read_png(path):
    image = imread(path)
    assert image.dtype == np.float32 and image.ndim == 3 and image.shape[2] == 4  # RGBA
    return image


def pixels_of(image, colour) -> int:
    return int(np.isclose(image[..., :3], colour[:3], atol=0.01).all(axis=-1).sum())


def test_plot_command_writes_the_chosen_steps_timeline(tmp_path, capsys):
    write_run(tmp_path, step_records())
    timeline_png = tmp_path / "plots" / "timeline.png"
    assert main(["plot", str(tmp_path), "--step", "1"]) == 0
    assert str(timeline_png) in capsys.readouterr().out.split()
    step1 = read_png(timeline_png)
    # 9 inches at 100 dpi wide; 1.6 + 0.55 inches a pool high: step 1 has three pools (rollout, actor, critic)
    assert step1.shape == (round(100 * (1.6 + 0.55 * 3)), 900, 4)
    palette = colormaps["tab20"].colors
    rollout_blue, values_purple = palette[0], palette[8]  # the colours of the rollout and values phases
    assert pixels_of(step1, rollout_blue) > 1000 and pixels_of(step1, values_purple) > 1000  # bars drawn

    assert main(["plot", str(tmp_path)]) == 0  # default: step 3, the last with phase timings; two pools
    last = read_png(timeline_png)
    assert last.shape == (round(100 * (1.6 + 0.55 * 2)), 900, 4)
    assert pixels_of(last, rollout_blue) > 1000 and pixels_of(last, values_purple) == 0  # no critic at step 3


def test_no_timeline_without_phase_timings(tmp_path, capsys):
    write_run(tmp_path, [{"step": step, "critic/score/mean": 0.1 * step, "timing_s/step": 1.0} for step in (1, 2)])
    assert main(["plot", str(tmp_path)]) == 0
    printed = capsys.readouterr().out.split()
    assert printed == [str(tmp_path / "plots" / "reward.png"), str(tmp_path / "plots" / "timing.png")]
    assert not (tmp_path / "plots" / "timeline.png").exists()


def test_a_bad_step_is_a_clear_error(tmp_path, capsys):
    write_run(tmp_path, step_records())
    assert main(["plot", str(tmp_path), "--step", "9"]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.strip() == ("hybridflow plot: step 9 is not in the run's metrics: steps logged: 0-4; "
                                    "steps with phase timings: 1-3")
    assert not (tmp_path / "plots").exists()  # refused before any figure is written
    assert main(["plot", str(tmp_path), "--step", "0"]) == 2
    assert "step 0 has no phase timings" in capsys.readouterr().err
    with pytest.raises(ValueError, match="cannot go with keys"):
        plot_run(tmp_path, keys=["val/reward/mean"], step=1)
