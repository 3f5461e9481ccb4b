"""Reward workers: rule-based functions on decoded text, and learned reward (or cost) models.

``RuleReward`` (DP_COMPUTE_PROTO) calls a Python function per sample;
``RewardModel`` (MESH_COMPUTE_PROTO) runs a sequence-classification
checkpoint on the megatron engine. Both return ``token_level_scores`` [B, R]
with the sequence score on the last valid response token.
"""

from workers.reward.functions import REWARD_FUNCTIONS, resolve_reward_fn
from workers.reward.reward_model import RewardModel
from workers.reward.rule_reward import RewardFunctionError, RuleReward

__all__ = ["REWARD_FUNCTIONS", "RewardFunctionError", "RewardModel", "RuleReward", "resolve_reward_fn"]
