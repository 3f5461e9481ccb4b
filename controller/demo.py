"""The demo job: data-parallel regression on a worker group, on Ray or under torchrun.

Until the RL trainer lands this is what ``make demo`` runs: every worker
holds a replica of a linear model, each step scatters a DataProto batch over
the ranks (DP_COMPUTE_PROTO), the ranks all-reduce their gradients over the
group's own process group and step, and the controller checks that the
replicas stayed identical and that the fit recovers the true weights.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from controller.resource_pool import ResourcePool
from controller.worker_group import WorkerGroup
from hybridengine.layout import ParallelLayout
from workers import BaseWorker, DataProto, Dispatch, register


class RegressionWorker(BaseWorker):
    def __init__(self, features: int, lr: float, seed: int) -> None:
        torch.manual_seed(seed)  # same seed on every rank: identical replicas
        self.model = torch.nn.Linear(features, 1)
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=lr)
        self.set_layout(ParallelLayout(data_parallel=self.world_size))

    @register(Dispatch.DP_COMPUTE_PROTO)
    def train_step(self, batch: DataProto) -> DataProto:
        x, y = batch.batch["x"], batch.batch["y"]
        global_batch = batch.meta_info["global_batch_size"]
        per_sample = (self.model(x).squeeze(-1) - y) ** 2
        self.optimizer.zero_grad()
        (per_sample.sum() / global_batch).backward()
        for param in self.model.parameters():
            dist.all_reduce(param.grad, group=self.process_group)
        self.optimizer.step()
        return DataProto({"loss": per_sample.detach()})

    @register(Dispatch.ONE_TO_ALL)
    def weights(self) -> torch.Tensor:
        return torch.cat([p.detach().flatten() for p in self.model.parameters()])


def run_demo(backend: str = "auto", workers: int = 4, steps: int = 60, batch_size: int = 256) -> dict:
    started = time.perf_counter()
    pool = ResourcePool([workers], backend=backend)
    group = WorkerGroup(pool, RegressionWorker, kwargs={"features": 8, "lr": 0.1, "seed": 0}, role="regression")
    info = group.worker_info()
    print(f"[demo] backend={pool.backend}: {workers} worker processes up in {time.perf_counter() - started:.1f} s")
    for rank_info in info:
        print(f"[demo]   rank {rank_info['rank']}: pid {rank_info['pid']} on {rank_info['device']}, layout {rank_info['layout']}")

    generator = torch.Generator().manual_seed(1)
    true_w, true_b = torch.randn(8, generator=generator), 0.5
    for step in range(steps):
        x = torch.randn(batch_size, 8, generator=generator)
        y = x @ true_w + true_b + 0.01 * torch.randn(batch_size, generator=generator)
        batch = DataProto({"x": x, "y": y}, meta_info={"global_batch_size": batch_size})
        loss = group.train_step(batch).batch["loss"].mean().item()
        if step % 10 == 0 or step == steps - 1:
            print(f"[demo] step {step:3d}  mse {loss:.5f}  (batch of {batch_size} split over {workers} ranks)")

    replicas = group.weights()
    spread = max((w - replicas[0]).abs().max().item() for w in replicas)
    error = (replicas[0][:8] - true_w).abs().max().item()
    print(f"[demo] replicas identical to {spread:.1e}; max |w - w_true| = {error:.4f}; bias {replicas[0][8].item():.3f} (true {true_b})")
    pool.shutdown()
    return {"final_mse": loss, "replica_spread": spread, "weight_error": error}
