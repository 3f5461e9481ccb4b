"""Reward workers: rule-based functions on decoded text, and learned reward (or cost) models.

``RuleReward`` (DP_COMPUTE_PROTO) calls a Python function per sample (by
default the one its ``data_source`` routes to);
``RewardModel`` (MESH_COMPUTE_PROTO) runs a Llama / Mistral / Qwen-family
sequence-classification checkpoint on the megatron engine; ``HFRewardModel``
(DP_COMPUTE_PROTO) runs any other one-label ``AutoModelForSequenceClassification``
(DeBERTa, BERT-style, ...) through transformers with its own tokenizer, and
``RewardModel.from_pretrained`` picks between the two. All return
``token_level_scores`` [B, R] with the sequence score on the last valid
response token.
"""

from workers.reward.functions import REWARD_FUNCTIONS, resolve_reward_fn
from workers.reward.hf_reward_model import HFRewardModel
from workers.reward.reward_model import RewardModel
from workers.reward.router import DATA_SOURCE_SCORERS, check_reward_fn, score_by_data_source
from workers.reward.rule_reward import RewardFunctionError, RuleReward

__all__ = ["DATA_SOURCE_SCORERS", "HFRewardModel", "REWARD_FUNCTIONS", "RewardFunctionError", "RewardModel", "RuleReward",
           "check_reward_fn", "resolve_reward_fn", "score_by_data_source"]
