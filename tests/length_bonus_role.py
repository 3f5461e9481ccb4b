"""A role of the RL loop in one file: a worker that pays each response a bonus per token, on a pool of the job's,
called by the step after the reward. Importing this module registers it (``controller.rl.role_registry``);
a job then has it where its config holds a ``length_bonus:`` section."""

from dataclasses import dataclass

import torch

from controller.rl.role_registry import RoleType, register_role
from workers import BaseWorker, DataProto, Dispatch, register
from workers.reward.rule_reward import last_token_scores
from workers.role_spec import RoleSpec


@dataclass(frozen=True)
class LengthBonusConfig:
    weight: float = 0.1  # the bonus per response token

    def __post_init__(self):
        if not self.weight >= 0:
            raise ValueError(f"weight must be >= 0, got {self.weight}")


class LengthBonus(BaseWorker):
    def __init__(self, weight: float) -> None:
        self.weight = weight

    @register(Dispatch.DP_COMPUTE_PROTO)
    def bonus(self, data: DataProto) -> DataProto:
        return DataProto({"bonus": self.weight * data.batch["response_mask"].sum(-1).float()})


def add_bonus(group, batch: DataProto, scores: DataProto) -> DataProto:
    """The scored batch with each response's bonus added to its score (on its last token)."""
    bonus = group.bonus(batch).batch["bonus"]
    scores.batch["token_level_scores"] = (scores.batch["token_level_scores"]
                                          + last_token_scores(bonus, batch.batch["response_mask"]))
    scores.batch["scores"] = scores.batch["scores"] + bonus
    return scores


register_role(RoleType(name="length_bonus", section=LengthBonusConfig,
                       spec=lambda section, job: RoleSpec(LengthBonus, {"weight": section.weight}),
                       phase="score", call=add_bonus))
