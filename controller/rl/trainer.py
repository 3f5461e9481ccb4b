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

A step's phases: generate (the actor's weights resharded into the rollout at the boundary) and
score -> old and reference log-probs, values -> advantages -> critic update -> actor update ->
metrics. What differs between algorithms hangs off the algorithm object's hooks
(``controller.algorithms.RLAlgorithm``): ReMax's greedy baseline and DAPO's dynamic sampling after
scoring, Safe-RLHF's cost advantages, the policy objective and the rollout correction as the
update's loss terms. Every role lives on one resource pool (colocated, the hybrid engine's
setting) unless ``register_placement`` puts it elsewhere.
"""

from __future__ import annotations

import math
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from controller.algorithms import SafeRLHF, StepContext, StepState, build_algorithm
from controller.checks.placement import PLACEABLE_ROLES, job_pools
from controller.config import RLConfig, check_config
from controller.data import PromptLoader
from controller.errors import ConfigError
from controller.models.builtin import resolve_model_path
from controller.rl.bad_steps import BadSteps
from controller.rl.job_prompts import rl_job_prompts
from controller.rl.role_assembly import ROLE_ORDER, reference_role
from controller.rl.role_defaults import critic_from_causal_lm
from controller.rl.role_specs import declare_roles, kl_loss_function, with_parallelism, with_resolved_paths
from controller.rl.rollout_client import RolloutClient, rollout_client
from controller.rl.rollout_dump import RolloutDump
from controller.rl.rollout_pool import RolloutWeightLink, separate_rollout_kwargs
from controller.rl.rollout_source import RolloutSource
from controller.rl.routes import routes_for_actor, without_routes
from controller.rl.schedules import build_schedule, generation_seed
from controller.rl.step_metrics import batch_metrics, kl_metrics, nothing_to_train, phase_lines, reduce_update_metrics
from controller.rl.trainer_builder import config_from_keywords
from controller.rl.trainer_checkpoint import TrainerCheckpoint
from controller.rl.trainer_inputs import TrainerInputs
from controller.runtime.hang_watch import HangWatch
from controller.runtime.placement import PlacementError, PoolShape, pool_shape
from controller.runtime.resource_pool import ResourcePool
from controller.runtime.worker_group import WorkerGroup
from hybridengine.device import accelerator_count, device_memory_bytes
from workers.data_proto import DataProto
from workers.data_schema import ROLLOUT_FIELDS, DataSchema
from workers.actor import PolicyUpdateTerms
from workers.keywords import check_keywords
from workers.rollout.agreement import logprob_agreement, old_log_probs_from_update, use_old_log_probs
from workers.user_kl import UserKLTerm

__all__ = ["RLTrainer"]

# The rollout's own metrics that a step reports; extra generation rounds add to the timings and bytes.
ROLLOUT_METRICS = ("timing_s/gen", "timing_s/reshard", "timing_s/weight_sync", "weight_sync/bytes",
                   "reshard/bytes_received", "reshard/expert_bytes_received", "reshard/lora_bytes_received",
                   "rollout/tokens_per_s",
                   # either way the weights came (in place or across pools): the time and the bytes received
                   "timing_s/weight_update", "weight_update/bytes_received",
                   # a rollout on its own pool: the cross-pool transfer, beside the in-place reshard's
                   "timing_s/weight_transfer", "weight_transfer/bytes", "weight_transfer/bound_bytes",
                   "weight_transfer/bytes_sent",
                   "rollout/kv_cache_tokens")  # what vLLM's KV cache holds (whole blocks), as the planner sizes it


class RLTrainer:
    def __init__(self, config: RLConfig | None = None, /, **keywords: Any) -> None:
        """``RLTrainer(config, train_data=..., val_data=..., algorithm=..., pool=..., logger=...)``: the job
        a typed config (``controller.config.RLConfig``) describes, with the inputs that are objects
        (``controller.rl.trainer_inputs.TrainerInputs``; None: what the config describes).

        ``RLTrainer(actor=..., train_data=..., batch_size=..., ...)``: the researcher's keyword form, which
        ``controller.rl.trainer_builder.config_from_keywords`` turns into that config, keyword by keyword.
        ``algorithm``: a name, an AlgorithmConfig (or its dict), or an RLAlgorithm object. ``mode``:
        "sync"; "one_step_off" (the rollout on a pool of its own generates step k+1 while step k trains);
        or "async" (it generates a stream of samples, ``partial_rollout_tokens`` per sample per call, None:
        whole responses, with at most ``max_in_flight`` prompt groups at once, None: as the staleness bound
        allows). Samples more than ``max_staleness`` updates stale are not trained on; see
        ``controller.rl.schedules``. ``rollout_data_dir``: each step's samples, with the per-token
        advantages they trained on, as ``{dir}/{step}.jsonl`` (``controller.rl.rollout_dump``).
        ``rollout`` None: generation from the actor's model, in vLLM where it is installed (megatron
        otherwise), laid out by ``device_map="auto"``'s rule. ``lr``: the actor's (and critic's) learning
        rate, where their own ``optim`` does not set one. ``rollout_proto``: a schema
        (``DataProto(field="name", ...)``) of the fields the rollout must produce, checked now and on the
        first batch. ``verbose``: one console line per phase of each step.

        Every keyword is checked now: an unknown one, or a value of the wrong kind, raises before any
        process starts; the checks across fields (``controller.config.check_config``) run at ``build``.
        """
        if config is None:
            missing = [key for key in ("actor", "train_data", "batch_size") if key not in keywords]
            if missing:
                raise TypeError(f"RLTrainer takes a config, RLTrainer(config), or the keywords actor=, train_data= "
                                f"and batch_size= (with the rest of the job); missing: {missing}")
            check_keywords("RLTrainer", config_from_keywords, keywords)
            config, inputs = config_from_keywords(**keywords)
        else:
            if not isinstance(config, RLConfig):
                raise TypeError(f"RLTrainer(config): config must be an RLConfig (controller.config.load_config), "
                                f"got {type(config).__name__}")
            check_keywords("RLTrainer(config, ...)", TrainerInputs, keywords)
            inputs = TrainerInputs(**keywords)
            config = with_resolved_paths(config)  # hub ids: their cached snapshots (the keyword form's are)
        self.config, self.inputs = config, inputs
        trainer = config.trainer
        self.run_dir = Path(trainer.run_dir) if trainer.run_dir is not None else None
        self._scratch: tempfile.TemporaryDirectory | None = None
        self.policy_path = (resolve_model_path(config.model_path, self._work_dir())
                            if config.model_path.startswith("builtin:") else config.model_path)
        algorithm = inputs.algorithm
        safe_rlhf = config.algorithm.safe_rlhf_cost_fn is not None or config.cost_model is not None
        if algorithm is None:
            algorithm = build_algorithm(config.algorithm, safe_rlhf=safe_rlhf)
        elif safe_rlhf and not isinstance(algorithm, SafeRLHF):  # a cost is scored: its hooks wrap the object's
            algorithm = SafeRLHF(algorithm)
        self.algorithm = algorithm
        self.ppo = config.ppo
        self.specs = declare_roles(config, algorithm, self.policy_path)
        self.rollout_proto = DataSchema(dict(trainer.rollout_proto)) if trainer.rollout_proto is not None else None
        if self.rollout_proto is not None:
            self.rollout_proto.check(getattr(self.specs["rollout"].worker_cls, "produces", ROLLOUT_FIELDS))
        self._proto_seen = False
        self.verbose = trainer.log_phases
        self.lora_sync_choice = None  # rollout.lora_sync auto: the planner's choice and why (choose_lora_sync)
        self.rollout_client: RolloutClient | None = None  # how responses come: the group or the server (build)
        self.placement = {role: "default" for role in self.specs}
        self.rollout_on_its_own_pool = False
        self.mode = trainer.mode
        self.schedule = build_schedule(trainer.mode, trainer.max_staleness, trainer.partial_rollout_tokens,
                                       trainer.max_in_flight)
        self.rollout_link: RolloutWeightLink | None = None  # the weights' path to a rollout on its own pool
        self.pool_shapes: dict[str, PoolShape] = {"default": PoolShape("default", trainer.nnodes, trainer.nproc)}
        self.backend = trainer.launcher
        self.ray_address = trainer.ray_address
        self.kl_loss_fn = kl_loss_function(config.algorithm.kl_loss_fn)  # imported and its signature checked
        self.train_data, self.val_data = inputs.train_data, inputs.val_data
        if self.train_data is None:  # the prompts config.data describes, loaded and checked now, as the CLI does
            prompts = rl_job_prompts(config, self.specs["actor"].model_path)
            self.train_data, self.val_data = prompts.train, prompts.val
        self.batch_size, self.shuffle, self.seed = config.data.batch_size, config.data.shuffle, trainer.seed
        self.checkpoints = TrainerCheckpoint(self.run_dir)
        self.logger = inputs.logger
        self.rollout_dump = (RolloutDump(trainer.rollout_data_dir, self.specs["actor"].model_path)
                             if trainer.rollout_data_dir is not None else None)
        self.save_every, self.val_every, self.val_before_train = trainer.save_every, trainer.val_every, trainer.val_before_train
        self.rollout_sampling = sampling = config.rollout.sampling
        self.max_response_length = config.rollout.max_response_length  # a conversation's, for agent rollouts
        self.old_log_probs_from_update = old_log_probs_from_update(
            algorithm.config.old_log_prob_source, self.ppo.ppo_epochs, self.ppo.ppo_mini_batch_size,
            self.batch_size * sampling.n, read_before_update=algorithm.config.kl_in_reward
        ) and not config.rollout.serves_agent  # a served agent's batch may hold more rows than one mini-batch
        self.groups: dict[str, WorkerGroup] = {}
        self.pools: dict[str, ResourcePool] = {"default": inputs.pool} if inputs.pool is not None else {}
        self.global_step = 0
        # every worker call's deadline, from its own durations (trainer.hang_timeout_s: a fixed one)
        self.watch = HangWatch(self.run_dir / "hangs" if self.run_dir is not None else None, trainer.hang_timeout_s)
        self.bad_steps = BadSteps(trainer.max_bad_steps)  # steps in a row that skipped an optimizer step
        self.loader: PromptLoader | None = None
        self.pad_token_id: int | None = None
        pools = job_pools(trainer)  # the config's own placement: the pools' owners first, then the roles sharing them
        for role, shape in sorted(pools.items(), key=lambda item: item[1].name != item[0]):
            if role == "default":
                continue
            if shape.name == role:
                self.register_placement(role, nodes=shape.nodes, processes_per_node=shape.processes_per_node)
            else:
                self.register_placement(role, pool=shape.name)

    @property
    def pool_sizes(self) -> dict[str, int]:
        """Processes of each pool."""
        return {name: shape.world_size for name, shape in self.pool_shapes.items()}

    @property
    def kl_ctrl(self):
        """The algorithm's KL coefficient controller (the KL penalty in the reward)."""
        return self.algorithm.kl_ctrl

    # ------------------------------------------------------------- declaration
    def register_placement(self, role: str, devices: int | None = None, pool: str | None = None, *,
                           nodes: int | None = None, processes_per_node: int | None = None) -> None:
        """Put ``role`` on its own resource pool. Before the first step.

        The pool is ``devices`` processes on one node (one per device), or
        ``nodes`` x ``processes_per_node`` processes across that many nodes::

            trainer.register_placement("actor", nodes=2, processes_per_node=4)   # rollout follows the actor
            trainer.register_placement("critic", 4)                              # a node of its own
            trainer.register_placement("ref_policy", pool="actor")               # colocated with the actor

        Roles given the same ``pool`` name share its processes (colocation); by
        default every role is on the pool "default". The rollout follows the
        actor and reshards its weights in place, unless it is placed itself::

            trainer.register_placement("rollout", 4)    # generation on 4 processes of its own

        Then the actor sends it the weights across pools after each update
        (``controller.rl.rollout_pool``). Under torchrun a megatron role's pool must
        be the whole world, so split placement is a Ray feature.
        """
        self._before_build("register_placement")
        if role not in self.specs:
            raise ConfigError(f"unknown role {role!r}; roles of this trainer: {sorted(self.specs)}")
        if role == "rollout" and pool is not None and pool == self.placement.get("actor"):
            raise ConfigError(f"register_placement('rollout', pool={pool!r}): that is the actor's pool, where the "
                              f"rollout sits by default; give it a pool of its own, or leave it with the actor")
        if devices is not None and (nodes is not None or processes_per_node is not None):
            raise ConfigError(f"register_placement({role!r}): give devices (one node) or nodes and "
                              f"processes_per_node, not both")
        pool = pool or role
        shape = None
        if devices is not None or processes_per_node is not None:
            value = devices if devices is not None else {"nodes": nodes or 1, "processes_per_node": processes_per_node}
            try:
                shape = pool_shape(pool, value, f"register_placement({role!r})")
            except PlacementError as exc:
                raise ConfigError(str(exc)) from None
        elif nodes is not None:
            raise ConfigError(f"register_placement({role!r}, nodes={nodes}): give processes_per_node too")
        if pool in self.pool_shapes:
            known = self.pool_shapes[pool]
            if shape is not None and known is not None and known.process_on_nodes != shape.process_on_nodes:
                if known.nodes == shape.nodes == 1:
                    raise ConfigError(f"pool {pool!r} has {known.world_size} processes, not {shape.world_size}")
                raise ConfigError(f"pool {pool!r} is {known}, not {shape}")
        elif shape is None:
            raise ConfigError(f"pool {pool!r} is new: give its devices (>= 1), or nodes and processes_per_node")
        else:
            self.pool_shapes[pool] = shape
        self.placement[role] = pool
        if role == "actor" and not self.rollout_on_its_own_pool:
            self.placement["rollout"] = pool
        if role == "rollout":
            self.rollout_on_its_own_pool = True

    def register_parallelism(self, role: str, tensor_parallel: int | None = None, pipeline_parallel: int | None = None) -> None:
        """Set a megatron role's TP/PP (the rollout's generation TP/PP), in the config. Before the first step."""
        self._before_build("register_parallelism")
        if role not in self.specs:
            raise ConfigError(f"unknown role {role!r}; roles of this trainer: {sorted(self.specs)}")
        if role != "rollout" and "engine" not in self.specs[role].kwargs:
            raise ConfigError(f"role {role!r} ({self.specs[role].worker_cls.__name__}) has no model parallelism to set")
        self.config = with_parallelism(self.config, role, tensor_parallel, pipeline_parallel)
        self.specs = declare_roles(self.config, self.algorithm, self.policy_path)

    def _before_build(self, what: str) -> None:
        if self.groups:
            raise RuntimeError(f"{what} must come before the first step: the worker groups already exist")

    # -------------------------------------------------------------------- build
    def build(self) -> None:
        """The checks across the whole config (with the placement as declared), then the pools and groups."""
        if self.groups:
            return
        self.lay_out()
        self.choose_lora_sync()
        from controller.planner.prelaunch import check_before_launch

        check_before_launch(self.placed_config())  # a GPU job that will not fit, refused before any worker
        self.check()
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(self.specs["actor"].model_path)
        # Loaders first: a prompt the rollout cannot take is an error before any worker starts.
        rollout_cfg = self.config.rollout
        # With truncation "left" the rollout keeps a long prompt's end; otherwise the loader refuses it up front.
        max_prompt = rollout_cfg.max_prompt_length if rollout_cfg.truncation == "error" else None
        self.loader = PromptLoader(self.train_data, tokenizer, self.batch_size, max_prompt, self.shuffle, self.seed)
        self.pad_token_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        self.val_loader = (PromptLoader(self.val_data, tokenizer, min(self.batch_size, len(self.val_data)), max_prompt,
                                        shuffle=False) if self.val_data is not None else None)
        for name, shape in self.pool_shapes.items():
            if name in self.pools:
                continue
            self.pools[name] = ResourcePool(shape.process_on_nodes, backend=self.backend, ray_address=self.ray_address)
        if "critic" in self.specs:  # a critic on a causal LM: the LM's body and a new value head
            self.specs["critic"] = critic_from_causal_lm(self.specs["critic"], self._work_dir(),
                                                         self.config.critic_ppo.value_head_init)
        for role in ROLE_ORDER:
            if role in self.specs:
                spec, pool = self.specs[role], self.pools[self.placement[role]]
                kwargs = spec.kwargs
                if role == "rollout" and self.rollout_on_its_own_pool:
                    kwargs = separate_rollout_kwargs(kwargs, self.specs["actor"].kwargs.get("engine"),
                                                     self.groups["actor"].world_size)
                self.groups[role] = WorkerGroup(pool, spec.worker_cls, role=role, kwargs=kwargs, watch=self.watch)
        served = stream = None
        if rollout_cfg.serves_agent:
            from controller.serving.served_rollout import ServedRollout

            minis = [self.ppo.ppo_mini_batch_size] + ([self.config.critic_ppo.ppo_mini_batch_size]
                                                      if "critic" in self.groups else [])
            served = ServedRollout(self.groups["rollout"], tokenizer, rollout_cfg, math.lcm(*minis))
            if self.mode == "async":  # the replicas serve across steps; the weights change under the sessions
                from controller.serving.served_stream import ServedStream

                self.schedule = stream = ServedStream(served, self.config.trainer.max_staleness,
                                                      rollout_cfg.server_update)
        if self.rollout_on_its_own_pool:
            self.rollout_link = RolloutWeightLink(self.groups["actor"], self.groups["rollout"],
                                                  self.pools[self.placement["rollout"]].controller_address())
        self.rollout_client = rollout_client(self.groups["rollout"], self.rollout_link, served, stream)

    def lay_out(self) -> None:
        """Each ``device_map="auto"`` role's layout, the planner's fastest that fits the job's devices
        (``controller.planner.device_map``), written into the config as if the user had set it; nothing starts."""
        from controller.planner.device_map import auto_layouts

        auto = {role for role, spec in self.specs.items()
                if spec.device_map == "auto" and not spec.explicit_parallelism}
        if not auto:
            return
        cluster, efficiency = self._job_cluster()
        layouts = auto_layouts(self.placed_config(), auto, cluster, efficiency, flash_attention=accelerator_count() > 0)
        for role, (tp, pp) in layouts.items():
            self.config = with_parallelism(self.config, role, tp, pp)
        self.specs = declare_roles(self.config, self.algorithm, self.policy_path)

    def choose_lora_sync(self) -> None:
        """``rollout.lora_sync: auto``: how a LoRA actor's adapters reach the rollout, merged or served, as the
        planner scores the job on its devices (``controller.planner.lora_choice``); said on the console."""
        if self.config.rollout.lora_sync != "auto":
            return
        from controller.planner.lora_choice import resolve_lora_sync

        cluster, efficiency = self._job_cluster() if self.config.actor.lora.enabled else (None, None)
        try:
            placed, choice = resolve_lora_sync(replace(self.placed_config(), model_path=self.policy_path), cluster,
                                               efficiency, flash_attention=accelerator_count() > 0)
            rollout = placed.rollout
        except ValueError as exc:  # a model the planner cannot read: the mode that runs on every engine
            rollout, choice = replace(self.config.rollout, lora_sync="merge"), None
            print(f"[hybridflow] rollout.lora_sync auto -> merge: the planner could not score the job ({exc})",
                  file=sys.stderr, flush=True)
        self.config = replace(self.config, rollout=rollout)
        self.specs = declare_roles(self.config, self.algorithm, self.policy_path)
        self.lora_sync_choice = choice
        if choice is not None:
            print(f"[hybridflow] rollout.lora_sync auto -> {choice.mode}: {choice.reason}", file=sys.stderr, flush=True)

    def _job_cluster(self):
        """The job's devices as the planner sees them (``controller.planner.device_map.job_cluster``)."""
        from controller.planner.device_map import job_cluster

        used = {self.placement[role] for role in self.placement}
        shapes = [shape for name, shape in self.pool_shapes.items() if name in used or name == "default"]
        return job_cluster(sum(s.nodes for s in shapes), self.config.trainer.nproc,
                           sum(s.world_size for s in shapes), device_memory_bytes())

    def placed_config(self):
        """The config with its pools as declared (``register_placement`` included) in ``trainer.placement``."""
        placement, owner = {}, {}
        for role, pool in self.placement.items():
            shape = self.pool_shapes[pool]
            if role == "rollout" and not self.rollout_on_its_own_pool:
                continue  # it follows the actor
            if pool != "default" and role in PLACEABLE_ROLES:  # the pool's first role holds it, the others share it
                if pool in owner:
                    placement[role] = owner[pool]
                else:
                    owner[pool] = role
                    placement[role] = {"nodes": shape.nodes, "processes_per_node": shape.processes_per_node}
        return replace(self.config, trainer=replace(self.config.trainer, placement=placement))

    def check(self) -> None:
        """ConfigError listing every problem of the config, its pools as declared (``register_placement``
        included), the policy's and the reward model's checkpoints; nothing starts."""
        from hybridengine.model.spec import ModelSpec
        from workers.reward.reward_model import megatron_spec_or_none

        config = self.placed_config()
        path = self.specs["actor"].model_path
        policy = ModelSpec.from_pretrained(path) if Path(path, "config.json").is_file() else None
        reward = self.config.reward.model_path
        check_config(config, policy, reward_spec=megatron_spec_or_none(reward) if reward is not None else None)

    def _work_dir(self) -> Path:
        """Where the trainer writes what it derives (a critic's value-head model): the run directory, else
        a temporary directory of this trainer's."""
        if self.run_dir is not None:
            return self.run_dir
        if self._scratch is None:
            self._scratch = tempfile.TemporaryDirectory(prefix="hybridflow-")
        return Path(self._scratch.name)

    # --------------------------------------------------------------------- step
    def step(self, step: int | None = None) -> dict[str, float]:
        """One full RL step on the worker groups; returns its metrics."""
        self.build()
        if step is not None:
            self.global_step = step
        alg, state = self.algorithm, StepState(self.global_step)
        batch = self.schedule.rollout(self.rollout_source(), state)  # sync: now; else while earlier steps trained
        ctx = StepContext.of(self)  # what the algorithm's hooks see of this trainer
        batch = alg.after_scoring(ctx, state, batch)  # ReMax's greedy baseline, DAPO's filter and shaping
        batch = self.compute_log_probs(batch, state)  # old (unless the update gives them), reference, values
        with state.timed("adv"):
            batch = alg.advantages(ctx, state, batch)
        terms = alg.loss_terms(ctx, state, batch)  # the policy objective, the rollout correction
        self.update(batch, terms, state)  # the critic, then the actor
        alg.after_update(ctx, state, batch)
        return self.finish_step(batch, state)  # metrics, validation, logging, checkpoint

    # ------------------------------------------------------------- phases
    def rollout_source(self) -> RolloutSource:
        """What the schedule sees of this trainer for the current step."""
        link = self.rollout_link
        return RolloutSource(
            version=self.global_step, seed=self.seed, batch_size=self.batch_size, sampling=self.rollout_sampling,
            pad_token_id=self.pad_token_id, next_prompts=self.next_prompts, generate_and_score=self.generate_and_score,
            score=self.score, submit=self.rollout_client.submit,
            sync_weights=link.sync if link is not None else lambda receive=None: {},
            record_rollout_metrics=self.record_rollout_metrics)

    def next_prompts(self, state: StepState) -> DataProto:
        """The loader's next prompt batch, through the algorithm's ``before_generation`` hook."""
        return self.algorithm.before_generation(StepContext.of(self), state, self.loader.next_batch())

    def generate_and_score(self, prompts: DataProto, state: StepState, round_index: int = 0) -> DataProto:
        """Sampled responses to ``prompts``, scored; ``round_index`` > 0: an extra generation round of the step."""
        seed = generation_seed(self.seed, state.step, round_index)
        with state.timed("rollout"):
            batch = self.generate(prompts, state, sampling={"seed": seed})
        with state.timed("reward"):
            return batch.union(self.score(batch))

    def generate(self, prompts: DataProto, state: StepState | None, sampling: dict[str, Any],
                 keep_metrics: bool = True) -> DataProto:
        """The rollout's responses to ``prompts`` under ``sampling`` (merged over the rollout config's)."""
        transfer = self.rollout_link.sync() if self.rollout_link is not None else {}
        out = self.rollout_client.responses(prompts, sampling)
        if self.rollout_proto is not None and not self._proto_seen:  # the declared fields, on a real batch
            self.rollout_proto.check([*out.batch, *out.non_tensor_batch])
            self._proto_seen = True
        metrics = {**out.meta_info.pop("metrics", {}), **transfer}
        if keep_metrics and state is not None:
            self.record_rollout_metrics(state, metrics)
        return out

    @staticmethod
    def record_rollout_metrics(state: StepState, metrics: dict[str, Any]) -> None:
        """A generation's metrics into the step's: timings and bytes add up over a step's rounds."""
        # A multi-turn rollout's agent/* metrics (turns, tool calls and errors, finish reasons) as they come.
        state.rollout_metrics.update({k: float(v) for k, v in metrics.items() if k.startswith("agent/")})
        for key in (k for k in ROLLOUT_METRICS if k in metrics):
            summed = key.startswith("timing_s/") or key.endswith(("bytes", "bytes_received"))
            previous = state.rollout_metrics.get(key, 0.0) if summed else 0.0
            state.rollout_metrics[key] = previous + float(metrics[key])

    def score(self, batch: DataProto) -> DataProto:
        """``token_level_scores`` and ``scores`` of each response (and its cost under Safe-RLHF)."""
        if "reward_model" in self.groups:
            out = self.groups["reward_model"].compute_rm_score(batch)
            key = self.specs["reward_model"].kwargs.get("score_key", "rm_scores")
            scores = DataProto({"token_level_scores": out.batch["token_level_scores"], "scores": out.batch[key]})
        else:
            out = self.groups["reward"].compute_reward(batch)
            scores = out.select([k for k in ("token_level_scores", "scores", "reward_timed_out") if k in out.batch])
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

    def compute_log_probs(self, batch: DataProto, state: StepState) -> DataProto:
        """Old log-probs (skipped when the update's own forward gives them), reference log-probs, values."""
        g = self.groups
        batch = routes_for_actor(batch, self.algorithm.config.router_replay)  # a mixture of experts' routes
        if not self.old_log_probs_from_update:  # on-policy, the update's own forward gives them, detached
            with state.timed("old_log_prob"):
                old = g["actor"].compute_log_prob(batch)
                state.metrics.update(old.meta_info.pop("router_replay", {}))  # router_replay/agreement
                batch = batch.union(old)
            state.metrics.update(logprob_agreement(batch.batch["rollout_log_probs"], batch.batch["old_log_probs"],
                                                   batch.batch["response_mask"]))
            batch = use_old_log_probs(batch, self.algorithm.config.old_log_prob_source)
        reference = reference_role(self.specs, self.algorithm.config, self.ppo, self.kl_loss_fn)
        if reference is not None:  # the reference policy, or a LoRA actor's base (its adapters off)
            with state.timed("ref"):
                batch = batch.union(g[reference].compute_ref_log_prob(without_routes(batch)))
        if "critic" in g:
            with state.timed("values"):
                batch = batch.union(g["critic"].compute_values(without_routes(batch)))
        return batch

    def update(self, batch: DataProto, terms: PolicyUpdateTerms, state: StepState) -> None:
        """The critic's PPO update, then the actor's with the algorithm's ``terms``; their metrics go into
        ``state.metrics``."""
        g = self.groups
        empty = nothing_to_train(state.step + 1, batch, state.rollout_metrics)
        if empty is not None:  # an update over no token gives NaNs and says nothing of why
            print(f"[hybridflow] {empty}", flush=True)
            state.metrics["training/nothing_to_train"] = 1.0
            return
        if "critic" in g:
            with state.timed("update_critic"):
                state.metrics.update(reduce_update_metrics(g["critic"].update_critic(without_routes(batch))))
        with state.timed("update_actor"):
            if self.kl_loss_fn is not None:  # the user's term, called with this step
                terms = replace(terms, user_kl=UserKLTerm(self.kl_loss_fn, self.global_step))
            metrics = reduce_update_metrics(g["actor"].update_actor(batch, terms, self.old_log_probs_from_update))
        if self.rollout_link is not None:
            self.rollout_link.mark_stale()
        for key in [k for k in metrics if k.startswith("actor/rollout_corr/")]:
            metrics[key.removeprefix("actor/")] = metrics.pop(key)
        if self.old_log_probs_from_update:  # the agreement the skipped pass would have measured
            for stat in ("max", "mean"):
                metrics[f"rollout/logprob_diff_{stat}"] = metrics.pop(f"actor/rollout_logprob_diff_{stat}")
            for key in [k for k in metrics if k.startswith("actor/router_replay/")]:  # its one pass: the rollout's weights
                metrics[key.removeprefix("actor/")] = metrics.pop(key)
        metrics.update(kl_metrics(metrics, user_fn=self.kl_loss_fn is not None, ppo=self.ppo,
                                  reward_beta=self.algorithm.kl_ctrl.value if self.algorithm.config.kl_in_reward else None))
        state.metrics.update(metrics)
        self.count_bad_step(state)

    def count_bad_step(self, state: StepState) -> None:
        """A step whose actor or critic skipped an optimizer step (a NaN or Inf loss or gradient: the update
        left their weights and optimizer state as they were) is said and counted; ``trainer.max_bad_steps``
        of them in a row stop the run, naming the first."""
        skipped = [role for role in ("critic", "actor") if state.metrics.get(f"{role}/skipped", 0.0) > 0]
        in_row = self.bad_steps.count(state.step + 1, skipped)  # as the console and the metrics number it
        if in_row is not None:
            state.metrics["training/bad_steps_in_row"] = in_row

    def finish_step(self, batch: DataProto, state: StepState) -> dict[str, float]:
        """The step's metrics; then validation, logging and the checkpoint where they are due."""
        state.timing["step"] = time.perf_counter() - state.start
        metrics = {**batch_metrics(batch), **state.metrics, **state.rollout_metrics}
        metrics.update({f"timing_s/{k}": v for k, v in state.timing.items()})
        tokens = int(batch.batch["attention_mask"].sum())
        metrics["perf/throughput"] = tokens / state.timing["step"]
        metrics["perf/max_memory_gb"] = max(i["peak_memory_gb"] for i in self.groups["actor"].worker_info())
        if self.val_every and (self.global_step + 1) % self.val_every == 0:
            metrics.update(self.validate())
        self.global_step += 1
        if self.rollout_dump is not None:
            self.rollout_dump.write(self.global_step, batch)
        if self.logger is not None:
            self.logger.log(self.global_step, metrics)
        if self.verbose:
            for line in phase_lines(metrics, len(batch)):
                print(f"[hybridflow] {line}", flush=True)
        if self.save_every and self.global_step % self.save_every == 0:
            self.save_checkpoint()
        return metrics

    def validate(self) -> dict[str, float]:
        """Greedy responses to every held-out prompt: mean reward and response length."""
        self.build()
        if self.val_loader is None:
            return {}
        scores, lengths, calls = [], [], []
        self.rollout_client.weights_for_validation(self.global_step)  # a served stream: taken in flight
        for prompts in self.val_loader.all_batches():
            out = self.rollout_client.responses(prompts, {"greedy": True, "n": 1, "seed": None}, training=False)
            scores.append(self.score(out).batch["scores"])
            lengths.append(out.batch["response_mask"].sum(-1).float())
            if "agent_tool_calls" in out.non_tensor_batch:  # an agent rollout: the tool calls of each sample
                calls += [float(c) for c in out.non_tensor_batch["agent_tool_calls"]]
        result = {"val/reward/mean": float(torch.cat(scores).mean()),
                  "val/response_length/mean": float(torch.cat(lengths).mean())}
        if calls:
            result["val/agent/tool_calls/mean"] = sum(calls) / len(calls)
        return result

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
    def save_checkpoint(self) -> Path:
        """The actor (and critic), then the trainer's own state last: the commit point of the step."""
        return self.checkpoints.save(self)

    def resume(self) -> int:
        """Continue from the newest complete checkpoint under run_dir; returns its step (0: none)."""
        self.build()
        step = self.checkpoints.resume(self)
        if self.rollout_link is not None:
            self.rollout_link.mark_stale()
        return step

    def export_hf(self, path: str | Path, precision: str | None = None) -> Path:
        """The actor's current weights (and the tokenizer) as an HF checkpoint directory, in ``precision``
        ("bf16" / "fp32"; None: the actor's)."""
        from transformers import AutoTokenizer

        self.build()
        self.groups["actor"].save_hf(str(path), precision)
        AutoTokenizer.from_pretrained(self.specs["actor"].model_path).save_pretrained(str(path))
        return Path(path)

    def export_peft(self, path: str | Path) -> Path:
        """A LoRA actor's adapters as a PEFT adapter directory (``peft.PeftModel.from_pretrained(base, path)``
        loads it onto the base model; ``export_hf`` writes them merged)."""
        self.build()
        self.groups["actor"].save_peft(str(path))
        return Path(path)

    def shutdown(self) -> None:
        if self.rollout_client is not None:  # a served stream: its sessions and replicas stop first
            self.rollout_client.close()
            self.rollout_client = None
        if self.rollout_link is not None:
            self.rollout_link.close()
            self.rollout_link = None
        for pool in self.pools.values():
            pool.shutdown()
        if self._scratch is not None:
            self._scratch.cleanup()
            self._scratch = None

