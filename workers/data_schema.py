"""DataSchema: the fields a stage must produce, in the user's names (``DataProto(field="name", ...)``).

    rollout_proto = DataProto(input_ids="input_ids", attention_mask="attention_mask",
                              sequences="sequences", logprobs="logprobs")

Each keyword is a field the user's code reads; its value names the field as the stage writes it,
in the stage's own words or in the field's common ones, which map to the rollout's: ``sequences``
is ``input_ids`` (prompt and response), ``logprobs`` / ``log_probs`` are ``rollout_log_probs``
(the engine's log-probs of the sampled tokens), ``response_ids`` is ``responses``. The trainer
checks a rollout schema against what the rollout produces before the first step, and again on the
first batch.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

__all__ = ["FIELD_ALIASES", "ROLLOUT_FIELDS", "DataSchema"]

#: What every rollout batch holds (workers.rollout.batch.sequence_tensors).
ROLLOUT_FIELDS = ("prompts", "responses", "input_ids", "attention_mask", "position_ids", "response_mask",
                  "rollout_log_probs")

#: Common names -> the rollout's own.
FIELD_ALIASES = {"sequences": "input_ids", "logprobs": "rollout_log_probs", "log_probs": "rollout_log_probs",
                 "response_ids": "responses", "prompt_ids": "prompts", "loss_mask": "response_mask"}


@dataclass(frozen=True)
class DataSchema:
    """The user's field names -> the names the stage writes (aliases resolved by ``source``)."""

    fields: dict[str, str]

    def __post_init__(self) -> None:
        bad = {k: v for k, v in self.fields.items() if not isinstance(v, str) or not v}
        if bad:
            raise TypeError(f"DataProto(field='name', ...) declares a schema: each value must be a field name (a "
                            f"string); got {bad}")

    @staticmethod
    def source(name: str) -> str:
        return FIELD_ALIASES.get(name, name)

    def resolved(self) -> dict[str, str]:
        """user field -> the stage's own field name."""
        return {field: self.source(name) for field, name in self.fields.items()}

    def missing(self, produced: Iterable[str]) -> dict[str, str]:
        produced = set(produced)
        return {field: name for field, name in self.resolved().items() if name not in produced}

    def check(self, produced: Iterable[str], stage: str = "rollout") -> None:
        """ValueError naming each declared field the stage does not produce, and what it does produce."""
        produced = sorted(produced)
        missing = self.missing(produced)
        if missing:
            listing = ", ".join(f"{field}={self.fields[field]!r}" for field in missing)
            raise ValueError(f"{stage}_proto declares {listing}, which the {stage} does not produce; it produces "
                             f"{produced} (and the aliases {sorted(FIELD_ALIASES)})")

    def view(self, batch: Any) -> dict[str, Any]:
        """The declared fields of a DataProto under the user's names."""
        return {field: batch.batch[name] if name in batch.batch else batch.non_tensor_batch[name]
                for field, name in self.resolved().items()}
