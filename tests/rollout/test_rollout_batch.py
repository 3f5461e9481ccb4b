"""Sampling settings, prompt checks and the rollout batch layout: pure functions, no engine."""

import pytest
import torch

from hybridengine.model.spec import ModelSpec
from workers import DataProto
from workers.rollout import PromptError, RolloutConfig, SamplingConfig
from workers.rollout.batch import (
    Completion,
    build_requests,
    build_rollout_batch,
    check_special_tokens,
    stop_in_continuation,
)


def prompts(rows, width=6):
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    mask = torch.zeros(len(rows), width, dtype=torch.long)
    for i, row in enumerate(rows):
        ids[i, width - len(row):] = torch.tensor(row)
        mask[i, width - len(row):] = 1
    return DataProto({"input_ids": ids, "attention_mask": mask, "answer": torch.arange(len(rows))}, {"tag": ["a", "b", "c"][: len(rows)]})


def test_sampling_settings_are_checked_with_every_problem_named():
    with pytest.raises(ValueError) as info:
        SamplingConfig(max_new_tokens=0, temperature=-1.0, top_p=0.0, top_k=0, n=0)
    message = str(info.value)
    for part in ("max_new_tokens must be a positive integer, got 0", "temperature must be a finite number >= 0",
                 "top_p must be in (0, 1]", "top_k must be -1", "n (samples per prompt) must be >= 1"):
        assert part in message
    with pytest.raises(ValueError, match=r"unknown sampling settings \['temprature'\]"):
        SamplingConfig().updated({"temprature": 0.5})
    assert SamplingConfig(stop="##").stop == ("##",)


def test_greedy_and_logprob_temperature():
    assert SamplingConfig(temperature=0).is_greedy and SamplingConfig(greedy=True, temperature=0.7).is_greedy
    assert SamplingConfig(greedy=True, temperature=0.7).logprob_temperature == 1.0
    assert SamplingConfig(temperature=0.7).logprob_temperature == 0.7


def test_requests_are_prompt_major_with_seeds_by_global_index():
    sampling = SamplingConfig(n=3, seed=100)
    reqs = build_requests(prompts([[5, 6], [7]]), sampling, max_prompt_length=6, first_index=4)
    assert [r.prompt_ids for r in reqs] == [(5, 6)] * 3 + [(7,)] * 3
    # seed + index * n + sample: independent of how the batch was split across replicas.
    assert [r.seed for r in reqs] == [100 + 4 * 3 + j for j in range(3)] + [100 + 5 * 3 + j for j in range(3)]
    assert all(r.seed is None for r in build_requests(prompts([[5]]), SamplingConfig(), 6))


def test_long_prompts_error_by_default_and_can_be_truncated_on_the_left():
    batch = prompts([[1, 2], [3, 4, 5, 6, 7]])
    with pytest.raises(PromptError, match=r"prompt 11 has 5 tokens, more than max_prompt_length=3"):
        build_requests(batch, SamplingConfig(), max_prompt_length=3, first_index=10)
    reqs = build_requests(batch, SamplingConfig(), max_prompt_length=3, truncation="left")
    assert reqs[1].prompt_ids == (5, 6, 7)


def test_bad_prompt_batches_are_refused():
    with pytest.raises(PromptError, match="empty"):
        build_requests(DataProto({"input_ids": torch.zeros(0, 3, dtype=torch.long),
                                  "attention_mask": torch.zeros(0, 3, dtype=torch.long)}), SamplingConfig(), 4)
    with pytest.raises(PromptError, match="no 'attention_mask'"):
        build_requests(DataProto({"input_ids": torch.ones(2, 3, dtype=torch.long)}), SamplingConfig(), 4)
    with pytest.raises(PromptError, match="prompt 1 is empty"):
        build_requests(prompts([[1], []]), SamplingConfig(), 4)
    with pytest.raises(PromptError, match="truncation 'right' is not one of"):
        build_requests(prompts([[1]]), SamplingConfig(), 4, truncation="right")


def test_tokenizer_without_pad_or_eos_is_refused():
    with pytest.raises(PromptError, match="has no pad_token_id and no eos_token_id"):
        check_special_tokens(None, None, "model-x")
    with pytest.raises(PromptError, match="has no eos_token_id"):
        check_special_tokens(0, None, "model-x")
    check_special_tokens(0, 2, "model-x")


