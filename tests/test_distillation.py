"""On-policy distillation without a process: OPD's advantages and the reverse-KL metric against the formula by hand,
the teacher's tokenizer check, its config section and the checks before launch, and the researcher's keyword.
(The teacher's log-probs and its KL term against HF: tests/megatron/test_actor_parity.py; the CLI, learning:
tests/test_distillation_e2e.py; one-step-off and a resumed run with a teacher: tests/test_one_step_off.py.)"""

import math
import shutil

import numpy as np
import pytest
import torch

from conftest import ROOT
from controller.algorithms import StepState, build_algorithm
from controller.algorithms.config import AlgorithmConfig
from controller.config import ConfigError, check_config, load_config
from controller.models.builtin import resolve_model_path
from controller.rl.step_metrics import batch_metrics
from controller.rl.teacher import TeacherConfig, tokenizer_mismatch
from workers.data_proto import DataProto

OPD_TINY = ROOT / "examples" / "distillation" / "opd_tiny.yaml"

# Two prompts, two samples each; responses of 3, 2, 3 and 1 tokens (right padding holds junk: never read).
MASK = torch.tensor([[1, 1, 1], [1, 1, 0], [1, 1, 1], [1, 0, 0]], dtype=torch.float32)
TEACHER = torch.tensor([[-0.5, -1.0, -0.1], [-2.0, -0.3, 9.0], [-0.7, -0.2, -1.5], [-0.05, 7.0, 7.0]])
STUDENT = torch.tensor([[-1.2, -0.4, -0.1], [-0.5, -0.9, 5.0], [-0.7, -2.2, -0.5], [-3.05, 3.0, 3.0]])
SCORES = torch.tensor([1.0, 0.0, 0.0, 0.0])  # the task reward of each response (on its last token)


def opd_batch() -> DataProto:
    token_scores = torch.zeros(4, 3)
    token_scores[[0, 1, 2, 3], [2, 1, 2, 0]] = SCORES
    return DataProto({"teacher_log_probs": TEACHER, "old_log_probs": STUDENT, "response_mask": MASK,
                      "token_level_scores": token_scores, "scores": SCORES},
                     non_tensor_batch={"uid": np.array(["a", "a", "b", "b"], dtype=object)})


def test_opd_advantages_are_the_teachers_minus_the_students_log_prob_per_token():
    algorithm = build_algorithm(AlgorithmConfig(name="opd"))
    out = algorithm.advantages(None, StepState(0), opd_batch())
    by_hand = torch.tensor([[-0.5 + 1.2, -1.0 + 0.4, -0.1 + 0.1],
                            [-2.0 + 0.5, -0.3 + 0.9, 0.0],
                            [-0.7 + 0.7, -0.2 + 2.2, -1.5 + 0.5],
                            [-0.05 + 3.05, 0.0, 0.0]])
    torch.testing.assert_close(out.batch["advantages"], by_hand)
    torch.testing.assert_close(out.batch["token_level_rewards"], by_hand)  # the per-token reward it trains on


def test_opd_adds_the_task_rewards_group_advantage_at_its_weight():
    algorithm = build_algorithm(AlgorithmConfig(name="opd", settings={"reward_weight": 0.5}))
    assert algorithm.settings.reward_weight == 0.5 and algorithm.estimator == "grpo"
    out = algorithm.advantages(None, StepState(0), opd_batch())
    # GRPO by hand: group a scores (1, 0): mean 0.5, sample std sqrt(0.5); group b (0, 0): 0.
    group_a = 0.5 / (math.sqrt(0.5) + 1e-6)
    task = torch.tensor([[group_a] * 3, [-group_a] * 2 + [0.0], [0.0] * 3, [0.0] * 3])
    distill = (TEACHER - STUDENT) * MASK
    torch.testing.assert_close(out.batch["advantages"], distill + 0.5 * task * MASK)


def test_opd_settings_are_checked_where_they_are_read():
    with pytest.raises(ConfigError, match="algorithm: reward_weight must be a finite number >= 0, got -1.0"):
        load_config(OPD_TINY, ["algorithm.reward_weight=-1"])
    with pytest.raises(ConfigError, match="reward_weight"):  # another algorithm has no such setting
        load_config(OPD_TINY, ["algorithm.name=grpo", "algorithm.reward_weight=1"])


