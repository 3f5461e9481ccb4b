"""The built-in algorithms' defaults: estimator, policy objective, clip ranges, aggregation, paper.

A preset fills what the user leaves unset (``null`` in the config): ``algorithm.name: gspo`` clips at
GSPO's ranges unless ``ppo.clip_ratio_low`` / ``clip_ratio_high`` are given. The README's algorithm
table is this one.
"""

from __future__ import annotations

from dataclasses import dataclass

from workers.policy_losses import PolicyLossSpec

__all__ = ["AlgorithmPreset", "PRESETS"]


@dataclass(frozen=True)
class AlgorithmPreset:
    estimator: str  # a registered advantage estimator (controller.algorithms.advantages)
    policy_loss: str = "ppo"  # one of workers.policy_losses.POLICY_LOSSES
    clip_ratio_low: float = 0.2
    clip_ratio_high: float = 0.2
    loss_agg_mode: str = "token-mean"
    norm_adv_by_std: bool = True  # GRPO-family: divide by the group's std
    dynamic_sampling: bool = False  # DAPO: drop prompt groups whose rewards are all equal, generate more
    overlong_buffer_fraction: float = 0.0  # DAPO: the overlong buffer as a fraction of max_new_tokens (0: off)
    paper: str = ""

    def loss_spec(self) -> PolicyLossSpec:
        return PolicyLossSpec(self.policy_loss, self.clip_ratio_low, self.clip_ratio_high, agg_mode=self.loss_agg_mode)


PRESETS: dict[str, AlgorithmPreset] = {
    "ppo": AlgorithmPreset("gae", paper="Schulman et al. 2017, arXiv:1707.06347"),
    "grpo": AlgorithmPreset("grpo", paper="Shao et al. 2024 (DeepSeekMath), arXiv:2402.03300"),
    "rloo": AlgorithmPreset("rloo", paper="Ahmadian et al. 2024, arXiv:2402.14740"),
    "remax": AlgorithmPreset("remax", paper="Li et al. 2023, arXiv:2310.10505"),
    "reinforce_plus_plus": AlgorithmPreset("reinforce_plus_plus", paper="Hu 2025, arXiv:2501.03262"),
    "reinforce_plus_plus_baseline": AlgorithmPreset("reinforce_plus_plus_baseline", paper="Hu 2025, arXiv:2501.03262"),
    "dapo": AlgorithmPreset("grpo", clip_ratio_high=0.28, dynamic_sampling=True, overlong_buffer_fraction=0.2,
                            paper="Yu et al. 2025, arXiv:2503.14476"),
    "gspo": AlgorithmPreset("grpo", policy_loss="gspo", clip_ratio_low=3e-4, clip_ratio_high=4e-4,
                            loss_agg_mode="seq-mean-token-mean", paper="Zheng et al. 2025, arXiv:2507.18071"),
    "gspo_token": AlgorithmPreset("grpo", policy_loss="gspo_token", clip_ratio_low=3e-4, clip_ratio_high=4e-4,
                                  loss_agg_mode="seq-mean-token-mean", paper="Zheng et al. 2025, arXiv:2507.18071"),
    "dr_grpo": AlgorithmPreset("grpo", norm_adv_by_std=False, loss_agg_mode="seq-mean-token-sum-norm",
                               paper="Liu et al. 2025 (Dr. GRPO), arXiv:2503.20783"),
    "cispo": AlgorithmPreset("grpo", policy_loss="cispo", clip_ratio_low=1.0, clip_ratio_high=4.0,
                             paper="MiniMax 2025 (MiniMax-M1), arXiv:2506.13585"),
}
