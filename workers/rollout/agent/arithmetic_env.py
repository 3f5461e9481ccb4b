"""ArithmeticEnvironment: the built-in environment of multi-step arithmetic problems, rewarded on the final answer.

    rollout:
      agent: {tools: [calculator], environment: "workers.rollout.agent.arithmetic_env:ArithmeticEnvironment"}
    reward: {fn: environment}
    data: {task: word_problems, steps: 3}

The model's tool calls run (a calculator, usually) and come back as tool
messages; the first reply without a tool call is its answer, and the
conversation ends there with reward 1.0 if that answer (the number it ends
with, as ``arithmetic_answer`` reads it) is the sample's ``ground_truth``,
else 0.0. A conversation cut short (turns or tokens) gets no reward.
"""

from __future__ import annotations

from typing import Any

from workers.reward.functions import arithmetic_answer
from workers.rollout.agent.loop import StepResult, ToolEnvironment

__all__ = ["ArithmeticEnvironment"]


class ArithmeticEnvironment(ToolEnvironment):
    def reset(self, sample: dict[str, Any]) -> list[dict]:
        if sample.get("ground_truth") is None:
            raise ValueError("ArithmeticEnvironment needs each sample's ground_truth (the expected number)")
        self.ground_truth = str(sample["ground_truth"])
        return super().reset(sample)

    def step(self, messages: list[dict], reply: str) -> StepResult:
        step = super().step(messages, reply)
        if not step.done:
            return step  # tool results: the conversation goes on
        reward = arithmetic_answer("", reply, self.ground_truth, {})
        return StepResult(None, reward, True, step.info)
