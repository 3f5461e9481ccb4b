"""A hybridflow ``Environment`` (``workers.rollout.agent``) as a user's agent on the rollout server.

    agent = environment_agent(lambda: ArithmeticEnvironment(ToolBox([Calculator()]), "hermes"), tools, max_turns=3)

The conversation is the built-in agent loop's (``rollout.agent.environment``), turn by turn, through the
OpenAI path: the environment reads each reply's whole text (``raw_content``, tool-call blocks as the model
wrote them) and answers with messages, which go back with the reply the server returned, so the server
continues the sample's ids. A request past the sample's token budget is refused (HTTP 400) where the loop
would stop for ``length``; the agent stops there too. Same prompts and seeds give the same samples.
"""

from __future__ import annotations

import asyncio
from typing import Any, Callable

__all__ = ["environment_agent"]


def environment_agent(make_environment: Callable[[], Any], tools: list[dict] | None, max_turns: int):
    """An ``async def agent(client, row)`` that runs a fresh ``make_environment()`` per sample and returns the
    rewards its steps gave."""

    async def agent(client, row: dict) -> float:
        import openai

        environment = make_environment()
        messages = environment.reset(row)
        reward = 0.0
        for _ in range(max_turns):
            try:
                response = await client.chat.completions.create(model="policy", messages=messages,
                                                                **({"tools": tools} if tools else {}))
            except openai.BadRequestError:  # the sample's tokens are spent
                break
            choice = response.choices[0]
            messages.append(choice.message.model_dump(exclude_none=True))
            observation, step_reward, done, *_ = await asyncio.to_thread(environment.step, list(messages),
                                                                         choice.model_extra["raw_content"])
            reward += float(step_reward)
            if done or not observation:
                break
            messages += list(observation)
        return reward

    return agent
