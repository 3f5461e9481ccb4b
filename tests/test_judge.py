"""A generative judge without a process: the built-in verdict parsers and the template against hand-written
verdicts, how the judge's scores combine with a rule's (alone, weighted, routed by data_source), its metrics, and
the checks before launch. (Through `hybridflow train`, against transformers: tests/test_judge_e2e.py.)"""

import numpy as np
import pytest
import torch

from conftest import ROOT
from controller.config import ConfigError, check_config, load_config
from controller.rl.judge_scores import judge_scores
from controller.rl.step_metrics import batch_metrics
from workers.data_proto import DataProto
from workers.reward.judge import JUDGE_COLUMNS
from workers.reward.judge_verdicts import boxed, resolve_parser, resolve_template, score_out_of_10, yes_no

PPO_TINY = ROOT / "examples" / "ppo_tiny.yaml"


def test_the_built_in_parsers_read_the_verdicts_score():
    assert score_out_of_10("Clear and right. Score: 7/10") == pytest.approx(0.7)
    assert score_out_of_10("I give it 3 out of 10, then 8/10 on reflection") == pytest.approx(0.8)  # the last
    assert score_out_of_10("Score: 9") == pytest.approx(0.9) and score_out_of_10("score is 12/10") == 1.0
    assert score_out_of_10("a fine answer") is None
    assert boxed(r"so the grade is \boxed{0.25}") == 0.25 and boxed(r"\boxed{1} then \boxed{ 3 }") == 3.0
    assert boxed("no box") is None and boxed(r"\boxed{good}") is None
    assert yes_no("Is it right? Yes.") == 1.0 and yes_no("yes at first, but no") == 0.0
    assert yes_no("Nobody knows") is None  # whole words only


def test_templates_render_the_row_and_refuse_an_unknown_placeholder():
    render = resolve_template("Q: {question}\nA: {response}\nRef: {reference}")
    assert render({"question": "2+2=", "response": "4", "reference": "4", "data_source": "x"}) == "Q: 2+2=\nA: 4\nRef: 4"
    with pytest.raises(ValueError, match=r"names placeholder\(s\) \['answer'\]; valid: \{question\}, \{response\}"):
        resolve_template("Q: {question} A: {answer}")
    with pytest.raises(ValueError, match="not a valid format string"):
        resolve_template("Q: {question")
    assert resolve_template("judge_functions:slow_on_odd").__name__ == "slow_on_odd"
    with pytest.raises(ValueError, match="is not one of the built-in parsers"):
        resolve_parser("score_out_of_100")


class FakeJudge:
    """A judge group whose verdicts are fixed (its worker is exercised in the e2e test): what it was asked."""

    def __init__(self, scores):
        self.scores, self.asked = scores, None

    def compute_reward(self, batch):
        self.asked = len(batch)
        rows = len(batch)
        columns = {name: torch.zeros(rows) for name in JUDGE_COLUMNS}
        columns["judge_scores"] = torch.tensor(self.scores[:rows])
        columns["judge_parse_failed"][0] = 1.0
        columns["judge_tokens"] = torch.full((rows,), 5.0)
        columns["judge_seconds"] = torch.full((rows,), 0.5)
        return DataProto(columns)


def batch_of(sources):
    mask = torch.tensor([[1, 1, 0], [1, 1, 1], [1, 0, 0], [1, 1, 1]], dtype=torch.float32)
    return DataProto({"response_mask": mask}, non_tensor_batch={"data_source": np.array(sources, dtype=object)})


def rule(values):
    return DataProto({"scores": torch.tensor(values), "token_level_scores": torch.zeros(4, 3),
                      "reward_timed_out": torch.zeros(4)})


