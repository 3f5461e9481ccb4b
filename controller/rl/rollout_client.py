"""RolloutClient: how the trainer gets responses, chosen once when the job is built.

Three ways, one protocol, so that the step never asks which one it has:

- ``GroupRollout``: the rollout's worker group generates each batch (``generate_sequences``);
- ``ServedRolloutClient``: the user's agent (``rollout.agent.entrypoint``) talks to the rollout server,
  session by session, for each batch (``controller.serving.served_rollout``);
- ``ServedStreamClient``: trainer.mode async with a served agent: the replicas serve across steps and take
  each update in flight (``controller.serving.served_stream``), so a batch asked for while they serve
  comes through them.

Each one answers ``responses(prompts, sampling, training)`` (the rollout's batch), ``submit(method,
data)`` (a call answered later: one_step_off's generation ahead), ``weights_for_validation(step)`` (the
policy's current weights, before greedy validation) and ``close()``.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Protocol

from controller.rl.rollout_pool import RolloutWeightLink
from controller.rl.schedules import with_sampling
from controller.runtime.worker_group import WorkerGroup
from workers.data_proto import DataProto

__all__ = ["GroupRollout", "RolloutClient", "ServedRolloutClient", "ServedStreamClient", "rollout_client"]


class RolloutClient(Protocol):
    def responses(self, prompts: DataProto, sampling: dict[str, Any], training: bool = True) -> DataProto: ...

    def submit(self, method: str, data: DataProto) -> Future: ...

    def weights_for_validation(self, step: int) -> None: ...

    def close(self) -> None: ...


class GroupRollout:
    """The rollout's worker group generates each batch; ``link``: the weights' path to it on its own pool."""

    def __init__(self, group: WorkerGroup, link: RolloutWeightLink | None) -> None:
        self.group, self.link = group, link

    def responses(self, prompts: DataProto, sampling: dict[str, Any], training: bool = True) -> DataProto:
        return self.group.generate_sequences(with_sampling(prompts, sampling))

    def submit(self, method: str, data: DataProto) -> Future:
        return getattr(self.group, method).submit(data)

    def weights_for_validation(self, step: int) -> None:
        if self.link is not None:
            self.link.sync()

    def close(self) -> None:
        pass


class ServedRolloutClient(GroupRollout):
    """The user's agent on the rollout server, for each batch (padded to whole mini-batches when it trains);
    a generation ahead (one_step_off) runs on a thread of the controller's, serving on the rollout's pool
    while the actor trains on its own."""

    def __init__(self, group: WorkerGroup, link: RolloutWeightLink | None, served) -> None:
        super().__init__(group, link)
        self.served = served  # controller.serving.served_rollout.ServedRollout
        self._calls: ThreadPoolExecutor | None = None

    def responses(self, prompts: DataProto, sampling: dict[str, Any], training: bool = True) -> DataProto:
        return self.served.generate(prompts, sampling, pad=training)

    def submit(self, method: str, data: DataProto) -> Future:
        if method != "generate_sequences":
            return super().submit(method, data)
        if self._calls is None:
            self._calls = ThreadPoolExecutor(1, thread_name_prefix="hybridflow-served-rollout")
        return self._calls.submit(self.served.generate, data, {})

    def close(self) -> None:
        if self._calls is not None:
            self._calls.shutdown(wait=True)
            self._calls = None


class ServedStreamClient(ServedRolloutClient):
    """trainer.mode async with a served agent: while the stream's replicas serve, a batch comes through them
    and validation's weights are taken in flight."""

    def __init__(self, group: WorkerGroup, link: RolloutWeightLink | None, served, stream) -> None:
        super().__init__(group, link, served)
        self.stream = stream  # controller.serving.served_stream.ServedStream (also the trainer's schedule)

    def responses(self, prompts: DataProto, sampling: dict[str, Any], training: bool = True) -> DataProto:
        if self.stream.serving:
            return self.stream.generate_now(prompts, sampling)
        return super().responses(prompts, sampling, training)

    def weights_for_validation(self, step: int) -> None:
        if self.stream.serving:
            self.stream.take_weights(self.link.sync, step)
        else:
            super().weights_for_validation(step)

    def close(self) -> None:
        self.stream.close()  # its sessions and replicas stop first
        super().close()


def rollout_client(group: WorkerGroup, link: RolloutWeightLink | None, served=None, stream=None) -> RolloutClient:
    """The client of a job: through the server where a served agent generates (as a stream under async),
    else the group."""
    if served is None:
        return GroupRollout(group, link)
    if stream is None:
        return ServedRolloutClient(group, link, served)
    return ServedStreamClient(group, link, served, stream)