def test_rollout_batch_layout():
    batch = prompts([[5, 6], [7, 8, 9]], width=4)
    sampling = SamplingConfig(n=2, max_new_tokens=3, temperature=0.5)
    reqs = build_requests(batch, sampling, max_prompt_length=3, truncation="left")
    completions = [Completion([11], [-0.5], "stop"), Completion([12, 13, 14], [-1.0, -2.0, -3.0]),
                   Completion([], []), Completion([15, 16], [-0.25, -0.75], "stop")]
    out = build_rollout_batch(batch, reqs, completions, sampling, max_prompt_length=3, pad_token_id=0)
    b = out.batch
    assert b["prompts"].tolist() == [[0, 5, 6], [0, 5, 6], [7, 8, 9], [7, 8, 9]]  # width min(4, 3)
    assert b["responses"].tolist() == [[11, 0, 0], [12, 13, 14], [0, 0, 0], [15, 16, 0]]
    assert b["response_mask"].tolist() == [[1, 0, 0], [1, 1, 1], [0, 0, 0], [1, 1, 0]]
    assert b["attention_mask"][0].tolist() == [0, 1, 1, 1, 0, 0]
    assert b["position_ids"][0].tolist() == [0, 0, 1, 2, 2, 2]
    assert b["input_ids"][1].tolist() == [0, 5, 6, 12, 13, 14]
    assert b["rollout_log_probs"][3].tolist() == [-0.25, -0.75, 0.0]
    assert b["answer"].tolist() == [0, 0, 1, 1] and out.non_tensor_batch["tag"].tolist() == ["a", "a", "b", "b"]
    assert out.non_tensor_batch["finish_reason"].tolist() == ["stop", "length", "length", "stop"]
    assert out.meta_info["temperature"] == 0.5


def test_rollout_config_lists_every_problem():
    with pytest.raises(ValueError) as info:
        RolloutConfig(engine="sglang", truncation="middle", tensor_parallel=0, reshard_method="magic")
    message = str(info.value)
    for part in ("engine 'sglang' is not one of ('vllm', 'megatron')", "truncation 'middle'",
                 "reshard_method 'magic'", "tensor_parallel must be a positive integer, got 0"):
        assert part in message
    with pytest.raises(ValueError, match="vllm engine runs pipeline_parallel=1 only"):
        RolloutConfig(engine="vllm", pipeline_parallel=2)
    assert RolloutConfig(sampling={"max_new_tokens": 5}, max_prompt_length=7).max_model_len == 12


def test_vllm_head_dims_that_cpu_attention_cannot_run_are_refused(tmp_path):
    from tiny_models import make_llama

    from workers.rollout.vllm_engine import check_vllm_head_dim

    check_vllm_head_dim(ModelSpec.from_pretrained(make_llama(tmp_path / "ok", layers=1)))  # head dim 32
    narrow = ModelSpec.from_pretrained(make_llama(tmp_path / "narrow", layers=1, head_dim=16))
    with pytest.raises(ValueError, match=r"head dimension 16 cannot run on vLLM's CPU attention; supported head dimensions: \[32, 64"):
        check_vllm_head_dim(narrow)


def test_logprob_agreement_counts_response_tokens_only():
    from workers.rollout.agreement import logprob_agreement

    rollout = torch.tensor([[-1.0, -2.0, -9.0], [-0.5, -0.5, -0.5]])
    actor = torch.tensor([[-1.1, -2.0, 0.0], [-0.5, -0.8, -0.5]])
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    got = logprob_agreement(rollout, actor, mask)
    assert got["rollout/logprob_diff_max"] == pytest.approx(0.3)
    assert got["rollout/logprob_diff_mean"] == pytest.approx((0.1 + 0.0 + 0.0 + 0.3 + 0.0) / 5)


def test_old_log_probs_for_the_ratio_come_from_recompute_or_rollout():
    from workers.rollout.agreement import use_old_log_probs

    batch = DataProto({"old_log_probs": torch.zeros(2, 3), "rollout_log_probs": torch.ones(2, 3)})
    assert use_old_log_probs(batch, "recompute").batch["old_log_probs"].sum() == 0
    assert use_old_log_probs(batch, "rollout").batch["old_log_probs"].sum() == 6
    with pytest.raises(ValueError, match="'actor' is not one of"):
        use_old_log_probs(batch, "actor")
    with pytest.raises(KeyError, match="needs 'rollout_log_probs'"):
        use_old_log_probs(DataProto({"old_log_probs": torch.zeros(2, 3)}), "rollout")


