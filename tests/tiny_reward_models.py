"""Tiny random DeBERTa-v2 reward models made on the spot (controller/models/builtin_reward_model.py), and a
reward worker that counts what each rank scored."""

import torch
import torch.distributed as dist

from controller.models.builtin_reward_model import SENTENCES, make_deberta_reward_model, save_word_tokenizer  # noqa: F401
from workers.dispatch import Dispatch
from workers.register import register
from workers.reward.hf_reward_model import HFRewardModel

# Each turn "[CLS] role : content [SEP]": a chat template a DeBERTa reward model could have been trained with.
CHAT_TEMPLATE = "{% for m in messages %}[CLS] {{ m['role'] }} : {{ m['content'] }} [SEP] {% endfor %}"

# The builtin reward model's maker (controller/models/builtin_reward_model.py), under the name the tests use.
make_deberta_rm = make_deberta_reward_model


class CountingHFRewardModel(HFRewardModel):
    """HFRewardModel that also counts the rows each rank scored (to see the data-parallel split)."""

    rows_scored = 0

    @register(Dispatch.DP_COMPUTE_PROTO)
    def compute_rm_score(self, data):
        self.rows_scored += len(data)
        return super().compute_rm_score(data)

    @register(Dispatch.ONE_TO_ALL)
    def scored_rows(self) -> list[int]:
        """Rows scored by each rank, gathered over the group's own process group."""
        counts = [torch.zeros(1, dtype=torch.long) for _ in range(self.world_size)]
        dist.all_gather(counts, torch.tensor([self.rows_scored]), group=self.process_group)
        return [int(c) for c in counts]
