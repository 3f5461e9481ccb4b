"""Generation for the RL loop: the Rollout role over vLLM or megatron's inference engine."""

from workers.rollout.batch import Completion, GenerationRequest, PromptError
from workers.rollout.config import ROLLOUT_ENGINES, RolloutConfig
from workers.rollout.rollout import Rollout
from workers.rollout.sampling import SamplingConfig

__all__ = ["Completion", "GenerationRequest", "PromptError", "ROLLOUT_ENGINES", "Rollout", "RolloutConfig", "SamplingConfig"]
