"""Agents for ``rollout.agent.entrypoint``: ``async def agent(client, row)`` against the rollout server."""
