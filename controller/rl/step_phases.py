"""The RL step's phases, declared: what each reads and writes, and the role whose pool runs it.

    generation -> scoring -+-> old log-probs -+-> advantages -+-> critic update -+-> next step
                           +-> ref log-probs -+    (driver)   +-> actor update --+
                           +-> values --------+
                           +-> registered roles' log-probs (the teacher's: controller.rl.role_registry)

``RLTrainer`` runs the phases of each stage through ``controller.rl.phase_flow``, which starts each one
once what it reads is written and its pool is free; the planner's time model follows the same graph
(``controller.planner.search.critical_path``). A phase's name is its ``timing_s/`` key.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["STEP_PHASES", "StepPhase"]


@dataclass(frozen=True)
class StepPhase:
    """``role``: whose pool runs it (None: the controller, the ``driver``); ``"reference"`` and ``"scorer"``
    stand for the job's reference role (the reference policy or a LoRA actor's base) and its reward role
    (the reward model, or the rule reward's workers)."""

    role: str | None
    reads: tuple[str, ...]
    writes: tuple[str, ...]


STEP_PHASES: dict[str, StepPhase] = {
    "rollout": StepPhase("rollout", reads=("prompts",), writes=("responses",)),
    "gen_baseline": StepPhase("rollout", reads=("prompts",), writes=("baseline_responses",)),  # ReMax's greedy one
    "reward": StepPhase("scorer", reads=("responses",), writes=("scores",)),
    "old_log_prob": StepPhase("actor", reads=("responses",), writes=("old_log_probs",)),
    "ref": StepPhase("reference", reads=("responses",), writes=("ref_log_probs",)),
    "values": StepPhase("critic", reads=("responses",), writes=("values",)),
    "adv": StepPhase(None, reads=("scores", "old_log_probs", "ref_log_probs", "values"),
                     writes=("advantages", "returns")),
    "update_critic": StepPhase("critic", reads=("returns",), writes=("critic_weights",)),
    "update_actor": StepPhase("actor", reads=("advantages",), writes=("actor_weights",)),
}
