"""The calculator environment with a simulated user who answers every final answer with "Use the calculator.",
so that conversations take several turns whatever a random model writes; and the same environment as a
user's agent on the rollout server (``controller.serving.environment_agent``)."""

from controller.serving.environment_agent import environment_agent
from workers.rollout.agent.arithmetic_env import ArithmeticEnvironment
from workers.rollout.agent.calculator import Calculator
from workers.rollout.agent.loop import StepResult
from workers.rollout.agent.tool import ToolBox

MAX_TURNS = 3
_BOX = ToolBox([Calculator()])


class KeepTalking(ArithmeticEnvironment):
    def __init__(self, box=_BOX, tool_format: str = "hermes", tokenizer=None) -> None:
        super().__init__(box, tool_format, tokenizer)

    def step(self, messages, reply):
        step = super().step(messages, reply)
        if step.done:  # the answer is scored; the user asks again
            return StepResult([{"role": "user", "content": "Use the calculator."}], step.reward, False, step.info)
        return step


agent = environment_agent(KeepTalking, _BOX.schemas(), MAX_TURNS)
