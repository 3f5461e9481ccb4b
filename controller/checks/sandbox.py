"""The sandbox: a job that runs model-written code where it cannot be isolated is refused."""

from __future__ import annotations

from controller.checks.facts import JobFacts

__all__ = ["sandbox_problems", "uses_sandbox"]


def uses_sandbox(config) -> bool:
    """Whether the job runs model-written code by a built-in: a reward (named, or the code_expression task's
    scorer under reward.fn auto) or an agent tool. A user's function calling the sandbox itself is refused
    at its first run instead, on a machine that cannot isolate."""
    from workers.rollout.agent.python_tool import PythonTool
    from workers.sandbox import SANDBOX_REWARDS, SANDBOX_TOOLS

    reward = config.reward
    by_fn = reward.model_path is None and reward.worker is None
    if by_fn and (reward.fn in SANDBOX_REWARDS or (reward.fn == "auto" and config.data.task == "code_expression")):
        return True
    if config.algorithm.safe_rlhf_cost_fn in SANDBOX_REWARDS:
        return True
    agent = config.rollout.agent
    if agent is None or agent.entrypoint is not None:
        return False
    for name in agent.tools:
        if name in SANDBOX_TOOLS:
            return True
        try:
            from workers.rollout.agent.config import resolve_tool

            if issubclass(resolve_tool(name), PythonTool):
                return True
        except ValueError:  # reported by the rollout's own check
            continue
    return False


def sandbox_problems(job: JobFacts) -> list[str]:
    """A job that runs code where the sandbox cannot isolate it is refused, unless limits-only is said."""
    from workers.sandbox import isolation_problem

    if not uses_sandbox(job.config):
        return []
    problem = isolation_problem(job.config.sandbox.isolation)
    return [f"sandbox: {problem}"] if problem else []
