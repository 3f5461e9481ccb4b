"""``reward:``: one way to score, and reward and cost functions found and bound now."""

from __future__ import annotations

from controller.checks.facts import JobFacts

__all__ = ["reward_problems"]


def reward_problems(job: JobFacts) -> list[str]:
    return _reward_problems(job.config)


def _reward_problems(config) -> list[str]:
    """Reward and cost functions found and their signatures bound now, not in a worker after start-up."""
    from workers.reward.router import check_reward_fn

    reward, alg = config.reward, config.algorithm
    problems = []
    if reward.worker is not None and reward.model_path is not None:
        problems.append("reward: reward.worker (your own worker) and reward.model_path (a reward model) are both "
                        "set; give one")
    elif reward.fn is None and reward.model_path is None and reward.worker is None and reward.judge is None:
        problems.append("reward: set reward.fn (a rule) or reward.model_path (a reward model), or reward.worker "
                        "(your own worker), or reward.judge (a generative judge)")
    if reward.judge is not None:
        problems += _judge_problems(config)
    if reward.timeout_s is not None and not reward.timeout_s > 0:
        problems.append(f"reward.timeout_s must be a positive number of seconds or null (no limit), got "
                        f"{reward.timeout_s!r}")
    if reward.max_concurrency is not None and reward.max_concurrency < 1:
        problems.append(f"reward.max_concurrency must be a positive integer or null, got {reward.max_concurrency!r}")
    by_fn = reward.model_path is None and reward.worker is None and reward.fn is not None
    checks = [("reward.fn", reward.fn)] if by_fn else []
    if alg.safe_rlhf_cost_fn is not None:
        checks.append(("algorithm.safe_rlhf_cost_fn", alg.safe_rlhf_cost_fn))
    for key, spec in checks:
        try:
            check_reward_fn(spec, reward.kwargs if key == "reward.fn" else None, key)
        except ValueError as exc:
            problems.append(str(exc))
    return problems


def _judge_problems(config) -> list[str]:
    """A generative judge: its template and parser resolved, its checkpoint a chat model, its routing and mode."""
    from workers.reward.judge_verdicts import resolve_parser, resolve_template
    from workers.rollout.generator import generator_class, registered_generators

    judge, problems = config.reward.judge, []
    for resolve, value in ((resolve_template, judge.template), (resolve_parser, judge.parser)):
        try:
            resolve(value)
        except ValueError as exc:
            problems.append(str(exc))
    if judge.engine not in registered_generators():
        problems.append(f"reward.judge.engine {judge.engine!r} is not one of {list(registered_generators())}")
    elif not generator_class(judge.engine).loads_checkpoint:
        problems.append(f"reward.judge.engine {judge.engine!r} generates on weights it is given (the actor's, "
                        f"resharded) and cannot load a checkpoint of its own; use an engine that does (vllm)")
    if judge.data_sources and config.reward.fn is None and config.reward.model_path is None \
            and config.reward.worker is None:
        problems.append("reward.judge.data_sources routes rows between the judge and another reward, and there is "
                        "none (reward.fn null): every row is the judge's; drop reward.judge.data_sources")
    if config.trainer.mode == "async":
        problems.append("reward.judge: trainer.mode=async is refused: async scores each prompt group as its samples "
                        "finish, inside the sample stream, so the judge would generate a small batch per group "
                        "between weight updates instead of one batch a step; use sync or one_step_off")
    problem = _chat_model_problem(judge.model_path)
    if problem:
        problems.append(problem)
    return problems


def _chat_model_problem(model_path: str) -> str | None:
    """Why ``model_path`` cannot be a judge (no HF checkpoint, no chat template); None when it can."""
    from pathlib import Path

    from workers.pretrained import resolve_pretrained

    path = resolve_pretrained(model_path, missing_ok=True)
    if not Path(path, "config.json").is_file():
        return f"reward.judge.model_path {model_path!r}: no HF checkpoint there (no config.json)"
    config = Path(path, "tokenizer_config.json")
    template = Path(path, "chat_template.jinja").is_file() or Path(path, "chat_template.json").is_file()
    if not template and config.is_file():
        import json

        template = bool(json.loads(config.read_text()).get("chat_template"))
    if not template:
        return (f"reward.judge.model_path {model_path!r} has no chat template (tokenizer_config.json's chat_template, "
                f"or chat_template.jinja): the judge's user turn cannot be written; use an instruct/chat checkpoint")
    return None
