"""Advantage estimators as pure tensor functions, behind a name registry.

Per-token tensors are [B, T] over response tokens; ``response_mask`` marks the
real tokens (1) and the right padding (0). Every estimator has one signature,
``estimator(inputs, config) -> (advantages, returns)``, both [B, T] and zero
on padded positions, so the trainer picks one by name and users add their own
with ``@register_advantage_estimator("name")`` without touching this file.

A mask-0 position inside a response (the observation tokens between the turns
of a multi-turn rollout) is skipped, not a boundary: GAE and the returns of
ReMax and REINFORCE++ carry across it, so each position gets what it would get
in the compacted row of the model's tokens alone. Masked positions may hold
anything (NaN included); no output reads them.

Where these estimators differ from verl's ``core_algos`` (0.9.1), on purpose:

- Whitening epsilon (REINFORCE++, REINFORCE++-baseline, whitened GAE): 1e-6
  here, 1e-8 in verl, added to the variance. The two agree to 0.5% once the
  variance is 1e-4 and to 5e-5 at 1e-2. When a batch's returns are nearly
  constant (a variance of 1e-9, rounding noise), 1e-8 scales that noise up
  to advantages of about 0.3 and 1e-6 to about 0.03: ours keeps the update of
  a batch with no signal small.
  Set ``AdvantageConfig(epsilon=1e-8)`` to reproduce verl.
- A prompt group of one sample: GRPO gives it advantage 0 here; verl gives
  the raw score (its mean 0 and std 1 for a group of one). Without other
  samples there is no baseline, and a raw score would enter the loss on a
  different scale from the normalised advantages beside it, so ours leaves
  it out of the gradient. RLOO refuses it here (the leave-one-out baseline
  does not exist), while verl returns the raw score; a job with
  ``rollout.sampling.n < 2`` is refused before launch, so a group of one can
  only come from code that builds its own batch, and it should hear of it.
  REINFORCE++-baseline centres a group of one on itself (0), as verl does.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from hybridengine.ops.advantage_scan import discounted_returns, gae_scan
from workers.policy_losses import masked_mean, zero_padding

__all__ = [
    "ADVANTAGE_ESTIMATORS",
    "AdvantageConfig",
    "AdvantageEstimator",
    "AdvantageInputs",
    "compute_advantages",
    "get_advantage_estimator",
    "group_rows",
    "masked_var",
    "masked_whiten",
    "register_advantage_estimator",
]


def masked_var(values: torch.Tensor, mask: torch.Tensor, unbiased: bool = True) -> torch.Tensor:
    """Variance of ``values`` over the positions where ``mask`` is 1.

    unbiased=True divides the squared deviations by n - 1 (Bessel), as
    ``torch.var`` does by default; with n <= 1 valid entries it falls back to
    dividing by n (so one valid entry has variance 0, not NaN).
    """
    mask = mask.to(values.dtype)
    values = zero_padding(values, mask)
    mean = masked_mean(values, mask)
    n = mask.sum()
    squared = ((values - mean) * mask).square().sum()
    if unbiased and n > 1:
        return squared / (n - 1)
    return squared / n.clamp(min=1)


def masked_whiten(values: torch.Tensor, mask: torch.Tensor, epsilon: float = 1e-8, shift_mean: bool = True) -> torch.Tensor:
    """(values - mean) / sqrt(var + epsilon) over valid positions; padded positions become 0.

    Mean and (unbiased) variance are taken over the valid entries of the whole
    batch. ``shift_mean=False`` only rescales (adds the mean back).
    """
    values = zero_padding(values, mask)
    mean = masked_mean(values, mask)
    var = masked_var(values, mask, unbiased=True)
    whitened = (values - mean) * torch.rsqrt(var + epsilon)
    if not shift_mean:
        whitened = whitened + mean
    return whitened * mask.to(values.dtype)


@dataclass
class AdvantageInputs:
    """What an estimator may read. Each estimator checks the optional fields it needs.

    token_level_rewards: [B, T] reward per response token (often the score on the
        last token, minus a KL penalty on every token).
    response_mask: [B, T], 1 on real response tokens, 0 on right padding.
    values: [B, T] critic values V(s_t), for GAE.
    group_index: length-B ids; samples of one prompt share an id (rows need not be adjacent).
    baseline_rewards: [B] sequence score of the greedy rollout, for ReMax.
    """

    token_level_rewards: torch.Tensor
    response_mask: torch.Tensor
    values: torch.Tensor | None = None
    group_index: Sequence[Hashable] | Any | None = None
    baseline_rewards: torch.Tensor | None = None

    def __post_init__(self) -> None:
        rewards, mask = self.token_level_rewards, self.response_mask
        if rewards.dim() != 2:
            raise ValueError(f"token_level_rewards must be [B, T], got shape {tuple(rewards.shape)}")
        if mask.shape != rewards.shape:
            raise ValueError(
                f"response_mask shape {tuple(mask.shape)} must equal token_level_rewards shape {tuple(rewards.shape)}"
            )
        if self.values is not None and self.values.shape != rewards.shape:
            raise ValueError(
                f"values shape {tuple(self.values.shape)} must equal token_level_rewards shape {tuple(rewards.shape)}"
            )
        batch = rewards.shape[0]
        if self.baseline_rewards is not None and tuple(self.baseline_rewards.shape) != (batch,):
            raise ValueError(f"baseline_rewards must be [B] = ({batch},), got shape {tuple(self.baseline_rewards.shape)}")
        if self.group_index is not None and len(self.group_index) != batch:
            raise ValueError(f"group_index has {len(self.group_index)} ids but the batch has {batch} rows")


@dataclass(frozen=True)
class AdvantageConfig:
    """Knobs shared by the estimators.

    gamma: discount (GAE, REINFORCE++). lam: GAE's lambda. norm_adv_by_std: GRPO
    divides by the group std (True) or only subtracts the group mean (False).
    epsilon: added to the std (GRPO) or the variance (whitening) before dividing.
    whiten: whiten GAE advantages over the batch's valid tokens.
    """

    gamma: float = 1.0
    lam: float = 1.0
    norm_adv_by_std: bool = True
    epsilon: float = 1e-6
    whiten: bool = True

    def __post_init__(self) -> None:
        for name in ("gamma", "lam"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and 0.0 <= value <= 1.0):
                raise ValueError(f"AdvantageConfig.{name} must be in [0, 1], got {value!r}")
        if not (isinstance(self.epsilon, (int, float)) and math.isfinite(self.epsilon) and self.epsilon > 0):
            raise ValueError(f"AdvantageConfig.epsilon must be a finite number > 0, got {self.epsilon!r}")


AdvantageEstimator = Callable[[AdvantageInputs, AdvantageConfig], tuple[torch.Tensor, torch.Tensor]]

#: name -> estimator; read it to see what is registered.
ADVANTAGE_ESTIMATORS: dict[str, AdvantageEstimator] = {}


def register_advantage_estimator(name: str, override: bool = False) -> Callable[[AdvantageEstimator], AdvantageEstimator]:
    """Decorator that registers ``fn(inputs, config) -> (advantages, returns)`` under ``name``.

    Registering a taken name is an error unless ``override=True``.
    """
    if not isinstance(name, str) or not name:
        raise ValueError(f"advantage estimator name must be a non-empty string, got {name!r}")

    def decorator(fn: AdvantageEstimator) -> AdvantageEstimator:
        if not callable(fn):
            raise TypeError(f"advantage estimator {name!r} must be callable, got {type(fn).__name__}")
        if name in ADVANTAGE_ESTIMATORS and not override:
            raise ValueError(f"advantage estimator {name!r} is already registered; pass override=True to replace it")
        ADVANTAGE_ESTIMATORS[name] = fn
        return fn

    return decorator


def get_advantage_estimator(name: str) -> AdvantageEstimator:
    """The estimator registered under ``name``; ValueError listing the registered names otherwise."""
    try:
        return ADVANTAGE_ESTIMATORS[name]
    except (KeyError, TypeError):
        raise ValueError(f"unknown advantage estimator {name!r}; registered: {sorted(ADVANTAGE_ESTIMATORS)}") from None


def compute_advantages(
    name: str, inputs: AdvantageInputs, config: AdvantageConfig | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Look up ``name`` and run it: (advantages [B, T], returns [B, T])."""
    return get_advantage_estimator(name)(inputs, config or AdvantageConfig())


