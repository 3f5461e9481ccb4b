"""Workers: DataProto, BaseWorker and the @register dispatch rules.

Knows nothing of Ray or of the RL algorithm loop.
"""

from hybridengine.device import defer_compile_on_cpu

defer_compile_on_cpu()  # before anything imports megatron-core: its torch.compile'd fusions cost an inductor import

# isort: split

from workers.base_worker import BaseWorker
from workers.data_proto import DataProto
from workers.dispatch import Dispatch, DispatchError, GroupView, RankCall, register_dispatch_mode
from workers.register import register

__all__ = [
    "BaseWorker",
    "DataProto",
    "Dispatch",
    "DispatchError",
    "GroupView",
    "RankCall",
    "register",
    "register_dispatch_mode",
]
