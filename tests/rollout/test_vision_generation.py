"""A Qwen2.5-VL checkpoint on this stack, without torchvision (issue #59's first step): vLLM generates from
images through the project's vLLM plugin (``vllm_compat.image_only_processor``), expands each image into the
processor's count of image tokens, and scores as HF transformers does on the same ids and pixels."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

HERE = Path(__file__).parent
ROOT = HERE.parent.parent
IMAGE_PAD = 258  # the tokenizer's <|image_pad|>: the character vocabulary's 256 ids, then the vision tokens


@pytest.fixture(scope="module")
def generated(tmp_path_factory):
    from tiny_models import make_qwen2_5_vl

    tmp_path = tmp_path_factory.mktemp("vision")
    model = make_qwen2_5_vl(tmp_path / "vl")
    out = tmp_path / "vision.pt"
    proc = subprocess.run([sys.executable, str(HERE / "vision_program.py"), str(model), str(out)], capture_output=True,
                          text=True, timeout=300, env={**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "2"})
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-5000:]
    return torch.load(out)


def test_vllm_generates_from_images_through_the_image_only_processor(generated):
    """Each image becomes grid_t * grid_h * grid_w / merge_size**2 image tokens, in vLLM's prompt as in the
    processor's; the pixels reach the model (HF's log-probs with another image are far from vLLM's)."""
    assert [r["grid"] for r in generated] == [[1, 4, 4], [1, 8, 6]]  # 56 x 56 and 112 x 84 pixels, 14-pixel patches
    for result in generated:
        assert result["processor"] == "ImageOnlyQwen2_5_VLProcessor"
        t, h, w = result["grid"]
        assert result["processor_ids"].count(IMAGE_PAD) == t * h * w // 2 ** 2  # merge_size 2
        assert result["vllm_prompt_ids"] == result["processor_ids"]
        assert len(result["tokens"]) == 6
        vllm = torch.tensor(result["vllm_log_probs"])
        assert (vllm - torch.tensor(result["hf_other_image"])).abs().max() > 0.1
        assert (vllm - torch.tensor(result["hf_log_probs"])).abs().max() < 5e-3


def test_vllm_log_probs_on_image_prompts_are_hfs_within_1e_4(generated):
    for result in generated:
        torch.testing.assert_close(torch.tensor(result["vllm_log_probs"]), torch.tensor(result["hf_log_probs"]),
                                   atol=1e-4, rtol=0)
