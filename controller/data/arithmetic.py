"""The built-in arithmetic task: ``a op b`` problems from a seed, nothing to download.

Two renderings of the same problems: raw text ``7+5=`` (``arithmetic_prompts``,
what ``data.task: arithmetic`` trains the tiny demo model on) and chat rows
in verl's schema (``arithmetic_rows``, what ``hybridflow data arithmetic``
writes for instruction-tuned models). ``word_problems`` chains several
draws into one multi-step problem ("Start with 37. Add 12, then multiply
by 3. ..."), what ``data.task: word_problems`` gives an agent with a
calculator. Rows carry ``data_source
"arithmetic"``, so the reward router scores them without a ``reward.fn``.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

from controller.data.dataset import PromptDataset

__all__ = ["ARITHMETIC_INSTRUCTION", "ARITHMETIC_OPERATORS", "ArithmeticProblem", "WordProblem", "arithmetic_problems",
           "arithmetic_prompts", "arithmetic_rows", "word_problem_draws", "word_problems"]

ARITHMETIC_OPERATORS = "+-*"
ARITHMETIC_INSTRUCTION = "What is {a} {op} {b}? Answer with just the number."
DATA_SOURCE = "arithmetic"


@dataclass(frozen=True)
class ArithmeticProblem:
    a: int
    op: str
    b: int

    @property
    def answer(self) -> int:
        return self.a + self.b if self.op == "+" else self.a - self.b if self.op == "-" else self.a * self.b


def arithmetic_problems(count: int, seed: int, max_operand: int = 9,
                        operators: str = ARITHMETIC_OPERATORS) -> list[ArithmeticProblem]:
    """``count`` problems with operands in [0, max_operand]; the same arguments give the same problems."""
    if count < 1 or max_operand < 1:
        raise ValueError(f"need count >= 1 and max_operand >= 1, got count={count}, max_operand={max_operand}")
    unknown = sorted(set(operators) - set(ARITHMETIC_OPERATORS))
    if not operators or unknown:
        raise ValueError(f"operators {operators!r}: each must be one of {ARITHMETIC_OPERATORS!r}"
                         + (f" (not {unknown})" if unknown else ""))
    rng = random.Random(seed)
    return [_draw(rng, max_operand, operators) for _ in range(count)]


def _draw(rng: random.Random, max_operand: int, operators: str) -> ArithmeticProblem:
    # The draw order (a, b, then the operator) is what fixed-seed runs were recorded with: keep it.
    a, b = rng.randint(0, max_operand), rng.randint(0, max_operand)
    return ArithmeticProblem(a, rng.choice(operators), b)


def arithmetic_prompts(count: int, seed: int, max_operand: int = 9, operators: str = ARITHMETIC_OPERATORS) -> PromptDataset:
    """``count`` problems like ``7+5=`` (answers ``12``), data source "arithmetic"."""
    problems = arithmetic_problems(count, seed, max_operand, operators)
    return PromptDataset(tuple(f"{p.a}{p.op}{p.b}=" for p in problems), tuple(str(p.answer) for p in problems),
                         (DATA_SOURCE,) * len(problems),
                         tuple({"index": i} for i in range(len(problems))))


def arithmetic_rows(count: int, seed: int, split: str, max_operand: int = 9, operators: str = ARITHMETIC_OPERATORS,
                    instruction: str = ARITHMETIC_INSTRUCTION) -> list[dict[str, Any]]:
    """Chat rows in verl's schema; ``instruction`` is formatted with ``a``, ``op`` and ``b``."""
    try:
        instruction.format(a=1, op="+", b=2)
    except (KeyError, IndexError, ValueError) as exc:
        raise ValueError(f"instruction {instruction!r} must use only the fields {{a}}, {{op}} and {{b}} ({exc})") from None
    return [{"prompt": [{"role": "user", "content": instruction.format(a=p.a, op=p.op, b=p.b)}],
             "data_source": DATA_SOURCE,
             "reward_model": {"style": "rule", "ground_truth": str(p.answer)},
             "extra_info": {"split": split, "index": i}}
            for i, p in enumerate(arithmetic_problems(count, seed, max_operand, operators))]


_STEP_WORDS = {"+": "add {b}", "-": "subtract {b}", "*": "multiply by {b}"}
WORD_PROBLEM_INSTRUCTION = "What is the result? Answer with just the number."


@dataclass(frozen=True)
class WordProblem:
    """A start and ``steps`` operations applied in turn: (operator, operand) pairs."""

    start: int
    operations: tuple[tuple[str, int], ...]

    @property
    def text(self) -> str:
        said = ", then ".join(_STEP_WORDS[op].format(b=b) for op, b in self.operations)
        return f"Start with {self.start}. {said[0].upper()}{said[1:]}. {WORD_PROBLEM_INSTRUCTION}"

    @property
    def values(self) -> list[int]:
        """The value after each operation (the last is the answer)."""
        out, value = [], self.start
        for op, b in self.operations:
            value = ArithmeticProblem(value, op, b).answer
            out.append(value)
        return out

    @property
    def answer(self) -> int:
        return self.values[-1]


def word_problem_draws(count: int, seed: int, steps: int = 2, max_operand: int = 99,
                       operators: str = ARITHMETIC_OPERATORS) -> list[WordProblem]:
    """The problems ``word_problems`` phrases: each operation is one draw of the arithmetic generator, whose
    first operand starts the problem (for the first draw) and whose operator and second operand are the step."""
    if steps < 1:
        raise ValueError(f"word problems need steps >= 1, got {steps}")
    rng = random.Random(seed)
    problems = []
    for _ in range(count):
        draws = [_draw(rng, max_operand, operators) for _ in range(steps)]
        problems.append(WordProblem(draws[0].a, tuple((d.op, d.b) for d in draws)))
    return problems


def word_problems(count: int, seed: int, steps: int = 2, max_operand: int = 99,
                  operators: str = ARITHMETIC_OPERATORS) -> PromptDataset:
    """``count`` problems of ``steps`` operations each, chat messages, data source "arithmetic".

    Each operation is one draw of the arithmetic generator: its first operand starts the problem, and
    every draw's operator and second operand is the next step. The answer is the steps applied in order.
    """
    problems = word_problem_draws(count, seed, steps, max_operand, operators)
    return PromptDataset(tuple([{"role": "user", "content": p.text}] for p in problems),
                         tuple(str(p.answer) for p in problems), (DATA_SOURCE,) * count,
                         tuple({"index": i, "steps": steps} for i in range(count)))
