"""Teacher: a frozen model that scores the student's own samples, token by token (on-policy distillation).

    teacher = Teacher.from_pretrained("runs/sft_tiny/hf_actor", tensor_parallel=2)
    group.compute_teacher_log_prob(batch)   # -> DataProto({"teacher_log_probs": [B, R]})

A forward-only megatron role at a layout of its own, like the reference policy: the log-prob of every sampled
response token under the teacher's own distribution (temperature 1, whatever the student sampled at: the
distribution the student is taught), from the same fused output-layer kernel as the actor's log-probs, so a
teacher equal to the student scores exactly the student's log-probs. It holds no optimizer and takes no part in
the 3D-HybridEngine. Its tokenizer must be the student's (``controller.rl.teacher`` refuses another before
launch): it reads the student's token ids as they are.
"""

from __future__ import annotations

from workers.actor import _LogProbRole
from workers.data_proto import DataProto
from workers.dispatch import Dispatch
from workers.megatron.config import EngineConfig
from workers.register import register

__all__ = ["TEACHER_LOG_PROBS", "Teacher"]

TEACHER_LOG_PROBS = "teacher_log_probs"  # the batch field it writes: [B, R] (past a response: as the old log-probs)


class Teacher(_LogProbRole):
    def __init__(self, model_path: str, engine: EngineConfig | None = None) -> None:
        self._build_engine(model_path, engine, optim=None)

    @register(Dispatch.MESH_COMPUTE_PROTO)
    def compute_teacher_log_prob(self, data: DataProto) -> DataProto | None:
        """The teacher's log-prob of each response token, at temperature 1."""
        result = self._log_probs(data, temperature=1.0)
        return None if result is None else DataProto({TEACHER_LOG_PROBS: result[0]})
