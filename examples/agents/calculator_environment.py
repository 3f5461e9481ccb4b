"""The built-in calculator environment (``workers.rollout.agent.arithmetic_env``) as an agent on the rollout
server: the same conversation the built-in loop has (``rollout.agent.environment``), through the OpenAI path.

    rollout:
      server: true
      agent: {entrypoint: "examples.agents.calculator_environment:agent", max_turns: 3}
    reward: {fn: environment}            # the environment's reward, returned by the agent

Each reply's whole text (``raw_content``: the tool-call blocks as the model wrote them) goes to the
environment, which runs the calls and answers with tool messages; the reply message the server returned goes
back with them, so the server continues the sample's ids (the token budget, the seeds turn by turn and the
observations' framing are the built-in loop's).
"""

import asyncio

import openai

from workers.rollout.agent import Calculator, ToolBox
from workers.rollout.agent.arithmetic_env import ArithmeticEnvironment

MAX_TURNS = 3
_BOX = ToolBox([Calculator()])


async def agent(client: openai.AsyncOpenAI, row: dict) -> float:
    environment = ArithmeticEnvironment(_BOX, "hermes")
    messages = environment.reset(row)
    reward = 0.0
    for _ in range(MAX_TURNS):
        try:
            response = await client.chat.completions.create(model="policy", messages=messages, tools=_BOX.schemas())
        except openai.BadRequestError:  # the sample's tokens are spent
            break
        choice = response.choices[0]
        messages.append(choice.message.model_dump(exclude_none=True))
        step = await asyncio.to_thread(environment.step, messages, choice.model_extra["raw_content"])
        reward += step[1]
        if step[2] or not step[0]:
            break
        messages += step[0]
    return reward