def test_a_stop_string_begun_in_an_earlier_call_ends_the_response_through_its_last_token():
    def ids(text):
        return [ord(c) for c in text]

    def decode(tokens):
        return "".join(chr(t) for t in tokens)

    # Against the reference: the response is the shortest prefix of the whole text holding a stop string.
    def reference(before, new, stops):
        whole = before + new
        k = next((k for k in range(len(before) + 1, len(whole) + 1) if any(s in decode(whole[:k]) for s in stops)), None)
        return None if k is None else k - len(before)

    cases = [("ab\n", "\ncd", ("\n\n",)),            # the stop's first character came in the earlier call
             ("x<|e", "nd|>yy", ("<|end|>",)),         # 4 characters before the boundary, 3 after
             ("abc", "dX<|end|>", ("<|end|>", "cd")),  # the earlier of two: "cd" spans, <|end|> lies in new
             ("abc", "def", ("zz",)), ("", "a\n\n", ("\n\n",)), ("ab", "", ("b",))]
    for before, new, stops in cases:
        got = stop_in_continuation(ids(before), ids(new), stops, decode)
        assert got == (reference(ids(before), ids(new), stops) if before and new else None), (before, new, stops, got)
    assert stop_in_continuation(ids("ab\n"), ids("\ncd"), (), decode) is None
    assert stop_in_continuation(ids("ab\n"), ids("\ncd"), ("\n\n",), decode) == 1
    assert stop_in_continuation(ids("x<|e"), ids("nd|>yy"), ("<|end|>",), decode) == 4
    # Only the tail that can hold a stop string is decoded, however long the response so far.
    seen = []
    stop_in_continuation(ids("q" * 500 + "a"), ids("b"), ("ab",), lambda t: seen.append(len(t)) or decode(t))
    assert max(seen) <= len("ab") + 8 + 1


def test_routed_experts_line_up_with_the_tokens_and_pad_with_minus_one():
    """A mixture of experts' completions' routes ([prompt + response - 1, layers, k]) sit at their tokens'
    columns of input_ids; -1 marks padding and the last token; batches of other prompt widths concatenate."""
    from workers.megatron.routing_replay import ROLLOUT_ROUTES
    from workers.rollout.batch import concat_rollout_batches

    sampling = SamplingConfig(n=1, max_new_tokens=3)
    batch_in = prompts([[5, 6], [7, 8, 9]], width=4)
    requests = build_requests(batch_in, sampling, max_prompt_length=8)

    def routes(n, base):  # [n, 2 layers, k 2]: distinct values per position
        return (base + torch.arange(n * 4).reshape(n, 2, 2)).to(torch.int16)

    completions = [Completion([1, 2, 3], [0.0] * 3, routed_experts=routes(4, 0)),  # 2 + 3 - 1
                   Completion([4], [0.0], "stop", routed_experts=routes(3, 100))]  # 3 + 1 - 1
    made = build_rollout_batch(batch_in, requests, completions, sampling, 8, pad_token_id=0)
    out = made.batch
    got = out[ROLLOUT_ROUTES]
    assert got.shape == (2, 4 + 3, 2, 2) and got.dtype == torch.int16
    # row 0: prompt at columns 2-3, response 4-6; routes on columns 2..5, none on the last token (6)
    assert torch.equal(got[0, 2:6], routes(4, 0)) and (got[0, :2] == -1).all() and (got[0, 6:] == -1).all()
    # row 1: prompt at 1-3, one response token at 4; routes on 1..3
    assert torch.equal(got[1, 1:4], routes(3, 100)) and (got[1, :1] == -1).all() and (got[1, 4:] == -1).all()
    known = got[..., 0, 0] >= 0
    assert (known <= out["attention_mask"].bool()).all()  # a route only where there is a token
    long_prompt = prompts([[5, 6, 7, 8, 9, 10]], width=6)
    wider = build_rollout_batch(long_prompt, build_requests(long_prompt, sampling, 8),
                                [Completion([1], [0.0], routed_experts=routes(6, 7))], sampling, 8, pad_token_id=0)
    both = concat_rollout_batches([made, wider], pad_token_id=0).batch
    assert both[ROLLOUT_ROUTES].shape == (3, 6 + 3, 2, 2)
    assert torch.equal(both[ROLLOUT_ROUTES][:2, 2:], got) and (both[ROLLOUT_ROUTES][:2, :2] == -1).all()
    with pytest.raises(RuntimeError, match="completion 1 carries no routed experts while others do"):
        build_rollout_batch(batch_in, requests, [completions[0], Completion([4], [0.0])], sampling, 8, pad_token_id=0)
