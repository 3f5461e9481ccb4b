"""An agent for the async CLI test: one chat request, rewarded by the parity of the reply's length, so that a
group's samples differ in reward (a gradient) whatever the tiny model says."""


async def agent(client, row):
    reply = await client.chat.completions.create(model="policy", messages=list(row["messages"]), max_tokens=16)
    return float(len(reply.choices[0].message.content or "") % 2)
