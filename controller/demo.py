"""The demo job that ``make demo`` runs, on Ray or under torchrun, until the RL trainer lands.

Part 1, worker groups: every worker holds a replica of a linear model, each
step scatters a DataProto batch over the ranks (DP_COMPUTE_PROTO), the ranks
all-reduce their gradients over the group's own process group and step; the
controller checks that the replicas stay identical and recover the weights.

Part 2, megatron + 3D-HybridEngine: a small Llama-shaped policy, TP=2 x PP=2
on the same four processes, takes PPO steps that reward responses made of
low token ids (a rule-based reward on fixed responses, since generation
lands with the rollout engines), and its weights are resharded for a TP=1
generation layout and back after every step.
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

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
    result = data_parallel_regression(pool, started, steps, batch_size)
    if workers % 4 == 0:
        result.update(megatron_policy_gradient(pool))
    pool.shutdown()
    return result


def data_parallel_regression(pool: ResourcePool, started: float, steps: int, batch_size: int) -> dict:
    workers = pool.world_size
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
    return {"final_mse": loss, "replica_spread": spread, "weight_error": error}


def _tiny_policy(path: Path) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                         initializer_range=0.05)
    LlamaForCausalLM(config).save_pretrained(path, safe_serialization=True)


def _ppo_batch(batch_size: int = 16, prompt: int = 8, response: int = 8) -> tuple[DataProto, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(1, 256, (batch_size, prompt + response), generator=g)
    mask = torch.ones_like(ids)
    responses = ids[:, prompt:]
    reward = (responses < 128).float().mean(-1)  # share of low token ids in the response
    batch = DataProto({"input_ids": ids, "attention_mask": mask, "position_ids": mask.cumsum(-1) - 1,
                       "responses": responses, "response_mask": torch.ones_like(responses)})
    return batch, reward


def megatron_policy_gradient(pool: ResourcePool, steps: int = 6) -> dict:
    from workers.actor import Actor

    with tempfile.TemporaryDirectory() as tmp:
        _tiny_policy(Path(tmp) / "policy")
        actor = WorkerGroup(pool, Actor, role="actor", kwargs=dict(
            model_path=str(Path(tmp) / "policy"),
            engine={"tensor_parallel": 2, "pipeline_parallel": 2, "micro_batch_size": 2},
            optim={"lr": 2e-3},
            ppo={"ppo_mini_batch_size": 8, "ppo_epochs": 2},
        ))
    print(f"[demo] megatron actor at {actor.layout} on the same processes")
    batch, reward = _ppo_batch()
    # GRPO-style advantages: the reward against the batch mean, for every response token.
    advantages = ((reward - reward.mean()) / (reward.std() + 1e-6)).unsqueeze(-1).expand(-1, 8).contiguous()
    good = reward > reward.median()
    first = None
    for step in range(steps):
        old = actor.compute_log_prob(batch)
        log_probs = old.batch["old_log_probs"].sum(-1)
        gap = (log_probs[good].mean() - log_probs[~good].mean()).item()
        first = gap if first is None else first
        metrics = actor.update_actor(batch.union(old).union(DataProto({"advantages": advantages})))[0]
        reshard = actor.to_generation(1, 1, release_training=True)
        back = actor.to_training()
        received = max(r["reshard/bytes_received"] for r in reshard) / 2**20
        print(f"[demo] PPO step {step}: pg_loss {metrics['actor/pg_loss'][-1]:+.4f}  "
              f"grad_norm {metrics['actor/grad_norm'][-1]:.3f}  log p(good) - log p(bad) {gap:+.3f}  | "
              f"reshard TP2xPP2 -> TP1: {1e3 * max(r['timing_s/reshard'] for r in reshard):.0f} ms, "
              f"{received:.2f} MiB in per rank, back in {1e3 * max(b['timing_s/reshard_back'] for b in back):.0f} ms")
    log_probs = actor.compute_log_prob(batch).batch["old_log_probs"].sum(-1)
    gap = (log_probs[good].mean() - log_probs[~good].mean()).item()
    print(f"[demo] the policy moved towards rewarded responses: log-prob gap {first:+.3f} -> {gap:+.3f}")
    return {"logprob_gap_start": first, "logprob_gap_end": gap}
