"""JobAssembly: a job's config turned into what runs it: its roles and their pools, checked and planned
before any process starts, then the pools, the worker groups, the prompt loaders, the schedule, the weights'
link to a rollout on its own pool and the rollout client.

    job = JobAssembly(config, algorithm, train_data, val_data, pool=None)
    job.register_placement("critic", 4)       # declarations come first (the trainer forwards them here)
    job.build()                               # lay_out, lora_sync, the pre-launch check, then the groups

``RLTrainer`` runs steps on ``job``; it keeps no placement state of its own. Each ``device_map: auto`` role
is laid out by the planner, ``rollout.lora_sync: auto`` is chosen by it, and ``check_config`` runs over the
config with the pools as declared, all before the first process.
"""

from __future__ import annotations

import math
import sys
import tempfile
from dataclasses import replace
from pathlib import Path
from typing import Any

from controller.config import RLConfig, check_config
from controller.data import PromptLoader
from controller.errors import ConfigError
from controller.models.builtin import resolve_model_path
from controller.rl.role_assembly import ROLE_ORDER
from controller.rl.role_defaults import critic_from_causal_lm
from controller.rl.resolve import auto_layout, resolve
from controller.rl.role_placement import RolePlacement
from controller.rl.role_specs import declare_roles, with_parallelism
from controller.rl.rollout_client import RolloutClient, rollout_client
from controller.rl.rollout_pool import RolloutWeightLink, separate_rollout_kwargs
from controller.rl.schedules import build_schedule
from controller.runtime.hang_watch import HangWatch
from controller.runtime.placement import PoolShape
from controller.runtime.resource_pool import ResourcePool
from controller.runtime.worker_group import WorkerGroup
from hybridengine.device import accelerator_count, device_memory_bytes

__all__ = ["JobAssembly"]


