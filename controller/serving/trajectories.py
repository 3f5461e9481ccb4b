"""A session's training samples, token for token what it was served.

The turns of a session form a forest: a turn's ``parent`` is the turn whose ids its prompt starts with.
Each path from a root to a leaf is one sample: the root's prompt, then each turn's sampled ids (masked in,
with their log-probs and policy versions) and, between turns, the ids the client's messages added
(masked out). A session that never rewrote its history is one sample; each break (a request rendered from
scratch) or branch (two requests continuing the same turn) adds one.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from controller.serving.session import ServedTurn

__all__ = ["ServedSample", "session_samples"]


@dataclass
class ServedSample:
    prompt_ids: list[int]
    response_ids: list[int] = field(default_factory=list)
    response_mask: list[int] = field(default_factory=list)  # 1: sampled by the engine; 0: sent by the client
    log_probs: list[float] = field(default_factory=list)  # the engine's, on sampled tokens; 0.0 elsewhere
    versions: list[int] = field(default_factory=list)  # the policy version that sampled each token; -1 elsewhere
    turns: int = 0
    finish_reason: str | None = None

    @property
    def context_ids(self) -> list[int]:
        return self.prompt_ids + self.response_ids


def session_samples(turns: list[ServedTurn]) -> list[ServedSample]:
    """The samples of a session's turns (in the order their last turns were served)."""
    children: dict[int, list[int]] = {}
    for index, turn in enumerate(turns):
        if turn.parent is not None:
            if not 0 <= turn.parent < index:
                raise ValueError(f"turn {index} continues turn {turn.parent}, which is not an earlier turn")
            children.setdefault(turn.parent, []).append(index)
    samples = []
    for leaf in (i for i in range(len(turns)) if i not in children):
        path = [leaf]
        while turns[path[-1]].parent is not None:
            path.append(turns[path[-1]].parent)
        path.reverse()
        sample = ServedSample(list(turns[path[0]].prompt_ids))
        for index in path:
            turn = turns[index]
            context = sample.context_ids
            if turn.prompt_ids[:len(context)] != context:
                raise ValueError(f"turn {index}'s prompt does not start with the ids of the turns it continues")
            added = turn.prompt_ids[len(context):]
            sample.response_ids += added + turn.completion_ids
            sample.response_mask += [0] * len(added) + [1] * len(turn.completion_ids)
            sample.log_probs += [0.0] * len(added) + list(turn.log_probs)
            sample.versions += [-1] * len(added) + list(turn.versions)
            sample.turns += 1
            sample.finish_reason = turn.finish_reason
        samples.append(sample)
    return samples
