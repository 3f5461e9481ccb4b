"""A mixture of experts' routed experts across pools: each generation rank's experts, point to point.

A rollout on a pool of its own holds nothing of the training shards, so every
generation rank receives its whole generation experts: at generation TP t_g,
every expert of its stage's layers cut to its 1/t_g of the FFN units, or
(``GenerationLayout.expert_parallel``) its 1/t_g of the experts whole, placed
linearly (nothing is held, so no placement holds more). That is the least it
can receive: the bound is the shard's expert bytes.

Units are ``expert_plan``'s: a gate row, an up row and a down column. A needed
expert spans the training ETP slices its units fall in; each slice is sent by
one of the expert-DP ranks that hold it, the least loaded so far (ties to the
lowest rank), so the senders share the load. Every training rank sends one
message to each generation rank it serves. Pure: both pools compute the same
plan.
"""

from __future__ import annotations

from dataclasses import dataclass

from hybridengine.cross_pool.plan import CrossPoolPlan
from hybridengine.model.spec import ModelSpec
from hybridengine.reshard.expert_plan import EXPERT_UNIT_ROWS, ExpertNeed, ExpertPiece

__all__ = ["CrossPoolExperts", "plan_cross_pool_experts"]


@dataclass(frozen=True)
class CrossPoolExperts:
    spec: ModelSpec
    plan: CrossPoolPlan
    needs: tuple[tuple[ExpertNeed, ...], ...]  # per generation rank, in (layer, expert) order; pieces' sources are training ranks

    def unit_bytes(self, element_size: int) -> int:
        return EXPERT_UNIT_ROWS * self.spec.hidden_size * element_size

    def bound(self, gen_rank: int, element_size: int) -> int:
        """What ``gen_rank`` must receive: all of its generation experts."""
        return self.unit_bytes(element_size) * sum(n.units[1] - n.units[0] for n in self.needs[gen_rank])

    def sends(self, train_rank: int) -> dict[int, list[tuple[ExpertNeed, ExpertPiece]]]:
        """The pieces ``train_rank`` sends, by generation rank, in that rank's order."""
        out: dict[int, list[tuple[ExpertNeed, ExpertPiece]]] = {}
        for gen_rank, needs in enumerate(self.needs):
            for need in needs:
                for piece in need.pieces:
                    if piece.source == train_rank:
                        out.setdefault(gen_rank, []).append((need, piece))
        return out

    def receives(self, gen_rank: int) -> dict[int, list[tuple[ExpertNeed, ExpertPiece]]]:
        """The pieces ``gen_rank`` receives, by training rank, in its own order."""
        out: dict[int, list[tuple[ExpertNeed, ExpertPiece]]] = {}
        for need in self.needs[gen_rank]:
            for piece in need.pieces:
                out.setdefault(piece.source, []).append((need, piece))
        return out

    def generation_name(self, gen_rank: int, need: ExpertNeed, which: str) -> str:
        """The generation stage's megatron name of ``need``'s ``which`` ("linear_fc1.weight" / "linear_fc2.weight")."""
        coord, gen = self.plan.gen_coordinate(gen_rank), self.plan.gen
        layer = self.spec.layers_of_stage(coord.pp_rank, gen.pipeline_parallel).index(need.layer)
        experts = self.spec.moe.num_experts
        local = need.slot - coord.tp_rank * experts // gen.tensor_parallel if gen.expert_parallel else need.slot
        return f"decoder.layers.{layer}.mlp.experts.local_experts.{local}.{which}"


def plan_cross_pool_experts(spec: ModelSpec, plan: CrossPoolPlan) -> CrossPoolExperts:
    """The routed experts' part of ``plan`` (the dense part's cross-pool plan): who sends which units to whom."""
    moe, train, gen = spec.moe, plan.train, plan.gen
    if moe is None:
        raise ValueError(f"{spec.architecture} has no routed experts to plan")
    experts, ffn, tg = moe.num_experts, moe.expert_ffn_hidden_size, gen.tensor_parallel
    if (experts if gen.expert_parallel else ffn) % tg:
        raise ValueError(f"generation tensor_parallel={tg} does not divide the "
                         f"{f'{experts} experts' if gen.expert_parallel else f'experts FFN size {ffn}'}")
    per_rank, width = experts // train.ep, ffn // train.etp
    sent = [0] * train.world_size
    needs = []
    for gen_rank in range(plan.gen_world_size):
        coord = plan.gen_coordinate(gen_rank)
        g = coord.tp_rank
        if gen.expert_parallel:
            wanted, units = range(g * experts // tg, (g + 1) * experts // tg), (0, ffn)
        else:
            wanted, units = range(experts), (g * ffn // tg, (g + 1) * ffn // tg)
        mine = []
        for layer in spec.layers_of_stage(coord.pp_rank, gen.pipeline_parallel):
            stage = spec.stage_of_layer(layer, train.pp)[0]
            for expert in wanted:
                pieces = []
                for j in range(units[0] // width, -(-units[1] // width)):  # the training ETP slices it spans
                    part = (max(units[0], j * width), min(units[1], (j + 1) * width))
                    holders = [train.expert_rank_of(j, expert // per_rank, d, stage) for d in range(train.edp)]
                    source = min(holders, key=lambda h: (sent[h], h))
                    sent[source] += part[1] - part[0]
                    pieces.append(ExpertPiece(layer, expert, part, source))
                mine.append(ExpertNeed(layer, expert, expert, units, tuple(pieces)))
        needs.append(tuple(mine))
    return CrossPoolExperts(spec, plan, tuple(needs))
