"""megatron-core's model-parallel state for one worker process, with explicit groups.

megatron keeps its TP/PP/DP groups in module globals; the engine reads them
once, here, into a ``MegatronGroups`` value and passes that around, so no
other code reaches into ``parallel_state``. The training grid is the only
grid megatron's globals ever hold (a generation layout gets its own groups).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

from hybridengine.device import prepare_megatron
from hybridengine.layout import ParallelLayout

__all__ = ["MegatronGroups", "initialize_megatron"]


@dataclass(frozen=True)
class MegatronGroups:
    layout: ParallelLayout
    tp_rank: int
    pp_rank: int
    dp_rank: int
    tp_group: Any
    pp_group: Any
    dp_group: Any


def initialize_megatron(layout: ParallelLayout, seed: int, process_group: Any = None) -> MegatronGroups:
    """Set up megatron's groups for ``layout`` over this process's torch.distributed world.

    Colocated megatron roles share one process and so one set of megatron
    groups: a second role must ask for the same layout.
    """
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    prepare_megatron()
    if process_group is not None and process_group is not dist.group.WORLD:
        raise ValueError(
            "megatron roles need a resource pool that spans the whole torch.distributed world; "
            "under torchrun, give them the first pool and make it as large as the world"
        )
    if dist.get_world_size() != layout.world_size:
        raise ValueError(
            f"world size {dist.get_world_size()} != tensor_parallel * pipeline_parallel * data_parallel "
            f"= {layout.tp} * {layout.pp} * {layout.dp}"
        )
    if ps.model_parallel_is_initialized():
        have = (ps.get_tensor_model_parallel_world_size(), ps.get_pipeline_model_parallel_world_size())
        if have != (layout.tp, layout.pp):
            raise ValueError(
                f"this process already runs megatron at TP{have[0]}xPP{have[1]}; colocated roles must use "
                f"the same layout, not {layout}"
            )
    else:
        ps.initialize_model_parallel(tensor_model_parallel_size=layout.tp, pipeline_model_parallel_size=layout.pp)
    model_parallel_cuda_manual_seed(seed)
    coord = layout.coordinate(dist.get_rank())
    groups = MegatronGroups(
        layout=layout,
        tp_rank=ps.get_tensor_model_parallel_rank(),
        pp_rank=ps.get_pipeline_model_parallel_rank(),
        dp_rank=ps.get_data_parallel_rank(),
        tp_group=ps.get_tensor_model_parallel_group(),
        pp_group=ps.get_pipeline_model_parallel_group(),
        dp_group=ps.get_data_parallel_group(),
    )
    if (groups.tp_rank, groups.pp_rank, groups.dp_rank) != coord:
        raise RuntimeError(f"megatron placed rank {dist.get_rank()} at {groups} but the layout says {coord}")
    return groups
