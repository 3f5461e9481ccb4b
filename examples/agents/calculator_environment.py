"""The built-in calculator environment (``workers.rollout.agent.arithmetic_env``) as an agent on the rollout
server: the same conversation the built-in loop has (``rollout.agent.environment``), through the OpenAI path
(``controller.serving.environment_agent``).

    rollout:
      server: true
      agent: {entrypoint: "examples.agents.calculator_environment:agent", max_turns: 3}
    reward: {fn: environment}            # the environment's reward, returned by the agent
"""

from controller.serving.environment_agent import environment_agent
from workers.rollout.agent import Calculator, ToolBox
from workers.rollout.agent.arithmetic_env import ArithmeticEnvironment

_BOX = ToolBox([Calculator()])

agent = environment_agent(lambda: ArithmeticEnvironment(_BOX, "hermes"), _BOX.schemas(), max_turns=3)
