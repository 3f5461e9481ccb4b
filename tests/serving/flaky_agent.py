"""An agent for the CLI test: sample k (in the order the trainer starts them) raises (k % 4 == 0), hangs past
its timeout (1), or answers through the plain-openai example agent and then asks again with its history
rewritten, so that its session splits in two, and returns 1.0 (2) or 0.0 (3)."""

import asyncio
import itertools

from examples.agents.openai_calculator import agent as openai_agent

_STARTED = itertools.count()


async def agent(client, row):
    kind = next(_STARTED) % 4
    if kind == 0:
        raise RuntimeError("the agent failed on purpose")
    if kind == 1:
        await asyncio.sleep(3600)  # past rollout.agent.session_timeout_s
    await openai_agent(client, row)
    await client.chat.completions.create(model="policy", messages=[{"role": "user", "content": "Again?"}], max_tokens=4)
    return 1.0 if kind == 2 else 0.0
