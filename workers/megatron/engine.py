"""MegatronEngine: one process's shard of a model, trained or evaluated with megatron-core.

The engine owns the model stage, megatron's DDP wrapper, optimizer and LR
schedule, and runs micro-batches through megatron's forward-backward
schedule (1F1B when pipeline-parallel). It knows nothing of PPO: the roles
(actor, critic, reference) hand it a per-micro-batch function that turns
the model's output into a loss and statistics.

Precision (``EngineConfig.precision``): in bf16 the stage's parameters and
activations are bf16; a trained stage is wrapped in megatron's Float16Module
and stepped by its mixed-precision optimizer, which keeps fp32 master
weights, reduces gradients in fp32 and writes the rounded weights back. The
model output reaches the step function in the model's dtype (no fp32 copy of
the hidden states or logits); what the step function computes from it
(log-probs, entropies, values, losses) is fp32.
"""

from __future__ import annotations

import contextlib
from functools import partial
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist

from hybridengine.model.catalogue import ExpertShard
from hybridengine.parallel.layout import ParallelLayout
from workers.data_proto import DataProto
from workers.megatron.config import PRECISIONS, EngineConfig, OptimConfig, check_precision
from workers.megatron.hf_checkpoint import export_hf_shard, load_hf_shard, write_hf_index
from workers.megatron.lora import LoRAConfig, adapters_disabled, attach_lora, merged_weights
from workers.megatron.lora_peft import full_adapters, load_peft_adapter, save_peft_adapter
from workers.megatron.lr_schedule import build_lr_scheduler
from workers.megatron.megatron_compat import fuse_cpu_adam, prepare_megatron, return_hidden_states
from workers.megatron.model import build_gpt_stage
from workers.megatron.micro_batches import (
    MicroBatch,
    PaddingStats,
    RunOutputs,
    build_micro_batch,
    fixed_groups,
    split_to_count,
    token_budget_groups,
)
from workers.megatron.moe_padding import MoEPadding, padding_mask
from workers.megatron.mrope import batch_mrope_positions
from workers.megatron.packed_sequences import split_rows
from workers.megatron.parallel import MegatronGroups, training_groups
from workers.megatron.preflight import check_training_setup
from workers.megatron.routing_monitor import RoutingMonitor
from workers.megatron.routing_replay import ROLLOUT_ROUTES, ROUTED_EXPERTS, RoutingReplay, check_replay
from workers.megatron.vision_tower import (
    MULTI_MODAL_INPUTS,
    VISION_MODULE,
    image_embeddings,
    image_token_mask,
    row_grids,
    scatter_image_embeddings,
)

__all__ = ["MegatronEngine", "MicroBatch", "StepFn"]  # MicroBatch: workers.megatron.micro_batches


# (micro-batch, model output on the last stage) -> (loss, statistics)
StepFn = Callable[[MicroBatch, torch.Tensor], tuple[torch.Tensor, dict[str, torch.Tensor]]]


