"""Which roles see a mixture of experts' rollout routes, and as what (``algorithm.router_replay``).

The rollout's batch carries ``rollout_routed_experts`` when asked (the experts
each token was routed to while generating). Only the actor reads them: under
``rollout`` as ``routed_experts``, which its routers replay in the log-prob and
update passes; under ``measure`` as they are, which its routers are only
compared with. The reference policy and the critic route as their own weights
say, so they never see them.
"""

from __future__ import annotations

from workers.data_proto import DataProto
from workers.megatron.routing_replay import ROLLOUT_ROUTES, ROUTED_EXPERTS

__all__ = ["routes_for_actor", "without_routes"]


def routes_for_actor(batch: DataProto, mode: str) -> DataProto:
    """``batch`` with the rollout's routes under the key the actor acts on for ``mode``, or without them."""
    if ROLLOUT_ROUTES not in batch.batch:
        return batch
    if mode == "off":
        return without_routes(batch)
    if mode == "measure":
        return batch
    tensors = {(ROUTED_EXPERTS if k == ROLLOUT_ROUTES else k): v for k, v in batch.batch.items()}
    return DataProto(tensors, batch.non_tensor_batch, batch.meta_info)


def without_routes(batch: DataProto) -> DataProto:
    """``batch`` without any routes (for the reference policy and the critic)."""
    if ROLLOUT_ROUTES not in batch.batch and ROUTED_EXPERTS not in batch.batch:
        return batch
    tensors = {k: v for k, v in batch.batch.items() if k not in (ROLLOUT_ROUTES, ROUTED_EXPERTS)}
    return DataProto(tensors, batch.non_tensor_batch, batch.meta_info)
