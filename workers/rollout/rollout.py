"""Rollout: the role that turns prompts into responses, on vLLM or on megatron's inference engine.

Colocated with the actor (same processes, ``actor_role``), each call
reshards the actor's current weights into the generation layout through the
3D-HybridEngine and generates from them:

* vLLM: the generation shard is copied into this rank's vLLM engine in
  vLLM's per-rank layout, then the generation buffer is dropped (vLLM keeps
  its own copy: what that costs is reported as ``weight_sync/bytes`` and
  ``timing_s/weight_sync``).
* megatron: a generation-layout GPTModel whose parameters are views into the
  generation buffer (zero copy) runs megatron-core's static inference engine;
  the buffer is dropped after generation.

Without an actor (``actor_role=None``) the vLLM engine serves the weights of
``model_path`` as they are.

Batches are split over generation replicas (``GenerationMesh``): every rank
of one generation TP x PP group sees the same prompts.
"""

from __future__ import annotations

import time
from dataclasses import replace
from typing import Any

import torch
import torch.distributed as dist

from hybridengine.parallel.layout import ParallelLayout
from hybridengine.model.spec import ModelSpec
from hybridengine.reshard.plan import GenerationLayout, GenerationMesh, plan_reshard
from workers.base_worker import BaseWorker
from workers.data_proto import DataProto
from workers.dispatch import Dispatch
from workers.keywords import check_constructor
from workers.pretrained import resolve_pretrained
from workers.register import register
from workers.role_spec import RoleSpec
from workers.rollout.batch import (
    Completion,
    GenerationRequest,
    PromptError,
    build_requests,
    build_rollout_batch,
    check_special_tokens,
    stop_in_continuation,
)
from workers.megatron.config import PRECISIONS
from workers.rollout.config import RolloutConfig

__all__ = ["Rollout"]

VLLM_VOCAB_PADDING = 64


