"""The code-expression task (``data.task: code_expression``): "write a Python expression whose printed value is
the target", for the tiny model.

Each target is the answer of one draw of the arithmetic generator
(``arithmetic_problems``: ``a op b`` with operands in [0, max_operand]), and
the prompt is the arithmetic task's read the other way: ``12=`` asks for
something equal to 12. The model answers with an expression (``3*4``,
``12``, ``20-8``); the reward ``code_expression_shaped`` (the data source's
scorer; ``code_expression`` is the 1/0 form) runs ``print((<expression>))``
in the sandbox and compares what it prints with the target.

Rows are in verl's schema with data source "code_expression" and the target
as the ground truth; the problem that drew the target is kept in
``extra_info.problem`` (one expression that works).
"""

from __future__ import annotations

from typing import Any

from controller.data.arithmetic import ARITHMETIC_OPERATORS, arithmetic_problems
from controller.data.dataset import PromptDataset

__all__ = ["DATA_SOURCE", "code_expression_prompts", "code_expression_rows"]

DATA_SOURCE = "code_expression"


def code_expression_rows(count: int, seed: int, split: str, max_operand: int = 9,
                         operators: str = ARITHMETIC_OPERATORS) -> list[dict[str, Any]]:
    """``count`` rows in verl's schema, raw-text prompts ``"<target>="``; the same arguments give the same rows."""
    return [{"prompt": f"{p.answer}=", "data_source": DATA_SOURCE,
             "reward_model": {"style": "rule", "ground_truth": str(p.answer)},
             "extra_info": {"split": split, "index": i, "problem": f"{p.a}{p.op}{p.b}"}}
            for i, p in enumerate(arithmetic_problems(count, seed, max_operand, operators))]


def code_expression_prompts(count: int, seed: int, max_operand: int = 9,
                            operators: str = ARITHMETIC_OPERATORS) -> PromptDataset:
    """The task's prompts, targets and problems (``data.task: code_expression``)."""
    rows = code_expression_rows(count, seed, "train", max_operand, operators)
    return PromptDataset(tuple(r["prompt"] for r in rows), tuple(r["reward_model"]["ground_truth"] for r in rows),
                         (DATA_SOURCE,) * len(rows), tuple(r["extra_info"] for r in rows))
