"""RLTrainer: the RL loop over worker groups, in one screen.

    trainer = RLTrainer(actor=Actor.from_pretrained(path, tensor_parallel=2), reward_fn="arithmetic_shaped",
                        algorithm="ppo", train_data=arithmetic_prompts(512, seed=0), batch_size=16)
    metrics = trainer.step()         # one full PPO step on the real worker groups
    trainer.fit(total_steps=20)

A step's phases: generate (the actor's weights resharded into the rollout at the boundary) and score ->
old and reference log-probs, values -> advantages -> critic update -> actor update -> metrics. Each phase is
declared with what it reads and writes (``controller.rl.step_phases``); those of roles on disjoint pools run
at the same time (``controller.rl.phase_flow``), their results joined in this order. What differs
between algorithms hangs off the algorithm object's hooks (``controller.algorithms.RLAlgorithm``). The job
it runs on (roles, placement, pools, groups, loaders, schedule, rollout client) is its ``JobAssembly``'s.
"""

from __future__ import annotations

import time
from dataclasses import replace
from functools import partial
from pathlib import Path
from typing import Any

from controller.algorithms import StepContext, StepState
from controller.config import RLConfig
from controller.rl.bad_steps import BadSteps
from controller.rl.job_prompts import rl_job_prompts
from controller.rl.job_assembly import JobAssembly
from controller.rl.phase_flow import DRIVER, Phase, PhaseFlow
from controller.rl.step_phases import STEP_PHASES
from controller.rl.role_assembly import reference_role
from controller.rl.role_registry import reads_old_log_probs, role_phase
from controller.rl.role_specs import kl_loss_function
from controller.rl.rollout_dump import RolloutDump
from controller.rl.rollout_source import RolloutSource
from controller.rl.routes import routes_for_actor, without_routes
from controller.rl.schedules import generation_seed
from controller.rl.step_metrics import (actor_update_metrics, batch_metrics, kl_metrics, nothing_to_train, phase_lines,
                                        record_rollout_metrics, reduce_update_metrics, timeline_metrics)
from controller.rl.trainer_checkpoint import TrainerCheckpoint, TrainingState
from controller.rl.trainer_inputs import job_algorithm, trainer_arguments
from controller.rl.validation import validate
from workers.data_proto import DataProto
from workers.data_schema import ROLLOUT_FIELDS, DataSchema
from workers.actor import PolicyUpdateTerms
from workers.rollout.agreement import logprob_agreement, old_log_probs_from_update, use_old_log_probs
from workers.user_kl import UserKLTerm

__all__ = ["RLTrainer"]

# What the trainer reads from its job's assembly (RLTrainer.__getattr__): it keeps no placement state of its own.
_FROM_JOB = frozenset({
    "config", "specs", "policy_path", "placement", "pool_shapes", "pool_sizes", "rollout_on_its_own_pool", "backend",
    "ray_address", "groups", "pools", "loader", "val_loader", "pad_token_id", "schedule", "mode", "rollout_link",
    "rollout_client", "run_dir", "batch_size", "shuffle", "seed", "train_data", "val_data", "watch", "lora_sync_choice",
    "register_placement", "register_parallelism", "build", "check", "placed_config", "lay_out", "calls_at"})


