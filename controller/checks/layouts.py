"""Layouts: each megatron role's grid over its pool, its mini-batches, the model split it asks for, and the
generation layout the actor's weights are resharded into (colocated or across pools)."""

from __future__ import annotations

from typing import Any

from controller.checks.facts import JobFacts

__all__ = ["layout_problems", "model_split_problem", "response_limit", "sequence_layout_problem"]


def layout_problems(job: JobFacts) -> list[str]:
    """Each role's grid (colocated roles may differ in TP/PP), then the generation layout from the actor's."""
    problems, actor_layout = _role_layouts(job)
    problems += _generation_layout(job, actor_layout)
    config, spec = job.config, job.model_spec
    if spec is not None and config.rollout.max_model_len > spec.max_position_embeddings:
        rollout = config.rollout
        problems.append(f"rollout: max_prompt_length {rollout.max_prompt_length} + {response_limit(rollout)} "
                        f"{rollout.max_response_length} = {rollout.max_model_len} exceeds the model's "
                        f"max_position_embeddings {spec.max_position_embeddings}")
    return problems


def _roles(job: JobFacts) -> list[tuple[str, str, Any, int | None]]:
    """(key, role, engine section, PPO mini-batch or None) of each megatron role."""
    config = job.config
    roles = [("actor", "actor", config.actor.engine, config.ppo.ppo_mini_batch_size)]
    if job.needs_critic:
        roles.append(("critic", "critic", config.critic.engine, config.critic_ppo.ppo_mini_batch_size))
    if config.reward.model_path is not None:
        roles.append(("reward.engine", "reward_model", config.reward.engine, None))  # forward only: no mini-batches
    from controller.rl.role_registry import role_engine

    for name in config.roles:  # registered roles holding a model (the teacher): forward only
        engine = role_engine(config, name)
        if engine is not None:
            roles.append((f"{name}.engine", name, engine, None))
    return roles


def _role_layouts(job: JobFacts):
    """The problems of each role's grid, and the actor's layout (None where it has none)."""

    config, pools, problems, actor_layout = job.config, job.pools, [], None
    trainer, data, n = config.trainer, config.data, config.rollout.sampling.n
    for key, role, eng, mini in _roles(job):
        mp = eng.tensor_parallel * eng.pipeline_parallel
        if role not in pools and "default" not in pools:
            continue
        world = pools.get(role, pools.get("default")).world_size
        where = (f"trainer.placement.{role}" if role in trainer.placement else "trainer.nproc" if trainer.nnodes == 1
                 else f"trainer.nnodes x nproc = {trainer.nnodes} x {trainer.nproc} =")
        if world % mp:
            problems.append(f"{key}: tensor_parallel x pipeline_parallel = {mp} does not divide {where} {world}")
            continue
        try:
            layout = eng.layout(world)
        except ValueError as exc:
            problems.append(f"{key}: {exc}")
            continue
        spec = job.role_specs.get(key)
        if problem := sequence_layout_problem(key, spec, eng):
            problems.append(problem)
        if role == "actor":
            actor_layout = layout
        if spec is not None and (problem := model_split_problem(key, spec, eng)):
            problems.append(problem)
        if mini is not None:
            problems += _mini_batch_problems(job, role, eng, mini, layout, data.batch_size * n)
    return problems, actor_layout


