"""An agent for the CLI test: sample k (in the order the trainer starts them) raises (k % 4 == 0), hangs past
its timeout (1), or answers through the plain-openai example agent and then asks again with its history
rewritten, so that its session splits in two, and returns 1.0 (2) or 0.0 (3); (3) first asks through a client
without the job's API key, which must be refused (else it raises). From the third step (k >= 32) on, every sample
raises, as an agent reading a column the row lacks would."""

import asyncio
import itertools

import openai

from examples.agents.openai_calculator import agent as openai_agent

_STARTED = itertools.count()


async def agent(client, row):
    started = next(_STARTED)
    if started >= 32:
        return row["question"]  # KeyError: no such column
    kind = started % 4
    if kind == 0:
        raise RuntimeError("the agent failed on purpose")
    if kind == 1:
        await asyncio.sleep(3600)  # past rollout.agent.session_timeout_s
    if kind == 3:  # another process of the machine, without the job's key
        stranger = openai.AsyncOpenAI(base_url=str(client.base_url), api_key="not-the-job-key", max_retries=0)
        try:
            await stranger.chat.completions.create(model="policy", messages=[{"role": "user", "content": "hi"}])
        except openai.AuthenticationError:
            pass
        else:
            raise AssertionError("the server answered a request without the job's API key")
        finally:
            await stranger.close()
    await openai_agent(client, row)
    await client.chat.completions.create(model="policy", messages=[{"role": "user", "content": "Again?"}], max_tokens=4)
    return 1.0 if kind == 2 else 0.0
