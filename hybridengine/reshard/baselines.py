"""The two ways of reaching the generation layout that the 3D-HybridEngine is measured against.

Both first rebuild the whole model on every rank and then cut this rank's
generation shard out of it, so they produce exactly the weights the
micro-DP executor produces (the tests hold all three equal):

* ``full_allgather``: the model treated as partitioned over all t*p*d ranks
  (each DP replica contributes 1/d of its shard, ZeRO-3 / DeepSpeed-Chat
  style) and all-gathered across the world: (tpd-1)/(tpd) M received.
* ``tp_pp_gather``: tensor by tensor, gather over the training TP group and
  broadcast over the PP group (HybridFlow-V, and what per-tensor weight
  syncs in today's frameworks do): (tp-1)/(tp) M received.
"""

from __future__ import annotations

import torch

from hybridengine.model.catalogue import stage_params
from hybridengine.model.geometry import join_tp_shards, split_tp_shard
from hybridengine.reshard.transport import Transport
from hybridengine.reshard.weight_plan import WeightPlan

__all__ = ["full_allgather", "tp_pp_gather", "BASELINES", "RESHARD_METHODS"]

FullModel = dict[tuple[int, str], torch.Tensor]  # (training stage, name) -> TP-joined tensor


def _cut_generation_shard(plan: WeightPlan, rank: int, full: FullModel) -> dict[str, torch.Tensor]:
    me = plan.layout.ranks[rank]
    out = {}
    for source in plan.sources(rank):
        tensor = full[(source.stage, source.train_names[0])]
        out[source.param.name] = split_tp_shard(source.param.geometry, tensor, plan.gen.tensor_parallel,
                                                me.gen_tp_rank).clone()
    return out


def _split_flat(flat: torch.Tensor, params) -> dict[str, torch.Tensor]:
    out, offset = {}, 0
    for p in params:
        out[p.name] = flat[offset : offset + p.numel].view(p.shape)
        offset += p.numel
    return out


def full_allgather(plan: WeightPlan, rank: int, params: dict[str, torch.Tensor], transport: Transport):
    spec, train = plan.spec, plan.train
    world = list(range(train.world_size))
    key = transport.new_group(world)
    catalog = {pp: stage_params(spec, train.tp, train.pp, pp) for pp in range(train.pp)}
    stage_size = {pp: sum(p.numel for p in ps) for pp, ps in catalog.items()}

    def chunk_sizes(pp: int) -> list[int]:
        base, extra = divmod(stage_size[pp], train.dp)
        return [base + (1 if i < extra else 0) for i in range(train.dp)]

    coord = train.coordinate(rank)
    flat = torch.cat([params[p.name].reshape(-1) for p in catalog[coord.pp_rank]])
    own = flat.split(chunk_sizes(coord.pp_rank))[coord.dp_rank].contiguous()
    sizes = [chunk_sizes(train.coordinate(r).pp_rank)[train.coordinate(r).dp_rank] for r in world]
    parts = transport.gather_parts(key, world, own, sizes)
    full: FullModel = {}
    for pp, stage_catalog in catalog.items():
        shards = []
        for tp in range(train.tp):
            shard_flat = torch.cat([parts[train.rank_of(tp, pp, dd)] for dd in range(train.dp)])
            shards.append(_split_flat(shard_flat, stage_catalog))
        for p in stage_catalog:
            full[(pp, p.name)] = join_tp_shards(p.geometry, [s[p.name] for s in shards])
    return _cut_generation_shard(plan, rank, full)


def tp_pp_gather(plan: WeightPlan, rank: int, params: dict[str, torch.Tensor], transport: Transport):
    spec, train = plan.spec, plan.train
    coord = train.coordinate(rank)
    tp_group = [train.rank_of(t, coord.pp_rank, coord.dp_rank) for t in range(train.tp)]
    pp_group = [train.rank_of(coord.tp_rank, s, coord.dp_rank) for s in range(train.pp)]
    # Group creation is collective over the world: every rank creates every group.
    keys = {}
    for group in train.tp_groups() + train.pp_groups():
        keys[tuple(group)] = transport.new_group(group)
    full: FullModel = {}
    for p in stage_params(spec, train.tp, train.pp, coord.pp_rank):
        local = params[p.name].contiguous()
        shards = transport.gather_parts(keys[tuple(tp_group)], tp_group, local.reshape(-1), [p.numel] * train.tp)
        full[(coord.pp_rank, p.name)] = join_tp_shards(p.geometry, [s.view(p.shape) for s in shards])
    for stage in range(train.pp):
        for p in stage_params(spec, 1, train.pp, stage):  # TP-joined shapes
            key = (stage, p.name)
            tensor = full[key] if stage == coord.pp_rank else torch.empty(p.shape, dtype=local.dtype)
            if train.pp > 1:
                transport.broadcast(tensor.contiguous() if stage == coord.pp_rank else tensor, pp_group[stage], keys[tuple(pp_group)])
            full[key] = tensor
    return _cut_generation_shard(plan, rank, full)


BASELINES = {"full_allgather": full_allgather, "tp_pp_gather": tp_pp_gather}
# Every way to reach the generation layout: the micro-DP gather (hybridengine.reshard.resharder), the dense group
# moved as pieces by the one executor (hybridengine.reshard.dense_group.move_dense), and the baselines.
RESHARD_METHODS = ("micro_dp", "pieces", *BASELINES)
