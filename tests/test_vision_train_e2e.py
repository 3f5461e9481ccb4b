"""End to end, a vision-language model through the CLI: a tiny Qwen2.5-VL and a parquet of image rows in verl's
schema, both made outside the project (``examples/vision/colour_task.py`` imports transformers, tokenizers and
datasets only); ``hybridflow sft`` fine-tunes it on the rows' (image prompt, answer) pairs for 2 steps, then
``hybridflow train`` takes 2 GRPO steps from that export at actor TP2, the vision tower trained too, with vLLM
generating from the same images on the synced weights (the tower's among them); a user's reward function sees each
sample's image; the export loads in transformers and answers an image prompt."""

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from conftest import ROOT

# The user's reward: it fails the run unless the sample's image arrived; it scores the variety of the answer's
# characters, so that the samples of a group differ and the step moves the weights.
USER_REWARD = textwrap.dedent("""
    def varied(prompt, response, ground_truth, extra, **kwargs):
        (image,) = extra["multi_modal_data"]["image"]
        assert image.size == (112, 56) and "What colour is the square?" in prompt, (image, prompt)
        assert ground_truth in ("red", "green", "blue", "yellow")
        return len(set(response)) / 8
""")


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    tmp_path = tmp_path_factory.mktemp("vision_e2e")
    outside = subprocess.run([sys.executable, str(ROOT / "examples" / "vision" / "colour_task.py"), "--out",
                              str(tmp_path / "task"), "--train", "8", "--val", "4"], capture_output=True, text=True,
                             timeout=300, env={**os.environ, "PYTHONPATH": ""}, cwd=str(tmp_path))
    assert outside.returncode == 0, outside.stderr[-3000:]
    (tmp_path / "user_reward.py").write_text(USER_REWARD)
    task, sft, run = tmp_path / "task", tmp_path / "sft", tmp_path / "run"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(ROOT)]), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "controller.cli", "sft", "--config", "examples/vision/sft_colour.yaml",
         f"model_path={task / 'model'}", f"trainer.run_dir={sft}", f"data.train_files={task / 'train.parquet'}",
         f"data.val_files={task / 'val.parquet'}", "trainer.total_steps=2", "data.batch_size=8", "trainer.val_every=0",
         "trainer.save_every=0", "trainer.logger=[jsonl]", "trainer.plots=false"],
        capture_output=True, text=True, timeout=600, env=env, cwd=str(ROOT))
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-5000:]
    proc = subprocess.run(
        [sys.executable, "-m", "controller.cli", "train", "--config", "examples/vision/grpo_colour.yaml",
         f"model_path={sft / 'hf_actor'}", f"trainer.run_dir={run}", "data.task=files",
         f"data.train_files={task / 'train.parquet'}", f"data.val_files={task / 'val.parquet'}",
         "reward.fn=user_reward:varied", "trainer.total_steps=2", "trainer.val_every=0", "trainer.val_before_train=false",
         "trainer.save_every=0", "rollout.sampling.n=2", "data.batch_size=4", "ppo.ppo_mini_batch_size=8",
         "actor.optim.lr=1e-2", "actor.freeze_vision_tower=false", "trainer.logger=[jsonl]", "trainer.plots=false", "trainer.export_hf=true"],
        capture_output=True, text=True, timeout=600, env=env, cwd=str(ROOT))
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-5000:]
    return task, sft, run


def test_sft_learns_the_answers_of_image_prompts_and_not_their_image_tokens(trained):
    task, sft, _ = trained
    steps = [json.loads(line) for line in (sft / "metrics.jsonl").read_text().splitlines()]
    assert [s["step"] for s in steps] == [1, 2] and steps[1]["sft/loss"] < steps[0]["sft/loss"]
    answers = [row["response"] for row in __import__("datasets").Dataset.from_parquet(str(task / "train.parquet"))]
    # each step is a whole epoch of the 8 rows: each learns its colour's characters and the end of turn, never the
    # prompt's 8 image tokens
    assert [s["sft/learned_tokens"] for s in steps] == [sum(len(a) + 1 for a in answers)] * 2


def test_two_grpo_steps_at_tp2_generate_from_the_images_and_train_on_them(trained):
    from hybridengine.model.spec import ModelSpec

    task, _, run = trained
    steps = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [s["step"] for s in steps] == [1, 2]
    spec = ModelSpec.from_pretrained(task / "model")
    for step in steps:  # vLLM's log-probs on the image prompts are the trainer's (fp32), after the step too
        assert step["rollout/logprob_diff_max"] < 1e-4, step["rollout/logprob_diff_max"]
        assert step["actor/grad_norm"] > 0 and step["prompt_length/mean"] > 8  # the image's 8 tokens and the text
        # the trained tower reaches vLLM whole at every sync, beside the resharded language model
        assert step["weight_sync/bytes"] > 4 * spec.vision.parameter_count + step["reshard/bytes_received"]


def test_the_export_loads_in_transformers_and_answers_an_image_prompt(trained):
    from PIL import Image
    from transformers import AutoTokenizer, Qwen2_5_VLForConditionalGeneration, Qwen2VLImageProcessorPil

    task, sft, run = trained
    model = Qwen2_5_VLForConditionalGeneration.from_pretrained(run / "hf_actor", dtype=torch.float32).eval()
    before = Qwen2_5_VLForConditionalGeneration.from_pretrained(sft / "hf_actor", dtype=torch.float32).state_dict()
    after = model.state_dict()
    for part in ("visual", "language_model"):  # both trained
        assert max((after[k] - before[k]).abs().max().item() for k in before if f".{part}." in k) > 1e-4, part
    tokenizer = AutoTokenizer.from_pretrained(run / "hf_actor")
    images = Qwen2VLImageProcessorPil.from_pretrained(run / "hf_actor")
    image = Image.new("RGB", (112, 56), (40, 70, 220))
    inputs = images(images=[image], return_tensors="pt")
    count = int(inputs["image_grid_thw"].prod()) // 4
    text = tokenizer.apply_chat_template([{"role": "user", "content": "<|vision_start|><|image_pad|><|vision_end|>"
                                                                      "What colour is the square?"}],
                                         add_generation_prompt=True, tokenize=False)
    text = text.replace("<|image_pad|>", "<|image_pad|>" * count)
    ids = tokenizer(text, add_special_tokens=False, return_tensors="pt")["input_ids"]
    kinds = (ids == model.config.image_token_id).int()
    out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), pixel_values=inputs["pixel_values"],
                         image_grid_thw=inputs["image_grid_thw"], mm_token_type_ids=kinds, max_new_tokens=4,
                         do_sample=False)
    assert out.shape[1] == ids.shape[1] + 4 or tokenizer.eos_token_id in out[0, ids.shape[1]:].tolist()
