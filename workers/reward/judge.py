"""A generative judge: an LLM that reads the question, the response and a reference, writes a verdict, and the
verdict parsed into a score (``reward.judge``).

    judge = RoleSpec(GenerativeJudge, {"model_path": "Qwen/Qwen2.5-7B-Instruct", "tokenizer_path": policy,
                                       "config": JudgeConfig(model_path=..., template=..., parser="yes_no")})
    group.compute_reward(batch)   # -> scores [B], token_level_scores [B, R], the judge's own columns

The judge is a rollout engine (vLLM) serving its checkpoint as loaded, on a pool of its own or
colocated: frozen, outside the 3D-HybridEngine. For each sample it renders the template (the judge's user turn,
through its chat template), generates greedily (``JudgeConfig.temperature`` 0), and parses the verdict. The
template and parser may be the user's functions: each call has ``timeout_s``, as a rule reward's; one past it
(or a verdict the parser cannot read, or a rendered prompt longer than ``max_prompt_length``) scores
``default_score`` and is counted, and the batch goes on. The generation itself is bounded by
``max_new_tokens``.
"""

from __future__ import annotations

import math
import time
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from typing import Any

import torch

from workers.data_proto import DataProto
from workers.deadline_threads import DeadlineThreads
from workers.dispatch import Dispatch
from workers.multimodal import MULTI_MODAL_INPUTS
from workers.register import register
from workers.reward.judge_verdicts import (DEFAULT_TEMPLATE, checked_score, resolve_parser, resolve_template)
from workers.reward.rule_reward import final_reply, last_token_scores
from workers.rollout.batch import GenerationRequest
from workers.rollout.config import RolloutConfig
from workers.rollout.rollout import Rollout
from workers.rollout.sampling import SamplingConfig

__all__ = ["GenerativeJudge", "JUDGE_COLUMNS", "JudgeConfig"]

# the columns compute_reward adds beside the scores, per sample: the judge's own score (before any weight), and
# whether its call timed out, its verdict was unreadable or its prompt too long; the verdict's tokens; the seconds
# the judge's generation took on the sample's replica
JUDGE_COLUMNS = ("judge_scores", "judge_timed_out", "judge_parse_failed", "judge_overlong", "judge_tokens",
                 "judge_seconds")
MAX_ABANDONED_CALLS = 64  # template or parser calls past their deadline still running: more is an error


@dataclass(frozen=True)
class JudgeConfig:
    """A generative judge: its model, prompt and verdict, and how it generates."""

    model_path: str | None = None  # an HF causal LM with a chat template (a directory or a hub id)
    # its user turn: a format string over {question}, {response}, {reference}, or "package.module:function"
    # taking the row (question, response, reference, data_source and the row's other fields)
    template: str = DEFAULT_TEMPLATE
    # the verdict's score: score_out_of_10 (N/10 to [0, 1]), boxed (the number in \boxed{}), yes_no (1 / 0), or
    # "package.module:function" taking (the verdict, the row) and returning a float or None (unreadable)
    parser: str = "score_out_of_10"
    default_score: float = 0.0  # a verdict not read, a call past timeout_s, a prompt too long: this score
    weight: float = 1.0  # the judge's score is added at this weight (to a rule reward's, where there is one)
    # data sources the judge scores (their rows take weight x its score in place of the rule's); empty: every row
    data_sources: tuple[str, ...] = ()
    engine: str = "vllm"  # its generation engine: one that loads a checkpoint of its own (vllm)
    tensor_parallel: int = 1  # its generation TP (its pool's ranks in groups of this many; each group a replica)
    precision: str = "bf16"  # bf16 or fp32
    max_prompt_length: int = 1024  # the rendered judge prompt's tokens at most (longer: default_score, counted)
    max_new_tokens: int = 64  # the verdict's tokens at most
    temperature: float = 0.0  # 0: greedy
    timeout_s: float | None = 120.0  # each sample's template and parser calls at most (seconds); None: no limit
    max_concurrency: int = 8  # template and parser calls at once (threads)
    kv_cache_bytes: int = 64 << 20  # its engine's KV cache
    max_num_seqs: int = 256  # sequences its engine runs at once at most

    def __post_init__(self) -> None:
        if not self.model_path:
            raise ValueError("model_path is required: the judge's HF checkpoint (a causal LM with a chat template)")
        for name in ("default_score", "weight"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise ValueError(f"{name} must be a finite number, got {value!r}")
        if self.precision not in ("bf16", "fp32"):
            raise ValueError(f"precision {self.precision!r} is not one of ['bf16', 'fp32']")
        if self.timeout_s is not None and not self.timeout_s > 0:
            raise ValueError(f"timeout_s must be a positive number of seconds or null, got {self.timeout_s!r}")
        for name in ("tensor_parallel", "max_prompt_length", "max_new_tokens", "max_concurrency", "max_num_seqs"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)!r}")
        object.__setattr__(self, "data_sources", tuple(self.data_sources))

    def rollout_config(self) -> RolloutConfig:
        """The judge's engine as a rollout serving its checkpoint."""
        return RolloutConfig(engine=self.engine, tensor_parallel=self.tensor_parallel,
                             max_prompt_length=self.max_prompt_length, kv_cache_bytes=self.kv_cache_bytes,
                             max_num_seqs=self.max_num_seqs, sleep_between_rollouts=False,
                             sampling=SamplingConfig(max_new_tokens=self.max_new_tokens, temperature=self.temperature))


