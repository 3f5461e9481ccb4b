"""Rollout: the role that turns prompts into responses, on any registered generation engine.

The engine is a ``Generator`` (``workers.rollout.generator``: vLLM, megatron's
static inference engine, or one a user registers); the weights reach it
through a ``WeightSync`` (``workers.rollout.weight_sync``), chosen once:

* colocated with the actor (same processes, ``actor_role``): before each
  generation the actor's weights are resharded into the generation layout
  through the 3D-HybridEngine and pushed into the engine (vLLM copies them
  and the buffer is dropped at once; megatron generates on views of it, zero
  copy, and the buffer is dropped after generation);
* on a pool of its own (``training=...``): the trainer pushes the weights
  across pools when the rollout's copy is stale (``receive_weights``);
* neither: the engine serves ``model_path`` as loaded.

Batches are split over generation replicas (``GenerationMesh``): every rank
of one generation TP x PP group sees the same prompts.
"""

from __future__ import annotations

import time
from typing import Any

import torch
import torch.distributed as dist

from hybridengine.model.spec import ModelSpec
from hybridengine.parallel.layout import ParallelLayout
from hybridengine.reshard.plan import GenerationLayout, GenerationMesh, plan_reshard
from workers.base_worker import BaseWorker
from workers.data_proto import DataProto
from workers.dispatch import Dispatch
from workers.keywords import check_constructor
from workers.pretrained import resolve_pretrained
from workers.register import register
from workers.role_spec import RoleSpec
from workers.multimodal import MULTI_MODAL_DATA
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
from workers.rollout.training_layout import TrainingLayout
from workers.rollout.generator import GeneratorContext, RequestServing, build_generator
from workers.rollout.weight_sync import CheckpointWeights, CrossPoolSync, weight_sync_for

__all__ = ["Rollout"]