class MegatronEngine:
    def __init__(
        self,
        model_path: str,
        config: EngineConfig,
        world_size: int,
        optim: OptimConfig | None = None,
        process_group: Any = None,
        lora: LoRAConfig | None = None,
        freeze_vision_tower: bool = True,
    ) -> None:
        """``lora``: train low-rank adapters on a frozen base (``workers.megatron.lora``) instead of every weight.
        ``freeze_vision_tower``: a vision-language model's tower and merger keep their weights (False: they train
        with the language model)."""
        self.model_path = Path(model_path)
        self.config = config
        self.lora = lora if lora is not None and lora.enabled else None
        if self.lora is not None and optim is None:
            raise ValueError("LoRA adapters train: a role without an optimizer (a reference or reward model) "
                             "cannot take them")
        self.spec, layout, reader = check_training_setup(model_path, config, world_size)
        if self.lora is not None and layout.cp > 1:
            raise ValueError(f"context_parallel {layout.cp} with LoRA (rank {self.lora.rank}): context parallelism "
                             "does not take LoRA adapters yet; set context_parallel 1 or train every weight")
        self.groups: MegatronGroups = training_groups(layout, config.seed, process_group)
        g = self.groups
        self.model_config, module = build_gpt_stage(
            self.spec, layout.tp, layout.pp, g.pp_rank, config.params_dtype, pg_collection=g.collection,
            packed=config.packed, attention=config.attention, cp=layout.cp,
            recompute_granularity=config.recompute_granularity, recompute_num_layers=config.recompute_num_layers,
            ep=layout.ep, etp=layout.etp, router=config.router)
        # Micro-batches are trimmed to their own longest row (and sized by a token budget), so the
        # activations between pipeline stages change shape: megatron sends each shape ahead.
        self.model_config.variable_seq_lengths = layout.pp > 1
        load_hf_shard(module, reader, self.spec, g.tp_rank, layout.tp, g.pp_rank, layout.pp, self.experts, g.etp_rank)
        # Adapters before megatron's DDP and optimizer are built: the frozen base gets neither gradient buffers
        # nor optimizer state. A value model's head is new, so it trains beside the adapters.
        self.adapters = attach_lora(module, self.spec, self.lora, layout.tp, g.tp_group, g.tp_rank, g.pp_rank,
                                    layout.pp, config.seed) if self.lora else {}
        if self.adapters and self.lora.adapter_path is not None:
            load_peft_adapter(module, self.spec, self.lora, layout.tp, g.tp_rank, g.pp_rank, layout.pp)
        if self.adapters and self.spec.is_value_model and hasattr(module, "output_layer"):
            module.output_layer.requires_grad_(True)
        if hasattr(module, VISION_MODULE) and freeze_vision_tower:  # before DDP: a frozen tower gets no
            getattr(module, VISION_MODULE).requires_grad_(False)           # gradient buffer, no optimizer state
        # Routing figures are an update's (run_ppo_epochs reads them): a forward-only engine keeps none.
        self.routing = RoutingMonitor(module, self.spec, g) if self.spec.is_moe and optim is not None else None
        self.replay: RoutingReplay | None = None  # built at the first batch with routes to replay
        self.padding = MoEPadding(module) if self.spec.is_moe else None
        self.optimizer = self.scheduler = None
        self.optim_config = optim
        self.output_deferred = False
        if optim is None:
            module.requires_grad_(False)
            self.model = module
        else:
            self.model, self.optimizer, self.scheduler = self._wrap_for_training(module, optim)

    @property
    def layout(self) -> ParallelLayout:
        """The grid as the weights see it: ``dp`` counts every replica, context-parallel ranks among them."""
        return self.groups.layout.weights

    @property
    def grid(self) -> ParallelLayout:
        """The grid as the data sees it: ``data_replicas`` take rows of their own, each split over ``cp`` ranks."""
        return self.groups.layout

    @property
    def experts(self) -> ExpertShard:
        """The routed experts this rank holds (a mixture of experts)."""
        layout = self.layout
        return ExpertShard(layout.ep, self.groups.ep_rank, layout.etp)

    @property
    def sequence_parallel(self) -> bool:
        """Activations between layers are split over the TP ranks along the sequence (MoE with TP > 1)."""
        return bool(self.model_config.sequence_parallel)

    # ---------------------------------------------------------------- setup
    def _wrap_for_training(self, module, optim: OptimConfig):
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
        from megatron.core.distributed.finalize_model_grads import finalize_model_grads
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

        from megatron.core.transformer.module import Float16Module

        ddp_config = DistributedDataParallelConfig(
            grad_reduce_in_fp32=True, overlap_grad_reduce=False, use_distributed_optimizer=optim.use_distributed_optimizer
        )
        if self.model_config.bf16:
            module = Float16Module(self.model_config, module)
        groups = self.groups.collection
        model = DistributedDataParallel(config=self.model_config, ddp_config=ddp_config, module=module,
                                        pg_collection=groups)
        self.model_config.finalize_model_grads_func = finalize_model_grads  # the schedule passes it the groups
        optimizer = get_megatron_optimizer(
            OptimizerConfig(
                optimizer="adam",
                lr=optim.lr,
                min_lr=optim.min_lr,
                weight_decay=optim.weight_decay,
                adam_beta1=optim.adam_beta1,
                adam_beta2=optim.adam_beta2,
                adam_eps=optim.adam_eps,
                clip_grad=optim.clip_grad,
                bf16=self.model_config.bf16,
                params_dtype=self.config.params_dtype,
                use_distributed_optimizer=optim.use_distributed_optimizer,
            ),
            [model],
            use_gloo_process_groups=False,  # megatron's extra gloo DP groups: the explicit ones serve
            pg_collection=groups,
        )
        return model, optimizer, build_lr_scheduler(optimizer, optim)

    # -------------------------------------------------------------- running
    @property
    def device(self) -> torch.device:
        """Where this stage's parameters, and so its micro-batches, live."""
        return next(self.module().parameters()).device

    def micro_batches(self, batch: DataProto) -> list[MicroBatch]:
        """``batch`` cut into micro-batches (fixed size, or by token budget), each trimmed to its longest row; packed
        (and split over the CP ranks) when the engine packs sequences.

        A token budget is per rank: under context parallelism a micro-batch holds up to CP x the budget, each
        rank a CP-th of it."""
        budget = self.config.max_tokens_per_micro_batch
        if budget is None:
            groups = fixed_groups(len(batch), self.config.micro_batch_size)
        else:
            groups = token_budget_groups(batch.batch["attention_mask"].long().sum(-1).tolist(), budget * self.grid.cp)
            if self.layout.has_expert_grid and self.grid.data_replicas > 1:
                # The experts' all-to-all spans data-parallel ranks: every rank runs as many micro-batches.
                groups = split_to_count(groups, int(self.dp_max([len(groups)])[0]))
        width_multiple = self.layout.tp if self.sequence_parallel else 1
        micro = [build_micro_batch(batch.batch, rows, self.device, width_multiple) for rows in groups]
        if self.config.packed:
            for mb in micro:
                self._pack(mb)
        images = batch.non_tensor_batch.get(MULTI_MODAL_INPUTS)
        if images is not None:  # a vision-language batch: each row's images go with it
            for mb, rows in zip(micro, groups):
                mb[MULTI_MODAL_INPUTS] = [images[row] for row in rows]
        return micro

    def _pack(self, mb: MicroBatch) -> None:
        """``mb``'s rows as packed tokens of this CP rank (``packed_sequences``): its ``input_ids`` become [1, T],
        ``response_local`` says where each response position lies among them, ``sequence_split`` goes to megatron."""
        g = self.groups
        tokens, response_local, split = split_rows(
            mb["input_ids"], mb["attention_mask"].long().sum(-1), mb["response_index"], self.grid.cp, g.cp_rank,
            pad_rows=not self.config.pack_sequences, context_group=g.cp_group)
        mb.update(input_ids=tokens, response_local=response_local, sequence_split=split)

    def run(self, batch: DataProto, step_fn: StepFn, forward_only: bool, loss_scale: float = 1.0) -> RunOutputs:
        """Every micro-batch of ``batch`` through the schedule; the last stage's statistics, one dict per micro-batch.

        Each micro-batch loss is multiplied by ``loss_scale`` before backward; the schedule's division
        by the number of micro-batches (which may differ between DP ranks under a token budget) is
        undone here, so the gradient is that of the sum of the micro-batch losses. A per-row statistic
        comes back in the micro-batches' order: ``RunOutputs.rows`` restores the batch's.
        """
        prepare_megatron()
        if ROUTED_EXPERTS in batch.batch or ROLLOUT_ROUTES in batch.batch:
            replayed = ROUTED_EXPERTS in batch.batch
            check_replay(self.spec, self.config.recompute_granularity if replayed else None,
                         self.config.moe_capacity_factor if replayed else None)
        micro = self.micro_batches(batch)
        mask = batch.batch["attention_mask"]
        slots = sum(mb["input_ids"].numel() for mb in micro) * self.grid.cp  # a CP rank holds a CP-th of each row
        padding = PaddingStats(real=int(mask.sum()), before=mask.numel(), after=slots)
        seq_length = max(mb["input_ids"].shape[1] for mb in micro)
        # megatron's schedule multiplies each loss by the CP size (its CP ranks' losses are local means): here
        # every CP rank computes the whole loss, so that is undone too
        scale = loss_scale * len(micro) / self.grid.cp

        def loss_func(mb: MicroBatch, output: torch.Tensor):
            loss, stats = step_fn(mb, output)
            return loss * scale, stats

        # The last stage's output stays in the model's dtype; step functions compute in fp32 from it.
        keep_dtype = {"fp32_output": False} if self.optimizer is not None and self.model_config.bf16 else {}

        def forward_step(data_iterator, model):
            mb = next(data_iterator)
            with self._routes_of(mb), self._padding_of(mb):
                output = self._forward(model, mb, **keep_dtype)
            return output, partial(loss_func, mb)

        context = torch.no_grad() if forward_only else torch.enable_grad()
        with context:
            stats = self._schedule()(
                forward_step_func=forward_step,
                data_iterator=iter(micro),
                model=[self.model],
                num_microbatches=len(micro),
                seq_length=seq_length,
                micro_batch_size=max(mb["input_ids"].shape[0] for mb in micro),
                forward_only=forward_only,
            )
        return RunOutputs(stats, micro, padding)

    def _forward(self, model, mb: MicroBatch, **kwargs) -> torch.Tensor:
        """``model`` (this stage, wrapped or not) on micro-batch ``mb``; a vision-language model's images go in
        through its vision tower."""
        ids = mb["input_ids"]
        split = mb.get("sequence_split")
        if split is not None:  # packed rows: megatron's THD format (its RoPE restarts at each row, CP-aware)
            return model(ids, split.positions.unsqueeze(0), None, packed_seq_params=split, **kwargs)
        if self.spec.vision is None:
            return model(ids, _position_ids(ids), None, **kwargs)
        positions, embeddings = self._multimodal_inputs(mb)
        return model(ids, positions, None, decoder_input=embeddings, **kwargs)

    def _multimodal_inputs(self, mb: MicroBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """A vision-language micro-batch's 3-D positions [3, B, S] and its token embeddings [S, B, H] with the
        vision tower's image embeddings in place at the image tokens."""
        ids, module = mb["input_ids"], self.module()
        inputs = mb.get(MULTI_MODAL_INPUTS) or [None] * len(ids)
        lengths = mb["attention_mask"].long().sum(-1).tolist()
        vision, grids = self.spec.vision, row_grids(inputs)
        positions = batch_mrope_positions(ids, lengths, grids, vision)
        embeddings = module.embedding(input_ids=ids, position_ids=None)
        features = image_embeddings(getattr(module, VISION_MODULE), inputs, ids.device)
        mask = image_token_mask(ids, [sum(map(vision.image_tokens, row)) for row in grids], vision.image_token_id)
        return positions, scatter_image_embeddings(embeddings, mask, features)

    def _padding_of(self, mb: MicroBatch):
        """Within: ``mb``'s forward, a mixture of experts' routers leaving its padding out of their losses and
        counts (``moe_padding``); nothing for a dense model."""
        if self.padding is None:
            return contextlib.nullcontext()
        return self.padding.within(padding_mask(mb["attention_mask"].sum(-1), mb["input_ids"].shape[1],
                                                self.sequence_parallel, self.groups.tp_rank, self.layout.tp))

    def _routes_of(self, mb: MicroBatch):
        """Within: ``mb``'s forward, its routers replaying its ``routed_experts`` when it has them, or compared
        with its ``rollout_routed_experts``."""
        key = next((k for k in (ROUTED_EXPERTS, ROLLOUT_ROUTES) if k in mb), None)
        if key is None:
            return contextlib.nullcontext()
        if self.replay is None:
            self.replay = RoutingReplay(self.module(), self.spec, self.spec.layers_of_stage(
                self.groups.pp_rank, self.layout.pp), self.groups.tp_rank, self.layout.tp, self.sequence_parallel)
        return self.replay.replaying(mb[key], replay=key == ROUTED_EXPERTS)

    def replay_metrics(self) -> dict[str, float]:
        """How often the routers' own top-k agreed with a batch's routes (``router_replay/agreement``, overall
        and per layer) in the passes since the last call, then forgotten; collective over the pool. Empty
        when no pass carried routes."""
        if self.replay is None:
            return {}
        return self.replay.metrics(self.groups.pool_group)

    def _schedule(self) -> Callable:
        """megatron's forward-backward schedule for this grid (1F1B over the PP group when PP > 1)."""
        from megatron.core.pipeline_parallel import schedules
        from megatron.core.pipeline_parallel.p2p_communication import P2PCommunicator

        groups = self.groups.collection
        if self.layout.pp == 1:
            return partial(schedules.forward_backward_no_pipelining, pg_collection=groups)
        p2p = P2PCommunicator(pp_group=groups.pp, config=self.model_config)
        return partial(schedules.forward_backward_pipelining_without_interleaving, p2p_communicator=p2p,
                       pg_collection=groups)

    def routing_metrics(self) -> dict[str, float]:
        """A mixture of experts' ``moe/...`` routing figures (``RoutingMonitor``) of the passes since the last
        call, then forgotten; collective over the pool. Empty for a dense model or a forward-only engine."""
        if self.routing is None:
            return {}
        metrics = self.routing.metrics()
        self.routing.reset()
        return metrics

    def zero_grad(self) -> None:
        self.model.zero_grad_buffer()
        self.optimizer.zero_grad()

    def optimizer_step(self) -> dict[str, float]:
        """Advance the LR schedule, clip and step; returns grad_norm, the LR used and ``skipped`` (0.0).

        The schedule moves first, so optimizer step k (from 1) uses the LR of
        step k: the first warmup step already has lr / warmup_steps, not 0.

        Gradients with a NaN or an Inf anywhere in the grid (a non-finite loss on one micro-batch of one
        rank spreads to every rank's reduced gradients) skip the step on every rank, agreed by one
        all-reduce: the weights, the optimizer's state and the LR schedule stay as they were, the gradients
        are zeroed, and ``skipped`` is 1.0 with a NaN ``grad_norm``.
        """
        if self.gradients_non_finite():
            self.zero_grad()
            return {"grad_norm": float("nan"), "lr": float(self.optimizer.param_groups[0]["lr"]), "skipped": 1.0}
        self.scheduler.step(increment=1)
        lr = self.optimizer.param_groups[0]["lr"]
        fuse_cpu_adam(self.optimizer)
        ok, grad_norm, _ = self.optimizer.step()
        if not ok:  # only a loss scaler skips (fp16, which PRECISIONS does not offer): checked above
            raise FloatingPointError("the optimizer skipped its step (non-finite gradients)")
        return {"grad_norm": float(grad_norm), "lr": float(lr), "skipped": 0.0}

    def gradients_non_finite(self) -> bool:
        """Whether any rank of the grid holds a NaN or an Inf in its gradient buffers (collective)."""
        local = any(not bool(torch.isfinite(buffer.grad_data).all())
                    for buffer in [*self.model.buffers, *self.model.expert_parallel_buffers])
        flag = torch.tensor([1.0 if local else 0.0], dtype=torch.float64, device=self.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.groups.pool_group)
        return bool(flag.item() > 0)

    def state_bytes(self) -> dict[str, int]:
        """What this rank holds for the model's state, counted from its tensors' storages (each once).

        ``weights``: the parameters (with the distributed optimizer, megatron's parameter buffer, padding
        included); ``gradients``: the DDP gradient buffers; ``optimizer``: what the optimizer adds, its
        fp32 master copies and its per-parameter state (Adam's moments and step counters). What the
        planner predicts (``controller.planner.memory``) is held to this.
        """
        seen: set[int] = set()

        def storage(t: torch.Tensor) -> int:
            s = t.untyped_storage()
            if s.data_ptr() in seen or s.nbytes() == 0:
                return 0
            seen.add(s.data_ptr())
            return s.nbytes()

        weights = sum(storage(p) for p in self.model.parameters())
        gradients = optimizer = 0
        if self.optimizer is not None:
            for buffer in [*self.model.buffers, *self.model.expert_parallel_buffers]:
                if buffer.param_data is not None:
                    weights += storage(buffer.param_data)
                gradients += storage(buffer.grad_data)
            for inner in getattr(self.optimizer, "chained_optimizers", [self.optimizer]):
                torch_optimizer = inner.optimizer
                for group in torch_optimizer.param_groups:
                    for param in group["params"]:
                        optimizer += storage(param)
                        optimizer += sum(storage(v) for v in torch_optimizer.state.get(param, {}).values()
                                         if isinstance(v, torch.Tensor))
        return {"weights": weights, "gradients": gradients, "optimizer": optimizer}

    def saved_activation_bytes(self, batch: DataProto) -> dict[str, int]:
        """What the first micro-batch's forward keeps for backward on this rank, parameters aside: the
        activations a training micro-batch holds between its forward and backward (PP 1 only), counted from
        the tensors autograd saves (each storage once). What the planner's activation model predicts.

        Returns ``bytes``, and the micro-batch's ``rows``, ``seq_len`` (its longest row) and ``image_patches``
        (a vision-language batch's patches through the tower).
        """
        if self.layout.pp != 1:
            raise ValueError(f"saved_activation_bytes measures PP 1 layouts; this engine is {self.layout}")
        mb = self.micro_batches(batch)[0]
        params = {p.untyped_storage().data_ptr() for p in self.model.parameters()}
        seen: set[int] = set()
        total = 0

        def pack(t: torch.Tensor) -> torch.Tensor:
            nonlocal total
            storage = t.untyped_storage()
            if storage.data_ptr() not in params and storage.data_ptr() not in seen:
                seen.add(storage.data_ptr())
                total += storage.nbytes()
            return t

        with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            output = self._forward(self.model, mb)
        del output
        patches = sum(int(row["image_grid_thw"].prod(-1).sum()) for row in mb.get(MULTI_MODAL_INPUTS, ()) if row)
        # the micro-batch's width: its longest row (packed rows, or a CP rank's chunks of them, span no more)
        seq_len = int(mb["attention_mask"].long().sum(-1).max()) if self.config.packed else int(mb["input_ids"].shape[1])
        return {"bytes": total, "rows": len(mb["rows"]), "seq_len": seq_len, "image_patches": patches}

    def vocab_start(self) -> int:
        """The first vocabulary id of this TP rank's rows (of the padded vocabulary)."""
        return self.groups.tp_rank * (self.spec.vocab_rows // self.layout.tp)

    def dp_sum(self, values: list[float]) -> list[float]:
        return self._dp_reduce(values, dist.ReduceOp.SUM)

    def dp_max(self, values: list[float]) -> list[float]:
        return self._dp_reduce(values, dist.ReduceOp.MAX)

    def _dp_reduce(self, values: list[float], op) -> list[float]:
        """Over the replicas that take rows of their own (a CP group's ranks hold the same rows: counted once)."""
        tensor = torch.tensor(values, dtype=torch.float64, device=self.device)  # where the DP group's backend reduces
        if self.grid.data_replicas > 1:
            dist.all_reduce(tensor, op=op, group=self.groups.data_group)
        return tensor.tolist()

    # ------------------------------------------------------- output layer
    def defer_output_layer(self) -> None:
        """From now on the last stage's model returns hidden states [B, S, H] instead of logits.

        The caller applies the output layer itself (``output_weight``), fused
        with what it computes from the logits; the layer's parameters, and so
        checkpoints, optimizer and resharding, are unchanged. No sequence
        parallelism here, so the layer's input is the full hidden state on
        every TP rank, as the fused op expects.
        """
        if self.groups.pp_rank != self.layout.pp - 1:
            return
        return_hidden_states(self.module().output_layer, self.groups.tp_group if self.sequence_parallel else None)
        self.output_deferred = True

    def output_weight(self) -> torch.Tensor:
        """This TP rank's output-layer weight [V / tp, H] (the embedding's when they are tied)."""
        gpt = self.module()
        if gpt.share_embeddings_and_output_weights:
            return gpt.shared_embedding_or_output_weight()
        return gpt.output_layer.weight

    # ---------------------------------------------------------- export
    def module(self) -> torch.nn.Module:
        """The GPTModel stage under every wrapper (DDP, Float16Module): its parameters are the model's."""
        module = self.model
        while hasattr(module, "module"):
            module = module.module
        return module

    def export_hf(self, out_dir: str, precision: str | None = None) -> None:
        """Write the model as a HF checkpoint directory (collective over all ranks).

        ``precision`` "bf16" / "fp32": the dtype of the written tensors (None: the engine's). An fp32
        export of a bf16 engine holds the bf16 weights the model runs with, widened.
        """
        dtype = PRECISIONS[check_precision(precision)] if precision is not None else self.config.params_dtype
        g, layout = self.groups, self.layout
        out = Path(out_dir)
        if g.is_first:
            out.mkdir(parents=True, exist_ok=True)
        dist.barrier(group=g.pool_group)
        write = g.tp_rank == 0 and g.dp_rank == 0
        write_experts = g.etp_rank == 0 and layout.expert_coordinate(g.grid_rank).edp_rank == 0
        weight_map = export_hf_shard(self.module(), self.spec, out, g.tp_rank, layout.tp, g.pp_rank, layout.pp, g.tp_group,
                                     write, dtype, self.experts, g.etp_group, write_experts,
                                     merged_weights(self.module()) if self.adapters else None)
        maps: list[dict] = [None] * layout.world_size  # type: ignore[list-item]
        dist.all_gather_object(maps, weight_map, group=g.pool_group)
        if g.is_first:
            write_hf_index(out, maps, self.model_path, dtype)
        dist.barrier(group=g.pool_group)

    def export_peft(self, out_dir: str) -> None:
        """Write the adapters as a PEFT adapter directory that ``peft.PeftModel.from_pretrained(base, out_dir)``
        loads onto this model's base checkpoint (collective over all ranks)."""
        if not self.adapters:
            raise ValueError("this engine has no LoRA adapters to export (its lora.rank is 0)")
        g, layout = self.groups, self.layout
        stage = full_adapters(self.module(), self.spec, layout.tp, g.tp_group, g.pp_rank, layout.pp)
        last = g.pp_rank == layout.pp - 1
        if self.spec.is_value_model and last:  # the value head trains beside the adapters (PEFT's "score")
            stage["value_head"] = self.module().output_layer.weight.detach().cpu()
        stages: list[dict] = [None] * layout.world_size  # type: ignore[list-item]
        dist.all_gather_object(stages, stage if g.tp_rank == 0 and g.dp_rank == 0 else {}, group=g.pool_group)
        if g.is_first:
            tensors = {k: v for s in stages for k, v in s.items()}
            save_peft_adapter(tensors, self.lora, out_dir, str(self.model_path), tensors.pop("value_head", None))
        dist.barrier(group=g.pool_group)

    def base_model(self):
        """Within: the model computes as its frozen base, the LoRA adapters off (the reference policy of a LoRA
        actor); without adapters, as it is."""
        return adapters_disabled(self.module())


def _position_ids(ids: torch.Tensor) -> torch.Tensor:
    """0..width-1 for every row of a micro-batch (its rows are left-aligned: padding trimmed off the front)."""
    return torch.arange(ids.shape[1], device=ids.device).unsqueeze(0).expand_as(ids)
