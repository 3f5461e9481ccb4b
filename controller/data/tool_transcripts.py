"""Supervised tool-call transcripts for the calculator word problems: a warm start before agentic RL.

Each problem of ``word_problem_draws`` becomes a chat in which the assistant calls the calculator once per
operation, reads each result from a tool message, and answers with the number:

    user:       Start with 7. Multiply by 18, then multiply by 11. What is the result? Answer with just the number.
    assistant:  <tool_call>{"name": "calculator", "arguments": {"expression": "7 * 18"}}</tool_call>
    tool:       126
    assistant:  <tool_call>{"name": "calculator", "arguments": {"expression": "126 * 11"}}</tool_call>
    tool:       1386
    assistant:  1386

The calls are written in the configured ``tool_format`` as the model must write them (``hermes`` or
``json``), the results are the built-in calculator's own output, and the tools reach the prompt as the rollout
gives them (``ChatFormat``): rendered by the chat template, or described in a system message when the template
renders no tools. So the transcripts are in the model's own chat format, and ``hybridflow sft`` learns the
assistant turns only (``data.format: messages``, with the ``tools`` column).
"""

from __future__ import annotations

import json
from typing import Any

from controller.data.arithmetic import ARITHMETIC_OPERATORS, word_problem_draws

__all__ = ["TOOL_CALL_TEMPLATES", "calculator_transcripts"]

TOOL_CALL_TEMPLATES = {
    "hermes": '<tool_call>\n{{"name": "calculator", "arguments": {arguments}}}\n</tool_call>',
    "json": '{{"tool": "calculator", "arguments": {arguments}}}',
}


def calculator_transcripts(count: int, seed: int, tokenizer, steps: int = 2, max_operand: int = 99,
                           operators: str = ARITHMETIC_OPERATORS, tool_format: str = "hermes") -> list[dict[str, Any]]:
    """``count`` rows ``{"messages": [...], "tools": [calculator schema], "ground_truth": answer}``."""
    from workers.rollout.agent.calculator import Calculator
    from workers.rollout.agent.trajectory import ChatFormat

    if tool_format not in TOOL_CALL_TEMPLATES:
        raise ValueError(f"tool transcripts are written in {sorted(TOOL_CALL_TEMPLATES)}, not {tool_format!r}")
    calculator = Calculator()
    tools = [calculator.schema()]
    chat = ChatFormat(tokenizer, tools=tools, tool_format=tool_format)
    rows = []
    for problem in word_problem_draws(count, seed, steps, max_operand, operators):
        messages: list[dict[str, Any]] = chat.with_tool_instructions([{"role": "user", "content": problem.text}])
        value = problem.start
        for (op, b), expected in zip(problem.operations, problem.values):
            expression = f"{value} {op} {b}"
            call = TOOL_CALL_TEMPLATES[tool_format].format(arguments=json.dumps({"expression": expression}))
            result = calculator.call(expression=expression)
            if result != str(expected):
                raise AssertionError(f"the calculator gives {result} for {expression}, the problem {expected}")
            messages += [{"role": "assistant", "content": call}, {"role": "tool", "content": result}]
            value = expected
        messages.append({"role": "assistant", "content": str(problem.answer)})
        rows.append({"messages": messages, "tools": tools, "ground_truth": str(problem.answer)})
    return rows
