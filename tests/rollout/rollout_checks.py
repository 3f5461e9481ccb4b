"""What the rollout programs' outputs must satisfy, checked against HF transformers."""

import torch

EOS = 2  # the char tokenizer's </s>


def hf_greedy(model_dir, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    out = model.generate(torch.tensor([prompt_ids]), max_new_tokens=max_new_tokens, do_sample=False,
                         eos_token_id=EOS, pad_token_id=0)
    return out[0, len(prompt_ids):].tolist()


def responses(batch) -> list[list[int]]:
    mask = batch.batch["response_mask"].bool()
    return [row[m].tolist() for row, m in zip(batch.batch["responses"], mask)]


def prompts(batch) -> list[list[int]]:
    mask = batch.batch["attention_mask"][:, : batch.batch["prompts"].shape[1]].bool()
    return [row[m].tolist() for row, m in zip(batch.batch["prompts"], mask)]


def assert_greedy_matches_hf(batch, model_dir, max_new_tokens: int) -> None:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    for i, (prompt, response) in enumerate(zip(prompts(batch), responses(batch))):
        out = model.generate(torch.tensor([prompt]), max_new_tokens=max_new_tokens, do_sample=False,
                             eos_token_id=EOS, pad_token_id=0)
        expected = out[0, len(prompt):].tolist()
        if EOS in expected:
            expected = expected[: expected.index(EOS) + 1]
        assert response == expected, f"prompt {i} {prompt}: rollout {response}, HF {expected}"


def hf_log_probs(batch, model_dir, temperature: float) -> torch.Tensor:
    """log_softmax(logits / T) at the response tokens, one unpadded sequence at a time."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    width = batch.batch["responses"].shape[1]
    out = torch.zeros(len(batch), width)
    for i, (prompt, response) in enumerate(zip(prompts(batch), responses(batch))):
        ids = torch.tensor([prompt + response])
        with torch.no_grad():
            logits = model(ids).logits[0, len(prompt) - 1 : -1] / temperature
        out[i, : len(response)] = torch.log_softmax(logits, -1).gather(-1, torch.tensor(response)[:, None])[:, 0]
    return out
