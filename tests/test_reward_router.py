"""Rewards keyed by data source: the router, math-verify equivalence, and the before-launch checks of reward.fn."""

import sys
import textwrap

import pytest

from workers.reward.math_answer import math_equivalence
from workers.reward.router import (
    DATA_SOURCE_SCORERS,
    check_reward_fn,
    resolve_scorer,
    score_by_data_source,
    unknown_data_sources,
)


@pytest.mark.parametrize("response, truth, score", [
    (r"So the answer is $\boxed{\frac{1}{2}}$.", "0.5", 1.0),
    (r"\boxed{0.5}", r"\frac{1}{2}", 1.0),
    (r"We get \boxed{2\sqrt{2}}", r"\sqrt{8}", 1.0),
    (r"\boxed{\dfrac{3}{4}}", r"\frac34", 1.0),
    (r"\boxed{x^2 + 2x + 1}", r"(x+1)^2", 1.0),
    (r"\boxed{3}", r"\frac{1}{2}", 0.0),
    (r"\boxed{2\sqrt{3}}", r"\sqrt{8}", 0.0),
    ("I do not know.", "7", 0.0),
    (r"\boxed{7}", ["7", "seven"], 1.0),  # several accepted answers
])
def test_math_answers_are_compared_by_math_verify(response, truth, score):
    assert math_equivalence("", response, truth, {}) == score
    assert score_by_data_source("", response, truth, {"data_source": "DigitalLearningGmbH/MATH-lighteval"}) == score


def test_each_data_source_reaches_its_scorer():
    gsm8k = {"data_source": "openai/gsm8k"}
    assert score_by_data_source("", "6 * 7 = 42\n#### 42", "42", gsm8k) == 1.0
    assert score_by_data_source("", "#### 41", "42", {"data_source": "gsm8k"}) == 0.0
    # The built-in task keeps its shaped reward (partial credit for a number of the right length).
    assert score_by_data_source("", "12", "12", {"data_source": "arithmetic"}) == 1.0
    assert score_by_data_source("", "13", "12", {"data_source": "arithmetic"}) == 0.5
    for source in ("math", "lighteval/MATH", "HuggingFaceH4/MATH-500"):
        assert DATA_SOURCE_SCORERS[source] is math_equivalence
    with pytest.raises(ValueError, match=r"no reward function for data_source 'mystery'; known data sources: \["):
        score_by_data_source("", "1", "1", {"data_source": "mystery"})
    with pytest.raises(ValueError, match="no reward function for data_source None"):
        score_by_data_source("", "1", "1", {})
    assert unknown_data_sources(["arithmetic", "mystery", None, "mystery"]) == ["mystery", None]  # by repr
    assert resolve_scorer("auto") is score_by_data_source


def test_rule_reward_worker_routes_by_the_batch_data_source(tmp_path):
    from test_rule_reward import make_batch

    from controller.models.char_tokenizer import save_char_tokenizer
    from workers.reward import RuleReward

    tokenizer = str(save_char_tokenizer(tmp_path / "tok", 256))
    batch = make_batch(tokenizer, prompts=["a", "b", "c"], responses=["#### 4", "1/2", "13"],
                       ground_truth=["4", "0.5", "12"], data_source=["openai/gsm8k", "math", "arithmetic"],
                       extra_info=[{}, {}, {}])
    scores = RuleReward(tokenizer, reward_fn="auto").compute_reward(batch).batch["scores"]
    assert scores.tolist() == [1.0, 1.0, 0.5]
    # reward.kwargs pass the check for "auto" and reach every routed scorer, which take **kwargs.
    routed = RuleReward(tokenizer, reward_fn="auto", reward_kwargs={"note": "x"}).compute_reward(batch)
    assert routed.batch["scores"].tolist() == [1.0, 1.0, 0.5]


def test_reward_functions_are_imported_and_their_signature_bound_before_launch(tmp_path, monkeypatch, request):
    request.addfinalizer(lambda: sys.modules.pop("my_rewards", None))  # imported by the checks below
    (tmp_path / "my_rewards.py").write_text(textwrap.dedent("""
        def good(prompt, response, ground_truth, extra, **kwargs):
            return 1.0

        def two_args(prompt, response):
            return 1.0

        def strict(prompt, response, ground_truth, extra, *, scale):
            return scale

        not_a_function = 3
    """))
    (tmp_path / "broken_rewards.py").write_text("raise RuntimeError('boom at import')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert check_reward_fn("my_rewards:good").__name__ == "good"
    assert check_reward_fn("my_rewards:strict", {"scale": 2.0}).__name__ == "strict"
    assert check_reward_fn("auto") is score_by_data_source
    with pytest.raises(ValueError, match=r"reward.fn: 'my_rewards:two_args' has the signature \(prompt, response\), "
                                         r"which does not accept \(prompt, response, ground_truth, extra\)"):
        check_reward_fn("my_rewards:two_args")
    with pytest.raises(ValueError, match=r"does not accept .* and the keyword arguments \['scale', 'typo'\] \(reward.kwargs\)"):
        check_reward_fn("my_rewards:strict", {"scale": 1.0, "typo": 1})
    with pytest.raises(ValueError, match=r"reward.fn: 'my_rewards:strict' has the signature"):
        check_reward_fn("my_rewards:strict")  # scale is required
    with pytest.raises(ValueError, match=r"algorithm.safe_rlhf_cost_fn: reward function 'broken_rewards:fn': module "
                                         r"'broken_rewards' failed to import \(RuntimeError: boom at import\)"):
        check_reward_fn("broken_rewards:fn", key="algorithm.safe_rlhf_cost_fn")
    with pytest.raises(ValueError, match="reward.fn: reward function 'no_such_module_xyz:fn': module 'no_such_module_xyz' failed"):
        check_reward_fn("no_such_module_xyz:fn")
    with pytest.raises(ValueError, match="has no attribute 'missing'"):
        check_reward_fn("my_rewards:missing")
    with pytest.raises(ValueError, match="is a int, not a callable"):
        check_reward_fn("my_rewards:not_a_function")
    with pytest.raises(ValueError, match="reward.fn: unknown reward function 'gsm8k'; built-in functions"):
        check_reward_fn("gsm8k")
