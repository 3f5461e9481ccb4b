"""The transformers reward worker on the GPU: HFRewardModel's scores against the HF model run directly.

    python tools/check_reward_gpu.py --json reward.json             # cuda:0, bf16 and fp32
    python tools/check_reward_gpu.py --allow-cpu                    # the same on the CPU (a dry run)

A random DeBERTa-v2 classifier with a tokenizer of its own (builtin:tiny-deberta-reward) scores
arithmetic responses written by the built-in character-level policy's tokenizer: the worker decodes
and re-encodes them, as it does for a hub reward model. Prints and writes the largest difference from
transformers run on the same texts on the same device, per precision, and the worker's rows/s.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from controller.models.builtin import resolve_model_path  # noqa: E402
from hybridengine.device import accelerator_available  # noqa: E402
from workers.base_worker import WorkerContext, bind_context, unbind_context  # noqa: E402
from workers.data_proto import DataProto  # noqa: E402
from workers.reward.hf_reward_model import HFRewardModel  # noqa: E402


def batch_of(policy: str, pairs: list[tuple[str, str]]) -> DataProto:
    """Left-padded prompts and right-padded responses in the policy tokenizer's ids."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(policy)
    prompts = [tokenizer(p, add_special_tokens=False)["input_ids"] for p, _ in pairs]
    responses = [tokenizer(r, add_special_tokens=False)["input_ids"] for _, r in pairs]
    width_p, width_r = max(map(len, prompts)), max(map(len, responses))
    pad = tokenizer.pad_token_id
    prompt_ids = torch.tensor([[pad] * (width_p - len(p)) + p for p in prompts])
    response_ids = torch.tensor([r + [pad] * (width_r - len(r)) for r in responses])
    prompt_mask = torch.tensor([[0] * (width_p - len(p)) + [1] * len(p) for p in prompts])
    response_mask = torch.tensor([[1] * len(r) + [0] * (width_r - len(r)) for r in responses])
    return DataProto({"prompts": prompt_ids, "responses": response_ids, "input_ids": torch.cat([prompt_ids, response_ids], 1),
                      "attention_mask": torch.cat([prompt_mask, response_mask], 1), "response_mask": response_mask})


def direct_scores(rm: str, pairs: list[tuple[str, str]], device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(rm)
    model = AutoModelForSequenceClassification.from_pretrained(rm, dtype=dtype).to(device).eval()
    with torch.no_grad():
        return torch.stack([model(**tokenizer(p, r, return_tensors="pt").to(device)).logits[0, 0].float().cpu()
                            for p, r in pairs])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--allow-cpu", action="store_true", help="run on the CPU when no GPU is visible")
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--json")
    args = parser.parse_args()
    if not accelerator_available() and not args.allow_cpu:
        raise SystemExit("no GPU visible (give --allow-cpu for a dry run on the CPU)")
    device = torch.device("cuda", 0) if accelerator_available() else torch.device("cpu")
    work = tempfile.mkdtemp(prefix="reward-check-")
    policy = resolve_model_path("builtin:tiny-arithmetic", work)
    rm = resolve_model_path("builtin:tiny-deberta-reward", work)
    pairs = [(f"{a}+{b}=", str(a + b + (a * b) % 3)) for a, b in zip(range(args.rows), range(3, args.rows + 3))]
    pairs = [(p, r) for p, r in pairs if int(r) < 100]  # the reward tokenizer knows 0-99
    batch = batch_of(policy, pairs)
    results = {"device": str(device), "rows": len(pairs)}
    for precision, dtype, tolerance in (("fp32", torch.float32, 1e-4), ("bf16", torch.bfloat16, 5e-2)):
        token = bind_context(WorkerContext(rank=0, world_size=1, local_rank=0, device=device, role="reward_model"))
        try:
            worker = HFRewardModel(rm, tokenizer_path=policy, precision=precision, micro_batch_size=16)
        finally:
            unbind_context(token)
        start = time.perf_counter()
        scores = worker.compute_rm_score(batch).batch["rm_scores"]
        seconds = time.perf_counter() - start
        expected = direct_scores(rm, pairs, device, dtype)
        difference = float((scores - expected).abs().max())
        scale = float(expected.abs().max())
        ok = difference <= tolerance * max(scale, 1.0)
        results[precision] = {"max_abs_difference": difference, "score_scale": scale, "rows_per_s": len(pairs) / seconds,
                              "ok": ok}
        print(f"{precision}: max |worker - transformers| {difference:.2e} (scores up to {scale:.3f}), "
              f"{len(pairs) / seconds:.0f} rows/s on {device}: {'ok' if ok else 'FAILED'}")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    if not all(results[p]["ok"] for p in ("fp32", "bf16")):
        raise SystemExit(1)


if __name__ == "__main__":
    main()