class Rollout(BaseWorker):
    def __init__(self, model_path: str, config: RolloutConfig | None = None, actor_role: str | None = "actor",
                 training: TrainingLayout | None = None, sandbox_isolation: str | None = None,
                 precision: str | None = None) -> None:
        """``config``: the typed rollout section (None: its defaults). ``training``: set when the rollout has a
        pool of its own and the actor sends it weights (``receive_weights``): the actor's layout, vocabulary
        padding and precision, which its shards are cut by. ``sandbox_isolation``: the job's
        ``sandbox.isolation``, this process's default for the agent tools that run code. ``precision``: a
        checkpoint served as loaded (no actor, no training pool): its dtype, "fp32" (the default) or "bf16"."""
        from transformers import AutoTokenizer

        from workers.sandbox import set_default_isolation

        set_default_isolation(sandbox_isolation)

        self.config = cfg = config or RolloutConfig()
        self.spec = spec = ModelSpec.from_pretrained(model_path)
        if spec.is_value_model:
            raise ValueError(f"{model_path} is a {spec.architecture} (a value head); rollout needs a causal LM")
        if training is not None and actor_role is not None:
            raise ValueError("a rollout on its own pool (training=...) takes its weights from the actor's pool, "
                             "not from a colocated actor: give actor_role=None")
        self.training = training
        self.tokenizer = AutoTokenizer.from_pretrained(model_path)
        self.pad_token_id = cfg.pad_token_id if cfg.pad_token_id is not None else self.tokenizer.pad_token_id
        self.eos_token_id = cfg.eos_token_id if cfg.eos_token_id is not None else self.tokenizer.eos_token_id
        check_special_tokens(self.pad_token_id, self.eos_token_id, model_path)
        source = self.peer(actor_role).weight_source() if actor_role is not None else None
        self.gen = GenerationLayout(cfg.tensor_parallel, cfg.pipeline_parallel, cfg.expert_parallel)
        if source is not None:  # the shards arrive cut and padded as the actor's engine cuts them
            self.spec = spec = source.spec
            train, dtype = source.layout, source.dtype
        else:  # standalone or fed across pools: the generation grid is the whole pool, each rank its own shard
            if self.training is not None:  # the shards that arrive are padded as the actor's engine pads them
                self.spec = spec = spec.with_padded_vocab(self.training.make_vocab_size_divisible_by,
                                                          self.training.tensor_parallel)
            train = ParallelLayout.for_world(self.world_size, cfg.tensor_parallel, cfg.pipeline_parallel)
            dtype = PRECISIONS[self.training.precision if self.training is not None else precision or "fp32"]
        if source is not None or self.training is not None:  # (a checkpoint served as loaded: its engine pads it)
            spec.check_layout(cfg.tensor_parallel, cfg.pipeline_parallel)
        self.dtype = dtype
        self.plan = plan_reshard(train, self.gen)  # refuses an unreachable layout, listing the legal ones
        self.set_layout(GenerationMesh(train, self.gen))
        self.weight_sync = weight_sync_for(
            source, self.training, spec=spec, gen=self.gen, gen_dp=self.plan.gen_dp, rank=self.rank, dtype=dtype,
            device=self.device, method=cfg.reshard_method, release_training=cfg.release_training,
            lora=cfg.lora_adapter, bucket_bytes=cfg.weight_bucket_bytes)
        self.generator = build_generator(cfg.engine, GeneratorContext(
            model_path, spec, self.plan, self.rank, dtype, cfg, self.eos_token_id, self.pad_token_id, self._decode,
            weights_pushed=source is not None or self.training is not None, colocated=source is not None))
        self.agent = None
        self._serving = None  # (EngineLoop, ReplicaServer, the sync's metrics) between start_serving and serve
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
        built_for = self.generator.max_new_tokens
        if built_for is not None and sampling.max_new_tokens > built_for:
            raise ValueError(f"max_new_tokens {sampling.max_new_tokens} exceeds the {built_for} the {cfg.engine} "
                             f"engine was built for (its max_model_len); raise sampling.max_new_tokens in the "
                             f"rollout config")
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
        images = partial.non_tensor_batch.get(MULTI_MODAL_DATA, [None] * len(partial))
        requests = [GenerationRequest(tuple(prompts[i][prompt_mask[i]].tolist() + responses[i, :lengths[i]].tolist()),
                                      sampling.request_seed(first_index + i, 0), tuple((images[i] or {}).get("image", ())))
                    for i in range(len(partial))]
        # Rows with fewer tokens left than a chunk run as a second batch, under their own limit.
        limits = [min(sampling.max_new_tokens, width - length) for length in lengths]
        if min(limits) < 1:
            raise ValueError(f"row {limits.index(min(limits))} is already {width} tokens long: nothing is left to generate")

        completions, metrics = self._on_current_weights(
            lambda: self.generator.generate_chunk(requests, sampling, limits))
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
        """``generate()`` on the policy's weights as they are now (pulled in first where the rollout pulls
        them, let go of after), timed."""
        metrics: dict[str, Any] = {}
        if not self.weight_sync.pushed:
            metrics.update(self.weight_sync.update(self.generator))
        gen_start = time.perf_counter()
        out = generate()
        metrics["timing_s/gen"] = time.perf_counter() - gen_start
        metrics.update(self.weight_sync.done(self.generator))
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

    # ------------------------------------------------------- as a server (rollout.server)
    @register(Dispatch.ONE_TO_ALL)
    def start_serving(self, api_key: str, host: str = "127.0.0.1") -> dict[str, Any]:
        """Take the policy's current weights (where the rollout pulls them) and open this rank's token-in,
        token-out endpoint (``workers.rollout.serving``), which answers only requests that carry ``api_key``;
        its address and the sync's metrics. Requests are served once ``serve`` runs; each rank is one replica
        (generation TP 1)."""
        if not isinstance(self.generator, RequestServing):
            raise ValueError(f"rollout.server needs an engine that serves requests one by one (vllm); the "
                             f"{self.config.engine!r} engine generates batches")
        if self.gen.tensor_parallel != 1 or self.gen.pipeline_parallel != 1:
            raise ValueError(f"rollout.server serves one engine per process: generation tensor_parallel and "
                             f"pipeline_parallel 1, got {self.gen.tensor_parallel} x {self.gen.pipeline_parallel}")
        from workers.rollout.serving import ReplicaServer

        metrics: dict[str, Any] = {}
        if not self.weight_sync.pushed:
            metrics.update(self.weight_sync.update(self.generator))
        loop = self.generator.serving_loop(self.config.sampling)
        # POST /update: the policy's current weights while serving (every rank at once: the reshard is collective)
        on_update = None if isinstance(self.weight_sync, CheckpointWeights) else (
            lambda: self.weight_sync.update(self.generator))
        self._serving = (loop, ReplicaServer(loop, api_key, host, on_update=on_update).start(), metrics)
        return {"address": self._serving[1].address, "max_model_len": loop.max_model_len, **metrics}

    @register(Dispatch.ONE_TO_ALL)
    def serve(self) -> dict[str, Any]:
        """Generate for the requests that reach this rank's endpoint until it is told to stop
        (``POST /stop``), then close it and let go of the weights; the serving's counts and metrics."""
        if self._serving is None:
            raise RuntimeError("serve() comes after start_serving()")
        loop, server, metrics = self._serving
        try:
            stats = loop.run()
        finally:
            server.close()
            self._serving = None
        metrics = {**metrics, **{f"serving/{k}": v for k, v in stats.items()}}
        metrics.update(self.weight_sync.done(self.generator))
        return metrics

    # ------------------------------------------------------- on a pool of its own
    @register(Dispatch.ONE_TO_ALL)
    def connect_training_pool(self, host: str, port: int, method: str = "auto", timeout_s: float = 600.0) -> dict[str, Any]:
        """Join the weight link from the actor's pool (the controller calls the actor's side at once)."""
        if not isinstance(self.weight_sync, CrossPoolSync):
            raise RuntimeError("this rollout has no training pool to connect to: it shares the actor's processes "
                               "and reshards in place, or serves its own checkpoint")
        return self.weight_sync.connect(host, port, method, timeout_s)

    @register(Dispatch.ONE_TO_ALL)
    def receive_weights(self) -> dict[str, Any]:
        """Take the actor's current weights, this rank's generation shard, into the engine; times and bytes."""
        return self.weight_sync.update(self.generator)

    @register(Dispatch.ONE_TO_ALL)
    def disconnect_training_pool(self) -> None:
        """Drop the weight link (with the actor's side, at the same time)."""
        if isinstance(self.weight_sync, CrossPoolSync):
            self.weight_sync.close()

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
