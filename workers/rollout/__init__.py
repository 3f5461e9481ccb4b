"""Generation for the RL loop: the Rollout role over a registered engine (vLLM, megatron's inference engine)."""

from workers.rollout.batch import Completion, GenerationRequest, PromptError
from workers.rollout.config import RolloutConfig
from workers.rollout.generator import Generator, register_generator, registered_generators
from workers.rollout.rollout import Rollout
from workers.rollout.sampling import SamplingConfig

__all__ = ["Completion", "GenerationRequest", "Generator", "PromptError", "Rollout", "RolloutConfig", "SamplingConfig",
           "register_generator", "registered_generators"]
