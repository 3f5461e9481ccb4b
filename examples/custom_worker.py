import torch
import torch.distributed as dist

from hybridflow import BaseWorker, DataProto, Dispatch, ResourcePool, WorkerGroup, register


class LengthReward(BaseWorker):
    """A rule-based reward: responses score higher the closer they are to a target length."""

    def __init__(self, target_length: int):
        self.target_length = target_length
        self.rows_scored = 0

    @register(Dispatch.DP_COMPUTE_PROTO)
    def score(self, batch: DataProto) -> DataProto:
        lengths = batch.batch["response_mask"].sum(dim=-1).float()
        self.rows_scored += len(batch)
        return DataProto({"reward": 1.0 / (1.0 + (lengths - self.target_length).abs())})

    @register(Dispatch.ONE_TO_ALL)
    def total_rows_scored(self) -> int:
        count = torch.tensor([self.rows_scored])
        dist.all_reduce(count, group=self.process_group)  # the group's own process group
        return int(count.item())


if __name__ == "__main__":
    pool = ResourcePool([2])  # two processes: Ray by default, the torchrun ranks under torchrun
    reward = WorkerGroup(pool, LengthReward, kwargs={"target_length": 4})
    mask = torch.tensor([[1, 1, 1, 1, 0, 0], [1, 1, 0, 0, 0, 0], [1, 1, 1, 1, 1, 1]])
    batch = DataProto({"response_mask": mask}, {"prompt": ["2+2=", "hi", "why?"]})
    scored = reward.score(batch)  # 3 rows: padded to 4, split over 2 ranks, gathered, unpadded
    print("rewards:", scored.batch["reward"].tolist())
    print("rows scored, summed over the group:", reward.total_rows_scored())  # 4: the padding row too
    pool.shutdown()
