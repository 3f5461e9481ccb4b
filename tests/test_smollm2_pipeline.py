"""The SmolLM2 example's pipeline (`make smollm2`), for 2 steps on a tiny random Qwen3-style model.

The same config file (examples/smollm2_arithmetic.yaml), the same data command
(`hybridflow data arithmetic`: verl-schema parquet of chat messages), the model
swapped for a Qwen3 checkpoint (q/k norm, head_dim apart from hidden / heads)
with a chat-template tokenizer. The 30-step run on the real model is not a
test: its figures are in the README.
"""

import json
import os
import re
import subprocess
import sys

from chat_tokenizer import save_chat_tokenizer
from conftest import ROOT
from tiny_models import make_qwen3


def hybridflow(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", "controller.cli", *args], capture_output=True, text=True,
                          timeout=600, env=env, cwd=str(ROOT))


def test_smollm2_example_pipeline_on_a_tiny_qwen3(tmp_path):
    model = make_qwen3(tmp_path / "qwen3", layers=2)
    save_chat_tokenizer(model, vocab_size=256)
    data = tmp_path / "data"
    proc = hybridflow("data", "arithmetic", "--out", str(data), "--train-size", "64", "--val-size", "8",
                      "--max-operand", "9")
    assert proc.returncode == 0, proc.stderr
    run = tmp_path / "run"
    proc = hybridflow("train", "--config", "examples/smollm2_arithmetic.yaml", f"model_path={model}",
                      f"data.train_files={data / 'train.parquet'}", f"data.val_files={data / 'val.parquet'}",
                      f"trainer.run_dir={run}", "trainer.total_steps=2", "trainer.val_every=2",
                      # the character tokenizer spends a token per character of the instruction
                      "rollout.max_prompt_length=96", "trainer.export_hf=false")
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-5000:]
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [0, 1, 2]  # validation before training, then the steps
    assert set(records[0]) == {"step", "val/reward/mean", "val/response_length/mean"}
    for step in records[1:]:
        assert 0.0 <= step["critic/score/mean"] <= 1.0
        assert step["response_length/mean"] <= 16  # sampling.max_new_tokens of the example
        # vLLM (Qwen3 weights synced from the megatron actor) and the actor's update agree per token, to what
        # the example's bf16 allows (fp32 agrees to 1e-3: tests/test_train_cli.py).
        assert step["rollout/logprob_diff_max"] < 0.1 and step["rollout/logprob_diff_mean"] < 0.02, step
        assert "timing_s/old_log_prob" not in step  # one epoch over one mini-batch: the update gives them
    assert "val/reward/mean" in records[2]
    assert (run / "plots" / "reward.png").is_file()  # the curve the README shows for the real run
    third_party = [line for line in proc.stdout.splitlines()
                   if not line.startswith(("[hybridflow]", "step ")) and re.search(r"\b(WARNING|INFO)\b", line)]
    assert third_party == []