def _require(inputs: AdvantageInputs, field: str, estimator: str, what: str) -> Any:
    value = getattr(inputs, field)
    if value is None:
        raise ValueError(f"{estimator} needs {field} ({what}); got None")
    return value


def _sequence_scores(inputs: AdvantageInputs) -> torch.Tensor:
    """Outcome reward per sequence: sum of the token-level rewards over valid tokens, [B]."""
    mask = inputs.response_mask.to(inputs.token_level_rewards.dtype)
    return (zero_padding(inputs.token_level_rewards, mask) * mask).sum(-1)


def group_rows(group_index: Sequence[Hashable] | Any) -> dict[Hashable, list[int]]:
    """Map each group id to the row indices holding it, in first-seen order.

    Accepts a list, a numpy array (object or int) or a 1-D tensor of ids.
    """
    ids = group_index.tolist() if hasattr(group_index, "tolist") else list(group_index)
    rows: dict[Hashable, list[int]] = {}
    for row, gid in enumerate(ids):
        try:
            rows.setdefault(gid, []).append(row)
        except TypeError:
            raise ValueError(f"group_index entries must be hashable; row {row} has {gid!r}") from None
    return rows


@register_advantage_estimator("gae")
def gae(inputs: AdvantageInputs, config: AdvantageConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation (Schulman et al. 2016) for PPO with a critic.

    Going backwards over valid tokens only (padded positions are skipped, so the
    value after a sequence's last token is 0):
        delta_t = r_t + gamma * V_{t+1} - V_t
        A_t     = delta_t + gamma * lam * A_{t+1}
    returns R_t = A_t + V_t (the critic's target, before whitening); advantages
    are then whitened over the batch's valid tokens when ``config.whiten``.
    Padded positions get 0 in both outputs.
    """
    values = _require(inputs, "values", "gae", "a critic")
    rewards, mask = inputs.token_level_rewards, inputs.response_mask.to(inputs.token_level_rewards.dtype)
    advantages, returns = gae_scan(rewards, values, mask, config.gamma, config.lam)
    advantages, returns = advantages.to(rewards.dtype), returns.to(rewards.dtype)
    if config.whiten:
        advantages = masked_whiten(advantages, mask, epsilon=config.epsilon)
    return advantages, returns


@register_advantage_estimator("grpo")
def grpo(inputs: AdvantageInputs, config: AdvantageConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """Group-relative outcome advantage (GRPO, Shao et al. 2024).

    With s_i the sum of row i's token rewards and G its group:
        A_i = (s_i - mean_G(s)) / (std_G(s) + epsilon)   if norm_adv_by_std
        A_i =  s_i - mean_G(s)                           otherwise
    std is the unbiased (n - 1) sample std, torch.std's default. A group of one
    sample has no baseline and gets A = 0. A_i is broadcast over the row's valid
    tokens; returns equal the advantages.
    """
    group_index = _require(inputs, "group_index", "grpo", "the prompt id of every sample")
    scores = _sequence_scores(inputs)
    seq_adv = torch.zeros_like(scores)
    for rows in group_rows(group_index).values():
        if len(rows) < 2:
            continue
        idx = torch.tensor(rows, device=scores.device)
        group = scores[idx]
        centred = group - group.mean()
        if config.norm_adv_by_std:
            centred = centred / (group.std(unbiased=True) + config.epsilon)
        seq_adv[idx] = centred
    advantages = seq_adv.unsqueeze(-1) * inputs.response_mask.to(scores.dtype)
    return advantages, advantages.clone()


@register_advantage_estimator("rloo")
def rloo(inputs: AdvantageInputs, config: AdvantageConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE leave-one-out (Ahmadian et al. 2024).

    The baseline of sample i is the mean score of the other samples of its group:
        A_i = s_i - (sum_G(s) - s_i) / (n - 1)
    Every group needs at least 2 samples. Broadcast over valid tokens; returns
    equal the advantages.
    """
    group_index = _require(inputs, "group_index", "rloo", "the prompt id of every sample")
    scores = _sequence_scores(inputs)
    seq_adv = torch.zeros_like(scores)
    for gid, rows in group_rows(group_index).items():
        if len(rows) < 2:
            raise ValueError(f"rloo needs at least 2 samples per group; group {gid!r} has {len(rows)} (row {rows[0]})")
        idx = torch.tensor(rows, device=scores.device)
        group = scores[idx]
        seq_adv[idx] = group - (group.sum() - group) / (len(rows) - 1)
    advantages = seq_adv.unsqueeze(-1) * inputs.response_mask.to(scores.dtype)
    return advantages, advantages.clone()


def _reward_to_go(rewards: torch.Tensor, mask: torch.Tensor, gamma: float) -> torch.Tensor:
    """G_t = r_t + gamma * G_{t'} with t' the next valid position (0 after the last): the sum of the
    future rewards, carried across masked positions (which hold 0)."""
    return discounted_returns(rewards, mask, gamma).to(rewards.dtype)


@register_advantage_estimator("remax")
def remax(inputs: AdvantageInputs, config: AdvantageConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """ReMax (Li et al. 2023): REINFORCE with the greedy rollout's score as baseline.

        G_t = sum_{k >= t} r_k   (undiscounted reward-to-go over the valid tokens after t, across
                                  any masked gap; gamma is not used)
        A_t = G_t - b            (b = baseline_rewards, the greedy response's sequence score)
    returns are G_t. Padded positions get 0.
    """
    baseline = _require(inputs, "baseline_rewards", "remax", "the greedy rollout's sequence reward")
    rewards = inputs.token_level_rewards
    mask = inputs.response_mask.to(rewards.dtype)
    returns = _reward_to_go(rewards, mask, 1.0)
    advantages = (returns - baseline.to(rewards.dtype).unsqueeze(-1)) * mask
    return advantages, returns


@register_advantage_estimator("reinforce_plus_plus")
def reinforce_plus_plus(inputs: AdvantageInputs, config: AdvantageConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++ (Hu 2025): discounted return-to-go, whitened over the batch.

        G_t = r_t + gamma * G_{t'}    t' the next valid token: masked positions are skipped, so an
                                      earlier turn of a multi-turn response sees the final reward
        A   = whiten(G) over all valid tokens of the batch: (G - mean) / sqrt(var + epsilon),
              var unbiased.
    returns are G_t. Padded positions get 0.
    """
    rewards = inputs.token_level_rewards
    mask = inputs.response_mask.to(rewards.dtype)
    returns = _reward_to_go(rewards, mask, config.gamma)
    advantages = masked_whiten(returns, mask, epsilon=config.epsilon)
    return advantages, returns


@register_advantage_estimator("reinforce_plus_plus_baseline")
def reinforce_plus_plus_baseline(inputs: AdvantageInputs, config: AdvantageConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++ with a group baseline (Hu et al. 2025, the variant for several samples per prompt).

        A_i = s_i - mean_G(s)                 (the group's mean score as the baseline)
        A   = whiten(A) over all valid tokens of the batch: (A - mean) / sqrt(var + epsilon), var unbiased.
    The baseline removes each prompt's difficulty; the batch whitening then sets one scale for all
    prompts (GRPO divides each group by its own std instead). A group of one sample has baseline
    itself. returns equal the advantages.
    """
    group_index = _require(inputs, "group_index", "reinforce_plus_plus_baseline", "the prompt id of every sample")
    scores = _sequence_scores(inputs)
    centred = torch.zeros_like(scores)
    for rows in group_rows(group_index).values():
        idx = torch.tensor(rows, device=scores.device)
        centred[idx] = scores[idx] - scores[idx].mean()
    mask = inputs.response_mask.to(scores.dtype)
    advantages = masked_whiten(centred.unsqueeze(-1) * mask, mask, epsilon=config.epsilon)
    return advantages, advantages.clone()