def _mini_batch_problems(job: JobFacts, role: str, eng, mini: int, layout, sequences: int) -> list[str]:
    data, rollout, problems = job.config.data, job.config.rollout, []
    if sequences % mini:
        problems.append(f"{role}: a step's {sequences} sequences (data.batch_size {data.batch_size} x n "
                        f"{rollout.sampling.n}) do not divide into PPO mini-batches of {mini}")
    elif mini % layout.data_replicas:
        problems.append(f"{role}: ppo_mini_batch_size {mini} does not divide over {layout.data_replicas} "
                        "data-parallel ranks")
    elif (mini // layout.data_replicas) % eng.micro_batch_multiple:
        problems.append(f"{role}: a mini-batch gives each DP rank {mini // layout.data_replicas} sequences, not a "
                        f"multiple of micro_batch_size {eng.micro_batch_size}")
    longest = rollout.max_model_len
    if eng.max_tokens_per_micro_batch is not None and eng.max_tokens_per_micro_batch * eng.context_parallel < longest:
        per_rank = -(-longest // eng.context_parallel)
        cp = f" x context_parallel {eng.context_parallel}" if eng.context_parallel > 1 else ""
        problems.append(f"{role}: engine.max_tokens_per_micro_batch {eng.max_tokens_per_micro_batch}{cp} is below "
                        f"the longest sequence, rollout.max_prompt_length + {response_limit(rollout)} = {longest}; "
                        f"raise it to {per_rank} or more")
    return problems


def _generation_layout(job: JobFacts, actor_layout) -> list[str]:
    """The actor's weights resharded into the rollout's layout: on its own pool, or colocated."""
    from hybridengine.cross_pool.plan import plan_cross_pool
    from hybridengine.reshard.expert_group import check_expert_split
    from hybridengine.reshard.plan import GenerationLayout, ReshardLayoutError, plan_reshard
    from hybridengine.reshard.weight_plan import plan_weights, refuse_routed_experts
    from workers.rollout.generator import generator_traits

    if actor_layout is None:
        return []
    config, spec, pools, rollout = job.config, job.model_spec, job.pools, job.config.rollout
    traits = generator_traits(rollout.engine, strict=False)
    gen = GenerationLayout(rollout.tensor_parallel, rollout.pipeline_parallel, rollout.expert_parallel)
    if "rollout" in pools:  # its own pool, fed across pools by the actor
        world, mp = pools["rollout"].world_size, gen.tensor_parallel * gen.pipeline_parallel
        if world % mp:
            return [f"rollout: tensor_parallel x pipeline_parallel = {mp} does not divide trainer.placement.rollout "
                    f"{world}"]
        try:
            plan_cross_pool(actor_layout, gen, world // mp)
            if spec is not None and spec.moe is not None:
                check_expert_split(spec, gen)
                refuse_routed_experts(spec, rollout.engine, gen, traits.experts_at_tensor_parallel)
        except ReshardLayoutError as exc:
            return [f"rollout: {exc}"]
        return []
    try:
        if spec is None:
            plan_reshard(actor_layout, gen)
        else:  # the actor's shards, padded as its engine pads them, planned into the generation layout
            actor = config.actor.engine
            plan_weights(spec.with_padded_vocab(actor.make_vocab_size_divisible_by, actor.tensor_parallel),
                         actor_layout, gen)
            refuse_routed_experts(spec, rollout.engine, gen, traits.experts_at_tensor_parallel)
    except ValueError as exc:  # ReshardLayoutError, or a split the model's heads do not allow
        return [f"rollout: {exc}"]
    return []


def response_limit(rollout) -> str:
    """The key that bounds a response: one reply's max_new_tokens, or a whole conversation's."""
    return "agent.max_response_length" if rollout.agent is not None else "max_new_tokens"


def sequence_layout_problem(key: str, spec: Any, engine) -> str | None:
    """Why ``engine``'s context parallelism or packed sequences cannot run the role ``key`` or its model (its
    ``ModelSpec``, None where unread); None when they can."""
    from workers.megatron.preflight import check_sequence_layout

    if key == "reward.engine" and engine.packed:
        return (f"{key}: a reward model scores padded rows: context_parallel and pack_sequences are for the actor, "
                "critic and reference")
    try:
        check_sequence_layout(spec, engine)
    except ValueError as exc:
        return f"{key}: {exc}"
    return None


def model_split_problem(key: str, spec: Any, engine) -> str | None:
    """Why the model (its ``ModelSpec``) cannot be split as ``engine`` says, its vocabulary padded for
    the TP size; None when it can. ``key`` names the role in the message."""
    try:
        padded = spec.with_padded_vocab(engine.make_vocab_size_divisible_by, engine.tensor_parallel)
        padded.check_layout(engine.tensor_parallel, engine.pipeline_parallel, engine.expert_parallel,
                            engine.expert_tensor_parallel)
    except ValueError as exc:
        return f"{key}: {exc}"
    return None
