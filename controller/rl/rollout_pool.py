"""A rollout on a pool of its own: the weight link from the actor's pool, and when it must carry the weights.

With ``register_placement("rollout", ...)`` (``trainer.placement.rollout``) generation runs on its own
processes. The actor's ranks and the rollout's form one standalone process group (hosted here, at a TCP
store on the controller's node), and the 3D-HybridEngine's cross-pool plan
(``hybridengine.cross_pool.plan``) feeds each generation rank exactly its shard from the training ranks
that hold its parts, point-to-point or down a broadcast chain. The weights travel when the rollout's copy
is older than the actor's: before the first generation, after every actor update, after a resume.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

from controller.runtime.worker_group import WorkerGroup
from workers.megatron.config import EngineConfig
from workers.rollout.training_layout import TrainingLayout

__all__ = ["RolloutWeightLink", "separate_rollout_kwargs"]


def separate_rollout_kwargs(rollout_kwargs: dict[str, Any], actor_engine: EngineConfig | None,
                            actor_world_size: int) -> dict[str, Any]:
    """The rollout's constructor arguments for a pool of its own: no colocated actor, and the actor's
    ``TrainingLayout``, by which the shards it will receive are cut."""
    return {**rollout_kwargs, "actor_role": None,
            "training": TrainingLayout.of_actor(actor_engine or EngineConfig(), actor_world_size)}


class RolloutWeightLink:
    """The actor's weights -> the separate rollout pool; ``sync`` sends them when the rollout's copy is stale."""

    def __init__(self, actor: WorkerGroup, rollout: WorkerGroup, host: str, method: str = "auto",
                 bucket_bytes: int = 256 << 20) -> None:
        """``bucket_bytes``: the rollout's ``weight_bucket_bytes``, which both sides cut the messages by."""
        import torch.distributed as dist

        self.actor, self.rollout = actor, rollout
        # The rendezvous of both pools' ranks; it lives as long as the link (the groups keep their connections).
        self.store = dist.TCPStore("0.0.0.0", 0, is_master=True, wait_for_workers=False)
        mesh = rollout.layout
        gen_tp, gen_pp = mesh.gen.tensor_parallel, mesh.gen.pipeline_parallel
        connecting = [actor.connect_generation_pool.submit(host, self.store.port, gen_tp, gen_pp, mesh.dp, method,
                                                           bucket_bytes),
                      rollout.connect_training_pool.submit(host, self.store.port, method)]
        plans = [future.result() for future in connecting]
        self.method = plans[0][0]["method"]
        print(f"[hybridflow] rollout on its own pool ({rollout.world_size} processes, {mesh.gen} x {mesh.dp} "
              f"replicas) fed by the actor's {actor.layout}: {plans[0][0]['reason']}", file=sys.stderr)
        self.stale = True

    def close(self) -> None:
        """Both pools let go of the link together, before either pool's processes are stopped: a process whose
        link peer vanished mid-connection would abort."""
        closing = [self.actor.disconnect_generation_pool.submit(), self.rollout.disconnect_training_pool.submit()]
        for future in closing:
            future.result()
        self.store = None

    def mark_stale(self) -> None:
        """The actor's weights changed (an update, a loaded checkpoint): send them before the next generation."""
        self.stale = True

    def sync(self, receive: Callable[[], list[dict[str, Any]]] | None = None) -> dict[str, float]:
        """Send the weights if the rollout's copy is stale; the transfer's metrics (empty when nothing moved).

        ``receive``: how the rollout's ranks take them, each rank's metrics (default: its group's
        ``receive_weights``; a rollout that is serving takes them through its replicas' ``POST /update``).

        ``weight_transfer/bytes`` is what the busiest generation rank received, ``bound_bytes`` its shard:
        equal, since each generation rank receives exactly its shard.
        """
        if not self.stale:
            return {}
        sending = self.actor.send_weights.submit()
        received = receive() if receive is not None else self.rollout.receive_weights()
        sent = sending.result()
        self.stale = False
        return {
            "timing_s/weight_transfer": max(r["timing_s/weight_transfer"] for r in received),
            "weight_transfer/bytes": max(r["weight_transfer/bytes"] for r in received),
            "weight_transfer/bound_bytes": max(r["weight_transfer/bound_bytes"] for r in received),
            "weight_transfer/bytes_sent": max(s["weight_transfer/bytes_sent"] for s in sent),
            "timing_s/weight_sync": max(r["timing_s/weight_sync"] for r in received),
            "weight_sync/bytes": sum(r["weight_sync/bytes"] for r in received),
            "timing_s/weight_update": max(r["timing_s/weight_update"] for r in received),
            "weight_update/bytes_received": max(r["weight_update/bytes_received"] for r in received),
        }
