"""What one RL iteration asks of each model: the planner's view of a job's config.

``job_workload(config)`` reads the typed config tree (``controller.config.RLConfig``)
and gives the roles that hold a model (actor, critic, reference, reward and
cost models, and registered roles that hold one: the teacher), what each does in a step (generation, forward passes,
updates: sequences, lengths, epochs, optimizer steps) and how it stores
itself (precision, distributed optimizer, recomputation, vocabulary
padding). Models are read from their ``config.json`` only: a directory with
no weights plans as well as a full checkpoint. A reward or cost classifier
that megatron cannot hold (a DeBERTa, say) runs on transformers in its own
worker and is left out of the plan.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from controller.rl.role_registry import reads_old_log_probs, role_engine
from hybridengine.model.spec import ModelConfigError, ModelSpec
from workers.rollout.agreement import old_log_probs_from_update
from workers.rollout.generator import GeneratorTraits, generator_traits

__all__ = ["RoleWork", "SERVING_ROLES", "Workload", "job_workload", "load_spec", "STAGES"]

STAGES = ("generation", "preparation", "training")  # a step's stages, in order (the HybridFlow paper's three)
SERVING_ROLES = ("rollout", "judge")  # roles that generate from a checkpoint of their own (RoleWork.serves)


def load_spec(path: str) -> ModelSpec:
    """A model's spec from its config alone: an HF directory (weights optional) or ``builtin:<name>``."""
    if path.startswith("builtin:"):
        from controller.models.builtin import BUILTIN_MODELS

        key = path.removeprefix("builtin:")
        if key in BUILTIN_MODELS:
            values = BUILTIN_MODELS[key]
            return ModelSpec.from_hf_config({"architectures": ["LlamaForCausalLM"], "model_type": "llama",
                                             "rms_norm_eps": 1e-6, "rope_theta": 10000.0, **values},
                                            f"builtin:{key}")
        raise ValueError(f"{path!r}: the planner reads built-in models {sorted('builtin:' + k for k in BUILTIN_MODELS)} "
                         f"or an HF directory with a config.json")
    from workers.pretrained import resolve_pretrained

    return ModelSpec.from_pretrained(resolve_pretrained(path))


@dataclass(frozen=True)
class RoleWork:
    """One model's part of a step and how its engine stores it."""

    role: str
    spec: ModelSpec  # as the checkpoint says (the engine pads the vocabulary for its TP)
    trains: bool
    precision: str = "bf16"
    distributed_optimizer: bool = False
    recompute: str | None = None
    recompute_num_layers: int = 1
    vocab_multiple: int | None = 128  # make_vocab_size_divisible_by
    forward_passes: int = 0  # forward passes over the step's sequences (log-probs, values, scores)
    epochs: int = 1  # training passes over the step's sequences
    mini_batch: int | None = None  # sequences per optimizer step
    generates: bool = False  # the actor when the rollout follows it, or the rollout on its own pool
    micro_batch: int = 1  # the config's micro_batch_size (what a plan of the config's own layout uses)
    tp: int = 1  # the config's TP / PP / EP / ETP (what the pre-launch check evaluates; the search chooses its own)
    pp: int = 1
    ep: int = 1
    etp: int | None = None
    cp: int = 1  # the config's context parallelism
    packed: bool = False  # its engine packs sequences (pack_sequences)
    lora_rank: int = 0  # LoRA adapters on the frozen base (trained roles); 0: every weight trains
    lora_targets: tuple[str, ...] = ()
    train_vision: bool = False  # a vision-language actor's tower trains (actor.freeze_vision_tower false)
    # A role that generates from a checkpoint of its own, with shapes of its own, to score (a generative judge):
    # its prompt and response tokens at most (None: the policy's rollout)
    prompt_len: int | None = None
    response_len: int | None = None

    def padded(self, tp: int) -> ModelSpec:
        return self.spec.with_padded_vocab(self.vocab_multiple, tp)

    @property
    def serves(self) -> bool:
        """It generates from its own checkpoint on its own layout: a rollout pool, or a generative judge."""
        return self.role in SERVING_ROLES

    def lengths(self, workload: "Workload") -> tuple[int, int]:
        """(prompt, response) tokens at most of what it generates."""
        return (self.prompt_len or workload.prompt_len, self.response_len or workload.response_len)


