"""On-policy distillation (``algorithm.name: opd``): the student samples, a teacher scores every sampled token,
and each token's advantage is the negative reverse KL on it.

    A_t = log pi_teacher(y_t | y_<t) - log pi_student(y_t | y_<t)  +  reward_weight * A_t(task)

The student's log-probs are the old ones (the policy that sampled, before the update), the teacher's come from the
``teacher`` role (``controller.rl.teacher``). Each token's term is its own (no discounting over later tokens, as
Agarwal et al. 2024 and Thinking Machines' on-policy distillation use it): a token the teacher finds likelier than
the student is pushed up, one it finds unlikely is pushed down, and the sampled estimate of KL(student || teacher)
is the step's ``actor/opd/reverse_kl``. ``reward_weight`` (default 0: pure distillation) adds the task reward's
advantages from the preset's estimator (GRPO's group baseline; ``algorithm.advantage_estimator`` chooses another).
The policy loss, clipping, aggregation and rollout correction are the job's, as for any algorithm.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from controller.algorithms.algorithm import RLAlgorithm, StepState, register_algorithm
from controller.algorithms.presets import AlgorithmPreset
from workers.data_proto import DataProto
from workers.policy_losses import zero_padding

__all__ = ["OPD", "OPD_PRESET", "distillation_advantages"]

OPD_PRESET = AlgorithmPreset("grpo", paper="Agarwal et al. 2024 (GKD), arXiv:2306.13649; Lu & Thinking Machines "
                                           "2025, On-Policy Distillation")


def distillation_advantages(teacher_log_probs: torch.Tensor, student_log_probs: torch.Tensor,
                            response_mask: torch.Tensor) -> torch.Tensor:
    """Each response token's ``log pi_teacher - log pi_student`` ([B, R]), 0 past each response."""
    mask = response_mask.to(torch.float32)
    return zero_padding(teacher_log_probs.float() - student_log_probs.float(), mask) * mask


@register_algorithm("opd", preset=OPD_PRESET)
class OPD(RLAlgorithm):
    reads_teacher = True

    @dataclass(frozen=True)
    class Config:
        # algorithm.reward_weight: the task reward's advantages (the estimator's) added at this weight; 0: none
        reward_weight: float = 0.0

        def __post_init__(self) -> None:
            value = self.reward_weight
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
                raise ValueError(f"reward_weight must be a finite number >= 0, got {value!r}")

    def advantages(self, ctx, state: StepState, batch: DataProto) -> DataProto:
        b = batch.batch
        distill = distillation_advantages(b["teacher_log_probs"], b["old_log_probs"], b["response_mask"])
        weight = self.settings.reward_weight
        if not weight:  # pure distillation: the reverse KL is each token's reward and advantage
            b.update({"token_level_rewards": distill, "advantages": distill, "returns": distill})
            return batch
        batch = super().advantages(ctx, state, batch)  # the task reward's (KL penalty in the reward included)
        b = batch.batch
        b.update({"token_level_rewards": distill + weight * b["token_level_rewards"],
                  "advantages": distill + weight * b["advantages"]})
        return batch
