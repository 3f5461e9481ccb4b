"""trainer.rollout_data_dir: a step's samples as JSON lines, per-token fields cut at the response's end."""

import json

import torch

from controller.rl.rollout_dump import RolloutDump
from workers.data_proto import DataProto


def test_a_step_is_written_whole_with_the_per_token_fields(tmp_path):
    prompts = torch.tensor([[0, 5, 6], [7, 8, 9]])
    responses = torch.tensor([[1, 2, 3, 4, 0], [4, 4, 0, 0, 0]])
    attention = torch.tensor([[0, 1, 1, 1, 1, 1, 1, 0], [1, 1, 1, 1, 1, 0, 0, 0]])
    response_mask = torch.tensor([[1, 0, 1, 1, 0], [1, 1, 0, 0, 0]])  # row 0: an observation token at 1
    advantages = torch.tensor([[0.5, 0.0, 0.5, 0.5, 0.0], [-1.0, -1.0, 0.0, 0.0, 0.0]])
    batch = DataProto({"prompts": prompts, "responses": responses, "attention_mask": attention,
                       "response_mask": response_mask, "advantages": advantages, "scores": torch.tensor([1.0, -2.0])},
                      non_tensor_batch={"uid": ["a", "b"]})
    path = RolloutDump(tmp_path / "dump").write(3, batch)
    assert path == tmp_path / "dump" / "3.jsonl" and not list((tmp_path / "dump").glob("*.partial"))
    first, second = [json.loads(line) for line in path.read_text().splitlines()]
    assert first == {"step": 3, "prompt": None, "response": None, "score": 1.0, "prompt_ids": [5, 6],
                     "response_ids": [1, 2, 3, 4], "uid": "a", "response_mask": [1, 0, 1, 1],
                     "advantages": [0.5, 0.0, 0.5, 0.5]}
    assert second["prompt_ids"] == [7, 8, 9] and second["response_ids"] == [4, 4]
    assert second["advantages"] == [-1.0, -1.0] and second["score"] == -2.0
