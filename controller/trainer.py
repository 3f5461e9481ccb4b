"""RLTrainer: the RL loop over worker groups, in one screen.

    trainer = RLTrainer(
        actor=Actor.from_pretrained(path, tensor_parallel=2, pipeline_parallel=2, optim={"lr": 1e-4}),
        rollout=Rollout.from_pretrained(path, tensor_parallel=1, sampling={"max_new_tokens": 8}),
        critic=Critic.from_pretrained(value_path, tensor_parallel=2),
        reward_fn="arithmetic_shaped",
        algorithm="ppo", train_data=arithmetic_prompts(512, seed=0), batch_size=16,
    )
    metrics = trainer.step()         # one full PPO step on the real worker groups
    trainer.fit(total_steps=20)

A step: generate (the actor's weights resharded into the rollout at the
boundary) -> reward -> old and reference log-probs -> values -> advantages
-> critic update -> actor update. Every role lives on one resource pool
(colocated, the hybrid engine's setting) unless ``register_placement``
puts it elsewhere.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from controller.algorithms.advantages import (
    AdvantageConfig,
    AdvantageInputs,
    compute_advantages,
)
from controller.algorithms.kl_control import (
    KLController,
    apply_kl_penalty,
    make_kl_controller,
)
from controller.algorithms.safe_rlhf import LagrangeMultiplier, combine_advantages
from controller.config import AlgorithmConfig, ConfigError
from controller.data import PromptDataset, PromptLoader
from controller.resource_pool import ResourcePool
from controller.step_metrics import batch_metrics, reduce_update_metrics
from controller.worker_group import WorkerGroup
from workers.actor import PPOActorConfig
from workers.data_proto import DataProto
from workers.megatron.config import as_config
from workers.reward import RuleReward
from workers.role_spec import RoleSpec
from workers.rollout.agreement import FROM_UPDATE, logprob_agreement, old_log_probs_from_update, use_old_log_probs
from workers.rollout.config import RolloutConfig

__all__ = ["RLTrainer"]

ROLE_ORDER = ("actor", "rollout", "ref_policy", "critic", "reward_model", "reward", "cost")


class RLTrainer:
    def __init__(
        self,
        *,
        actor: RoleSpec,
        rollout: RoleSpec,
        train_data: PromptDataset,
        batch_size: int,
        critic: RoleSpec | None = None,
        ref_policy: RoleSpec | None = None,
        reward_model: RoleSpec | None = None,
        reward_fn: str | Callable | None = None,
        reward_kwargs: dict[str, Any] | None = None,
        reward_worker: RoleSpec | None = None,
        cost_fn: str | Callable | None = None,
        cost_model: RoleSpec | None = None,
        algorithm: AlgorithmConfig | dict | str = "ppo",
        val_data: PromptDataset | None = None,
        kl_loss_fn: Callable | None = None,
        processes: int | None = None,
        backend: str = "auto",
        pool: ResourcePool | None = None,
        run_dir: str | Path | None = None,
        logger=None,
        save_every: int = 0,
        val_every: int = 0,
        val_before_train: bool = False,
        seed: int = 0,
        shuffle: bool = True,
    ) -> None:
        if isinstance(algorithm, str):
            algorithm = AlgorithmConfig(name=algorithm)
        elif isinstance(algorithm, dict):
            algorithm = AlgorithmConfig(**algorithm)
        self.algorithm = algorithm
        if sum(x is not None for x in (reward_fn, reward_model, reward_worker)) != 1:
            raise ConfigError("give exactly one of reward_fn (a rule), reward_model (a RewardModel spec) or "
                              "reward_worker (your own worker with compute_reward(batch) -> token_level_scores, scores)")
        if algorithm.needs_critic and critic is None:
            raise ConfigError(f"{algorithm.name} estimates advantages with GAE and needs a critic (critic=Critic.from_pretrained(...))")
        if cost_fn is not None and cost_model is not None:
            raise ConfigError("give cost_fn (a rule) or cost_model (a RewardModel spec), not both")
        safe_rlhf = cost_fn is not None or cost_model is not None
        if safe_rlhf and algorithm.needs_critic:
            raise ConfigError("Safe-RLHF costs here use a critic-free estimator (grpo, rloo, remax, reinforce_plus_plus); "
                              f"{algorithm.name} would need a cost critic")
        self.specs: dict[str, RoleSpec] = {"actor": actor, "rollout": rollout}
        if critic is not None:
            self.specs["critic"] = critic
        ppo = as_config(PPOActorConfig, actor.kwargs.get("ppo"))
        needs_ref = algorithm.use_reference if algorithm.use_reference is not None else (
            algorithm.kl_in_reward or ppo.use_kl_loss or kl_loss_fn is not None)
        if needs_ref:
            self.specs["ref_policy"] = ref_policy or RoleSpec(_reference_cls(), {
                "model_path": actor.model_path, "engine": actor.kwargs.get("engine")})
        tokenizer_path = actor.model_path
        if reward_model is not None:
            self.specs["reward_model"] = reward_model
        if reward_fn is not None:
            self.specs["reward"] = RoleSpec(RuleReward, {"tokenizer_path": tokenizer_path, "reward_fn": reward_fn,
                                                         "reward_kwargs": reward_kwargs})
        if reward_worker is not None:
            self.specs["reward"] = reward_worker
        if cost_fn is not None:
            self.specs["cost"] = RoleSpec(RuleReward, {"tokenizer_path": tokenizer_path, "reward_fn": cost_fn})
        if cost_model is not None:  # a RewardModel beside the reward model, scoring cost
            self.specs["cost"] = cost_model
        self.placement = {role: "default" for role in self.specs}
        self.pool_sizes: dict[str, int | None] = {"default": processes}
        self.backend = backend
        self.kl_loss_fn = kl_loss_fn
        self.train_data, self.val_data = train_data, val_data
        self.batch_size, self.shuffle, self.seed = batch_size, shuffle, seed
        self.run_dir = Path(run_dir) if run_dir is not None else None
        self.logger = logger
        self.save_every, self.val_every, self.val_before_train = save_every, val_every, val_before_train
        ctrl = dict(algorithm.kl_ctrl)
        self.kl_ctrl: KLController = make_kl_controller(ctrl.pop("kind", "fixed"), **ctrl)
        self.lagrange = LagrangeMultiplier(algorithm.safe_rlhf_lambda_init, algorithm.safe_rlhf_lambda_lr,
                                           algorithm.safe_rlhf_cost_limit) if safe_rlhf else None
        n = RolloutConfig.from_value(rollout.kwargs.get("config")).sampling.n
        self.old_log_probs_from_update = old_log_probs_from_update(
            algorithm.old_log_prob_source, ppo.ppo_epochs, ppo.ppo_mini_batch_size, batch_size * n,
            read_before_update=algorithm.kl_in_reward)
        self.groups: dict[str, WorkerGroup] = {}
        self.pools: dict[str, ResourcePool] = {"default": pool} if pool is not None else {}
        self.global_step = 0
        self.loader: PromptLoader | None = None

    # ------------------------------------------------------------- declaration
    def register_placement(self, role: str, devices: int | None = None, pool: str | None = None) -> None:
        """Put ``role`` on its own resource pool of ``devices`` processes (one per device). Before the first step.

        Roles given the same ``pool`` name share its processes (colocation); by
        default every role is on the pool "default". The rollout reshards the
        actor's weights in place, so it always sits on the actor's pool. Under
        torchrun a megatron role's pool must be the whole world, so split
        placement is a Ray feature.
        """
        self._before_build("register_placement")
        if role not in self.specs:
            raise ConfigError(f"unknown role {role!r}; roles of this trainer: {sorted(self.specs)}")
        if role == "rollout":
            raise ConfigError("the rollout reshards the actor's weights in place and always shares the actor's pool; "
                              "place the actor instead")
        pool = pool or role
        if pool in self.pool_sizes:
            if devices is not None and self.pool_sizes[pool] not in (None, devices):
                raise ConfigError(f"pool {pool!r} has {self.pool_sizes[pool]} processes, not {devices}")
        else:
            if devices is None or devices < 1:
                raise ConfigError(f"pool {pool!r} is new: give its number of devices (>= 1), got {devices!r}")
            self.pool_sizes[pool] = devices
        self.placement[role] = pool
        if role == "actor":
            self.placement["rollout"] = pool

    def register_parallelism(self, role: str, tensor_parallel: int | None = None, pipeline_parallel: int | None = None) -> None:
        """Set a megatron role's TP/PP (the rollout's generation TP/PP). Before the first step."""
        self._before_build("register_parallelism")
        if role not in self.specs:
            raise ConfigError(f"unknown role {role!r}; roles of this trainer: {sorted(self.specs)}")
        spec = self.specs[role]
        if role == "rollout":
            config = dict(spec.kwargs.get("config") or {})
            config.update({k: v for k, v in (("tensor_parallel", tensor_parallel), ("pipeline_parallel", pipeline_parallel)) if v})
            self.specs[role] = RoleSpec(spec.worker_cls, {**spec.kwargs, "config": config})
        elif "engine" in spec.kwargs:
            self.specs[role] = spec.with_parallelism(tensor_parallel, pipeline_parallel)
        else:
            raise ConfigError(f"role {role!r} ({spec.worker_cls.__name__}) has no model parallelism to set")

    def _before_build(self, what: str) -> None:
        if self.groups:
            raise RuntimeError(f"{what} must come before the first step: the worker groups already exist")

    # -------------------------------------------------------------------- build
    def build(self) -> None:
        if self.groups:
            return
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(self.specs["actor"].model_path)
        # Loaders first: a prompt the rollout cannot take is an error before any worker starts.
        rollout_cfg = RolloutConfig.from_value(self.specs["rollout"].kwargs.get("config"))
        # With truncation "left" the rollout keeps a long prompt's end; otherwise the loader refuses it up front.
        max_prompt = rollout_cfg.max_prompt_length if rollout_cfg.truncation == "error" else None
        self.loader = PromptLoader(self.train_data, tokenizer, self.batch_size, max_prompt, self.shuffle, self.seed)
        self.val_loader = (PromptLoader(self.val_data, tokenizer, min(self.batch_size, len(self.val_data)), max_prompt,
                                        shuffle=False) if self.val_data is not None else None)
        for name, size in self.pool_sizes.items():
            if name in self.pools:
                continue
            if size is None:
                size = int(os.environ.get("WORLD_SIZE", "1"))
            self.pools[name] = ResourcePool([size], backend=self.backend)
        for role in ROLE_ORDER:
            if role in self.specs:
                spec = self.specs[role]
                self.groups[role] = WorkerGroup(self.pools[self.placement[role]], spec.worker_cls, role=role, kwargs=spec.kwargs)

    # --------------------------------------------------------------------- step
    def step(self, step: int | None = None) -> dict[str, float]:
        """One full RL step on the worker groups; returns its metrics."""
        self.build()
        if step is not None:
            self.global_step = step
        g, alg = self.groups, self.algorithm
        timing: dict[str, float] = {}
        start = time.perf_counter()
        prompts = self.loader.next_batch()
        prompts.meta_info["sampling"] = {"seed": self.seed * 1_000_003 + self.global_step * 100_000}

        with _timer(timing, "rollout"):
            batch = g["rollout"].generate_sequences(prompts)
        rollout_metrics = dict(batch.meta_info.pop("metrics", {}))
        with _timer(timing, "reward"):
            batch = batch.union(self._score(batch))
        baseline = baseline_cost = None
        if alg.estimator == "remax":  # the greedy response's score is each prompt's baseline
            with _timer(timing, "gen_baseline"):
                greedy = g["rollout"].generate_sequences(_with_sampling(prompts, {"greedy": True, "n": 1, "seed": None}))
                greedy.meta_info.pop("metrics", None)
                greedy_scores = self._score(greedy).batch
                n = len(batch) // len(prompts)
                baseline = greedy_scores["scores"].repeat_interleave(n)
                if "cost_scores" in greedy_scores:
                    baseline_cost = greedy_scores["cost_scores"].repeat_interleave(n)
        if self.old_log_probs_from_update:  # on-policy: the update's own forward gives them, detached
            batch.meta_info["old_log_probs"] = FROM_UPDATE
        else:
            with _timer(timing, "old_log_prob"):
                batch = batch.union(g["actor"].compute_log_prob(batch))
            agreement = logprob_agreement(batch.batch["rollout_log_probs"], batch.batch["old_log_probs"],
                                          batch.batch["response_mask"])
            batch = use_old_log_probs(batch, alg.old_log_prob_source)
        if "ref_policy" in g:
            with _timer(timing, "ref"):
                batch = batch.union(g["ref_policy"].compute_ref_log_prob(batch))
        if "critic" in g:
            with _timer(timing, "values"):
                batch = batch.union(g["critic"].compute_values(batch))

        with _timer(timing, "adv"):
            kl_metrics = {}
            rewards = batch.batch["token_level_scores"]
            if alg.kl_in_reward:
                rewards, kl_metrics = apply_kl_penalty(rewards, batch.batch["old_log_probs"], batch.batch["ref_log_prob"],
                                                       batch.batch["response_mask"], self.kl_ctrl.value, alg.kl_penalty)
            inputs = AdvantageInputs(rewards, batch.batch["response_mask"], values=batch.batch.get("values"),
                                     group_index=batch.non_tensor_batch.get("uid"), baseline_rewards=baseline)
            config = AdvantageConfig(gamma=alg.gamma, lam=alg.lam, norm_adv_by_std=alg.norm_adv_by_std)
            advantages, returns = compute_advantages(alg.estimator, inputs, config)
            safe_metrics = {}
            if self.lagrange is not None:
                cost_inputs = AdvantageInputs(batch.batch["cost_token_level_scores"], batch.batch["response_mask"],
                                              group_index=inputs.group_index, baseline_rewards=baseline_cost)
                cost_adv, _ = compute_advantages(alg.estimator, cost_inputs, config)
                advantages = combine_advantages(advantages, cost_adv, self.lagrange.value)
                mean_cost = float(batch.batch["cost_scores"].mean())
                safe_metrics = {"safe_rlhf/lambda": self.lagrange.value, "safe_rlhf/cost/mean": mean_cost}
                self.lagrange.update(mean_cost)
            batch.batch.update({"token_level_rewards": rewards, "advantages": advantages, "returns": returns})

        update_metrics: dict[str, float] = {}
        if "critic" in g:
            with _timer(timing, "update_critic"):
                update_metrics.update(reduce_update_metrics(g["critic"].update_critic(batch)))
        with _timer(timing, "update_actor"):
            if self.kl_loss_fn is not None:
                batch.meta_info.update({"kl_loss_fn": self.kl_loss_fn, "step": self.global_step})
            update_metrics.update(reduce_update_metrics(g["actor"].update_actor(batch)))
            batch.meta_info.pop("kl_loss_fn", None)
        if self.old_log_probs_from_update:
            agreement = {f"rollout/logprob_diff_{s}": update_metrics.pop(f"actor/rollout_logprob_diff_{s}") for s in ("max", "mean")}
        if alg.kl_in_reward:
            self.kl_ctrl.update(kl_metrics.get("actor/reward_kl_penalty", 0.0), n_steps=len(prompts))
        timing["step"] = time.perf_counter() - start

        metrics = {**batch_metrics(batch), **update_metrics, **kl_metrics, **agreement, **safe_metrics}
        for key in ("timing_s/gen", "timing_s/reshard", "timing_s/weight_sync", "weight_sync/bytes",
                    "reshard/bytes_received", "rollout/tokens_per_s"):
            if key in rollout_metrics:
                metrics[key] = float(rollout_metrics[key])
        metrics.update({f"timing_s/{k}": v for k, v in timing.items()})
        tokens = int(batch.batch["attention_mask"].sum())
        metrics["perf/throughput"] = tokens / timing["step"]
        metrics["perf/max_memory_gb"] = max(i["peak_memory_gb"] for i in g["actor"].worker_info())
        if self.val_every and (self.global_step + 1) % self.val_every == 0:
            metrics.update(self.validate())
        self.global_step += 1
        if self.logger is not None:
            self.logger.log(self.global_step, metrics)
        if self.save_every and self.global_step % self.save_every == 0:
            self.save_checkpoint()
        return metrics

    def _score(self, batch: DataProto) -> DataProto:
        if "reward_model" in self.groups:
            out = self.groups["reward_model"].compute_rm_score(batch)
            key = self.specs["reward_model"].kwargs.get("score_key", "rm_scores")
            scores = DataProto({"token_level_scores": out.batch["token_level_scores"], "scores": out.batch[key]})
        else:
            scores = self.groups["reward"].compute_reward(batch).select(["token_level_scores", "scores"])
        if "cost" in self.groups:
            if hasattr(self.groups["cost"], "compute_rm_score"):
                cost = self.groups["cost"].compute_rm_score(batch)
                cost_scores = cost.batch[self.specs["cost"].kwargs.get("score_key", "rm_scores")]
            else:
                cost = self.groups["cost"].compute_reward(batch)
                cost_scores = cost.batch["scores"]
            scores = scores.union(DataProto({"cost_token_level_scores": cost.batch["token_level_scores"],
                                             "cost_scores": cost_scores}))
        return scores

    def validate(self) -> dict[str, float]:
        """Greedy responses to every held-out prompt: mean reward and response length."""
        self.build()
        if self.val_loader is None:
            return {}
        scores, lengths = [], []
        for prompts in self.val_loader.all_batches():
            out = self.groups["rollout"].generate_sequences(_with_sampling(prompts, {"greedy": True, "n": 1, "seed": None}))
            scores.append(self._score(out).batch["scores"])
            lengths.append(out.batch["response_mask"].sum(-1).float())
        return {"val/reward/mean": float(torch.cat(scores).mean()), "val/response_length/mean": float(torch.cat(lengths).mean())}

    def fit(self, total_steps: int) -> list[dict[str, float]]:
        history = []
        if self.val_before_train and self.global_step == 0:  # the starting point of the validation curve: step 0
            metrics = self.validate()
            if self.logger is not None and metrics:
                self.logger.log(0, metrics)
        while self.global_step < total_steps:
            history.append(self.step())
        if self.run_dir is not None and (not self.save_every or self.global_step % self.save_every):
            self.save_checkpoint()
        return history

    # ---------------------------------------------------------- checkpoints
    def _checkpoint_root(self) -> Path:
        if self.run_dir is None:
            raise ConfigError("checkpoints need a run_dir")
        return self.run_dir / "checkpoints"

    def save_checkpoint(self) -> Path:
        """Actor (and critic) state, then the trainer's own state last: the commit point of the step."""
        root = self._checkpoint_root()
        step = self.global_step
        for role in ("actor", "critic"):
            if role in self.groups:
                self.groups[role].save_checkpoint(str(root / role), step)
        state = {"step": step, "loader": self.loader.state_dict(), "kl_ctrl": self.kl_ctrl.state_dict(),
                 "lagrange": self.lagrange.state_dict() if self.lagrange else None}
        trainer_dir = root / "trainer"
        trainer_dir.mkdir(parents=True, exist_ok=True)
        _atomic_write(trainer_dir / f"step_{step:08d}.json", json.dumps(state))
        _atomic_write(trainer_dir / "latest", f"step_{step:08d}.json")
        return trainer_dir / f"step_{step:08d}.json"

    def resume(self) -> int:
        """Continue from the newest complete checkpoint under run_dir; returns its step (0: none)."""
        self.build()
        pointer = self._checkpoint_root() / "trainer" / "latest"
        if not pointer.is_file():
            return 0
        state = json.loads((pointer.parent / pointer.read_text().strip()).read_text())
        step = int(state["step"])
        for role in ("actor", "critic"):
            if role in self.groups:
                self.groups[role].load_checkpoint(str(self._checkpoint_root() / role / f"step_{step:08d}"))
        self.loader.load_state_dict(state["loader"])
        self.kl_ctrl.load_state_dict(state["kl_ctrl"])
        if self.lagrange is not None and state.get("lagrange"):
            self.lagrange.load_state_dict(state["lagrange"])
        self.global_step = step
        return step

    def export_hf(self, path: str | Path, precision: str | None = None) -> Path:
        """The actor's current weights (and the tokenizer) as an HF checkpoint directory, in ``precision``
        ("bf16" / "fp32"; None: the actor's)."""
        from transformers import AutoTokenizer

        self.build()
        self.groups["actor"].save_hf(str(path), precision)
        AutoTokenizer.from_pretrained(self.specs["actor"].model_path).save_pretrained(str(path))
        return Path(path)

    def shutdown(self) -> None:
        for pool in self.pools.values():
            pool.shutdown()


def _reference_cls():
    from workers.actor import ReferencePolicy

    return ReferencePolicy


def _with_sampling(prompts: DataProto, sampling: dict[str, Any]) -> DataProto:
    return DataProto(prompts.batch, prompts.non_tensor_batch, {**prompts.meta_info, "sampling": sampling})


class _timer:
    def __init__(self, timing: dict[str, float], name: str) -> None:
        self.timing, self.name = timing, name

    def __enter__(self):
        self.start = time.perf_counter()

    def __exit__(self, *exc):
        self.timing[self.name] = self.timing.get(self.name, 0.0) + time.perf_counter() - self.start


def _atomic_write(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)
