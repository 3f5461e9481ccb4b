"""RuleReward in one process: decoding, score placement, ground truth and extra fields, errors."""

import math

import numpy as np
import pytest
import torch

from controller.models.char_tokenizer import save_char_tokenizer
from workers import DataProto
from workers.base_worker import WorkerContext, bind_context, unbind_context
from workers.reward import RewardFunctionError, RuleReward
from workers.reward.rule_reward import last_token_scores

PROMPTS = ["12+30=", "2*3=", "7-2=", "9+9="]
RESPONSES = ["42", "#### 6", "", "1"]  # the third response is empty
GROUND_TRUTH = ["42", "6", "5", "18"]
PROMPT_WIDTH, RESPONSE_WIDTH = 8, 6


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    return str(save_char_tokenizer(tmp_path_factory.mktemp("char_tokenizer"), 256))


def make_batch(tokenizer_dir, prompts=PROMPTS, responses=RESPONSES, **fields) -> DataProto:
    """Left-padded prompts and right-padded responses, encoded with the char tokenizer."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    pad = tok.pad_token_id
    rows = len(prompts)
    prompt_ids = torch.full((rows, PROMPT_WIDTH), pad)
    prompt_mask = torch.zeros(rows, PROMPT_WIDTH, dtype=torch.long)
    response_ids = torch.full((rows, RESPONSE_WIDTH), pad)
    response_mask = torch.zeros(rows, RESPONSE_WIDTH, dtype=torch.long)
    for i, (prompt, response) in enumerate(zip(prompts, responses)):
        p = tok.encode(prompt, add_special_tokens=False)
        r = tok.encode(response, add_special_tokens=False)
        if p:
            prompt_ids[i, -len(p):] = torch.tensor(p)
            prompt_mask[i, -len(p):] = 1
        response_ids[i, : len(r)] = torch.tensor(r, dtype=torch.long)
        response_mask[i, : len(r)] = 1
    attention_mask = torch.cat([prompt_mask, response_mask], dim=1)
    return DataProto(
        {
            "prompts": prompt_ids,
            "responses": response_ids,
            "input_ids": torch.cat([prompt_ids, response_ids], dim=1),
            "attention_mask": attention_mask,
            "position_ids": (attention_mask.cumsum(-1) - 1).clamp(min=0),
            "response_mask": response_mask,
        },
        {key: np.array(values, dtype=object) for key, values in fields.items()},
        {"step": 3},
    )


def test_arithmetic_answer_scores_and_placement(tokenizer_dir):
    batch = make_batch(tokenizer_dir, ground_truth=GROUND_TRUTH)
    out = RuleReward(tokenizer_dir).compute_reward(batch)
    assert set(out.keys()) == {"token_level_scores", "scores"}
    assert out.batch["scores"].dtype == torch.float32
    assert out.batch["scores"].tolist() == [1.0, 1.0, 0.0, 0.0]
    expected = torch.zeros(4, RESPONSE_WIDTH)
    expected[0, 1] = 1.0  # "42": last valid response token at index 1
    expected[1, 5] = 1.0  # "#### 6": index 5
    assert out.batch["token_level_scores"].dtype == torch.float32
    assert torch.equal(out.batch["token_level_scores"], expected)


def test_text_ground_truth_and_extra_reach_the_function(tokenizer_dir):
    seen = []

    def record(prompt, response, ground_truth, extra, bonus):
        seen.append((prompt, response, ground_truth, extra))
        return len(response) + bonus

    batch = make_batch(tokenizer_dir, ground_truth=GROUND_TRUTH, data_source=["a", "b", "c", "d"])
    out = RuleReward(tokenizer_dir, reward_fn=record, reward_kwargs={"bonus": 0.25}).compute_reward(batch)
    assert [s[0] for s in seen] == PROMPTS  # the padding is not decoded
    assert [s[1] for s in seen] == RESPONSES
    assert [s[2] for s in seen] == GROUND_TRUTH
    assert [s[3] for s in seen] == [{"data_source": x} for x in "abcd"]
    assert out.batch["scores"].tolist() == [2.25, 6.25, 0.25, 1.25]
    # The empty response scores 0.25 but has no token to carry it.
    assert out.batch["token_level_scores"].tolist() == [
        [0, 2.25, 0, 0, 0, 0], [0, 0, 0, 0, 0, 6.25], [0] * 6, [1.25, 0, 0, 0, 0, 0],
    ]


def test_special_tokens_are_skipped_and_ground_truth_is_optional(tokenizer_dir):
    seen = []

    def record(prompt, response, ground_truth, extra):
        seen.append((prompt, response, ground_truth, extra))
        return 0.5

    batch = make_batch(tokenizer_dir, prompts=["<s>1+1="], responses=["2</s>"])
    RuleReward(tokenizer_dir, reward_fn=record).compute_reward(batch)
    assert seen == [("1+1=", "2", None, {})]


def test_shaped_reward_by_import_path(tokenizer_dir):
    batch = make_batch(tokenizer_dir, ground_truth=GROUND_TRUTH)
    worker = RuleReward(tokenizer_dir, reward_fn="workers.reward.functions:arithmetic_shaped")
    scores = worker.compute_reward(batch).batch["scores"]
    # "42" right; "#### 6" right; "" no digits; "1" one leading digit of the two in "18".
    assert scores.tolist() == [1.0, 1.0, 0.0, 0.25]


def boom(prompt, response, ground_truth, extra):
    if response == "":
        raise ZeroDivisionError("empty response")
    return 1.0


def test_a_raising_function_names_the_sample_and_function(tokenizer_dir):
    batch = make_batch(tokenizer_dir)
    with pytest.raises(RewardFunctionError, match=(
        r"reward function test_rule_reward:boom raised on sample 2 \(ZeroDivisionError: empty response\)"
    )) as info:
        RuleReward(tokenizer_dir, reward_fn=boom).compute_reward(batch)
    assert isinstance(info.value.__cause__, ZeroDivisionError)

    # A built-in without the ground truth it needs: named by its registered name.
    with pytest.raises(RewardFunctionError, match=(
        "reward function arithmetic_answer raised on sample 0 .ValueError: arithmetic_answer needs a ground truth"
    )):
        RuleReward(tokenizer_dir).compute_reward(batch)


def test_sample_index_counts_from_the_ranks_chunk(tokenizer_dir):
    """Rank 1 of 2 under DP_COMPUTE_PROTO holds rows 4..7 of the whole batch."""
    token = bind_context(WorkerContext(rank=1, world_size=2, local_rank=1, device=torch.device("cpu"), role="reward"))
    try:
        worker = RuleReward(tokenizer_dir, reward_fn=boom)
    finally:
        unbind_context(token)
    assert worker.rank == 1
    with pytest.raises(RewardFunctionError, match="raised on sample 6 "):
        worker.compute_reward(make_batch(tokenizer_dir))


@pytest.mark.parametrize("value,shown", [
    (None, r"None \(NoneType\)"), ("1.0", r"'1.0' \(str\)"), (math.nan, r"nan \(float\)"),
    (math.inf, r"inf \(float\)"), (-math.inf, r"-inf \(float\)"), (True, r"True \(bool\)"),
    (np.bool_(False), r"np\.False_ \(bool\)"), (torch.tensor(1.0), r"tensor\(1\.\) \(Tensor\)"),
])
def test_non_finite_or_non_numeric_scores_are_refused(tokenizer_dir, value, shown):
    batch = make_batch(tokenizer_dir)

    def bad_on_last(prompt, response, ground_truth, extra):
        return value if prompt == "9+9=" else 1.0

    with pytest.raises(RewardFunctionError, match=(
        rf"reward function test_rule_reward:.*bad_on_last returned {shown} on sample 3; "
        r"a reward must be a finite int or float"
    )):
        RuleReward(tokenizer_dir, reward_fn=bad_on_last).compute_reward(batch)


@pytest.mark.parametrize("value", [2, np.float32(0.5), np.int64(-3), 1e30])
def test_ints_and_numpy_numbers_are_accepted(tokenizer_dir, value):
    batch = make_batch(tokenizer_dir)
    out = RuleReward(tokenizer_dir, reward_fn=lambda *args: value).compute_reward(batch)
    assert out.batch["scores"].tolist() == [float(np.float32(value))] * 4


def test_missing_batch_keys(tokenizer_dir):
    batch = make_batch(tokenizer_dir).select(batch_keys=["prompts", "responses", "attention_mask"])
    with pytest.raises(KeyError, match=r"missing \['response_mask'\]"):
        RuleReward(tokenizer_dir).compute_reward(batch)


def test_unknown_reward_function_fails_at_construction(tokenizer_dir):
    with pytest.raises(ValueError, match="unknown reward function 'gsm8k'"):
        RuleReward(tokenizer_dir, reward_fn="gsm8k")


def test_last_token_scores():
    mask = torch.tensor([[1, 1, 1, 0], [0, 0, 0, 0], [1, 1, 1, 1], [1, 0, 0, 0]])
    out = last_token_scores(torch.tensor([0.5, 2.0, -1.0, 3.0], dtype=torch.float64), mask)
    assert out.dtype == torch.float32
    assert out.tolist() == [[0, 0, 0.5, 0], [0, 0, 0, 0], [0, 0, 0, -1.0], [3.0, 0, 0, 0]]


def test_trainer_hands_reward_kwargs_to_its_rule_reward_worker():
    """``reward.kwargs`` of a job reach every call of the reward function (through the RuleReward spec)."""
    from controller.data import arithmetic_prompts
    from controller.rl.trainer import RLTrainer
    from workers.actor import Actor
    from workers.rollout import Rollout

    trainer = RLTrainer(actor=Actor.from_pretrained("model"), rollout=Rollout.from_pretrained("model"),
                        reward_fn="format_check", reward_kwargs={"scale": 2.0}, algorithm="grpo",
                        train_data=arithmetic_prompts(8, seed=0), batch_size=4)
    spec = trainer.specs["reward"]
    assert spec.worker_cls is RuleReward
    assert spec.kwargs["reward_kwargs"] == {"scale": 2.0}


def test_a_multi_turn_sample_is_scored_on_the_models_last_turn(tokenizer_dir):
    # The decoded model tokens of a conversation would read "2+3" (a tool call) first; the answer is the last turn.
    conversations = [[{"role": "user", "content": "2+3?"}, {"role": "assistant", "content": "calc 2+3"},
                      {"role": "tool", "content": "5"}, {"role": "assistant", "content": "5"}]] * 4
    batch = make_batch(tokenizer_dir, ground_truth=["5", "5", "4", "5"], agent_messages=conversations)
    out = RuleReward(tokenizer_dir).compute_reward(batch)
    assert out.batch["scores"].tolist() == [1.0, 1.0, 0.0, 1.0]


def test_samples_are_scored_on_threads_up_to_max_concurrency_in_order(tokenizer_dir):
    import threading
    import time

    lock, running, most = threading.Lock(), [0], [0]

    def slow(prompt, response, ground_truth, extra):
        with lock:
            running[0] += 1
            most[0] = max(most[0], running[0])
        time.sleep(0.2)
        with lock:
            running[0] -= 1
        return float(len(prompt))

    prompts = [f"{i}+{i}=" + "9" * (i % 3) for i in range(8)]
    batch = make_batch(tokenizer_dir, prompts=prompts, responses=["1"] * 8)
    out = RuleReward(tokenizer_dir, reward_fn=slow, max_concurrency=4).compute_reward(batch)
    assert out.batch["scores"].tolist() == [float(len(p)) for p in prompts]  # each sample's own score, in order
    assert most[0] == 4
    most[0] = 0
    RuleReward(tokenizer_dir, reward_fn=slow).compute_reward(batch)  # a plain function: one at a time
    assert most[0] == 1
    with pytest.raises(RewardFunctionError, match="raised on sample 2"):  # the first failure, by sample
        RuleReward(tokenizer_dir, reward_fn=boom, max_concurrency=4).compute_reward(make_batch(tokenizer_dir))
    with pytest.raises(ValueError, match="max_concurrency must be a positive integer or None, got 0"):
        RuleReward(tokenizer_dir, reward_fn=slow, max_concurrency=0)


def test_a_reward_call_that_never_returns_times_out_scores_zero_and_the_batch_goes_on(tokenizer_dir):
    import threading
    import time

    never = threading.Event()

    def sometimes_hangs(prompt, response, ground_truth, extra):
        if prompt.startswith("2*3"):
            never.wait()  # sleeps forever
        return 1.0

    worker = RuleReward(tokenizer_dir, reward_fn=sometimes_hangs, max_concurrency=2, timeout_s=0.5)
    for _ in range(2):  # the first batch's hung call is abandoned: the second batch runs two at once again
        start = time.monotonic()
        out = worker.compute_reward(make_batch(tokenizer_dir))
        assert time.monotonic() - start < 0.5 + 1.0
        assert out.batch["scores"].tolist() == [1.0, 0.0, 1.0, 1.0]
        assert out.batch["reward_timed_out"].tolist() == [0.0, 1.0, 0.0, 0.0]
    assert worker._threads[2].hung == 2  # both abandoned, still waiting
    with pytest.raises(RewardFunctionError, match="raised on sample 2"):  # a failure is still a failure
        RuleReward(tokenizer_dir, reward_fn=boom, timeout_s=5).compute_reward(make_batch(tokenizer_dir))
    with pytest.raises(ValueError, match="timeout_s must be a positive number of seconds or None, got 0"):
        RuleReward(tokenizer_dir, reward_fn=boom, timeout_s=0)
    never.set()
