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
