"""The data and reward keys of the config: spellings old and new, and every problem named before launch."""

from pathlib import Path

import pytest

from controller.config import ConfigError, check_config, load_config

EXAMPLE = Path(__file__).parent.parent / "examples" / "ppo_tiny.yaml"


def problems(*overrides) -> str:
    with pytest.raises(ConfigError) as info:
        check_config(load_config(EXAMPLE, list(overrides)))
    return str(info.value)


def test_one_path_or_a_list_and_the_old_single_file_spelling(tmp_path):
    a, b = tmp_path / "a.parquet", tmp_path / "b.jsonl"
    a.touch(), b.touch()
    one = load_config(EXAMPLE, ["data.task=files", f"data.train_files={a}"])
    assert one.data.train_paths == (str(a),) and one.data.val_paths == ()
    several = load_config(EXAMPLE, ["data.task=files", f"data.train_files=[{a}, {b}]", f"data.val_files={b}"])
    assert several.data.train_paths == (str(a), str(b)) and several.data.val_paths == (str(b),)
    old = load_config(EXAMPLE, ["data.task=jsonl", f"data.train_file={b}", f"data.val_file={b}"])
    assert old.data.train_paths == (str(b),) and old.data.val_paths == (str(b),)
    for config in (one, several, old):
        check_config(config)
    defaults = load_config(None, [])
    assert defaults.reward.fn == "auto" and defaults.data.apply_chat_template == "auto"
    assert load_config(None, ["data.apply_chat_template=false"]).data.apply_chat_template is False


def test_data_problems_name_the_key_and_what_is_valid(tmp_path):
    there = tmp_path / "there.parquet"
    there.touch()
    assert "data.task 'csv' is not one of ('arithmetic', 'word_problems', 'code_expression', 'files', 'jsonl')" in problems("data.task=csv")
    assert "data.task 'files' needs data.train_files (one path or a list)" in problems("data.task=files")
    assert f"data: prompt file {tmp_path / 'gone.parquet'} does not exist" in problems(
        "data.task=files", f"data.train_files={tmp_path / 'gone.parquet'}")
    assert "data.train_file and data.train_files are both set" in problems(
        "data.task=files", f"data.train_files={there}", f"data.train_file={there}")
    assert "set data.task=files to train on them" in problems(f"data.train_files={there}")
    assert "data.operators '+/': each must be one of '+-*'" in problems("data.operators=+/")
    assert "data.apply_chat_template must be true, false or 'auto', got 'sometimes'" in problems(
        "data.apply_chat_template=sometimes")


def test_reward_functions_are_checked_with_the_config(tmp_path, monkeypatch):
    (tmp_path / "cfg_rewards.py").write_text("def needs_scale(prompt, response, ground_truth, extra, *, scale):\n"
                                             "    return scale\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    check_config(load_config(EXAMPLE, ["reward.fn=cfg_rewards:needs_scale", "reward.kwargs={scale: 2.0}"]))
    assert "reward.fn: 'cfg_rewards:needs_scale' has the signature" in problems("reward.fn=cfg_rewards:needs_scale")
    assert "algorithm.safe_rlhf_cost_fn: unknown reward function 'cost'" in problems(
        "algorithm.name=grpo", "rollout.sampling.n=2", "algorithm.safe_rlhf_cost_fn=cost")
    # A reward model takes the rule's place: reward.fn is not looked at then.
    check_config(load_config(EXAMPLE, ["reward.fn=not_imported:fn", "reward.model_path=some/rm"]))