class GenerativeJudge(Rollout):
    """``compute_reward`` by an LLM's verdicts (see the module docstring)."""

    def __init__(self, model_path: str, tokenizer_path: str, config: JudgeConfig) -> None:
        """``model_path``: the judge's checkpoint; ``tokenizer_path``: the policy's, which wrote the batch's ids."""
        from transformers import AutoTokenizer

        super().__init__(model_path, config.rollout_config(), actor_role=None, precision=config.precision)
        if not getattr(self.tokenizer, "chat_template", None):
            raise ValueError(f"the judge {model_path} has no chat template: its user turn cannot be written")
        self.judge = config
        self.policy_tokenizer = AutoTokenizer.from_pretrained(tokenizer_path)
        self.template = resolve_template(config.template)
        self.parser = resolve_parser(config.parser)
        self.calls = DeadlineThreads(config.max_concurrency, "hybridflow-judge", MAX_ABANDONED_CALLS)
        # The ranks of a generation TP group generate together, so they agree on which samples' templates finished
        # in time (each rank runs them; a call near its deadline may end on one rank and not another).
        self._tp_group = None
        if config.tensor_parallel > 1:
            for ranks in self.plan.gen_tp_groups:  # every rank makes every group, in one order (collective)
                group = torch.distributed.new_group(list(ranks))
                if self.rank in ranks:
                    self._tp_group = group

    @register(Dispatch.MESH_COMPUTE_PROTO)
    def compute_reward(self, data: DataProto) -> DataProto:
        """``scores`` [B] (the judge's score, ``default_score`` where it has none), ``token_level_scores`` [B, R]
        (on each response's last token) and ``JUDGE_COLUMNS``."""
        cfg = self.judge
        rows = self._rows(data)
        prompts, late_template = self._call_each(lambda row: self._judge_prompt(self.template(row)), rows)
        too_long = [p is not None and len(p) > cfg.max_prompt_length for p in prompts]
        ready = torch.tensor([p is not None and not long for p, long in zip(prompts, too_long)], dtype=torch.int32)
        if self._tp_group is not None:  # a sample goes to the engine only where every rank of the group has it
            agreed = ready.to(self.device)  # (on the group's device: NCCL reduces device tensors)
            torch.distributed.all_reduce(agreed, op=torch.distributed.ReduceOp.MIN, group=self._tp_group)
            ready = agreed.cpu()
        late_template = [late or (prompts[i] is not None and not too_long[i] and not ready[i])
                         for i, late in enumerate(late_template)]
        asked = ready.nonzero().flatten().tolist()
        start = time.perf_counter()
        completions = self.generator.generate([GenerationRequest(tuple(prompts[i]), None) for i in asked],
                                              self.config.sampling) if asked else []
        seconds = time.perf_counter() - start
        verdicts: list[str | None] = [None] * len(rows)
        tokens = [0] * len(rows)
        for i, completion in zip(asked, completions):
            verdicts[i] = self.tokenizer.decode(completion.token_ids, skip_special_tokens=True)
            tokens[i] = len(completion.token_ids)
        parsed, late_parser = self._call_each(lambda i: checked_score(self.parser(verdicts[i], rows[i])),
                                              [i if verdicts[i] is not None else None for i in range(len(rows))])
        timed_out = [late_template[i] or late_parser[i] for i in range(len(rows))]
        unread = [verdicts[i] is not None and not late_parser[i] and parsed[i] is None for i in range(len(rows))]
        scores = torch.tensor([cfg.default_score if s is None else s for s in parsed], dtype=torch.float32)
        mask = data.batch["response_mask"]
        return DataProto({
            "scores": scores, "token_level_scores": last_token_scores(scores, mask), "judge_scores": scores.clone(),
            "judge_timed_out": torch.tensor(timed_out, dtype=torch.float32),
            "judge_parse_failed": torch.tensor(unread, dtype=torch.float32),
            "judge_overlong": torch.tensor(too_long, dtype=torch.float32),
            "judge_tokens": torch.tensor(tokens, dtype=torch.float32),
            "judge_seconds": torch.full((len(rows),), seconds, dtype=torch.float32)})

    def _rows(self, data: DataProto) -> list[dict[str, Any]]:
        """Each sample as the template and parser see it: question, response, reference and its other fields."""
        prompts, responses = data.batch["prompts"], data.batch["responses"]
        prompt_mask = data.batch["attention_mask"][:, : prompts.shape[1]].bool()
        response_mask = data.batch["response_mask"].bool()
        decode = self.policy_tokenizer.batch_decode
        questions = decode([row[keep].tolist() for row, keep in zip(prompts, prompt_mask)], skip_special_tokens=True)
        answers = decode([row[keep].tolist() for row, keep in zip(responses, response_mask)], skip_special_tokens=True)
        fields = data.non_tensor_batch
        if fields.get("agent_messages") is not None:  # a multi-turn rollout: the answer is the model's last turn
            answers = [final_reply(messages) for messages in fields["agent_messages"]]
        truth = fields.get("ground_truth")
        rows = []
        for i in range(len(data)):
            extra = {k: v[i] for k, v in fields.items() if k not in ("ground_truth", MULTI_MODAL_INPUTS)}
            rows.append({**extra, "question": questions[i], "response": answers[i],
                         "reference": "" if truth is None or truth[i] is None else str(truth[i])})
        return rows

    def _judge_prompt(self, text: Any) -> list[int]:
        if not isinstance(text, str):
            raise TypeError(f"reward.judge.template returned {type(text).__name__}, not the user turn's text")
        return list(self.tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                                       tokenize=True, return_dict=False))

    def _call_each(self, fn, items: list[Any]) -> tuple[list[Any], list[bool]]:
        """``fn(item)`` for each item that is not None, on deadline threads: (results, timed out); a call past
        ``timeout_s`` gives None and True. A call that raises is raised, naming the sample."""
        timeout = self.judge.timeout_s if self.judge.timeout_s is not None else math.inf
        calls = [None if item is None else (self.calls.submit(fn, item, timeout_s=timeout), time.monotonic() + timeout)
                 for item in items]
        results, late = [], []
        for sample, (item, call) in enumerate(zip(items, calls)):
            if item is None:
                results.append(None)
                late.append(False)
                continue
            future, deadline = call
            try:
                if future is None:
                    raise FutureTimeout
                results.append(future.result(timeout=None if math.isinf(timeout) else
                                             max(0.0, deadline - time.monotonic())))
                late.append(False)
            except FutureTimeout:
                results.append(None)
                late.append(True)
            except Exception as exc:
                raise RuntimeError(f"the judge's template or parser raised on sample {sample} of this rank's "
                                   f"{len(items)} ({type(exc).__name__}: {exc})") from exc
        return results, late
