"""MegatronEngine: one process's shard of a model, trained or evaluated with megatron-core.

The engine owns the model stage, megatron's DDP wrapper, optimizer and LR
schedule, and runs micro-batches through megatron's forward-backward
schedule (1F1B when pipeline-parallel). It knows nothing of PPO: the roles
(actor, critic, reference) hand it a per-micro-batch function that turns
the model's output into a loss and statistics.
"""

from __future__ import annotations

from functools import partial
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist

from hybridengine.device import prepare_megatron
from hybridengine.layout import ParallelLayout
from workers.data_proto import DataProto
from workers.megatron.config import EngineConfig, OptimConfig
from workers.megatron.hf_checkpoint import export_hf_shard, load_hf_shard, write_hf_index
from workers.megatron.lr_schedule import build_lr_scheduler
from workers.megatron.model import build_gpt_stage
from workers.megatron.packing import check_contiguous_rows, left_pad_counts, roll_rows
from workers.megatron.parallel import MegatronGroups, initialize_megatron
from workers.megatron.preflight import check_training_setup

__all__ = ["MegatronEngine", "MicroBatch", "StepFn"]


class MicroBatch(dict):
    """A micro-batch as the model sees it: rows rolled so valid tokens start at index 0.

    Keys: ``input_ids`` (rolled), ``shift`` (per-row roll), ``response_length``,
    and every tensor of the original batch under its own name.
    """


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
    ) -> None:
        self.model_path = Path(model_path)
        self.config = config
        self.spec, layout, reader = check_training_setup(model_path, config, world_size)
        self.groups: MegatronGroups = initialize_megatron(layout, config.seed, process_group)
        g = self.groups
        self.model_config, module = build_gpt_stage(self.spec, layout.tp, layout.pp, g.pp_rank)
        load_hf_shard(module, reader, self.spec, g.tp_rank, layout.tp, g.pp_rank, layout.pp)
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
        return self.groups.layout

    # ---------------------------------------------------------------- setup
    def _wrap_for_training(self, module, optim: OptimConfig):
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
        from megatron.core.distributed.finalize_model_grads import finalize_model_grads
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

        ddp_config = DistributedDataParallelConfig(
            grad_reduce_in_fp32=True, overlap_grad_reduce=False, use_distributed_optimizer=optim.use_distributed_optimizer
        )
        model = DistributedDataParallel(config=self.model_config, ddp_config=ddp_config, module=module)
        self.model_config.finalize_model_grads_func = finalize_model_grads
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
                params_dtype=torch.float32,
                use_distributed_optimizer=optim.use_distributed_optimizer,
            ),
            [model],
        )
        return model, optimizer, build_lr_scheduler(optimizer, optim)

    # -------------------------------------------------------------- running
    def _micro_batches(self, batch: DataProto) -> list[MicroBatch]:
        size = self.config.micro_batch_size
        if len(batch) % size != 0:
            raise ValueError(
                f"{len(batch)} sequences on this data-parallel rank do not divide into micro-batches of "
                f"{size}; make the per-rank batch a multiple of micro_batch_size"
            )
        response_length = batch.batch["responses"].shape[1]
        micro = []
        for part in batch.split(size):
            mask = part.batch["attention_mask"]
            check_contiguous_rows(mask, part.batch.get("position_ids"))
            shift = left_pad_counts(mask)
            mb = MicroBatch(part.batch)
            mb.update(input_ids=roll_rows(part.batch["input_ids"], shift), shift=shift, response_length=response_length)
            micro.append(mb)
        return micro

    def run(self, batch: DataProto, step_fn: StepFn, forward_only: bool, loss_scale: float = 1.0) -> list[dict]:
        """Every micro-batch of ``batch`` through the schedule; the last stage's statistics.

        ``loss_scale`` multiplies each micro-batch loss before backward; the
        schedule itself divides by the number of micro-batches.
        """
        from megatron.core.pipeline_parallel import get_forward_backward_func

        prepare_megatron()
        micro = self._micro_batches(batch)
        seq_length = micro[0]["input_ids"].shape[1]

        def loss_func(mb: MicroBatch, output: torch.Tensor):
            loss, stats = step_fn(mb, output)
            return loss * loss_scale, stats

        def forward_step(data_iterator, model):
            mb = next(data_iterator)
            position_ids = torch.arange(seq_length).unsqueeze(0).expand_as(mb["input_ids"])
            output = model(mb["input_ids"], position_ids, None)
            return output, partial(loss_func, mb)

        context = torch.no_grad() if forward_only else torch.enable_grad()
        with context:
            return get_forward_backward_func()(
                forward_step_func=forward_step,
                data_iterator=iter(micro),
                model=[self.model],
                num_microbatches=len(micro),
                seq_length=seq_length,
                micro_batch_size=self.config.micro_batch_size,
                forward_only=forward_only,
            )

    def zero_grad(self) -> None:
        self.model.zero_grad_buffer()
        self.optimizer.zero_grad()

    def optimizer_step(self) -> dict[str, float]:
        """Advance the LR schedule, clip and step; returns grad_norm and the LR used.

        The schedule moves first, so optimizer step k (from 1) uses the LR of
        step k: the first warmup step already has lr / warmup_steps, not 0.
        """
        self.scheduler.step(increment=1)
        lr = self.optimizer.param_groups[0]["lr"]
        ok, grad_norm, _ = self.optimizer.step()
        if not ok:
            raise FloatingPointError("the optimizer skipped its step (non-finite gradients)")
        return {"grad_norm": float(grad_norm), "lr": float(lr)}

    def vocab_start(self) -> int:
        """The first vocabulary id of this TP rank's rows (of the padded vocabulary)."""
        return self.groups.tp_rank * (self.spec.vocab_rows // self.layout.tp)

    def dp_sum(self, values: list[float]) -> list[float]:
        tensor = torch.tensor(values, dtype=torch.float64)
        if self.layout.dp > 1:
            dist.all_reduce(tensor, group=self.groups.dp_group)
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
        layer = self.gpt_module().output_layer
        # An instance attribute shadows ColumnParallelLinear.forward; GPTModel
        # then transposes what it gets ([S, B, H]) to [B, S, H] as it would the logits.
        layer.forward = lambda hidden_states, weight=None, runtime_gather_output=None: (hidden_states, None)
        self.output_deferred = True

    def output_weight(self) -> torch.Tensor:
        """This TP rank's output-layer weight [V / tp, H] (the embedding's when they are tied)."""
        gpt = self.gpt_module()
        if gpt.share_embeddings_and_output_weights:
            return gpt.shared_embedding_or_output_weight()
        return gpt.output_layer.weight

    # ---------------------------------------------------------- export
    def module(self) -> torch.nn.Module:
        return self.model.module if hasattr(self.model, "module") else self.model

    def gpt_module(self) -> torch.nn.Module:
        """The GPTModel stage under every wrapper (DDP, Float16Module)."""
        module = self.model
        while hasattr(module, "module"):
            module = module.module
        return module

    def export_hf(self, out_dir: str) -> None:
        """Write the model as a HF checkpoint directory (collective over all ranks)."""
        g, layout = self.groups, self.layout
        out = Path(out_dir)
        if dist.get_rank() == 0:
            out.mkdir(parents=True, exist_ok=True)
        dist.barrier()
        write = g.tp_rank == 0 and g.dp_rank == 0
        weight_map = export_hf_shard(self.module(), self.spec, out, g.tp_rank, layout.tp, g.pp_rank, layout.pp, g.tp_group, write)
        maps: list[dict] = [None] * dist.get_world_size()  # type: ignore[list-item]
        dist.all_gather_object(maps, weight_map)
        if dist.get_rank() == 0:
            write_hf_index(out, maps, self.model_path)
        dist.barrier()