@dataclass(frozen=True)
class Workload:
    """One step: the sequences, their lengths, the schedule and every role's work."""

    sequences: int  # prompts x samples per prompt
    prompt_len: int
    response_len: int
    roles: tuple[RoleWork, ...]
    mode: str = "sync"  # sync, one_step_off or async: the latter two put the rollout on a pool of its own
    max_num_seqs: int = 256  # sequences one generation engine runs at once at most
    generation_engine: str = "vllm"
    generation_precision: str = "bf16"
    release_training: bool = True  # the actor's training weights are freed while the generation buffer exists
    flash_attention: bool = True  # GPU attention kernels keep no [heads, s, s] scores
    generation_tp: int = 1  # the config's rollout layout
    generation_pp: int = 1
    kv_block_tokens: int = 16  # the generation engine's KV block (vLLM: 16 on GPUs, 128 on its CPU backend)
    # The engine frees its weights between rollouts (vLLM's sleep mode on GPUs) and takes a whole shard each step.
    generation_sleeps: bool = True
    # A LoRA actor's adapters (rank 0: none) and how they reach the generation engine: merge, adapter or auto
    # (the planner's choice, ``Option.lora_sync``).
    lora_rank: int = 0
    lora_targets: tuple[str, ...] = ()
    lora_sync: str = "auto"
    # Phases on disjoint pools run at once (``trainer.overlap``); False: the sequential controller, every phase
    # in turn (``search.critical_path``).
    overlap: bool = True
    # A vision-language policy: the image tokens of a prompt (of prompt_len), each merge_size**2 patches through
    # the vision tower in every pass and in generation's prefill (``vision_image_tokens``)
    image_tokens: int = 0

    @property
    def seq_len(self) -> int:
        return self.prompt_len + self.response_len

    def role(self, name: str) -> RoleWork:
        for work in self.roles:
            if work.role == name:
                return work
        raise KeyError(f"the job has no {name!r} role; it has {[w.role for w in self.roles]}")

    def lora_modes(self) -> tuple[str | None, ...]:
        """How the adapters may reach the generation engine: (None,) without LoRA, the mode set, or for
        ``auto`` both where the engine can serve adapters (vLLM) and merging only elsewhere."""
        if not self.lora_rank:
            return (None,)
        if self.lora_sync != "auto":
            return (self.lora_sync,)
        traits = self.generation_traits
        serves = traits.serves_adapters and self.lora_rank <= traits.max_adapter_rank
        return ("merge", "adapter") if serves else ("merge",)

    @property
    def generation_traits(self) -> GeneratorTraits:
        """What the generation engine can do (its registered traits)."""
        return generator_traits(self.generation_engine)

    @property
    def role_names(self) -> tuple[str, ...]:
        return tuple(w.role for w in self.roles)


