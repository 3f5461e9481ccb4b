"""The training batch of a multi-turn rollout: every trajectory's exact ids, model tokens marked.

    batch = build_agent_batch(prompts, results, pad_token_id, max_response_length)

The same keys and layout as a single-turn rollout batch
(``workers.rollout.batch.build_rollout_batch``): ``prompts`` left-padded to
``max_prompt_length``, ``responses`` right-padded to ``max_response_length``,
``input_ids`` / ``attention_mask`` / ``position_ids`` over both, and
``rollout_log_probs``. Here a response holds the model's turns *and* the
observations between them, so ``attention_mask`` is 1 on every real token
while ``response_mask`` is 1 only on the tokens the model generated:
losses, advantages and the response-length metrics read that one. The
ids are the trajectories' own, never re-tokenized text. Non-tensor fields:
``finish_reason``, ``agent_turns``, ``agent_tool_calls``, ``agent_reward``
and ``agent_messages`` (the conversation, for reward functions and logs).
"""

from __future__ import annotations

import torch

from workers.data_proto import DataProto
from workers.rollout.agent.loop import AgentResult
from workers.rollout.batch import sequence_tensors

__all__ = ["build_agent_batch"]


def build_agent_batch(prompts: DataProto, results: list[AgentResult], pad_token_id: int,
                      max_response_length: int, max_prompt_length: int) -> DataProto:
    """``results[i]`` answers row ``i`` of ``prompts`` (n samples per prompt: repeat the prompts first).

    Widths are the limits, ``max_prompt_length`` and ``max_response_length``, so the batches of different
    generation replicas concatenate.
    """
    if len(results) != len(prompts):
        raise ValueError(f"{len(results)} agent results for {len(prompts)} prompt rows")
    rows = len(results)
    prompt_width = max_prompt_length
    longest = max(len(r.trajectory.prompt_ids) for r in results)
    if longest > max_prompt_length:
        raise ValueError(f"an agent prompt has {longest} tokens, over max_prompt_length {max_prompt_length}")
    prompt_ids = torch.full((rows, prompt_width), pad_token_id, dtype=torch.long)
    prompt_mask = torch.zeros(rows, prompt_width, dtype=torch.long)
    responses = torch.full((rows, max_response_length), pad_token_id, dtype=torch.long)
    real = torch.zeros(rows, max_response_length, dtype=torch.long)
    response_mask = torch.zeros(rows, max_response_length, dtype=torch.long)
    log_probs = torch.zeros(rows, max_response_length, dtype=torch.float32)
    for row, result in enumerate(results):
        trajectory = result.trajectory
        length = len(trajectory.response_ids)
        if length > max_response_length:
            raise ValueError(f"trajectory {row} has {length} response tokens, over max_response_length "
                             f"{max_response_length}")
        prompt = torch.tensor(trajectory.prompt_ids, dtype=torch.long)
        prompt_ids[row, prompt_width - len(prompt):] = prompt
        prompt_mask[row, prompt_width - len(prompt):] = 1
        responses[row, :length] = torch.tensor(trajectory.response_ids, dtype=torch.long)
        real[row, :length] = 1
        response_mask[row, :length] = torch.tensor(trajectory.response_mask, dtype=torch.long)
        log_probs[row, :length] = torch.tensor(trajectory.log_probs, dtype=torch.float32)
    generated = sequence_tensors(prompt_ids, prompt_mask, responses, real, response_mask, log_probs)
    rest = {k: v for k, v in prompts.batch.items() if k not in generated}
    non_tensor = {
        **prompts.non_tensor_batch,
        "finish_reason": [r.finish_reason for r in results],
        "agent_turns": [r.trajectory.turns for r in results],
        "agent_tool_calls": [r.tool_calls for r in results],
        "agent_reward": [r.reward for r in results],
        "agent_messages": [r.messages for r in results],
    }
    return DataProto({**rest, **generated}, non_tensor, dict(prompts.meta_info))