class JobAssembly:
    """A job's roles, their placement and layouts, and (once built) the pools and groups that run them."""

    def __init__(self, config: RLConfig, algorithm: Any, train_data: Any, val_data: Any, pool: ResourcePool | None = None,
                 ppo: Any = None) -> None:
        trainer = config.trainer
        self.config, self.algorithm = config, algorithm
        self.train_data, self.val_data = train_data, val_data
        self.ppo = ppo if ppo is not None else config.ppo
        self.run_dir = Path(trainer.run_dir) if trainer.run_dir is not None else None
        self._scratch: tempfile.TemporaryDirectory | None = None
        self.policy_path = (resolve_model_path(config.model_path, self._work_dir())
                            if config.model_path.startswith("builtin:") else config.model_path)
        self._declare(config)
        self.lora_sync_choice = None  # rollout.lora_sync auto: the planner's choice and why (build, resolve)
        # where the roles run: the config's own pools, then each register_placement (resolve writes it in)
        self.declared = RolePlacement.of(trainer, self.specs)
        self.mode = trainer.mode
        self.schedule = build_schedule(trainer.mode, trainer.max_staleness, trainer.partial_rollout_tokens,
                                       trainer.max_in_flight)
        self.rollout_link: RolloutWeightLink | None = None  # the weights' path to a rollout on its own pool
        self.rollout_client: RolloutClient | None = None  # how responses come: the group or the server (build)
        self.backend, self.ray_address = trainer.launcher, trainer.ray_address
        self.batch_size, self.shuffle, self.seed = config.data.batch_size, config.data.shuffle, trainer.seed
        self.groups: dict[str, WorkerGroup] = {}
        self.pools: dict[str, ResourcePool] = {"default": pool} if pool is not None else {}
        # every worker call's deadline, from its own durations (trainer.hang_timeout_s: a fixed one)
        self.watch = HangWatch(self.run_dir / "hangs" if self.run_dir is not None else None, trainer.hang_timeout_s)
        self.loader: PromptLoader | None = None
        self.val_loader: PromptLoader | None = None
        self.pad_token_id: int | None = None

    @property
    def pool_sizes(self) -> dict[str, int]:
        """Processes of each pool."""
        return self.declared.pool_sizes

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
        be the whole world, so split placement is a Ray feature. The declaration is a value
        (``controller.rl.role_placement.RolePlacement``) that ``resolve`` writes into the config.
        """
        self._before_build("register_placement")
        self.declared = self.declared.placed(role, devices, pool, nodes=nodes, processes_per_node=processes_per_node)

    @property
    def placement(self) -> dict[str, str]:
        """Each role's pool, as declared."""
        return dict(self.declared.roles)

    @property
    def pool_shapes(self) -> dict[str, PoolShape]:
        return dict(self.declared.shapes)

    @property
    def rollout_on_its_own_pool(self) -> bool:
        return self.declared.rollout_apart

    def register_parallelism(self, role: str, tensor_parallel: int | None = None, pipeline_parallel: int | None = None) -> None:
        """Set a megatron role's TP/PP (the rollout's generation TP/PP), in the config. Before the first step."""
        self._before_build("register_parallelism")
        if role not in self.specs:
            raise ConfigError(f"unknown role {role!r}; roles of this trainer: {sorted(self.specs)}")
        if role != "rollout" and "engine" not in self.specs[role].kwargs:
            raise ConfigError(f"role {role!r} ({self.specs[role].worker_cls.__name__}) has no model parallelism to set")
        self.config = with_parallelism(self.config, role, tensor_parallel, pipeline_parallel)
        self._declare(self.config)

    def _declare(self, config: RLConfig) -> None:
        declared = declare_roles(config, self.algorithm, self.policy_path)
        self.specs, self.role_calls = declared.specs, declared.calls

    def calls_at(self, phase: str) -> list[tuple[str, Any]]:
        """(role, call) of each role the step calls at ``phase`` besides the built-in ones: the algorithm's
        own roles (``RLAlgorithm.roles``), then the registered ones (``controller.rl.role_registry``)."""
        return self.role_calls.get(phase, [])

    def _before_build(self, what: str) -> None:
        if self.groups:
            raise RuntimeError(f"{what} must come before the first step: the worker groups already exist")

    def build(self) -> None:
        """The checks across the whole config (with the placement as declared), then the pools and groups."""
        if self.groups:
            return
        resolved = resolve(self.config, self.algorithm, self.policy_path, self._job_cluster, accelerator_count() > 0,
                           self.declared)  # the declarations, then the planner's choices
        self.lora_sync_choice = resolved.lora_sync
        self._settled(resolved.config, *resolved.notes)
        from controller.planner.prelaunch import check_before_launch

        check_before_launch(self.placed_config())  # a GPU job that will not fit, refused before any worker
        self.check()
        from transformers import AutoTokenizer

        from controller.data.images import ImageProcessing

        tokenizer = AutoTokenizer.from_pretrained(self.specs["actor"].model_path)
        images = ImageProcessing.for_model(self.specs["actor"].model_path)  # a vision-language model's
        # Loaders first: a prompt the rollout cannot take is an error before any worker starts.
        rollout_cfg = self.config.rollout
        # With truncation "left" the rollout keeps a long prompt's end; otherwise the loader refuses it up front.
        max_prompt = rollout_cfg.max_prompt_length if rollout_cfg.truncation == "error" else None
        self.loader = PromptLoader(self.train_data, tokenizer, self.batch_size, max_prompt, self.shuffle, self.seed,
                                   images=images)
        self.pad_token_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        self.val_loader = (PromptLoader(self.val_data, tokenizer, min(self.batch_size, len(self.val_data)), max_prompt,
                                        shuffle=False, images=images) if self.val_data is not None else None)
        for name, shape in self.pool_shapes.items():
            if name in self.pools:
                continue
            self.pools[name] = ResourcePool(shape.process_on_nodes, backend=self.backend, ray_address=self.ray_address)
        if "critic" in self.specs:  # a critic on a causal LM: the LM's body and a new value head
            self.specs["critic"] = critic_from_causal_lm(self.specs["critic"], self._work_dir(),
                                                         self.config.critic_ppo.value_head_init)
        for role in [*ROLE_ORDER, *(r for r in self.specs if r not in ROLE_ORDER)]:  # registered roles last
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
                                                  self.pools[self.placement["rollout"]].controller_address(),
                                                  bucket_bytes=self.config.rollout.weight_bucket_bytes)
        self.rollout_client = rollout_client(self.groups["rollout"], self.rollout_link, served, stream)

    def lay_out(self) -> None:
        """Each ``device_map="auto"`` role's layout, the planner's fastest that fits the job's devices
        (``controller.rl.resolve.auto_layout``), written into the config as if the user had set it."""
        self._settled(auto_layout(self.placed_config(), self.specs, self._job_cluster, accelerator_count() > 0))

    def _settled(self, placed, *notes: str | None) -> None:
        """The config as resolved (its placement kept where this assembly keeps it), the roles declared again."""
        self.config = replace(placed, trainer=self.config.trainer)
        self._declare(self.config)
        for note in notes:
            if note:
                print(f"[hybridflow] {note}", file=sys.stderr, flush=True)

    def _job_cluster(self):
        """The job's devices as the planner sees them (``controller.planner.device_map.job_cluster``)."""
        from controller.planner.device_map import job_cluster

        shapes = self.declared.used_shapes()
        return job_cluster(sum(s.nodes for s in shapes), self.config.trainer.nproc,
                           sum(s.world_size for s in shapes), device_memory_bytes())

    def placed_config(self):
        """The config with its pools as declared (``register_placement`` included) in ``trainer.placement``."""
        return self.declared.into(self.config)

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

    def shutdown(self) -> None:
        """The rollout client (a served stream's sessions and replicas first), the weights' link, the pools."""
        if self.rollout_client is not None:
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