def vision_image_tokens(spec: ModelSpec, model_path: str, prompt_len: int) -> int:
    """A vision-language prompt's image tokens as planned: one image as large as the checkpoint's image processor
    makes one (its max_pixels), within ``prompt_len``; ``prompt_len`` where there is no preprocessor_config.json
    (a planning-only directory). 0 for a text model."""
    if spec.vision is None:
        return 0
    import json
    from pathlib import Path

    config = Path(model_path) / "preprocessor_config.json"
    if not config.is_file():
        return prompt_len
    values = json.loads(config.read_text())
    size = values.get("size") or {}
    max_pixels = int(size.get("longest_edge") or values.get("max_pixels") or 0)
    side = spec.vision.patch_size * spec.vision.spatial_merge_size
    return min(prompt_len, max_pixels // side ** 2) if max_pixels else prompt_len


def job_workload(config, flash_attention: bool = True, load=load_spec) -> Workload:
    """The planner's view of ``config`` (an RLConfig); ``flash_attention`` False: the CPU path (attention keeps
    its scores, and vLLM's CPU backend caches KV in 128-token blocks)."""
    alg, rollout, trainer = config.algorithm, config.rollout, config.trainer
    sequences = config.data.batch_size * rollout.sampling.n
    policy = load(config.actor.model_path or config.model_path)
    separate_rollout = trainer.mode != "sync" or "rollout" in trainer.placement
    from_update = old_log_probs_from_update(alg.old_log_prob_source, config.ppo.ppo_epochs,
                                            config.ppo.ppo_mini_batch_size, sequences,
                                            read_before_update=reads_old_log_probs(config)
                                            ) and not rollout.serves_agent  # its batch may outgrow a mini-batch
    recompute_old = alg.old_log_prob_source != "rollout" and not from_update  # the actor's separate forward

    def engine_fields(section, trains: bool = False, eng=None) -> dict:
        eng = eng or section.engine
        lora = dict(lora_rank=section.lora.rank, lora_targets=section.lora.targets) if trains and section.lora.enabled else {}
        return dict(precision=eng.precision, recompute=eng.recompute_granularity,
                    recompute_num_layers=eng.recompute_num_layers, vocab_multiple=eng.make_vocab_size_divisible_by,
                    micro_batch=eng.micro_batch_size, tp=eng.tensor_parallel, pp=eng.pipeline_parallel,
                    ep=eng.expert_parallel, etp=eng.expert_tensor_parallel, cp=eng.context_parallel,
                    packed=eng.pack_sequences, **lora)

    needs_ref = alg.use_reference if alg.use_reference is not None else (
        alg.kl_in_reward or config.ppo.use_kl_loss or alg.kl_loss_fn is not None)
    # A LoRA actor is its own reference (its base, the adapters off): one more forward pass, no second model.
    ref_in_actor = needs_ref and config.ref_policy is None and config.actor.lora.enabled
    roles = [RoleWork("actor", policy, trains=True, distributed_optimizer=config.actor.optim.use_distributed_optimizer,
                      forward_passes=int(recompute_old) + int(ref_in_actor), epochs=config.ppo.ppo_epochs,
                      mini_batch=config.ppo.ppo_mini_batch_size, generates=not separate_rollout,
                      train_vision=policy.vision is not None and not config.actor.freeze_vision_tower,
                      **engine_fields(config.actor, trains=True))]
    if separate_rollout:
        roles.append(RoleWork("rollout", policy, trains=False, generates=True, vocab_multiple=None))
    if alg.needs_critic:
        critic_spec = load(config.critic.model_path) if config.critic.model_path else policy
        if not critic_spec.is_value_model:
            critic_spec = dataclasses.replace(critic_spec, num_labels=1)
        roles.append(RoleWork("critic", critic_spec, trains=True,
                              distributed_optimizer=config.critic.optim.use_distributed_optimizer, forward_passes=1,
                              epochs=config.critic_ppo.ppo_epochs, mini_batch=config.critic_ppo.ppo_mini_batch_size,
                              **engine_fields(config.critic, trains=True)))
    if needs_ref and not ref_in_actor:
        ref = config.ref_policy or config.actor
        spec = load(ref.model_path) if ref.model_path else policy
        roles.append(RoleWork("ref_policy", spec, trains=False, forward_passes=1, **engine_fields(ref)))
    for role, section in (("reward_model", config.reward), ("cost", config.cost_model)):
        if section is not None and section.model_path is not None:
            try:
                spec = load(section.model_path)
            except ModelConfigError:  # a classifier megatron cannot hold runs on transformers: not planned
                continue
            roles.append(RoleWork(role, spec, trains=False, forward_passes=1, **engine_fields(section)))
    judge = config.reward.judge
    if judge is not None:  # a generative judge: it generates verdicts on every sample, in the scoring phase
        try:
            roles.append(RoleWork("judge", load(judge.model_path), trains=False, generates=True, vocab_multiple=None,
                                  precision=judge.precision, tp=judge.tensor_parallel,
                                  prompt_len=judge.max_prompt_length, response_len=judge.max_new_tokens))
        except ModelConfigError:  # a model megatron's spec cannot read: not planned
            pass
    for name, section in config.roles.items():  # registered roles holding a model (the teacher): forward only
        engine = role_engine(config, name)
        if engine is not None:
            roles.append(RoleWork(name, load(section.model_path), trains=False, forward_passes=1,
                                  **engine_fields(section, eng=engine)))
    return Workload(sequences, rollout.max_prompt_length, rollout.max_response_length, tuple(roles), mode=trainer.mode,
                    max_num_seqs=rollout.max_num_seqs, generation_engine=rollout.engine,
                    release_training=rollout.release_training, flash_attention=flash_attention,
                    generation_tp=rollout.tensor_parallel, generation_pp=rollout.pipeline_parallel,
                    kv_block_tokens=16 if flash_attention else generator_traits(rollout.engine).kv_block_tokens_without_flash,
                    generation_sleeps=rollout.sleep_between_rollouts and flash_attention,
                    overlap=trainer.overlap,
                    image_tokens=vision_image_tokens(policy, config.actor.model_path or config.model_path,
                                                     rollout.max_prompt_length),
                    **(dict(lora_rank=config.actor.lora.rank, lora_targets=config.actor.lora.targets,
                            lora_sync=rollout.lora_sync) if config.actor.lora.enabled else {}))