class RLTrainer:
    def __init__(self, config: RLConfig | None = None, /, **keywords: Any) -> None:
        """``RLTrainer(config, train_data=..., algorithm=..., pool=..., logger=...)``: the job a typed config
        describes, with the inputs that are objects (``TrainerInputs``; None: what the config describes). Or
        ``RLTrainer(actor=..., train_data=..., batch_size=..., ...)``, the researcher's keyword form
        (``controller.rl.trainer_builder.config_from_keywords``: ``algorithm``, ``mode``, ``rollout``, ``lr``,
        ``rollout_proto``, ``rollout_data_dir``, ``verbose`` ... as documented there). Every keyword is
        checked now, before any process starts; the checks across fields run at ``build``.
        """
        config, inputs = trainer_arguments(config, keywords)
        train_data, val_data = inputs.train_data, inputs.val_data
        algorithm = job_algorithm(config, inputs.algorithm)
        self.inputs, self.algorithm, self.ppo = inputs, algorithm, config.ppo
        self.kl_loss_fn = kl_loss_function(config.algorithm.kl_loss_fn)  # imported and its signature checked
        self.job = JobAssembly(config, algorithm, train_data, val_data, inputs.pool)  # roles, placement, groups
        if train_data is None:  # the prompts config.data describes, loaded and checked now, as the CLI does
            prompts = rl_job_prompts(config, self.specs["actor"].model_path)
            self.job.train_data, self.job.val_data = prompts.train, prompts.val
        trainer = config.trainer
        self.rollout_proto = DataSchema(dict(trainer.rollout_proto)) if trainer.rollout_proto is not None else None
        if self.rollout_proto is not None:
            self.rollout_proto.check(getattr(self.specs["rollout"].worker_cls, "produces", ROLLOUT_FIELDS))
        self._proto_seen = False
        self.verbose = trainer.log_phases
        self.checkpoints = TrainerCheckpoint(self.run_dir)
        self.logger = inputs.logger
        self.rollout_dump = (RolloutDump(trainer.rollout_data_dir, self.specs["actor"].model_path)
                             if trainer.rollout_data_dir is not None else None)
        self.save_every, self.val_every, self.val_before_train = trainer.save_every, trainer.val_every, trainer.val_before_train
        self.rollout_sampling = sampling = config.rollout.sampling
        self.max_response_length = config.rollout.max_response_length  # a conversation's, for agent rollouts
        self.old_log_probs_from_update = old_log_probs_from_update(
            algorithm.config.old_log_prob_source, self.ppo.ppo_epochs, self.ppo.ppo_mini_batch_size,
            self.batch_size * sampling.n, read_before_update=reads_old_log_probs(config)
        ) and not config.rollout.serves_agent  # a served agent's batch may hold more rows than one mini-batch
        self.global_step = 0
        self.bad_steps = BadSteps(trainer.max_bad_steps)  # steps in a row that skipped an optimizer step
        self.overlap = trainer.overlap  # phases on disjoint Ray pools at the same time (controller.rl.phase_flow)

    def __getattr__(self, name: str) -> Any:
        """What the job's assembly owns (``controller.rl.job_assembly``): the config, roles, placement, pools, groups,
        loaders, schedule, rollout client, and the declarations (``register_placement``, ``build``, ...)."""
        job = self.__dict__.get("job")
        if job is not None and name in _FROM_JOB:
            return getattr(job, name)
        raise AttributeError(f"'RLTrainer' object has no attribute {name!r}")

    # --------------------------------------------------------------------- step
    def step(self, step: int | None = None) -> dict[str, float]:
        """One full RL step on the worker groups; returns its metrics."""
        self.build()
        if step is not None:
            self.global_step = step
        alg, state = self.algorithm, StepState(self.global_step, pools=self.phase_pools())
        batch = self.schedule.rollout(self.rollout_source(), state)  # sync: now; else while earlier steps trained
        ctx = StepContext.of(self)  # what the algorithm's hooks see of this trainer
        batch = alg.after_scoring(ctx, state, batch)  # ReMax's greedy baseline, DAPO's filter and shaping
        batch = self.compute_log_probs(batch, state)  # old (unless the update gives them), reference, values
        with state.timed("adv"):
            batch = alg.advantages(ctx, state, batch)
        terms = alg.loss_terms(ctx, state, batch)  # the policy objective, the rollout correction
        self.update(batch, terms, state)  # the critic's and the actor's (at once where their pools differ)
        alg.after_update(ctx, state, batch)
        return self.finish_step(batch, state)  # metrics, validation, logging, checkpoint

    # ------------------------------------------------------------- phases
    def phase_pools(self) -> dict[str, str]:
        """The pool each phase of the step runs on, as the job places its roles (``"driver"``: the controller)."""
        where = self.placement
        stands_for = {"reference": reference_role(self.specs, self.algorithm.config, self.ppo, self.kl_loss_fn),
                      "scorer": next((r for r in ("reward_model", "reward", "judge") if r in self.specs), "reward")}
        roles = {name: stands_for.get(phase.role, phase.role) for name, phase in STEP_PHASES.items()}
        roles.update({role: role for role, _ in self.calls_at("log_probs")})  # a registered role's phase: its name
        return {name: DRIVER if role is None else where[role] for name, role in roles.items()
                if role is None or role in where}

    def phase_flow(self) -> PhaseFlow:
        """Runs a stage's phases: at the same time on disjoint pools, where the pools are Ray's (under torchrun
        every megatron role spans the world, so its phases take turns as before)."""
        return PhaseFlow(overlap=self.overlap and all(p.backend == "ray" for p in self.pools.values()))

    def rollout_source(self) -> RolloutSource:
        """What the schedule sees of this trainer for the current step."""
        link = self.rollout_link
        return RolloutSource(
            version=self.global_step, seed=self.seed, batch_size=self.batch_size, sampling=self.rollout_sampling,
            pad_token_id=self.pad_token_id, next_prompts=self.next_prompts, generate_and_score=self.generate_and_score,
            score=self.score, submit=self.rollout_client.submit,
            sync_weights=link.sync if link is not None else lambda receive=None: {},
            record_rollout_metrics=record_rollout_metrics)

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
            record_rollout_metrics(state, metrics)
        return out

    def score(self, batch: DataProto) -> DataProto:
        """``token_level_scores`` and ``scores`` of each response, and what the other scoring roles add (a generative
        judge's, Safe-RLHF's cost)."""
        scores = None  # a generative judge alone scores in its call below
        if "reward_model" in self.groups:
            out = self.groups["reward_model"].compute_rm_score(batch)
            key = self.specs["reward_model"].kwargs.get("score_key", "rm_scores")
            scores = DataProto({"token_level_scores": out.batch["token_level_scores"], "scores": out.batch[key]})
        elif "reward" in self.groups:
            out = self.groups["reward"].compute_reward(batch)
            scores = out.select([k for k in ("token_level_scores", "scores", "reward_timed_out") if k in out.batch])
        for role, call in self.calls_at("score"):  # the judge, the algorithm's roles (Safe-RLHF's cost), registered
            scores = call(self.groups[role], batch, scores)
        return scores

    def compute_log_probs(self, batch: DataProto, state: StepState) -> DataProto:
        """Old log-probs (skipped when the update's own forward gives them), reference log-probs, values: each
        on its role's pool, at the same time where the pools differ."""
        g, source = self.groups, self.algorithm.config.old_log_prob_source
        batch = routes_for_actor(batch, self.algorithm.config.router_replay)  # a mixture of experts' routes
        reference = reference_role(self.specs, self.algorithm.config, self.ppo, self.kl_loss_fn)
        scored = without_routes(batch)
        phases = []
        if not self.old_log_probs_from_update:  # on-policy, the update's own forward gives them, detached
            phases.append(self.phase("old_log_prob", lambda: g["actor"].compute_log_prob(batch), state))
        if reference is not None:  # the reference policy, or a LoRA actor's base (its adapters off)
            phases.append(self.phase("ref", lambda: g[reference].compute_ref_log_prob(scored), state))
        if "critic" in g:
            phases.append(self.phase("values", lambda: g["critic"].compute_values(scored), state))
        registered = self.calls_at("log_probs")  # registered roles beside them: the teacher
        phases += [self.phase(role, partial(call, g[role], scored), state) for role, call in registered]
        out = self.phase_flow().run(phases, state, ready=("responses", "scores"))
        if "old_log_prob" in out:  # joined in this order whichever phase ended first
            old = out["old_log_prob"]
            state.metrics.update(old.meta_info.pop("router_replay", {}))  # router_replay/agreement
            batch = batch.union(old)
            state.metrics.update(logprob_agreement(batch.batch["rollout_log_probs"], batch.batch["old_log_probs"],
                                                   batch.batch["response_mask"]))
            batch = use_old_log_probs(batch, source)
        for name in ("ref", "values", *(role for role, _ in registered)):
            if name in out:
                batch = batch.union(out[name])
        return batch

    def update(self, batch: DataProto, terms: PolicyUpdateTerms, state: StepState) -> None:
        """The critic's PPO update and the actor's with the algorithm's ``terms``, at the same time where their
        pools differ; their metrics go into ``state.metrics``."""
        g = self.groups
        empty = nothing_to_train(state.step + 1, batch, state.rollout_metrics)
        if empty is not None:  # an update over no token gives NaNs and says nothing of why
            print(f"[hybridflow] {empty}", flush=True)
            state.metrics["training/nothing_to_train"] = 1.0
            return
        if self.kl_loss_fn is not None:  # the user's term, called with this step
            terms = replace(terms, user_kl=UserKLTerm(self.kl_loss_fn, self.global_step))
        from_update = self.old_log_probs_from_update
        phases = [self.phase("update_actor", lambda: g["actor"].update_actor(batch, terms, from_update), state)]
        if "critic" in g:
            critic = self.phase("update_critic", lambda: g["critic"].update_critic(without_routes(batch)), state)
            phases.insert(0, critic)
        with state.timed("update"):  # both updates' wall time
            out = self.phase_flow().run(phases, state, ready=("advantages", "returns"))
        if "update_critic" in out:
            state.metrics.update(reduce_update_metrics(out["update_critic"]))
        if self.rollout_link is not None:
            self.rollout_link.mark_stale()
        metrics = actor_update_metrics(reduce_update_metrics(out["update_actor"]), self.old_log_probs_from_update)
        metrics.update(kl_metrics(metrics, user_fn=self.kl_loss_fn is not None, ppo=self.ppo,
                                  reward_beta=self.algorithm.kl_ctrl.value if self.algorithm.config.kl_in_reward else None))
        state.metrics.update(metrics)
        # A role that skipped its optimizer step (a NaN or Inf loss or gradient) is said and counted;
        # trainer.max_bad_steps of them in a row stop the run, naming the first.
        skipped = [role for role in ("critic", "actor") if state.metrics.get(f"{role}/skipped", 0.0) > 0]
        in_row = self.bad_steps.count(state.step + 1, skipped)  # as the console and the metrics number it
        if in_row is not None:
            state.metrics["training/bad_steps_in_row"] = in_row

    def phase(self, name: str, run, state: StepState) -> Phase:
        """Phase ``name`` of the step, as ``STEP_PHASES`` declares it, on its role's pool (``state.pools``, the
        step's ``phase_pools``)."""
        declared = STEP_PHASES[name] if name in STEP_PHASES else role_phase(name)
        return Phase(name, state.pools[name], run, reads=declared.reads, writes=declared.writes)

    def finish_step(self, batch: DataProto, state: StepState) -> dict[str, float]:
        """The step's metrics; then validation, logging and the checkpoint where they are due."""
        state.timing["step"] = time.perf_counter() - state.start
        metrics = {**batch_metrics(batch), **state.metrics, **state.rollout_metrics}
        metrics.update({f"timing_s/{k}": v for k, v in state.timing.items()})
        metrics.update(timeline_metrics(state.phases, state.timing["step"], set(self.placement.values())))
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
        """Greedy responses to every held-out prompt: mean reward and response length (``rl.validation``)."""
        self.build()
        return {} if self.val_loader is None else validate(self.rollout_client, self.val_loader, self.score,
                                                           self.global_step)

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

    def save_checkpoint(self) -> Path:
        """The actor (and critic), then the trainer's own state last: the commit point of the step."""
        return self.checkpoints.save(self._state())

    def resume(self) -> int:
        """Continue from the newest complete checkpoint under run_dir; returns its step (0: none)."""
        self.build()
        step = self.checkpoints.resume(self._state())
        self.global_step = step or self.global_step
        if self.rollout_link is not None:
            self.rollout_link.mark_stale()
        return step

    def _state(self) -> TrainingState:  # what a checkpoint holds of the run
        return TrainingState(self.global_step, self.groups, self.loader, self.schedule, self.algorithm, self.bad_steps)

    def export_hf(self, path: str | Path, precision: str | None = None) -> Path:
        """The actor's weights and the tokenizer as an HF checkpoint, in ``precision`` (None: the actor's)."""
        from transformers import AutoTokenizer

        self.build()
        self.groups["actor"].save_hf(str(path), precision)
        AutoTokenizer.from_pretrained(self.specs["actor"].model_path).save_pretrained(str(path))
        return Path(path)

    def export_peft(self, path: str | Path) -> Path:
        """A LoRA actor's adapters as a PEFT adapter directory (``export_hf`` writes them merged)."""
        self.build()
        self.groups["actor"].save_peft(str(path))
        return Path(path)

    def shutdown(self) -> None:
        """The job's rollout client, weights' link and pools (``JobAssembly.shutdown``)."""
        self.job.shutdown()
