"""The routed experts' executor: this rank's generation experts from its training experts and its peers'.

It executes an ``ExpertPlan`` (``reshard.expert_plan``) and decides nothing: each piece a rank holds is
copied out of its own training shard, each other piece arrives in one message per sending peer, point to
point, and the bytes received are the plan's bound. A piece of units [a, b) travels as its gate rows, its
up rows and its down-projection columns (3 x (b - a) x hidden elements).

The generation experts come back under the generation stage's megatron names
(``decoder.layers.{l}.mlp.experts.local_experts.{k}.linear_fc1.weight`` [gate; up] and ``linear_fc2``), ``l`` the
layer within the generation stage, ``k`` the expert within the rank's generation shard: the catalogue's
names for that stage at ``ExpertShard(ep=t_g, ep_rank=g, etp=1)`` (whole experts) or
``ExpertShard(etp=t_g)`` (cut experts). Training parameters are only read.
"""

from __future__ import annotations

import torch

from hybridengine.reshard.expert_pieces import Blocks, assemble, cut_piece, pack, unpack
from hybridengine.reshard.expert_plan import ExpertNeed, ExpertPiece, ExpertPlan
from hybridengine.reshard.transport import Transport

__all__ = ["ExpertResharder", "generation_expert_name"]

_FC1, _FC2 = "linear_fc1.weight", "linear_fc2.weight"


def generation_expert_name(plan: ExpertPlan, rank: int, need: ExpertNeed, which: str) -> str:
    """The generation stage's megatron name of ``need``'s fc1 or fc2 (``which``: "linear_fc1.weight" / "linear_fc2.weight")."""
    me = plan.layout.ranks[rank]
    gen = plan.gen
    local_layer = plan.spec.layers_of_stage(me.gen_pp_rank, gen.pipeline_parallel).index(need.layer)
    per_rank = plan.spec.moe.num_experts // gen.tensor_parallel if gen.expert_parallel else plan.spec.moe.num_experts
    local = need.slot - me.gen_tp_rank * per_rank if gen.expert_parallel else need.slot
    return f"decoder.layers.{local_layer}.mlp.experts.local_experts.{local}.{which}"


class ExpertResharder:
    """Builds this rank's generation experts; the same object is reused every step."""

    def __init__(self, plan: ExpertPlan, rank: int, training_params: dict[str, torch.Tensor], transport: Transport) -> None:
        """``training_params``: this rank's training parameters by megatron name (the routed experts' are read)."""
        self.plan, self.rank, self.transport = plan, rank, transport
        spec, train = plan.spec, plan.train
        at = train.expert_coordinate(rank)
        self.per_rank = spec.moe.num_experts // train.ep
        self.first_expert = at.ep_rank * self.per_rank
        self.offset = at.etp_rank * (spec.moe.expert_ffn_hidden_size // train.etp)  # the own shard's first unit
        self.layers = spec.layers_of_stage(at.pp_rank, train.pp)
        self.params = training_params
        for layer in self.layers:  # every own expert shard present: fail at construction, not mid-exchange
            for j in range(self.per_rank):
                for which in (_FC1, _FC2):
                    name = self._training_name(layer, self.first_expert + j, which)
                    if name not in training_params:
                        raise ValueError(f"expert parameter {name} missing from rank {rank}'s training parameters")
        self.sends, self.receives = plan.sends(rank), plan.receives(rank)
        self.hidden = spec.hidden_size

    def _training_name(self, layer: int, expert: int, which: str) -> str:
        local_layer = self.layers.index(layer)
        return f"decoder.layers.{local_layer}.mlp.experts.local_experts.{expert - self.first_expert}.{which}"

    def _own(self, piece: ExpertPiece) -> Blocks:
        """(gate rows, up rows, down columns) of ``piece`` from this rank's training shard."""
        fc1 = self.params[self._training_name(piece.layer, piece.expert, _FC1)]
        fc2 = self.params[self._training_name(piece.layer, piece.expert, _FC2)]
        return cut_piece(fc1, fc2, piece, self.offset)

    def to_generation(self) -> dict[str, torch.Tensor]:
        """This rank's generation experts by generation name; point to point with every peer the plan names."""
        probe = self.params[self._training_name(self.layers[0], self.first_expert, _FC2)]
        dtype, device, hidden = probe.dtype, probe.device, self.hidden
        sends = {peer: pack([self._own(p) for _, p in pieces]) for peer, pieces in self.sends.items()}
        receives = {peer: torch.empty(3 * hidden * sum(p.size for _, p in pieces), dtype=dtype, device=device)
                    for peer, pieces in self.receives.items()}
        self.transport.exchange(sends, receives)
        arrived: dict[int, Blocks] = {}  # id(piece) -> its three blocks
        for peer, pieces in self.receives.items():
            arrived.update(unpack(receives[peer], [p for _, p in pieces], hidden))
        weights = {}
        for need in self.plan.needs[self.rank]:
            fc1, fc2 = assemble(need, lambda piece: self._own(piece) if piece.source == self.rank else arrived[id(piece)],
                                hidden, dtype, device)
            weights[generation_expert_name(self.plan, self.rank, need, _FC1)] = fc1
            weights[generation_expert_name(self.plan, self.rank, need, _FC2)] = fc2
        return weights
