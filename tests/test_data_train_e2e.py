"""End to end: files written by `hybridflow data`, chat prompts through a chat template, the reward routed by
data_source, and every row's fields (data_source, extra_info) reaching the reward function inside the workers."""

import json
import os
import subprocess
import sys
import textwrap

from chat_tokenizer import make_chat_model
from conftest import ROOT

# A cost function (Safe-RLHF's second reward worker) that fails the run unless the row's fields arrived.
FIELD_CHECK = textwrap.dedent("""
    def fields_arrived(prompt, response, ground_truth, extra, **kwargs):
        info = extra["extra_info"]
        assert extra["data_source"] == "arithmetic", extra
        assert info["split"] in ("train", "val") and isinstance(info["index"], int), info
        assert prompt.startswith("<|user|>") and prompt.endswith("<|assistant|>"), prompt  # the chat template's text
        return 0.0
""")


def test_chat_files_train_with_the_routed_reward(tmp_path):
    model = make_chat_model(tmp_path / "model")
    (tmp_path / "field_check.py").write_text(FIELD_CHECK)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(ROOT)]), "OMP_NUM_THREADS": "1"}

    def hybridflow(*args):
        return subprocess.run([sys.executable, "-m", "controller.cli", *args], capture_output=True, text=True,
                              timeout=600, env=env, cwd=str(ROOT))

    data = tmp_path / "data"
    proc = hybridflow("data", "arithmetic", "--out", str(data), "--train-size", "32", "--val-size", "4",
                      "--instruction", "{a}{op}{b}=")
    assert proc.returncode == 0, proc.stderr
    run = tmp_path / "run"
    proc = hybridflow(
        "train", "--config", "examples/ppo_tiny.yaml", f"model_path={model}", f"trainer.run_dir={run}",
        "trainer.launcher=torchrun", "trainer.nproc=1", "rollout.engine=megatron", "algorithm.name=grpo",
        "actor.engine.tensor_parallel=1", "actor.engine.pipeline_parallel=1", "actor.engine.micro_batch_size=2",
        "rollout.sampling.n=2", "data.batch_size=4", "ppo.ppo_mini_batch_size=8", "rollout.max_prompt_length=32",
        "rollout.sampling.max_new_tokens=4", "trainer.total_steps=1", "trainer.val_every=1", "trainer.save_every=0",
        "trainer.logger=[jsonl]", "trainer.export_hf=false", "trainer.plots=false",
        "data.task=files", f"data.train_files={data / 'train.parquet'}", f"data.val_files={data / 'val.parquet'}",
        "reward.fn=auto", "algorithm.safe_rlhf_cost_fn=field_check:fields_arrived")
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-5000:]
    (step,) = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert 0.0 <= step["critic/score/mean"] <= 1.0 and "val/reward/mean" in step
    assert step["safe_rlhf/cost/mean"] == 0.0
