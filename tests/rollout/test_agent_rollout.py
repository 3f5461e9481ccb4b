"""A multi-turn rollout on the real engine: megatron's static engine generates each turn on the actor's resharded
weights, a simulated user answers between turns, and the actor's log-probs on the very same ids agree with the
rollout's within 1e-4 (fp32) on every model token; observations sit between the turns, masked out."""

from pathlib import Path

import torch

from chat_tokenizer import make_chat_model
from conftest import run_torchrun

TEMPLATE = ("{% for m in messages %}<s>{{ m['role'] }}:{{ m['content'] }}</s>;{% endfor %}"
            "{% if add_generation_prompt %}<s>assistant:{% endif %}")


def test_multi_turn_rollout_log_probs_agree_with_the_actor_on_the_exact_ids(tmp_path):
    from transformers import AutoTokenizer

    model = make_chat_model(tmp_path / "model", TEMPLATE)
    proc = run_torchrun(Path(__file__).parent / "agent_program.py", [model, str(tmp_path)], nproc=2, timeout=400)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-5000:]
    saved = torch.load(tmp_path / "agent.pt", weights_only=False)
    batch, recomputed = saved["batch"], saved["recomputed"]
    mask = batch.batch["response_mask"].bool()
    assert mask.shape == (8, 80) and len(batch) == 8  # 4 prompts x 2 samples
    metrics = batch.meta_info["metrics"]
    assert metrics["agent/num_turns/mean"] == 3 and metrics["agent/finish_reason/stop"] == 1.0
    assert list(batch.non_tensor_batch["agent_reward"]) == [1.5] * 8  # 0.25 + 0.25 + 1.0
    tokenizer = AutoTokenizer.from_pretrained(model)
    for row in range(8):
        real = batch.batch["attention_mask"][row, -80:].bool()
        response = batch.batch["responses"][row][real].tolist()
        row_mask = mask[row][real].tolist()
        # Three model runs with the user's two answers between them, each in the template's delimiters.
        runs = [value for i, value in enumerate(row_mask) if i == 0 or row_mask[i - 1] != value]
        assert runs == [1, 0, 1, 0, 1], row_mask
        observations = tokenizer.decode([t for t, m in zip(response, row_mask) if not m])
        turn = int(batch.non_tensor_batch["agent_messages"][row][2]["content"][-1])
        assert f"<s>user:more{turn}</s>;<s>assistant:" in observations
    difference = (recomputed.batch["old_log_probs"] - batch.batch["rollout_log_probs"]).abs()[mask]
    assert difference.max() < 1e-4, difference.max()
    assert 8 * 3 <= int(mask.sum()) <= 8 * 3 * 6  # three turns of at most max_new_tokens each
    # The same seeds give the same conversations, token for token.
    assert torch.equal(saved["again"].batch["input_ids"], batch.batch["input_ids"])


def test_the_calculator_agent_example_trains_through_the_cli(tmp_path):
    """The calculator example, with REINFORCE++ and a simulated user who asks again after a reply without a tool
    call (so the random model's conversations have several turns) and scores every reply."""
    import json

    from test_train_cli import hybridflow

    proc = hybridflow("train", "--config", "examples/calculator_agent.yaml", "model_path=builtin:tiny-chat",
                      "algorithm.name=reinforce_plus_plus",
                      "rollout.agent.environment=tests.agent_environments:RetryingCalculator",
                      f"trainer.rollout_data_dir={tmp_path / 'rollouts'}",
                      f"trainer.run_dir={tmp_path}", "trainer.total_steps=2", "trainer.val_every=0",
                      "trainer.val_before_train=false", "trainer.logger=[jsonl]", "trainer.export_hf=false",
                      "trainer.plots=false", "data.batch_size=4", "data.train_size=32", "data.val_size=4",
                      "rollout.sampling.n=2", "rollout.sampling.max_new_tokens=16", "rollout.agent.max_response_length=64",
                      "ppo.ppo_mini_batch_size=8", "actor.engine.micro_batch_size=4", "rollout.kv_cache_bytes=67108864",
                      "rollout.max_prompt_length=640")
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-5000:]
    # The tools' instructions make the tiny model's character-level prompts long: refused before any worker starts.
    short = hybridflow("train", "--config", "examples/calculator_agent.yaml", "model_path=builtin:tiny-chat",
                       f"trainer.run_dir={tmp_path / 'short'}", "data.train_size=32", "data.val_size=4")
    assert short.returncode == 2 and "rollout.agent: 32 train prompt(s) render, with the tools' instructions, to more " \
        "than rollout.max_prompt_length 448 tokens" in short.stderr, short.stderr[-2000:]
    steps = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [s["step"] for s in steps] == [1, 2]
    for step in steps:
        for key in ("agent/num_turns/mean", "agent/tool_calls/mean", "agent/tool_errors", "agent/finish_reason/stop",
                    "agent/finish_reason/length", "response_length/mean", "actor/pg_loss", "critic/score/mean"):
            assert key in step, (key, sorted(step))
        assert 1 <= step["agent/num_turns/mean"] <= 3
        assert step["response_length/mean"] <= 64  # model tokens only
        shares = sum(step[f"agent/finish_reason/{r}"] for r in ("stop", "max_turns", "length", "environment_error"))
        assert abs(shares - 1.0) < 1e-6
        assert step["rollout/logprob_diff_max"] < 0.1  # bf16 engines agree on the exact multi-turn ids
    # The final reward reaches the earlier turns across the observation tokens (issue #30: their return was 0).
    rows = [json.loads(line) for step in (1, 2) for line in (tmp_path / "rollouts" / f"{step}.jsonl").read_text().splitlines()]
    assert len(rows) == 2 * 4 * 2
    multi_turn = [r for r in rows if "10" in "".join(str(int(m)) for m in r["response_mask"]).strip("0")]
    assert multi_turn, [r["response_mask"] for r in rows]
    for row in multi_turn:
        model = [i for i, m in enumerate(row["response_mask"]) if m]
        first_turn_end = next(i for i in model if row["response_mask"][i + 1] == 0)
        assert row["score"] != 0
        # gamma 1, the whole score on the last model token: every model token's return is the score.
        assert all(abs(row["returns"][i] - row["score"]) < 1e-5 for i in model), row
        assert row["advantages"][model[0]] == row["advantages"][first_turn_end] == row["advantages"][model[-1]]
    assert any(row["advantages"][0] != 0 for row in multi_turn)
