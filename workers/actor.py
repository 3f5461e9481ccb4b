"""Actor and ReferencePolicy: thin roles over the megatron training engine.

The actor computes log-probs and takes PPO steps; the reference policy only
computes log-probs and holds no optimizer. Both use MESH_COMPUTE_PROTO: each
data-parallel replica gets its share of the batch, every TP/PP rank of the
replica sees the same share, and TP rank 0 of the last stage answers.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from functools import partial
from typing import Any

import torch

from hybridengine.reshard.plan import GenerationLayout
from workers.data_proto import DataProto
from workers.dispatch import Dispatch
from workers.megatron.config import EngineConfig, OptimConfig
from workers.megatron.micro_batches import MicroBatch
from workers.megatron.engine_role import EngineRole
from workers.megatron.lora import LoRAConfig
from workers.megatron.hybrid_bridge import HybridBridge
from workers.megatron.ppo_update import run_ppo_epochs, token_share
from workers.megatron.token_outputs import response_log_probs
from workers.policy_losses import (
    KL_ESTIMATOR_NAMES,
    LOSS_AGG_MODES,
    POLICY_LOSSES,
    LossNormalizer,
    PolicyLossSpec,
    agg_loss,
    compute_policy_loss,
    kl_loss,
    masked_mean,
    zero_padding,
)
from workers.register import register
from workers.rollout import agreement
from workers.rollout_correction import RolloutCorrection, correction_metrics, correction_weights
from workers.user_kl import UserKLTerm

__all__ = ["Actor", "ReferencePolicy", "PPOActorConfig", "PolicyUpdateTerms"]


@dataclass(frozen=True)
class PPOActorConfig:
    """The actor's update. The objective's fields left None take the algorithm's defaults
    (controller.algorithms.presets; an Actor used on its own: PPO's, 0.2 / 0.2 and the token mean)."""

    ppo_mini_batch_size: int = 8  # sequences per optimizer step, over all DP ranks
    ppo_epochs: int = 1  # passes over each step's batch, each split into mini-batches
    shuffle: bool = True  # reshuffle the batch before each epoch's split (seeded from engine.seed)
    policy_loss: str | None = None  # one of POLICY_LOSSES
    clip_ratio_low: float | None = None  # the ratio's lower clip, 1 - clip_ratio_low; None: the algorithm's
    clip_ratio_high: float | None = None  # the ratio's upper clip, 1 + clip_ratio_high; None: the algorithm's
    clip_ratio_c: float | None = 3.0  # PPO's dual clip; None turns it off
    entropy_coeff: float = 0.0  # weight of the entropy bonus (subtracted from the loss); 0: none
    # a KL(actor || reference) term in the loss, read from a reference policy; algorithm.kl_in_reward puts
    # the KL in the reward instead
    use_kl_loss: bool = False
    kl_loss_coef: float = 0.001  # the weight of that KL term
    # its per-token estimator: k1, k2 or k3 (or kl, mse, low_var_kl); a "+" (k3+) keeps the value and takes
    # k2's gradient, whose expectation is the KL's (workers.policy_losses.kl_estimator)
    kl_loss_type: str = "k3"
    loss_agg_mode: str | None = None  # one of LOSS_AGG_MODES

    def __post_init__(self) -> None:
        if self.loss_agg_mode is not None and self.loss_agg_mode not in LOSS_AGG_MODES:
            raise ValueError(f"loss_agg_mode {self.loss_agg_mode!r} is not one of {LOSS_AGG_MODES}")
        if self.kl_loss_type not in KL_ESTIMATOR_NAMES:
            raise ValueError(f"kl_loss_type {self.kl_loss_type!r} is not one of {KL_ESTIMATOR_NAMES}")
        if self.policy_loss is not None and self.policy_loss not in POLICY_LOSSES:
            raise ValueError(f"policy_loss {self.policy_loss!r} is not one of {POLICY_LOSSES}")
        if self.ppo_mini_batch_size < 1 or self.ppo_epochs < 1:
            raise ValueError(
                f"ppo_mini_batch_size ({self.ppo_mini_batch_size}) and ppo_epochs ({self.ppo_epochs}) must be >= 1"
            )

    def policy_loss_spec(self, default: PolicyLossSpec | None = None) -> PolicyLossSpec:
        """The objective: the fields set here, ``default``'s (an algorithm's; None: PPO's) for those left None.

        ``clip_ratio_c`` is always this config's."""
        default = default or PolicyLossSpec()
        return PolicyLossSpec(
            kind=self.policy_loss or default.kind,
            clip_ratio_low=default.clip_ratio_low if self.clip_ratio_low is None else self.clip_ratio_low,
            clip_ratio_high=default.clip_ratio_high if self.clip_ratio_high is None else self.clip_ratio_high,
            clip_ratio_c=self.clip_ratio_c, agg_mode=self.loss_agg_mode or default.agg_mode)


@dataclass(frozen=True)
class PolicyUpdateTerms:
    """What the trainer's algorithm sets for one update (``update_actor(data, terms)``).

    ``norm_length``: the constant of the ``seq-mean-token-sum-norm`` aggregation (the maximum
    response length). ``rollout_correction``: importance weights between the rollout engine's
    log-probs and the old log-probs, applied to the policy loss (workers.rollout_correction).
    ``user_kl``: the user's own KL term (workers.user_kl), in place of ``ppo.use_kl_loss``'s.
    ``teacher_kl_coef``: the weight of KL(actor || teacher) in the loss, by ``ppo.kl_loss_type``, read from the
    batch's ``teacher_log_probs`` (0: none).
    """

    policy_loss: PolicyLossSpec
    rollout_correction: RolloutCorrection = field(default_factory=RolloutCorrection)
    norm_length: int | None = None
    user_kl: UserKLTerm | None = None
    teacher_kl_coef: float = 0.0


class _LogProbRole(EngineRole):
    """Shared by the actor and the reference policy: log-probs of response tokens."""

    def _build_engine(self, model_path: str, engine, optim, value_model: bool = False, lora=None,
                      freeze_vision_tower: bool = True) -> None:
        super()._build_engine(model_path, engine, optim, value_model, lora, freeze_vision_tower)
        if self.engine.config.fused_output_layer:
            self.engine.defer_output_layer()

    def _log_probs(self, data: DataProto, temperature: float | None = None) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Log-probs and entropies of the response tokens at ``temperature`` (None: the batch's sampling one)."""
        if temperature is None:
            temperature = float(data.meta_info.get("temperature", 1.0))

        def step(mb: MicroBatch, output: torch.Tensor):
            log_prob, entropy = response_log_probs(self.engine, mb, output, temperature)
            # A forward-only pass's loss is zero, on the output's device: megatron takes the MoE aux-loss
            # scale's device from it, and keeps that scale for the next backward.
            return output.new_zeros(()), {"log_probs": log_prob, "entropy": entropy}

        outputs = self.engine.run(data, step, forward_only=True)
        if not outputs:  # not the last pipeline stage
            return None
        return outputs.rows("log_probs"), outputs.rows("entropy")


class ReferencePolicy(_LogProbRole):
    def __init__(self, model_path: str, engine: EngineConfig | None = None) -> None:
        self._build_engine(model_path, engine, optim=None)

    @register(Dispatch.MESH_COMPUTE_PROTO)
    def compute_ref_log_prob(self, data: DataProto) -> DataProto | None:
        result = self._log_probs(data)
        return None if result is None else DataProto({"ref_log_prob": result[0]})


class Actor(_LogProbRole):
    def __init__(
        self,
        model_path: str,
        engine: EngineConfig | None = None,
        optim: OptimConfig | None = None,
        ppo: PPOActorConfig | None = None,
        lora: LoRAConfig | None = None,
        freeze_vision_tower: bool = True,
    ) -> None:
        """Each section typed (a ``RoleSpec`` or ``WorkerGroup`` builds one given as a dict); None: its
        defaults. ``lora``: train LoRA adapters on the frozen base (rank 0 or None: every weight trains).
        ``freeze_vision_tower``: a vision-language model's tower keeps its weights (False: it trains too)."""
        self.ppo = ppo or PPOActorConfig()
        self._build_engine(model_path, engine, optim or OptimConfig(), lora=lora,
                           freeze_vision_tower=freeze_vision_tower)
        self.hybrid = HybridBridge(self.engine)

    @register(Dispatch.MESH_COMPUTE_PROTO)
    def compute_log_prob(self, data: DataProto) -> DataProto | None:
        """Old log-probs and entropies of the response tokens. A mixture of experts' batch with routes (replayed
        ``routed_experts``, or the rollout's ``rollout_routed_experts`` to compare with) also gives how often
        the routers' own top-k agreed with them: ``meta_info["router_replay"]["router_replay/agreement"]`` (a
        key of its own, so the output unions with a rollout batch's ``meta_info["metrics"]``)."""
        result = self._log_probs(data)
        replay = self.engine.replay_metrics()  # collective: every rank, before the stages part
        if result is None:
            return None
        return DataProto({"old_log_probs": result[0], "entropys": result[1]}, meta_info={"router_replay": replay} if replay else {})

    @register(Dispatch.MESH_COMPUTE_PROTO)
    def compute_ref_log_prob(self, data: DataProto) -> DataProto | None:
        """The reference policy's log-probs from this LoRA actor: its frozen base with the adapters off, so
        no second model is held. Without adapters the actor is not the reference: refused."""
        if not self.engine.adapters:
            raise ValueError("compute_ref_log_prob on an actor needs LoRA adapters (its base is the reference); "
                             "a fully trained actor's reference is a ReferencePolicy of its own")
        with self.engine.base_model():
            result = self._log_probs(data)
        return None if result is None else DataProto({"ref_log_prob": result[0]})

    @register(Dispatch.MESH_COMPUTE_PROTO)
    def update_actor(self, data: DataProto, terms: PolicyUpdateTerms | None = None,
                     old_log_probs_from_update: bool = False) -> dict[str, Any]:
        """PPO epochs over mini-batches of ``data``; one optimizer step per mini-batch.

        ``terms`` (set by the trainer's algorithm): the policy objective, the rollout correction and the
        user's KL term; None: this actor's ``ppo`` config with PPO's defaults. With reference log-probs in
        the batch, ``actor/kl_div`` is the token mean of log pi - log ref over the update.
        ``old_log_probs_from_update``: the batch holds no old log-probs; the update is a single optimizer
        step, so its own forward, detached, is the old policy (the ratio is 1 with the gradient of the
        recompute path), and the rollout/train agreement on the sampled tokens comes back as
        ``actor/rollout_logprob_diff_mean`` and ``..._max``.
        """
        ppo = self.ppo
        if terms is not None and not isinstance(terms, PolicyUpdateTerms):
            raise TypeError(f"update_actor(terms=...) takes PolicyUpdateTerms, got {type(terms).__name__}")
        terms = terms or PolicyUpdateTerms(ppo.policy_loss_spec())
        temperature = float(data.meta_info.get("temperature", 1.0))
        from_update = bool(old_log_probs_from_update)
        sequences = len(data) * self.engine.grid.data_replicas
        if from_update and not agreement.old_log_probs_from_update(
                "auto", ppo.ppo_epochs, ppo.ppo_mini_batch_size, sequences, read_before_update=False):
            raise ValueError(
                f"old log-probs from the update need a single optimizer step: ppo_epochs 1 (got {ppo.ppo_epochs}) and "
                f"the {sequences} sequences in one mini-batch (ppo_mini_batch_size "
                f"{ppo.ppo_mini_batch_size}); recompute them with compute_log_prob instead")
        metrics = run_ppo_epochs(
            self.engine, data, ppo.ppo_mini_batch_size, ppo.ppo_epochs, ppo.shuffle,
            seed=self.engine.config.seed + self.update_count,
            make_step=lambda normalizer: partial(
                self._ppo_loss, terms=terms, temperature=temperature, from_update=from_update,
                normalizer=replace(normalizer, norm_length=terms.norm_length)),
            prefix="actor",
        )
        self.update_count += 1
        return metrics

    @register(Dispatch.MESH_COMPUTE_PROTO)
    def sft_step(self, data: DataProto) -> dict[str, Any]:
        """One supervised step on ``data`` (prompt | response rows, as a rollout hands them over): the
        token mean of -log p(response token) over ``response_mask``, over every row of every DP rank, one
        optimizer step. Metrics ``sft/loss``, ``sft/grad_norm``, ``sft/lr`` (one value each)."""
        sequences = len(data) * self.engine.grid.data_replicas
        metrics = run_ppo_epochs(self.engine, data, sequences, epochs=1, shuffle=False, seed=0,
                                 make_step=lambda normalizer: partial(self._sft_loss, normalizer=normalizer),
                                 prefix="sft")
        self.update_count += 1
        return metrics

    @register(Dispatch.MESH_COMPUTE_PROTO)
    def sft_eval(self, data: DataProto) -> DataProto | None:
        """Per row: the summed negative log-likelihood of its response tokens and their count (forward
        only), so that any set of rows gives its token-mean loss as sum / sum."""
        def step(mb: MicroBatch, output: torch.Tensor):
            log_prob, _ = response_log_probs(self.engine, mb, output, 1.0)
            mask = mb["response_mask"].to(log_prob.dtype)
            return output.new_zeros(()), {"nll_sum": -(log_prob * mask).sum(-1), "tokens": mask.sum(-1)}

        outputs = self.engine.run(data, step, forward_only=True)
        if not outputs:
            return None
        return DataProto({"nll_sum": outputs.rows("nll_sum"), "tokens": outputs.rows("tokens")})

    def _sft_loss(self, mb: MicroBatch, output: torch.Tensor, *, normalizer: LossNormalizer):
        log_prob, _ = response_log_probs(self.engine, mb, output, 1.0)
        loss = agg_loss(-log_prob, mb["response_mask"], "token-mean", normalizer)
        return loss, {"loss": loss.detach()}

    def weight_source(self) -> HybridBridge:
        """What a colocated rollout takes its weights from (``workers.rollout.weight_sync.WeightSource``)."""
        return self.hybrid

    @register(Dispatch.ONE_TO_ALL)
    def to_generation(
        self, tensor_parallel: int, pipeline_parallel: int = 1, method: str = "micro_dp", release_training: bool = False,
        expert_parallel: bool = False,
    ) -> dict[str, Any]:
        """Reshard the actor's weights into the generation layout (3D-HybridEngine).

        ``release_training``: the training shards free their memory until
        ``to_training`` (micro-DP gather plans), leaving one copy of the weights.
        ``expert_parallel``: a mixture of experts' routed experts whole on each generation TP rank.
        """
        gen = GenerationLayout(tensor_parallel, pipeline_parallel, expert_parallel)
        return self.hybrid.to_generation(gen, method, release_training)

    @register(Dispatch.ONE_TO_ALL)
    def connect_generation_pool(self, host: str, port: int, tensor_parallel: int, pipeline_parallel: int,
                                gen_dp: int, method: str = "auto", bucket_bytes: int = 256 << 20) -> dict[str, Any]:
        """Join the weight link to a rollout on a pool of its own (the controller calls the rollout's side at once);
        ``bucket_bytes``: the rollout's ``weight_bucket_bytes``."""
        return self.hybrid.connect_generation_pool(host, port, GenerationLayout(tensor_parallel, pipeline_parallel),
                                                   gen_dp, method, bucket_bytes=bucket_bytes)

    @register(Dispatch.ONE_TO_ALL)
    def disconnect_generation_pool(self) -> None:
        """Drop the weight link (with the rollout's side, at the same time)."""
        if self.hybrid.cross_pool is not None:
            self.hybrid.cross_pool.close()
            self.hybrid.cross_pool = None

    @register(Dispatch.ONE_TO_ALL)
    def send_weights(self) -> dict[str, float]:
        """The current weights to the separate rollout pool, each generation rank exactly its shard."""
        return self.hybrid.send_to_generation_pool()

    @register(Dispatch.ONE_TO_ALL)
    def to_training(self, offload: bool = False) -> dict[str, float]:
        """Drop the generation weights; the training shards were never moved."""
        return self.hybrid.to_training(offload)

    @register(Dispatch.ONE_TO_ALL)
    def generation_weights(self) -> dict[str, torch.Tensor]:
        """This rank's current generation shard (megatron names local to its generation stage)."""
        return {name: tensor.clone() for name, tensor in self.hybrid.weights.items()}

    def _ppo_loss(self, mb: MicroBatch, output: torch.Tensor, *, terms: PolicyUpdateTerms, temperature: float,
                  normalizer: LossNormalizer, from_update: bool = False):
        ppo, agg_mode = self.ppo, terms.policy_loss.agg_mode
        mask = mb["response_mask"]
        log_prob, entropy = response_log_probs(self.engine, mb, output, temperature)
        old_log_prob = log_prob.detach() if from_update else mb["old_log_probs"]  # the losses read valid tokens only
        # read here too (the agreement metric below), so its padding, which may hold anything, is zeroed first
        rollout_log_prob = zero_padding(mb["rollout_log_probs"], mask) if "rollout_log_probs" in mb else None
        weights = indicators = None
        if terms.rollout_correction.on and rollout_log_prob is not None:
            weights, indicators = correction_weights(old_log_prob, rollout_log_prob, mask, terms.rollout_correction)
        pg_loss, stats = compute_policy_loss(terms.policy_loss, old_log_prob, log_prob, mb["advantages"], mask,
                                             normalizer, weights)
        # Token means over this micro-batch become shares of the mini-batch's token mean.
        share = token_share(mask, normalizer)
        stats = {key: value * share for key, value in stats.items()}
        if rollout_log_prob is not None:
            mismatch = correction_metrics(old_log_prob, rollout_log_prob, mask, normalizer, weights, indicators)
            stats.update({f"rollout_corr/{key}": value for key, value in mismatch.items()})
        if from_update and rollout_log_prob is not None:
            diff = (rollout_log_prob.float() - log_prob.detach()).abs() * mask
            stats["rollout_logprob_diff_mean"] = masked_mean(diff, mask) * share
            stats["rollout_logprob_diff_max"] = diff.max()
        stats["entropy"] = masked_mean(entropy.detach(), mask) * share
        stats["pg_loss"] = pg_loss.detach()
        loss = pg_loss
        if ppo.entropy_coeff:
            loss = loss - ppo.entropy_coeff * agg_loss(entropy, mask, agg_mode, normalizer)
        if terms.user_kl is not None:  # the user's KL term, weight included
            kl, kl_stats = terms.user_kl(log_prob, mb["ref_log_prob"], mask, agg_mode, normalizer)
            loss = loss + kl
            stats.update(kl_stats)
        elif ppo.use_kl_loss:
            kl = kl_loss(log_prob, mb["ref_log_prob"], mask, ppo.kl_loss_type, agg_mode, normalizer)
            loss = loss + ppo.kl_loss_coef * kl
            stats["kl_loss"] = kl.detach()
        if terms.teacher_kl_coef:  # the teacher as a KL term (controller.rl.teacher)
            kl = kl_loss(log_prob, mb["teacher_log_probs"], mask, ppo.kl_loss_type, agg_mode, normalizer)
            loss = loss + terms.teacher_kl_coef * kl
            stats["teacher_kl_loss"] = kl.detach()
        if "kl_div" not in stats and "ref_log_prob" in mb:  # k1, the document's KL: mean log pi - log ref
            kl_div = zero_padding(log_prob.detach() - mb["ref_log_prob"].to(log_prob.dtype), mask) * mask
            stats["kl_div"] = kl_div.sum() / normalizer.tokens
        return loss, stats
