"""Environments for the CLI tests, importable by name (``rollout.agent.environment: tests.agent_environments:<name>``)."""

from workers.rollout.agent.loop import StepResult, ToolEnvironment


class RetryingCalculator(ToolEnvironment):
    """The calculator's tool environment, with a simulated user who asks again after a reply without a tool
    call until the turns run out, so even a random model's conversations have several turns. Each reply
    scores its length in characters / 100: every conversation ends with a non-zero, varied reward."""

    def step(self, messages: list[dict], reply: str) -> StepResult:
        step = super().step(messages, reply)
        observation = step.observation if step.observation is not None else [{"role": "user", "content": "Again."}]
        return StepResult(observation, len(reply) / 100.0, False, step.info)
