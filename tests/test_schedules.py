"""The schedules' pure parts: staleness metrics, dropping stale samples by prompt group, the generation seed,
and the config checks of trainer.mode (no process)."""

import numpy as np
import pytest
import torch

from controller.config import ConfigError, check_config, load_config
from controller.rl.schedules import build_schedule, drop_stale, generation_seed, staleness_metrics
from workers.data_proto import DataProto

from test_config import EXAMPLES


def batch(versions, uids):
    return DataProto({"policy_version": torch.tensor(versions), "x": torch.arange(len(versions))},
                     {"uid": np.array(uids, dtype=object)})


def test_staleness_metrics_count_each_age():
    m = staleness_metrics(torch.tensor([3, 3, 2, 0]), now=3, max_staleness=1)
    assert m == {"staleness/mean": pytest.approx(1.0), "staleness/max": 3.0, "staleness/dropped": 1.0,
                 "staleness/hist/0": 2.0, "staleness/hist/1": 1.0, "staleness/hist/2": 0.0, "staleness/hist/3": 1.0}
    with pytest.raises(ValueError, match="policy version 5 is ahead of the trainer's 3"):
        staleness_metrics(torch.tensor([5]), now=3, max_staleness=1)


def test_stale_samples_are_dropped_with_their_whole_prompt_group():
    data = batch([4, 4, 2, 4, 3, 3], ["a", "a", "b", "b", "c", "c"])
    kept, metrics = drop_stale(data, now=4, max_staleness=1)
    assert kept.batch["x"].tolist() == [0, 1, 4, 5]  # group b had one sample 2 updates stale
    assert metrics["staleness/dropped"] == 1.0
    same, _ = drop_stale(data, now=4, max_staleness=2)
    assert same is data
    with pytest.raises(RuntimeError, match="every sample of the step is more than trainer.max_staleness=0"):
        drop_stale(batch([1, 1], ["a", "a"]), now=3, max_staleness=0)


def test_generation_seeds_depend_on_the_step_and_round_only():
    seeds = {generation_seed(0, step, r) for step in range(50) for r in range(5)}
    assert len(seeds) == 250
    assert generation_seed(1, 3, 0) == 1_000_003 + 300_000


def test_trainer_mode_is_checked_before_launch():
    def problems(*overrides):
        with pytest.raises(ConfigError) as info:
            check_config(load_config(EXAMPLES / "ppo_tiny.yaml", list(overrides)))
        return str(info.value)

    assert "trainer.mode 'async_v2' is not one of ('sync', 'one_step_off', 'async')" in problems("trainer.mode=async_v2")
    assert "give the rollout a pool of its own (trainer.placement.rollout" in problems("trainer.mode=one_step_off")
    ray = ["trainer.launcher=ray", "trainer.placement={rollout: 2}", "trainer.mode=one_step_off"]
    assert "trainer.max_staleness must be >= 1, got 0" in problems(*ray, "trainer.max_staleness=0")
    check_config(load_config(EXAMPLES / "ppo_tiny.yaml", ray))
    assert "does not yet run DAPO's dynamic sampling" in problems(*ray, "algorithm.name=dapo", "rollout.sampling.n=2")
    # async: the same pool rule, and its own settings checked against the rollout's
    assert "trainer.mode async overlaps generation with training" in problems("trainer.mode=async")
    asynchronous = ["trainer.launcher=ray", "trainer.placement={rollout: 2}", "trainer.mode=async"]
    check_config(load_config(EXAMPLES / "ppo_tiny.yaml", [*asynchronous, "trainer.max_staleness=0",
                                                          "trainer.partial_rollout_tokens=6", "trainer.max_in_flight=4"]))
    assert ("trainer.partial_rollout_tokens must be an integer in [1, rollout.sampling.max_new_tokens=6] (tokens per "
            "sample per rollout call), got 7") in problems(*asynchronous, "trainer.partial_rollout_tokens=7")
    assert "trainer.max_in_flight must be a positive integer" in problems(*asynchronous, "trainer.max_in_flight=0")
    assert "trainer.mode async does not yet run DAPO's dynamic sampling" in problems(
        *asynchronous, "algorithm.name=dapo", "rollout.sampling.n=2")
    assert ("trainer.partial_rollout_tokens is a setting of trainer.mode async (this run is one_step_off); drop it"
            in problems(*ray, "trainer.partial_rollout_tokens=2"))
    with pytest.raises(ConfigError, match=r"trainer.mode async continues single-turn responses .* multi-turn"):
        check_config(load_config(EXAMPLES / "calculator_agent.yaml", asynchronous))
    with pytest.raises(ValueError, match="trainer.mode 'later' is not one of"):
        build_schedule("later", 1)


def test_one_step_off_runs_on_a_rollout_source_of_its_own():
    """A schedule sees the trainer only through a RolloutSource: here one made of plain functions. Step k
    trains on what was generated during step k-1, from the weights sent before it, seeded per step."""
    from concurrent.futures import Future

    from controller.algorithms import StepState
    from controller.rl.rollout_source import RolloutSource

    drawn, sent, synced, recorded = [], [], [], []

    def next_prompts(state):
        drawn.append(len(drawn))
        return DataProto({"input_ids": torch.full((2, 3), len(drawn) - 1)})

    def submit(method, data):
        sent.append((method, data.meta_info["sampling"]["seed"]))
        future = Future()
        future.set_result(DataProto({"responses": data.batch["input_ids"] + 100}, meta_info={"metrics": {"timing_s/gen": 1.0}}))
        return future

    def source(version):
        return RolloutSource(version=version, seed=7, batch_size=2, sampling=None, pad_token_id=0,
                             next_prompts=next_prompts, generate_and_score=None,
                             score=lambda b: DataProto({"scores": b.batch["responses"][:, 0].float()}),
                             submit=submit, sync_weights=lambda: synced.append(1) or {"weight_sync/bytes": 8.0},
                             record_rollout_metrics=lambda state, m: recorded.append(dict(m)))

    schedule = build_schedule("one_step_off", max_staleness=1)
    first = schedule.rollout(source(0), StepState(0))
    assert first.batch["responses"][:, 0].tolist() == [100, 100] and first.batch["policy_version"].tolist() == [0, 0]
    assert sent == [("generate_sequences", generation_seed(7, 0)), ("generate_sequences", generation_seed(7, 1))]
    second_state = StepState(1)
    second = schedule.rollout(source(1), second_state)  # generated during step 0, from the weights before its update
    assert second.batch["responses"][:, 0].tolist() == [101, 101] and second.batch["scores"].tolist() == [101.0, 101.0]
    assert second_state.metrics["staleness/mean"] == 1.0 and second_state.metrics["staleness/dropped"] == 0.0
    assert drawn == [0, 1, 2] and len(synced) == 3
    assert recorded.count({"weight_sync/bytes": 8.0}) == 3 and recorded.count({"timing_s/gen": 1.0}) == 2
