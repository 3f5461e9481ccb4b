"""An RL job's prompts, loaded from its ``data`` config and checked against its rollout and reward.

``hybridflow train`` (``controller.jobs.train_job``) and ``RLTrainer(config)`` without ``train_data``
both call ``rl_job_prompts`` before any process starts: an overlong prompt, a chat template that cannot
frame an agent's turns, or a ``data_source`` without a scorer is a ConfigError naming it.
"""

from __future__ import annotations

from collections.abc import Callable

from controller.config import ConfigError, RLConfig
from controller.data.prepare import JobPrompts, load_job_prompts

__all__ = ["rl_job_prompts"]


def rl_job_prompts(config: RLConfig, tokenizer_path: str, log: Callable[[str], None] | None = None) -> JobPrompts:
    """The train and validation prompts ``config.data`` describes, tokenized by ``tokenizer_path``'s tokenizer,
    each checked against the rollout (its length; an agent's rendering with the tools) and the reward (a
    scorer for every ``data_source`` when ``reward.fn`` is "auto"). ConfigError before any process starts."""
    from transformers import AutoTokenizer

    from workers.reward.router import AUTO, DATA_SOURCE_SCORERS, unknown_data_sources

    from controller.data.images import ImageProcessing

    rollout = config.rollout
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_path)
    images = ImageProcessing.for_model(tokenizer_path)  # a vision-language model's; None for a text model
    prompts = load_job_prompts(config.data, tokenizer, rollout.max_prompt_length, rollout.truncation, log, images)
    if rollout.agent is not None:
        _check_agent_prompts(rollout, tokenizer, prompts)
    routed = [key for key, fn in (("reward.fn", config.reward.fn if config.reward.model_path is None else None),
                                  ("algorithm.safe_rlhf_cost_fn", config.algorithm.safe_rlhf_cost_fn)) if fn == AUTO]
    judged = config.reward.judge.data_sources if config.reward.judge is not None else ()  # the judge scores them
    sources = [s for s in (*prompts.train.data_sources, *(prompts.val.data_sources if prompts.val is not None else ()))
               if s not in judged]
    unknown = unknown_data_sources(sources) if routed else []
    if unknown:
        raise ConfigError(f"{routed[0]} is 'auto' (score by data_source), but no reward function is known for "
                          f"data_source {', '.join(map(repr, unknown))} (data.data_source_key "
                          f"{config.data.data_source_key!r}); known data sources: {sorted(DATA_SOURCE_SCORERS)}. "
                          f"Set {routed[0]} to a built-in name or 'package.module:function'")
    return prompts


def _check_agent_prompts(rollout, tokenizer, prompts: JobPrompts) -> None:
    """A multi-turn rollout renders every prompt again, tools included: the template must frame turns as ids,
    and each prompt fit rollout.max_prompt_length, before any worker starts."""
    from controller.data.loader import prompt_messages
    from workers.rollout.agent import ChatFormat, ChatTemplateError

    with rollout.agent.toolbox() as box:
        try:
            chat = ChatFormat(tokenizer, tools=box.schemas() or None, end_of_turn_id=rollout.eos_token_id,
                              tool_format=rollout.agent.tool_format)
        except ChatTemplateError as exc:
            raise ConfigError(f"rollout.agent: {exc}") from None
    for name, dataset in (("train", prompts.train), ("val", prompts.val)):
        if dataset is None:
            continue
        lengths = [len(chat.prompt_ids(prompt_messages(dataset, row))) for row in range(len(dataset))]
        longest = max(lengths, default=0)
        if longest > rollout.max_prompt_length:
            raise ConfigError(f"rollout.agent: {sum(n > rollout.max_prompt_length for n in lengths)} {name} prompt(s) "
                              f"render, with the tools' instructions, to more than rollout.max_prompt_length "
                              f"{rollout.max_prompt_length} tokens (the longest: {longest}); raise max_prompt_length")
