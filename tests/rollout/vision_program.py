"""vLLM generates from images with a tiny random Qwen2.5-VL on CPU, through the project's vLLM plugin (an
image-only processor: no torchvision), and HF transformers scores the same ids and pixels.

    python vision_program.py MODEL_DIR OUT_FILE
"""

import os
import sys

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

import torch  # noqa: E402
from PIL import Image  # noqa: E402

MODEL, OUT = sys.argv[1], sys.argv[2]
PROMPT = "<|vision_start|><|image_pad|><|vision_end|>1+2="
IMAGES = [Image.new("RGB", (56, 56), (255, 0, 0)), Image.new("RGB", (84, 112), (0, 90, 200))]


def main() -> None:
    from transformers import Qwen2_5_VLForConditionalGeneration
    from transformers.models.qwen2_5_vl import Qwen2_5_VLProcessor
    from vllm import LLM, SamplingParams

    llm = LLM(model=MODEL, dtype="float32", max_model_len=256, enforce_eager=True, limit_mm_per_prompt={"image": 1},
              kv_cache_memory_bytes=16 << 20, seed=0)  # a fixed cache, not a share of the machine's memory
    outs = llm.generate([{"prompt": PROMPT, "multi_modal_data": {"image": image}} for image in IMAGES],
                        SamplingParams(max_tokens=6, temperature=0, logprobs=0, ignore_eos=True))
    processor = Qwen2_5_VLProcessor.from_pretrained(MODEL)  # the plugin's image-only processor
    model = Qwen2_5_VLForConditionalGeneration.from_pretrained(MODEL, dtype=torch.float32).eval()
    results = []
    for index, (image, out) in enumerate(zip(IMAGES, outs)):
        sample = out.outputs[0]
        inputs = processor(text=[PROMPT], images=[image], return_tensors="pt")
        ids = torch.tensor([list(out.prompt_token_ids) + list(sample.token_ids)])
        # which tokens are the image's: without them HF gives the image 1-D positions, not its 3-D (mrope) ones
        kinds = (ids == model.config.image_token_id).int()
        with torch.no_grad():
            logits = model(input_ids=ids, attention_mask=torch.ones_like(ids), pixel_values=inputs["pixel_values"],
                           image_grid_thw=inputs["image_grid_thw"], mm_token_type_ids=kinds).logits[0].float()
        start = len(out.prompt_token_ids)
        hf = torch.log_softmax(logits[start - 1:-1], -1).gather(-1, ids[0, start:, None])[:, 0]
        other = processor(text=[PROMPT], images=[IMAGES[0].resize(image.size, Image.NEAREST).rotate(90)
                                                 if index else Image.new("RGB", (56, 56), (0, 255, 0))],
                          return_tensors="pt")  # another image of the same size: the pixels must matter
        with torch.no_grad():
            logits = model(input_ids=ids, attention_mask=torch.ones_like(ids), pixel_values=other["pixel_values"],
                           image_grid_thw=other["image_grid_thw"], mm_token_type_ids=kinds).logits[0].float()
        elsewhere = torch.log_softmax(logits[start - 1:-1], -1).gather(-1, ids[0, start:, None])[:, 0]
        results.append({"processor_ids": inputs["input_ids"][0].tolist(), "vllm_prompt_ids": list(out.prompt_token_ids),
                        "grid": inputs["image_grid_thw"][0].tolist(), "tokens": list(sample.token_ids),
                        "vllm_log_probs": [step[t].logprob for t, step in zip(sample.token_ids, sample.logprobs)],
                        "hf_log_probs": hf.tolist(), "hf_other_image": elsewhere.tolist(),
                        "processor": type(processor).__name__})
    torch.save(results, OUT)


if __name__ == "__main__":
    main()
