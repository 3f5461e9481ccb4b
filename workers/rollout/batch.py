"""Prompts in, rollout batch out: the engine-independent half of generation.

Prompts arrive as a left-padded ``input_ids`` [B, P] with its
``attention_mask``. They become one request per (prompt, sample); the engine
turns each into a completion (token ids and the log-prob of each under the
sampling distribution); the completions become the batch the RL loop trains
on. Rows are ordered prompt-major: prompt i's n samples are rows i*n..i*n+n-1.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from workers.data_proto import DataProto
from workers.megatron.routing_replay import ROLLOUT_ROUTES
from workers.multimodal import MULTI_MODAL_DATA
from workers.rollout.sampling import SamplingConfig

__all__ = [
    "Completion",
    "GenerationRequest",
    "PromptError",
    "build_requests",
    "build_rollout_batch",
    "check_special_tokens",
    "concat_rollout_batches",
    "stop_in_continuation",
]

TRUNCATION_MODES = ("error", "left")


class PromptError(ValueError):
    """A prompt batch that cannot be generated from; raised before generation starts."""


@dataclass(frozen=True)
class GenerationRequest:
    prompt_ids: tuple[int, ...]
    seed: int | None  # None: the engine's own random stream
    images: tuple = ()  # a vision-language prompt's images (PIL), in the order of its image-token runs


@dataclass
class Completion:
    token_ids: list[int]
    log_probs: list[float]  # of each sampled token under the processed (tempered) distribution
    finish_reason: str = "length"  # "stop" (EOS or a stop string) or "length"
    # a mixture of experts' routes when asked for: [positions, layers, k] training expert ids of the prompt's
    # and the response's positions whose output the engine computed (all but the last token's)
    routed_experts: torch.Tensor | None = None


def stop_in_continuation(before: list[int], new: list[int], stops: tuple[str, ...] | list[str],
                         decode: Callable[[list[int]], str]) -> int | None:
    """How many of ``new`` tokens a response keeps when a stop string ends among them, having begun in
    ``before`` (the response's tokens from earlier calls), else None.

    An engine checks stop strings against the text it generated in the call, so one that spans two
    calls of a partial rollout is not seen there. Kept: through the token whose text completes the
    stop string, as the engines keep it within one call. Only the tail of ``before`` that can hold the
    start of a stop string is decoded (its characters, with a margin for tokens that decode to none).
    """
    if not stops or not before or not new:
        return None
    longest = max(len(stop) for stop in stops)
    tail = before[-(longest + 8):]
    start = len(decode(tail))  # text of the tail's tokens alone, before the new ones
    for k in range(1, min(len(new), longest + 8) + 1):
        text = decode(tail + new[:k])
        # A stop string found here must end past the tail's own text: one inside it would have stopped earlier.
        if any(text.find(stop, max(0, start - len(stop) + 1)) >= 0 for stop in stops):
            return k
    return None


def check_special_tokens(pad_token_id: int | None, eos_token_id: int | None, source: str) -> None:
    missing = [name for name, value in (("pad_token_id", pad_token_id), ("eos_token_id", eos_token_id)) if value is None]
    if missing:
        raise PromptError(
            f"the tokenizer of {source} has no {' and no '.join(missing)}; rollout needs both "
            f"(pad to batch prompts and responses, EOS to end a response): set them in the tokenizer "
            f"config or pass them in the rollout config"
        )


def build_requests(
    prompts: DataProto,
    sampling: SamplingConfig,
    max_prompt_length: int,
    truncation: str = "error",
    first_index: int = 0,
) -> list[GenerationRequest]:
    """One request per (prompt, sample), prompt-major; checks every prompt before any is generated.

    ``first_index`` is the global index of this batch's first prompt, so
    per-request seeds do not depend on how a batch was split across replicas.
    """
    if truncation not in TRUNCATION_MODES:
        raise PromptError(f"truncation {truncation!r} is not one of {TRUNCATION_MODES}")
    if len(prompts) == 0:
        raise PromptError("the prompt batch is empty: there is nothing to generate")
    for key in ("input_ids", "attention_mask"):
        if key not in prompts.batch:
            raise PromptError(f"the prompt batch has no {key!r}; it has {sorted(prompts.keys())}")
    input_ids, mask = prompts.batch["input_ids"], prompts.batch["attention_mask"]
    if input_ids.shape != mask.shape or input_ids.dim() != 2:
        raise PromptError(f"input_ids {tuple(input_ids.shape)} and attention_mask {tuple(mask.shape)} must be one [B, P] shape")
    images = prompts.non_tensor_batch.get(MULTI_MODAL_DATA)
    requests = []
    for i in range(len(prompts)):
        ids = input_ids[i][mask[i].bool()].tolist()
        row_images = tuple((images[i] or {}).get("image", ())) if images is not None else ()
        if not ids:
            raise PromptError(f"prompt {first_index + i} is empty (its attention_mask is all zeros)")
        if len(ids) > max_prompt_length:
            if row_images:
                raise PromptError(f"prompt {first_index + i} has {len(ids)} tokens with its images' tokens, more "
                                  f"than max_prompt_length={max_prompt_length}; a prompt with images is never cut "
                                  f"(its image tokens would be): raise max_prompt_length")
            if truncation == "error":
                raise PromptError(
                    f"prompt {first_index + i} has {len(ids)} tokens, more than max_prompt_length={max_prompt_length}; "
                    f"shorten it, raise max_prompt_length, or set truncation='left'"
                )
            ids = ids[-max_prompt_length:]
        for j in range(sampling.n):
            requests.append(GenerationRequest(tuple(ids), sampling.request_seed(first_index + i, j), row_images))
    return requests


def build_rollout_batch(
    prompts: DataProto,
    requests: list[GenerationRequest],
    completions: list[Completion],
    sampling: SamplingConfig,
    max_prompt_length: int,
    pad_token_id: int,
) -> DataProto:
    """The training batch: prompt (left-padded) + response (right-padded to max_new_tokens).

    Keys: ``prompts`` (the prompt as generated from, i.e. after truncation),
    ``responses``, ``input_ids``, ``attention_mask``, ``position_ids``,
    ``response_mask``, ``rollout_log_probs``; every other key of ``prompts``
    is repeated n times alongside. Widths depend only on the input width and
    the config, so batches from different replicas concatenate. Completions
    that carry their routed experts give ``rollout_routed_experts`` [B, P + R,
    layers, k] aligned with ``input_ids``, -1 where no route is known (padding,
    the last token).
    """
    n, width = sampling.n, sampling.max_new_tokens
    if not len(requests) == len(completions) == len(prompts) * n:
        raise RuntimeError(f"{len(requests)} requests and {len(completions)} completions "
                           f"for {len(prompts)} prompts x {n} samples")
    rows = len(completions)
    responses = torch.full((rows, width), pad_token_id, dtype=torch.long)
    response_mask = torch.zeros(rows, width, dtype=torch.long)
    log_probs = torch.zeros(rows, width, dtype=torch.float32)
    for row, completion in enumerate(completions):
        length = len(completion.token_ids)
        if length > width or len(completion.log_probs) != length:
            raise RuntimeError(f"completion {row}: {length} tokens, {len(completion.log_probs)} log-probs, limit {width}")
        responses[row, :length] = torch.tensor(completion.token_ids, dtype=torch.long)
        log_probs[row, :length] = torch.tensor(completion.log_probs, dtype=torch.float32)
        response_mask[row, :length] = 1
    repeated = prompts.repeat(n, interleave=True) if n > 1 else prompts
    prompt_width = min(prompts.batch["input_ids"].shape[1], max_prompt_length)
    prompt_ids = torch.full((rows, prompt_width), pad_token_id, dtype=torch.long)
    prompt_mask = torch.zeros(rows, prompt_width, dtype=torch.long)
    for row, request in enumerate(requests):
        prompt_ids[row, prompt_width - len(request.prompt_ids):] = torch.tensor(request.prompt_ids, dtype=torch.long)
        prompt_mask[row, prompt_width - len(request.prompt_ids):] = 1
    generated = sequence_tensors(prompt_ids, prompt_mask, responses, response_mask, response_mask, log_probs)
    if any(c.routed_experts is not None for c in completions):
        generated[ROLLOUT_ROUTES] = routes_tensor(requests, completions, prompt_width, width)
    rest = {k: v for k, v in repeated.batch.items() if k not in generated}
    meta = dict(prompts.meta_info)
    meta["temperature"] = sampling.logprob_temperature  # the actor recomputes log-probs at this temperature
    finish = [c.finish_reason for c in completions]
    return DataProto({**rest, **generated}, {**repeated.non_tensor_batch, "finish_reason": finish}, meta)


def routes_tensor(requests: list[GenerationRequest], completions: list[Completion], prompt_width: int,
                  width: int) -> torch.Tensor:
    """The completions' routed experts as one [B, prompt_width + width, layers, k] tensor aligned with the
    batch's left-padded prompts and right-padded responses; -1 where a position has no route."""
    first = next(c.routed_experts for c in completions if c.routed_experts is not None)
    out = torch.full((len(completions), prompt_width + width, *first.shape[1:]), -1, dtype=first.dtype)
    for row, (request, completion) in enumerate(zip(requests, completions)):
        routes = completion.routed_experts
        if routes is None:
            raise RuntimeError(f"completion {row} carries no routed experts while others do")
        start = prompt_width - len(request.prompt_ids)
        if routes.shape[1:] != first.shape[1:] or len(routes) > prompt_width + width - start:
            raise RuntimeError(f"completion {row}: routes {tuple(routes.shape)} do not fit its "
                               f"{len(request.prompt_ids)} + {len(completion.token_ids)} tokens")
        out[row, start:start + len(routes)] = routes
    return out


def sequence_tensors(prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, responses: torch.Tensor,
                     response_tokens: torch.Tensor, response_mask: torch.Tensor,
                     log_probs: torch.Tensor) -> dict[str, torch.Tensor]:
    """A rollout batch's tensors from its left-padded prompts and right-padded responses.

    ``response_tokens`` marks every real response token (what attention sees); ``response_mask`` the ones
    the model generated (what losses read). A single-turn response has one mask for both; a multi-turn one
    has observations between the model's turns.
    """
    attention_mask = torch.cat([prompt_mask, response_tokens], dim=1)
    return {
        "prompts": prompt_ids,
        "responses": responses,
        "input_ids": torch.cat([prompt_ids, responses], dim=1),
        "attention_mask": attention_mask,
        "position_ids": (attention_mask.cumsum(-1) - 1).clamp(min=0),
        "response_mask": response_mask,
        "rollout_log_probs": log_probs,
    }


PROMPT_SIDE = ("prompts", "input_ids", "attention_mask", ROLLOUT_ROUTES)


def concat_rollout_batches(parts: list[DataProto], pad_token_id: int) -> DataProto:
    """Rollout batches of different prompt widths as one: the prompt side left-padded to the widest.

    Response widths are max_new_tokens in every batch of one run; the prompt width is each batch's
    longest prompt, so batches generated from different prompt batches (DAPO's extra generation
    rounds) differ there. Position ids are recomputed from the padded attention mask.
    """
    widest = max(p.batch["prompts"].shape[1] for p in parts)
    padded = []
    for part in parts:
        extra = widest - part.batch["prompts"].shape[1]
        if extra == 0:
            padded.append(part)
            continue
        batch = dict(part.batch)
        for key in (k for k in PROMPT_SIDE if k in batch):
            value = batch[key]
            fill = {"attention_mask": 0, ROLLOUT_ROUTES: -1}.get(key, pad_token_id)
            batch[key] = torch.cat([value.new_full((value.shape[0], extra, *value.shape[2:]), fill), value], dim=1)
        batch["position_ids"] = (batch["attention_mask"].cumsum(-1) - 1).clamp(min=0)
        padded.append(DataProto(batch, part.non_tensor_batch, part.meta_info))
    return DataProto.concat(padded)
