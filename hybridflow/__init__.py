"""hybridflow's public API in one import.

    from hybridflow import RLTrainer, Actor, Rollout, arithmetic_prompts, resolve_model_path

Everything here is re-exported from the layered packages, which stay as
they are (``controller``: the single controller and the RL loop;
``workers``: roles, DataProto and dispatch; ``hybridengine``: layouts and
resharding); this module only gathers the names a user writes.
"""

from controller.algorithms import (
    AdvantageConfig,
    AdvantageInputs,
    RLAlgorithm,
    StepContext,
    StepState,
    group_rows,
    register_advantage_estimator,
    register_algorithm,
)
from controller.algorithms.algorithm_roles import AlgorithmRole
from controller.checks import register_check
from controller.config import RLConfig, load_config
from controller.data import (
    PromptDataset,
    PromptLoader,
    arithmetic_prompts,
    gsm8k_rows,
    load_prompt_files,
)
from controller.dataflow.graph import DataFlow, Node
from controller.dataflow.declarations import register_parallelism, register_placement, register_protocol
from controller.models.builtin import resolve_model_path, value_model_from_policy
from controller.runtime.resource_pool import ResourcePool
from controller.rl.role_registry import RoleType, register_role
from controller.rl.trainer import RLTrainer
from controller.runtime.worker_group import WorkerGroup
from workers.actor import Actor, ReferencePolicy
from workers.base_worker import BaseWorker
from workers.critic import Critic
from workers.data_proto import DataProto
from workers.dispatch import Dispatch
from workers.register import register
from workers.policy_losses import kl_penalty
from workers.reward import REWARD_FUNCTIONS, RewardModel, RuleReward, resolve_reward_fn, score_by_data_source
from workers.reward.rule_reward import last_token_scores
from workers.role_spec import RoleSpec
from workers.node_worker import node_context
from workers.rollout import Rollout
from workers.rollout.generator import GeneratorTraits, register_generator
from workers.teacher import Teacher

__all__ = [
    # the RL loop and its roles
    "RLTrainer", "Actor", "Critic", "ReferencePolicy", "RewardModel", "Rollout", "RuleReward", "Teacher",
    # workers, dispatch and groups
    "BaseWorker", "DataProto", "Dispatch", "register", "RoleSpec", "ResourcePool", "WorkerGroup", "DataFlow", "Node",
    # placed DataFlow nodes
    "register_placement", "register_parallelism", "register_protocol", "node_context",
    # data
    "PromptDataset", "PromptLoader", "arithmetic_prompts", "gsm8k_rows", "load_prompt_files",
    # rewards and algorithms
    "REWARD_FUNCTIONS", "resolve_reward_fn", "score_by_data_source", "last_token_scores",
    "register_advantage_estimator", "AdvantageConfig", "AdvantageInputs", "group_rows", "kl_penalty",
    "RLAlgorithm", "StepContext", "StepState", "register_algorithm",
    # extending the job: roles, engines, checks
    "RoleType", "register_role", "AlgorithmRole", "GeneratorTraits", "register_generator", "register_check",
    # models and configs
    "resolve_model_path", "value_model_from_policy", "RLConfig", "load_config",
]
