"""Micro-batches: grouping by token budget, trimming, response positions (pure), and the losses and gradients
of token-budget micro-batches against fixed ones on real actors (PP2 x DP2, gloo)."""

import pytest
import torch

from conftest import TESTS, run_torchrun
from tiny_models import make_llama, make_rl_batch
from workers.megatron.micro_batches import build_micro_batch, fixed_groups, original_order, token_budget_groups


def test_token_budget_groups_hold_at_most_the_budget_and_every_row_once():
    lengths = [5, 17, 3, 9, 12, 12, 1, 20, 8]
    groups = token_budget_groups(lengths, 24)
    assert sorted(i for g in groups for i in g) == list(range(len(lengths)))
    assert all(sum(lengths[i] for i in g) <= 24 for g in groups)
    # Longest first, cut greedily: [20], [17], [12, 12], [9, 8, 5], [3, 1]
    assert groups == [[7], [1], [4, 5], [3, 8, 0], [2, 6]]


def test_a_row_longer_than_the_budget_is_refused_with_the_length_to_use():
    with pytest.raises(ValueError, match="a sequence of 30 tokens .* exceeds max_tokens_per_micro_batch 24; raise it to at least 30"):
        token_budget_groups([5, 30], 24)
    with pytest.raises(ValueError, match="must be a positive integer, got 0"):
        token_budget_groups([5], 0)


def test_fixed_groups_need_a_multiple_of_the_size():
    assert fixed_groups(6, 2) == [[0, 1], [2, 3], [4, 5]]
    with pytest.raises(ValueError, match="7 sequences on this data-parallel rank do not divide into micro-batches of 2"):
        fixed_groups(7, 2)


def test_a_micro_batch_is_trimmed_to_its_longest_row_and_reads_each_response_token_where_it_is_predicted():
    batch = make_rl_batch(batch_size=6, prompt_length=6, response_length=5).batch
    rows = [4, 1, 3]
    mb = build_micro_batch(batch, rows)
    mask = batch["attention_mask"][rows]
    assert mb["input_ids"].shape == (3, int(mask.sum(-1).max()))
    ids, responses = batch["input_ids"][rows], batch["responses"][rows]
    for i in range(3):
        valid = ids[i][mask[i].bool()]
        row_length = len(valid)
        assert torch.equal(mb["input_ids"][i, :row_length], valid)  # rolled: valid tokens from index 0
        response_mask = batch["response_mask"][rows][i].bool()
        # The token after each response position is that response token (a next-token prediction).
        for j in torch.nonzero(response_mask).flatten().tolist():
            position = int(mb["response_index"][i, j])
            assert mb["input_ids"][i, position + 1] == responses[i, j]
    assert mb["response_index"].max() < mb["input_ids"].shape[1]  # padding positions clamped into the row


def test_original_order_undoes_the_grouping():
    batch = make_rl_batch(batch_size=5).batch
    micro = [build_micro_batch(batch, rows) for rows in ([3, 0], [4], [1, 2])]
    values = [batch["responses"][mb["rows"]].float() for mb in micro]
    assert torch.equal(original_order(values, micro), batch["responses"].float())


def test_token_budget_micro_batches_give_the_loss_and_gradients_of_fixed_ones(tmp_path):
    model = make_llama(tmp_path / "model")
    # 22-token rows at most; a budget of 40 makes micro-batches of 1-5 rows, their number differing between
    # the two DP ranks, their widths between micro-batches (shapes sent ahead between the pipeline stages).
    proc = run_torchrun(TESTS / "megatron" / "token_budget_program.py",
                        [str(model), str(tmp_path), "--pp", "2", "--budget", "40"], 4, timeout=400)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-5000:]
    result = torch.load(tmp_path / "result.pt", weights_only=False)
    mask = result["batch"].batch["response_mask"].bool()
    fixed, budget = result["fixed"], result["budget"]
    for key in ("old_log_probs", "entropys"):
        torch.testing.assert_close(budget["log_probs"].batch[key][mask], fixed["log_probs"].batch[key][mask], atol=1e-6, rtol=0)
    for f, b in zip(fixed["metrics"], budget["metrics"]):  # one dict per DP replica
        for key in ("actor/pg_loss", "actor/grad_norm", "actor/entropy", "actor/ppo_kl", "actor/pg_clipfrac"):
            assert b[key] == pytest.approx(f[key], abs=1e-6), key
        # The same rows as they came: the same padding before; less after grouping by length.
        assert b["actor/padding_fraction_before"] == f["actor/padding_fraction_before"]
        assert b["actor/padding_fraction_after"][0] < f["actor/padding_fraction_after"][0] < f["actor/padding_fraction_before"][0]
    for name, tensor in fixed["weights"].items():
        torch.testing.assert_close(budget["weights"][name], tensor, atol=1e-6, rtol=0, msg=lambda m, n=name: f"{n}: {m}")