def test_the_reverse_kl_metric_is_the_token_mean_of_log_student_minus_log_teacher():
    batch = opd_batch()
    batch.batch.update({"token_level_rewards": torch.zeros(4, 3), "responses": torch.zeros(4, 3, dtype=torch.long),
                        "prompts": torch.zeros(4, 2, dtype=torch.long), "attention_mask": torch.ones(4, 5)})
    diffs = [-1.2 + 0.5, -0.4 + 1.0, -0.1 + 0.1, -0.5 + 2.0, -0.9 + 0.3, -0.7 + 0.7, -2.2 + 0.2, -0.5 + 1.5,
             -3.05 + 0.05]
    assert batch_metrics(batch)["actor/opd/reverse_kl"] == pytest.approx(sum(diffs) / len(diffs))
    from controller.metrics.log import format_step_line

    assert format_step_line(3, 10, {"actor/opd/reverse_kl": 1.2345, "actor/ppo_kl": 0.01}) == (
        "step 3/10 | reverse_kl 1.23 | kl 0.01")


@pytest.fixture(scope="module")
def student(tmp_path_factory):
    return resolve_model_path("builtin:tiny-arithmetic", tmp_path_factory.mktemp("student"))


@pytest.fixture(scope="module")
def other_vocabulary(student, tmp_path_factory):
    """The student's model with a character tokenizer of 40 more ids: the same up to the student's last id."""
    from controller.models.char_tokenizer import save_char_tokenizer
    from transformers import AutoTokenizer

    path = tmp_path_factory.mktemp("teacher") / "wider"
    shutil.copytree(student, path)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        (path / name).unlink(missing_ok=True)
    save_char_tokenizer(path, len(AutoTokenizer.from_pretrained(student)) + 40)
    return path


def test_the_teachers_tokenizer_must_be_the_students(student, other_vocabulary, tmp_path):
    from transformers import AutoTokenizer

    assert tokenizer_mismatch(str(student), str(student)) is None
    ours = AutoTokenizer.from_pretrained(student)
    theirs = AutoTokenizer.from_pretrained(other_vocabulary)
    first = next(i for i in range(len(theirs)) if i >= len(ours)  # by decoding each id, not by the vocabularies
                 or ours.convert_ids_to_tokens(i) != theirs.convert_ids_to_tokens(i))
    problem = tokenizer_mismatch(str(student), str(other_vocabulary))
    kind = type(ours).__name__  # transformers' class for a tokenizer.json
    assert (f"the teacher's tokenizer ({kind} of {other_vocabulary}, {len(theirs)} tokens) is not "
            f"the student's ({kind} of {student}, {len(ours)} tokens)") in problem
    assert (f"they first differ at token id {first}: None in the student's, "
            f"{theirs.convert_ids_to_tokens(first)!r} in the teacher's") in problem
    # A tokenizer of another kind altogether: DeBERTa's word-level one differs from its first id.
    deberta = resolve_model_path("builtin:tiny-deberta-reward", tmp_path)
    other = AutoTokenizer.from_pretrained(deberta)
    assert (f"is not the student's ({kind} of {student}, {len(ours)} tokens): they first differ at "
            f"token id 0: '<pad>' in the student's, {other.convert_ids_to_tokens(0)!r} in the teacher's"
            in tokenizer_mismatch(str(student), deberta))


def test_a_mismatched_teacher_is_refused_before_launch_naming_both_tokenizers(student, other_vocabulary, tmp_path):
    """What ``hybridflow train`` checks before it starts a process (``check_job``); and the Python API when it
    declares the roles."""
    from controller.jobs.train_job import check_job
    from controller.rl.trainer import RLTrainer

    config = load_config(OPD_TINY, [f"model_path={student}", f"teacher.model_path={other_vocabulary}",
                                    f"trainer.run_dir={tmp_path}"])
    with pytest.raises(ConfigError, match="they first differ at token id"):
        check_job(config, str(student))
    with pytest.raises(ConfigError, match=r"teacher.model_path: the teacher's tokenizer .* is not the student's"):
        RLTrainer(config, train_data=[{"prompt": "1+1=", "ground_truth": "2"}])
    check_job(load_config(OPD_TINY, [f"model_path={student}", f"teacher.model_path={student}",
                                     f"trainer.run_dir={tmp_path}"]), str(student))  # the same tokenizer: runs