def test_the_judges_scores_alone_added_at_a_weight_or_routed_by_data_source():
    batch = batch_of(["a", "b", "a", "b"])
    alone = judge_scores(FakeJudge([0.1, 0.2, 0.3, 0.4]), batch, None, weight=1.0)
    torch.testing.assert_close(alone.batch["scores"], torch.tensor([0.1, 0.2, 0.3, 0.4]))
    torch.testing.assert_close(alone.batch["token_level_scores"],  # on each response's last token
                               torch.tensor([[0, 0.1, 0], [0, 0, 0.2], [0.3, 0, 0], [0, 0, 0.4]]))
    added = judge_scores(FakeJudge([0.1, 0.2, 0.3, 0.4]), batch, rule([1.0, 0.0, 1.0, 0.0]), weight=0.5)
    torch.testing.assert_close(added.batch["scores"], torch.tensor([1.05, 0.1, 1.15, 0.2]))
    assert "reward_timed_out" in added.batch  # the rule's own columns are kept
    judge = FakeJudge([0.6, 0.8])
    routed = judge_scores(judge, batch, rule([1.0, 0.0, 1.0, 0.0]), weight=2.0, data_sources=("b",))
    assert judge.asked == 2  # only the routed rows go to the judge
    torch.testing.assert_close(routed.batch["scores"], torch.tensor([1.0, 1.2, 1.0, 1.6]))
    torch.testing.assert_close(routed.batch["judged"], torch.tensor([0.0, 1.0, 0.0, 1.0]))
    nobody = FakeJudge([])
    assert judge_scores(nobody, batch, rule([1.0] * 4), weight=1.0, data_sources=("c",)).batch["scores"].sum() == 4
    assert nobody.asked is None

    # the metrics count the judged rows only
    b = {**routed.batch, "response_mask": batch.batch["response_mask"], "token_level_rewards": torch.zeros(4, 3),
         "responses": torch.zeros(4, 3, dtype=torch.long), "prompts": torch.zeros(4, 2, dtype=torch.long),
         "attention_mask": torch.ones(4, 5)}
    metrics = batch_metrics(DataProto(b))
    assert metrics["reward/judge/score/mean"] == pytest.approx(0.7) and metrics["reward/judge/samples"] == 2
    assert metrics["reward/judge/parse_failures"] == 1 and metrics["reward/judge/timeouts"] == 0
    assert metrics["reward/judge/tokens/mean"] == 5.0 and metrics["reward/judge/latency_s"] == 0.5


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    from controller.models.builtin import resolve_model_path

    where = tmp_path_factory.mktemp("models")
    return {name: resolve_model_path(f"builtin:{name}", where) for name in ("tiny-arithmetic", "tiny-chat")}


def test_a_judge_is_checked_before_launch(models):
    judge = [f"reward.judge.model_path={models['tiny-chat']}", "reward.fn=null"]

    def problems(*overrides):
        with pytest.raises(ConfigError) as info:
            check_config(load_config(PPO_TINY, [*judge, *overrides]))
        return str(info.value)

    check_config(load_config(PPO_TINY, judge))  # the judge alone is a reward
    assert "reward.judge.template names placeholder(s) ['answer']" in problems("reward.judge.template='{answer}'")
    assert "reward.judge.parser 'grade' is not one of the built-in parsers" in problems("reward.judge.parser=grade")
    assert "reward.judge: trainer.mode=async is refused" in problems("trainer.mode=async",
                                                                     "trainer.placement={rollout: 1}")
    assert "drop reward.judge.data_sources" in problems("reward.judge.data_sources=[arithmetic]")
    assert "cannot load a checkpoint of its own; use an engine that does (vllm)" in problems("reward.judge.engine=megatron")
    assert f"reward.judge.model_path '{models['tiny-arithmetic']}' has no chat template" in problems(
        f"reward.judge.model_path={models['tiny-arithmetic']}")
    with pytest.raises(ConfigError, match="reward.judge: weight must be a finite number, got 'much'|weight"):
        load_config(PPO_TINY, [*judge, "reward.judge.weight=much"])
    with pytest.raises(ConfigError, match="model_path is required"):
        load_config(PPO_TINY, ["reward.judge.parser=yes_no"])


def test_a_rule_reward_leaves_the_judges_data_sources_to_it(models):
    """Routed by data source: the rule scores its rows and skips the judge's (no call: 0)."""
    from workers.reward import RuleReward

    calls = []

    def exact(prompt, response, ground_truth, extra, **kwargs):
        calls.append(extra["data_source"])
        return 1.0

    worker = RuleReward(models["tiny-arithmetic"], exact, skip_data_sources=("writing",))
    batch = DataProto({"prompts": torch.ones(2, 2, dtype=torch.long), "responses": torch.ones(2, 2, dtype=torch.long),
                       "attention_mask": torch.ones(2, 4), "response_mask": torch.ones(2, 2)},
                      non_tensor_batch={"data_source": np.array(["arithmetic", "writing"], dtype=object)})
    assert worker.compute_reward(batch).batch["scores"].tolist() == [1.0, 0.0]
    assert calls == ["arithmetic"]