class Rollout(BaseWorker):
    def __init__(self, model_path: str, config: RolloutConfig | dict | None = None, actor_role: str | None = "actor",
                 training: dict[str, Any] | None = None) -> None:
        """``training``: set when the rollout has a pool of its own and the actor sends it weights
        (``receive_weights``): the actor's tensor_parallel, pipeline_parallel, data_parallel,
        make_vocab_size_divisible_by and precision, which its shards are cut by."""
        from transformers import AutoTokenizer

        self.config = cfg = RolloutConfig.from_value(config)
        self.spec = spec = ModelSpec.from_pretrained(model_path)
        if spec.is_value_model:
            raise ValueError(f"{model_path} is a {spec.architecture} (a value head); rollout needs a causal LM")
        if training is not None and actor_role is not None:
            raise ValueError("a rollout on its own pool (training=...) takes its weights from the actor's pool, "
                             "not from a colocated actor: give actor_role=None")
        self.training = dict(training) if training is not None else None
        self.cross_pool = None
        self.tokenizer = AutoTokenizer.from_pretrained(model_path)
        self.pad_token_id = cfg.pad_token_id if cfg.pad_token_id is not None else self.tokenizer.pad_token_id
        self.eos_token_id = cfg.eos_token_id if cfg.eos_token_id is not None else self.tokenizer.eos_token_id
        check_special_tokens(self.pad_token_id, self.eos_token_id, model_path)
        self.actor = self.peer(actor_role) if actor_role is not None else None
        if self.actor is not None:
            # The actor's spec: its vocabulary padding is what the resharded shards carry.
            self.spec = spec = self.actor.engine.spec
            spec.check_layout(cfg.tensor_parallel, cfg.pipeline_parallel)
        elif self.training is not None:  # the shards that arrive are padded as the actor's engine pads
            self.spec = spec = spec.with_padded_vocab(self.training["make_vocab_size_divisible_by"],
                                                      self.training["tensor_parallel"])
            spec.check_layout(cfg.tensor_parallel, cfg.pipeline_parallel)
        if cfg.engine == "vllm":
            # vLLM pads the vocabulary to a multiple of 64 itself (its DEFAULT_VOCAB_PADDING_SIZE) and splits that.
            spec.with_padded_vocab(VLLM_VOCAB_PADDING, 1).check_layout(
                cfg.tensor_parallel, cfg.pipeline_parallel)
        self.gen = GenerationLayout(cfg.tensor_parallel, cfg.pipeline_parallel)
        if self.actor is not None:
            train = self.actor.engine.layout
            dtype = next(self.actor.engine.module().parameters()).dtype
        else:
            if cfg.engine == "megatron" and self.training is None:
                raise ValueError("the megatron rollout generates from the actor's weights; colocate it with an "
                                 "actor (actor_role), give it a pool of its own fed by the actor (training=...), "
                                 "or use engine='vllm'")
            # Standalone or fed across pools: the generation grid is the whole pool, each rank its own shard.
            train = ParallelLayout.for_world(self.world_size, cfg.tensor_parallel, cfg.pipeline_parallel)
            dtype = PRECISIONS[self.training["precision"]] if self.training is not None else torch.float32
        self.dtype = dtype
        self.plan = plan_reshard(train, self.gen)  # refuses an unreachable layout, listing the legal ones
        self.set_layout(GenerationMesh(train, self.gen))
        if cfg.engine == "vllm":
            from workers.rollout.vllm_engine import VLLMGenerator

            self.generator = VLLMGenerator(
                model_path, spec, self.plan, self.rank, dtype=dtype, max_model_len=cfg.max_model_len,
                eos_token_id=self.eos_token_id, kv_cache_bytes=cfg.kv_cache_bytes, max_num_seqs=cfg.max_num_seqs,
                seed=cfg.seed, dummy_weights=self.actor is not None or self.training is not None,
                enforce_eager=cfg.enforce_eager,
                # Only a rollout sharing the actor's devices frees them between rollouts: one fed across pools
                # (or serving its own checkpoint) keeps its weights, which a level-2 sleep would discard.
                sleep_between_rollouts=cfg.sleep_between_rollouts and self.actor is not None,
            )
        else:
            from workers.rollout.megatron_engine import MegatronGenerator

            self.generator = MegatronGenerator(
                spec, self.plan, self.rank, {}, eos_token_id=self.eos_token_id, pad_token_id=self.pad_token_id,
                decode=self._decode,
            )
        self.agent = None
        if cfg.agent is not None:  # multi-turn conversations (workers.rollout.agent)
            from workers.rollout.agent import AgentLoop, ChatFormat

            self.tools = cfg.agent.toolbox()
            chat = ChatFormat(self.tokenizer, tools=self.tools.schemas() or None, end_of_turn_id=self.eos_token_id,
                              tool_format=cfg.agent.tool_format)
            self.agent = AgentLoop(chat, cfg.agent.environment_factory(self.tools, self.tokenizer), cfg.agent.limits())

    def _decode(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=False)

    @register(Dispatch.MESH_COMPUTE_PROTO)
    def generate_sequences(self, prompts: DataProto) -> DataProto:
        """Responses for ``prompts`` (left-padded ``input_ids`` + ``attention_mask``).

        ``prompts.meta_info["sampling"]`` (a dict of SamplingConfig fields)
        overrides the configured sampling for this call. Returns the training
        batch (see ``build_rollout_batch``) with ``meta_info["metrics"]``:
        ``timing_s/reshard``, ``timing_s/weight_sync``, ``timing_s/gen``,
        bytes moved, and token counts.
        """
        cfg = self.config
        start = time.perf_counter()
        sampling = cfg.sampling.updated(prompts.meta_info.get("sampling"))
        if sampling.max_new_tokens > cfg.sampling.max_new_tokens and cfg.engine == "vllm":
            raise ValueError(f"max_new_tokens {sampling.max_new_tokens} exceeds the {cfg.sampling.max_new_tokens} "
                             f"the vLLM engine was built for (its max_model_len); raise sampling.max_new_tokens in "
                             f"the rollout config")
        first_index = self.layout.coordinate(self.rank).dp_rank * len(prompts)
        if self.agent is not None:
            return self._generate_conversations(prompts, sampling, first_index, start)
        requests = self._checked_requests(prompts, sampling, first_index)
        completions, metrics = self._on_current_weights(lambda: self.generator.generate(requests, sampling))
        batch = build_rollout_batch(prompts, requests, completions, sampling, cfg.max_prompt_length, self.pad_token_id)
        return self._with_metrics(batch, metrics, start)

    @register(Dispatch.MESH_COMPUTE_PROTO)
    def generate_chunk(self, partial: DataProto) -> DataProto:
        """The next tokens of partially generated samples: async mode's partial rollouts (``controller.rl.sample_stream``).

        Each row is one sample: its prompt (``prompts``, left-padded, with ``prompt_mask``) and its response so far
        (``responses``, right-padded to the configured max_new_tokens, the first ``response_mask.sum()`` of them
        generated). It continues from there on the weights the rollout holds now, for at most
        ``meta_info["sampling"]["max_new_tokens"]`` more tokens and never past the configured max_new_tokens.
        Returns the extended ``responses``, ``response_mask`` and ``rollout_log_probs`` (the rows' own log-probs
        before this chunk come back as given) and ``finished`` (EOS or a stop string, or the full length), with
        the generation's metrics. Row i draws from the seed ``sampling.seed + i`` (its global row index).
        """
        cfg = self.config
        if self.agent is not None:
            raise ValueError("partial rollouts continue single-turn responses; a multi-turn (agent) rollout "
                             "generates whole conversations with generate_sequences")
        start = time.perf_counter()
        sampling = cfg.sampling.updated({**partial.meta_info.get("sampling", {}), "n": 1})
        responses = partial.batch["responses"].clone()
        response_mask = partial.batch["response_mask"].clone()
        log_probs = partial.batch["rollout_log_probs"].clone()
        width = responses.shape[1]
        if width != cfg.sampling.max_new_tokens:
            raise ValueError(f"partial responses are {width} wide; this rollout generates {cfg.sampling.max_new_tokens}")
        lengths = response_mask.sum(-1).tolist()
        first_index = self.layout.coordinate(self.rank).dp_rank * len(partial)
        prompts, prompt_mask = partial.batch["prompts"], partial.batch["prompt_mask"].bool()
        requests = [GenerationRequest(tuple(prompts[i][prompt_mask[i]].tolist() + responses[i, :lengths[i]].tolist()),
                                      sampling.request_seed(first_index + i, 0)) for i in range(len(partial))]
        # Rows with fewer tokens left than a chunk run as a second batch, under their own limit.
        limits = [min(sampling.max_new_tokens, width - length) for length in lengths]
        if min(limits) < 1:
            raise ValueError(f"row {limits.index(min(limits))} is already {width} tokens long: nothing is left to generate")

        def generate() -> list[Completion]:
            completions: list[Completion | None] = [None] * len(requests)
            for limit in sorted(set(limits), reverse=True):
                rows = [i for i, lim in enumerate(limits) if lim == limit]
                for i, done in zip(rows, self.generator.generate([requests[i] for i in rows],
                                                                 replace(sampling, max_new_tokens=limit))):
                    completions[i] = done
            return completions

        completions, metrics = self._on_current_weights(generate)
        for i, completion in enumerate(completions):  # a stop string begun in an earlier call ends the response
            before = responses[i, :lengths[i]].tolist()
            if (keep := stop_in_continuation(before, completion.token_ids, sampling.stop, self._decode)) is not None:
                completions[i] = Completion(completion.token_ids[:keep], completion.log_probs[:keep], "stop")
        finished = torch.zeros(len(partial), dtype=torch.bool)
        for i, completion in enumerate(completions):
            begin, count = lengths[i], len(completion.token_ids)
            responses[i, begin:begin + count] = torch.tensor(completion.token_ids, dtype=torch.long)
            log_probs[i, begin:begin + count] = torch.tensor(completion.log_probs, dtype=torch.float32)
            response_mask[i, begin:begin + count] = 1
            finished[i] = completion.finish_reason == "stop" or begin + count >= width
        out = DataProto({"responses": responses, "response_mask": response_mask, "rollout_log_probs": log_probs,
                         "finished": finished},
                        {"finish_reason": ["stop" if c.finish_reason == "stop" else "length" for c in completions]},
                        {"temperature": sampling.logprob_temperature})
        return self._with_metrics(out, metrics, start, tokens=sum(len(c.token_ids) for c in completions))

    def _on_current_weights(self, generate) -> tuple[Any, dict[str, Any]]:
        """``generate()`` on the actor's weights as they are now (resharded in, released after), timed."""
        cfg = self.config
        metrics: dict[str, Any] = {}
        if self.actor is not None:
            metrics.update(self._weights_from_actor())
        gen_start = time.perf_counter()
        out = generate()
        metrics["timing_s/gen"] = time.perf_counter() - gen_start
        if self.actor is not None and cfg.engine == "megatron":
            self.generator.release_weights()  # let go of the buffer's views, so the buffer can be freed
            metrics.update(self.actor.hybrid.to_training())
        if cfg.engine == "vllm":
            self.generator.sleep()
        return out, metrics

    @staticmethod
    def _with_metrics(batch: DataProto, metrics: dict[str, Any], start: float, tokens: int | None = None) -> DataProto:
        """``batch`` carrying the call's metrics; ``tokens``: those generated by this call (None: every
        response token of ``batch``)."""
        if tokens is None:
            tokens = int(batch.batch["response_mask"].sum())
        metrics.update({
            "rollout/response_tokens": tokens,
            "rollout/tokens_per_s": tokens / metrics["timing_s/gen"] if metrics["timing_s/gen"] > 0 else 0.0,
            "timing_s/rollout": time.perf_counter() - start,
        })
        batch.meta_info["metrics"] = metrics
        return batch

    def _checked_requests(self, prompts: DataProto, sampling, first_index: int):
        """Check this rank's prompts, and learn whether every other rank's passed, before any collective."""
        error = None
        try:
            requests = build_requests(prompts, sampling, self.config.max_prompt_length, self.config.truncation, first_index)
        except PromptError as exc:
            error, requests = str(exc), []
        self._raise_if_any_rank_failed(error)
        return requests

    def _raise_if_any_rank_failed(self, error: str | None) -> None:
        errors: list[str | None] = [None] * self.world_size
        dist.all_gather_object(errors, error, group=self.process_group)
        found = sorted({e for e in errors if e is not None})
        if found:
            raise PromptError("; ".join(found))

    def _generate_conversations(self, prompts: DataProto, sampling, first_index: int, start: float) -> DataProto:
        """The multi-turn rollout: each of the n samples of each prompt a conversation (``rollout.agent``)."""
        from workers.rollout.agent import agent_metrics
        from workers.rollout.agent.batch import build_agent_batch

        cfg, n = self.config, sampling.n
        repeated = prompts.repeat(n, interleave=True) if n > 1 else prompts
        if "messages" not in repeated.non_tensor_batch:
            raise PromptError("a multi-turn rollout starts from each prompt's chat messages (non-tensor 'messages', "
                              "as the prompt loader gives them); this batch has none")
        samples = [{key: values[row] for key, values in repeated.non_tensor_batch.items()} for row in range(len(repeated))]
        conversations = self.agent.begin(samples)
        too_long = [(row, len(r.trajectory.prompt_ids)) for row, r in enumerate(conversations.results)
                    if len(r.trajectory.prompt_ids) > cfg.max_prompt_length]
        error = None
        if too_long:
            row, length = too_long[0]
            error = (f"{len(too_long)} agent prompt(s) render (chat template and tool descriptions included) to more "
                     f"than rollout.max_prompt_length {cfg.max_prompt_length} tokens, e.g. row {first_index * n + row}: "
                     f"{length}")
        self._raise_if_any_rank_failed(error)  # before the reshard, which every rank takes part in
        turns = cfg.agent.max_turns
        seeds = (None if sampling.seed is None else
                 [sampling.seed + (first_index * n + row) * turns for row in range(len(samples))])
        results, metrics = self._on_current_weights(
            lambda: self.agent.converse(conversations, self.generator.generate, sampling, seeds))
        batch = build_agent_batch(repeated, results, self.pad_token_id, cfg.agent.max_response_length,
                                  cfg.max_prompt_length)
        batch.meta_info["temperature"] = sampling.logprob_temperature
        metrics.update(agent_metrics(results))
        return self._with_metrics(batch, metrics, start)

    def _weights_from_actor(self) -> dict[str, Any]:
        cfg = self.config
        hybrid = self.actor.hybrid
        metrics = dict(hybrid.to_generation(self.gen, cfg.reshard_method, cfg.release_training))
        if cfg.engine == "vllm":
            metrics.update(self.generator.sync_weights(hybrid.weights))
            metrics.update(hybrid.to_training())  # vLLM holds its own copy; the buffer can go now
        else:
            start = time.perf_counter()
            self.generator.set_weights(hybrid.weights)  # views into the buffer: nothing is copied
            metrics["timing_s/weight_sync"] = time.perf_counter() - start
            metrics["weight_sync/bytes"] = 0
        for key in ("gen_tp_rank", "gen_pp_rank", "gen_dp_rank"):
            metrics.pop(key, None)
        return metrics

    # ------------------------------------------------------- on a pool of its own
    @register(Dispatch.ONE_TO_ALL)
    def connect_training_pool(self, host: str, port: int, method: str = "auto", timeout_s: float = 600.0) -> dict[str, Any]:
        """Join the weight link from the actor's pool (the controller calls the actor's side at once)."""
        from hybridengine.cross_pool.transfer import CrossPoolTransfer, plan_for_model

        if self.training is None:
            raise RuntimeError("this rollout shares the actor's processes and reshards in place; it has no "
                               "training pool to connect to")
        t = self.training
        train = ParallelLayout(t["tensor_parallel"], t["pipeline_parallel"], t["data_parallel"])
        element = torch.empty((), dtype=self.dtype).element_size()
        plan = plan_for_model(self.spec, train, self.gen, self.plan.gen_dp, element, method)
        self.cross_pool = CrossPoolTransfer.standalone(self.spec, plan, train.world_size + self.rank, host, port,
                                                       timeout_s)
        return {"method": plan.method, "reason": plan.reason}

    @register(Dispatch.ONE_TO_ALL)
    def receive_weights(self) -> dict[str, Any]:
        """Take the actor's current weights, this rank's generation shard, into the engine; times and bytes."""
        if self.cross_pool is None:
            raise RuntimeError("no training pool is connected: call connect_training_pool first")
        before, start = self.cross_pool.bytes_received, time.perf_counter()
        weights = self.cross_pool.receive(self.rank, self.dtype, self.device)
        metrics = {"timing_s/weight_transfer": time.perf_counter() - start,
                   "weight_transfer/bytes": self.cross_pool.bytes_received - before,
                   "weight_transfer/bound_bytes": sum(w.numel() * w.element_size() for w in weights.values())}
        if self.config.engine == "vllm":
            metrics.update(self.generator.sync_weights(weights))
            self.cross_pool.release()  # vLLM holds its own copy
        else:
            self.generator.set_weights(weights)  # views of the transfer's buffer, kept until the next weights
            metrics.update({"timing_s/weight_sync": 0.0, "weight_sync/bytes": 0})
        return metrics

    @register(Dispatch.ONE_TO_ALL)
    def disconnect_training_pool(self) -> None:
        """Drop the weight link (with the actor's side, at the same time)."""
        if self.cross_pool is not None:
            self.cross_pool.close()
            self.cross_pool = None

    def close(self) -> None:
        if self.agent is not None:
            self.tools.close()
        self.generator.close()

    @classmethod
    def from_pretrained(cls, model_path: str, tensor_parallel: int | None = None, pipeline_parallel: int | None = None,
                        engine: str = "vllm", actor_role: str | None = "actor", device_map: str | None = None,
                        **config: Any) -> RoleSpec:
        """Declare a rollout on ``model_path``; a controller builds it later. ``config``: RolloutConfig fields,
        checked here. ``device_map="auto"``: the controller picks the generation TP unless it is given."""
        config = {"engine": engine, "tensor_parallel": tensor_parallel or 1, "pipeline_parallel": pipeline_parallel or 1,
                  **config}
        check_constructor(cls, {"model_path": model_path, "actor_role": actor_role, "config": config},
                          "Rollout.from_pretrained")
        model_path = resolve_pretrained(model_path, missing_ok=True)  # a hub id: its cached snapshot, found now
        return RoleSpec(cls, {"model_path": model_path, "actor_role": actor_role, "config": config},
                        device_map=device_map,
                        explicit_parallelism=tensor_parallel is not None or pipeline_parallel is not None)