def test_what_a_job_with_a_teacher_needs_is_checked_before_launch(student, tmp_path):
    base = [f"model_path={student}", f"trainer.run_dir={tmp_path}"]

    def problems(*overrides):
        with pytest.raises(ConfigError) as info:
            check_config(load_config(OPD_TINY, [*base, *overrides]))
        return str(info.value)

    with pytest.raises(ConfigError, match="teacher: model_path is required"):
        load_config(OPD_TINY, ["teacher.model_path=null"])
    with pytest.raises(ConfigError, match="a built-in model is random"):
        load_config(OPD_TINY, ["teacher.model_path=builtin:tiny-arithmetic"])
    no_teacher = [*base, "teacher=null"]
    with pytest.raises(ConfigError, match="algorithm.name 'opd' distils from a teacher: set teacher.model_path"):
        check_config(load_config(OPD_TINY, no_teacher))
    assert "algorithm.teacher_kl_coef=0.1 is a KL term to a teacher: set teacher.model_path" in problems(
        "algorithm.name=grpo", "algorithm.teacher_kl_coef=0.1", "teacher=null")
    assert "teacher: is set, but nothing reads it: use algorithm.name=opd" in problems(
        "algorithm.name=grpo", f"teacher.model_path={student}")
    assert "algorithm.teacher_kl_coef must be a finite number >= 0, got -0.5" in problems(
        f"teacher.model_path={student}", "algorithm.teacher_kl_coef=-0.5")
    assert "teacher: trainer.mode=async is refused: its responses are sampled across weight updates" in problems(
        f"teacher.model_path={student}", "trainer.mode=async", "trainer.placement={rollout: 1}")
    assert "teacher.engine: tensor_parallel x pipeline_parallel = 3 does not divide trainer.nproc 2" in problems(
        f"teacher.model_path={student}", "teacher.engine={tensor_parallel: 3}")
    # the teacher alone: no reward sample per prompt is compared, so one sample per prompt is enough
    check_config(load_config(OPD_TINY, [*base, f"teacher.model_path={student}", "rollout.sampling.n=1"]))
    assert "algorithm.kl_in_reward puts a KL penalty in the task reward, which opd with reward_weight 0" in problems(
        f"teacher.model_path={student}", "algorithm.kl_in_reward=true")
    assert "rollout.sampling.n must be >= 2" in problems(f"teacher.model_path={student}", "rollout.sampling.n=1",
                                                         "algorithm.reward_weight=1")


def test_a_runs_saved_config_gives_the_teacher_back(student, tmp_path):
    """What a run directory keeps (config.yaml: ``hybridflow export``, a resumed or restarted job) holds the teacher."""
    import yaml

    from controller.config import config_to_dict

    config = load_config(OPD_TINY, [f"teacher.model_path={student}", "teacher.engine={tensor_parallel: 2}",
                                    "algorithm.reward_weight=0.25"])
    saved = tmp_path / "config.yaml"
    saved.write_text(yaml.safe_dump(config_to_dict(config), sort_keys=False))
    again = load_config(saved)
    assert again == config and again.roles["teacher"].engine.tensor_parallel == 2
    assert again.algorithm.settings.reward_weight == 0.25


def test_the_teacher_defaults_to_the_reference_engine_and_the_researchers_keyword_declares_it(student):
    from controller.rl.teacher import teacher_engine
    from controller.rl.trainer import RLTrainer
    from workers.actor import Actor
    from workers.teacher import Teacher

    config = load_config(OPD_TINY, [f"teacher.model_path={student}", "actor.engine.micro_batch_size=3"])
    assert teacher_engine(config.roles["teacher"], config) == config.actor.engine
    config = load_config(OPD_TINY, [f"teacher.model_path={student}", "ref_policy.engine.micro_batch_size=5"])
    assert teacher_engine(config.roles["teacher"], config).micro_batch_size == 5
    trainer = RLTrainer(actor=Actor.from_pretrained(str(student)), algorithm="opd", reward_fn="arithmetic_answer",
                        teacher=Teacher.from_pretrained(str(student), tensor_parallel=2),
                        train_data=[{"prompt": "1+1=", "ground_truth": "2"}], batch_size=1)
    section = trainer.config.roles["teacher"]
    assert section == TeacherConfig(model_path=str(student), engine=section.engine)
    assert section.engine.tensor_parallel == 2
    assert trainer.specs["teacher"].worker_cls is Teacher and "ref_policy" not in trainer.specs
