"""A megatron-core GPTModel for one rank's generation stage, running on the resharded weights.

The Resharder hands each rank its generation shard (TP=t_g, PP=p_g) as
tensors, often views into one flat buffer. Here that shard becomes a
GPTModel wired to the generation TP/PP groups through a
ProcessGroupCollection, with the tensors installed as its parameters
without a copy. Like the training engines' grids (workers/megatron/parallel.py),
it never touches megatron's global parallel state.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from hybridengine.model.spec import ModelSpec
from hybridengine.reshard.plan import ReshardPlan
from workers.megatron.megatron_compat import ensure_scratch_buffer, prepare_megatron
from workers.megatron.model import gpt_config, gpt_model
from workers.megatron.parallel import ensure_rng_states

__all__ = ["build_generation_model", "generation_logits", "generation_process_groups"]


def _get_group(ranks: tuple[int, ...], cache: dict[tuple[int, ...], Any]) -> Any:
    if ranks not in cache:
        # new_group is collective over the whole world: callers walk every group in one fixed order.
        cache[ranks] = dist.new_group(list(ranks))
    return cache[ranks]


def _replica_groups(plan: ReshardPlan, key) -> list[tuple[int, ...]]:
    groups: dict[Any, list[int]] = {}
    for r in plan.ranks:
        groups.setdefault(key(r), []).append(r.rank)
    return sorted(tuple(sorted(g)) for g in groups.values())


def generation_process_groups(plan: ReshardPlan, rank: int, groups_cache: dict[tuple[int, ...], Any]):
    """This rank's ProcessGroupCollection for the generation layout; collective over the world.

    Every rank must call it with the same plan. Groups are kept in
    ``groups_cache`` (keyed by their ranks) so a later build creates none.
    """
    from megatron.core.process_groups_config import ProcessGroupCollection

    for kind, groups in (("tensor", plan.gen_tp_groups), ("pipeline", plan.gen_pp_groups)):
        for group in groups:
            # torch orders a group's members by global rank; megatron takes that order as the TP/PP
            # rank order, which must equal the order the resharder laid the shards out in.
            if list(group) != sorted(group):
                raise ValueError(
                    f"generation {kind}-parallel group {group} is not in increasing rank order "
                    f"(plan kind {plan.kind!r}, {plan.train} -> {plan.gen}); a process group would "
                    f"renumber its members, so this layout is not supported"
                )
    world = plan.train.world_size
    mp_groups = _replica_groups(plan, lambda r: r.gen_dp_rank)
    dp_groups = _replica_groups(plan, lambda r: (r.gen_tp_rank, r.gen_pp_rank))
    singles = [(r,) for r in range(world)]
    for group in [*plan.gen_tp_groups, *plan.gen_pp_groups, *mp_groups, *dp_groups, *singles]:
        _get_group(tuple(group), groups_cache)

    def mine(groups):
        return groups_cache[next(tuple(g) for g in groups if rank in g)]

    tp, pp, mp, dp = mine(plan.gen_tp_groups), mine(plan.gen_pp_groups), mine(mp_groups), mine(dp_groups)
    single = groups_cache[(rank,)]
    # Size-1 groups rather than None: megatron falls back to its (unset) global grid on None.
    # The embedding group is size 1 too: it only syncs tied-embedding grads, and generation has none.
    # Routed experts: whole on each generation TP rank (expert parallel over the TP group), or each cut across
    # it (expert TP); either way the expert grid of a stage is its TP group.
    ep, expt_tp = (tp, single) if plan.gen.expert_parallel else (single, tp)
    return ProcessGroupCollection(
        tp=tp, pp=pp, mp=mp, dp=dp, dp_cp=dp, cp=single, tp_cp=tp, embd=single, pos_embd=single,
        ep=ep, expt_tp=expt_tp, expt_dp=single, tp_ep=tp, tp_ep_pp=mp, tp_dp_cp=tp,  # a replica: no DP
    )


def build_generation_model(
    spec: ModelSpec,
    plan: ReshardPlan,
    rank: int,
    weights: dict[str, torch.Tensor],
    groups_cache: dict[tuple[int, ...], Any],
):
    """The GPTModel of ``rank``'s generation stage, whose parameters are ``weights`` (no copy).

    Collective over the world (process groups are created on first use).
    ``weights`` is what ``Resharder.to_generation`` returned: names local to
    the generation stage, local-spec layout at TP=t_g. The model is in eval
    mode and nothing in it requires grad. Do not call ``.to()`` / ``.cuda()``
    / ``.half()`` on it: ``Module._apply`` replaces each parameter's data and
    so detaches it from the resharder's buffer.
    """
    if spec.is_value_model:
        raise ValueError("a generation model is a causal LM; a value model (scalar head) does not generate")
    prepare_megatron()
    ensure_scratch_buffer()
    me = plan.ranks[rank]
    ensure_rng_states(me.gen_tp_rank)
    tp, pp = plan.gen.tensor_parallel, plan.gen.pipeline_parallel
    pg_collection = generation_process_groups(plan, rank, groups_cache)
    if pg_collection.tp.size() != tp or pg_collection.pp.size() != pp:
        raise RuntimeError(f"rank {rank}: generation groups have sizes TP{pg_collection.tp.size()} x "
                           f"PP{pg_collection.pp.size()}, the plan says {plan.gen}")
    dtype = next(iter(weights.values())).dtype if weights else torch.float32
    experts = {}
    if spec.moe is not None:
        if tp > 1:  # megatron runs an MoE layer under TP only sequence-parallel; the generation model does not yet
            raise ValueError(f"the megatron rollout engine generates a mixture of experts at tensor_parallel 1 only "
                             f"(got {plan.gen}); generate at TP > 1 with vLLM (rollout.engine: vllm)")
        experts = {"ep": tp if plan.gen.expert_parallel else 1, "etp": 1 if plan.gen.expert_parallel else tp}
    config = gpt_config(spec, tp, pp, dtype, initialize=False, **experts)  # the weights are replaced at once
    model = gpt_model(spec, config, me.gen_pp_rank == 0, me.gen_pp_rank == pp - 1, spec.tie_word_embeddings,
                      pg_collection=pg_collection)
    params = dict(model.named_parameters())
    # Model order, then shard order, so the error names the same first mismatch on every run.
    for name in params:
        if name not in weights:
            raise ValueError(f"rank {rank}: generation model parameter {name!r} has no tensor in the generation shard")
    for name in weights:
        if name not in params:
            raise ValueError(f"rank {rank}: generation shard tensor {name!r} is not a parameter of the generation model")
    for name, param in params.items():
        tensor = weights[name]
        if tuple(tensor.shape) != tuple(param.shape) or tensor.dtype != param.dtype:
            raise ValueError(f"rank {rank}: {name}: generation shard has {tuple(tensor.shape)} {tensor.dtype}, "
                             f"the model expects {tuple(param.shape)} {param.dtype}")
        param.requires_grad_(False)
        param.data = tensor
    return model.eval()


@torch.no_grad()
def generation_logits(model, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None):
    """Forward ``input_ids`` [b, s] through the generation pipeline; collective over its PP group.

    Returns this rank's vocab-parallel logits [b, s, vocab_rows / t_g] on the
    last generation stage and None elsewhere. Columns of ids >= spec.vocab_size
    (a padded vocabulary) are the padding rows' logits: cut them off before
    any softmax. RoPE positions are 0..s-1 for every
    row (megatron's RoPE ignores position ids), so rows must not be left-padded;
    ``attention_mask`` None means a plain causal mask.
    """
    prepare_megatron()
    pp_group = model.pg_collection.pp
    pp_ranks = dist.get_process_group_ranks(pp_group)
    stage = pp_ranks.index(dist.get_rank())
    batch, seq = input_ids.shape
    position_ids = torch.arange(seq, device=input_ids.device).unsqueeze(0).expand(batch, seq)
    if stage > 0:
        # Hidden states travel [s, b, h], as megatron's decoder produces and consumes them.
        hidden = torch.empty(seq, batch, model.config.hidden_size, dtype=model.config.params_dtype,
                             device=input_ids.device)
        dist.recv(hidden, src=pp_ranks[stage - 1], group=pp_group)
        model.set_input_tensor(hidden)
    output = model(input_ids if stage == 0 else None, position_ids, attention_mask)
    if stage < len(pp_ranks) - 1:
        dist.send(output.contiguous(), dst=pp_ranks[stage + 1], group=pp_group)
        return None
    return output
