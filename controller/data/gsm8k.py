"""GSM8K rows (``question``, ``answer`` ending in ``#### N``) into verl's schema, as verl's
examples/data_preprocess/gsm8k.py writes them: the question plus an instruction as one user
message, the number after ``####`` (commas dropped) as the rule's ground truth.
"""

from __future__ import annotations

import re
from typing import Any

__all__ = ["GSM8K_DATA_SOURCE", "GSM8K_INSTRUCTION", "gsm8k_final_answer", "gsm8k_rows"]

GSM8K_DATA_SOURCE = "openai/gsm8k"
GSM8K_INSTRUCTION = 'Let\'s think step by step and output the final answer after "####".'
_SOLUTION = re.compile(r"#### (\-?[0-9\.\,]+)")


def gsm8k_final_answer(answer: str) -> str:
    """``"... #### 1,234"`` -> ``"1234"``."""
    match = _SOLUTION.search(answer)
    if match is None:
        raise ValueError(f"GSM8K answer has no '#### <number>' line: ...{answer[-120:]!r}")
    return match.group(1).replace(",", "")


def gsm8k_rows(rows: list[dict[str, Any]], split: str, instruction: str = GSM8K_INSTRUCTION,
               source: str = "input") -> list[dict[str, Any]]:
    """verl-schema rows; ``extra_info`` keeps the original question and answer (reward functions may read them)."""
    out = []
    for index, row in enumerate(rows):
        missing = [key for key in ("question", "answer") if not isinstance(row.get(key), str)]
        if missing:
            raise ValueError(f"{source} row {index}: GSM8K rows need string fields 'question' and 'answer'; "
                             f"missing {missing}, columns: {sorted(row)}")
        try:
            truth = gsm8k_final_answer(row["answer"])
        except ValueError as exc:
            raise ValueError(f"{source} row {index}: {exc}") from None
        content = f"{row['question']} {instruction}" if instruction else row["question"]
        out.append({
            "data_source": GSM8K_DATA_SOURCE,
            "prompt": [{"role": "user", "content": content}],
            "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": truth},
            "extra_info": {"split": split, "index": index, "answer": row["answer"], "question": row["question"]},
        })
    return out
