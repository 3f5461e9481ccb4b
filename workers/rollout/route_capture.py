"""The experts a mixture of experts' routers chose while generating: rollout routing replay's first half.

Every completion can carry ``routed_experts`` [positions, layers, k]: for each
position of its sequence (prompt, then response) whose output the engine
computed, the k experts each MoE layer sent that token to, as training expert
ids. A sequence of P prompt and T response tokens has P + T - 1 of them: the
last response token is sampled, never fed back. The training engine replays
them (``workers.megatron.routing_replay``) so that its routers choose as the
rollout's did.

``RouteRecorder`` records them in the megatron rollout engine: a forward hook
on every router of the generation model keeps, for each forward of the decode
loop, the experts of each (position, row) of its window (megatron's tokens are
sequence-major, ``[window, batch]``); a row's routes are its positions in order.
Each pipeline stage records its own layers, and ``gather_layers`` joins them.

Generation expert ids become training ids through the hybrid engine's
placement (generation expert j is training expert ``placement[j]``; the
identity unless generation is expert-parallel): ``to_training_ids``.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from hybridengine.model.catalogue import layer_index

__all__ = ["ROUTE_DTYPE", "RouteRecorder", "gather_layers", "to_training_ids"]

ROUTE_DTYPE = torch.int16  # expert ids: fewer than 32768 experts a layer


def to_training_ids(routes: torch.Tensor, placement: tuple[int, ...] | None) -> torch.Tensor:
    """``routes`` (generation expert ids, any shape) as training expert ids, sorted along the last dim."""
    routes = routes.long()
    if placement is not None and placement != tuple(range(len(placement))):
        routes = torch.tensor(placement, dtype=torch.long)[routes]
    return routes.sort(-1).values.to(ROUTE_DTYPE)


class RouteRecorder:
    """The routes of one generate call's forwards, on this pipeline stage's routers."""

    def __init__(self, model: torch.nn.Module, layers: range, topk: int) -> None:
        from megatron.core.transformer.moe.router import TopKRouter

        self.layers, self.topk = layers, topk
        self.recording = False
        self.windows: dict[int, list[torch.Tensor]] = {}  # local layer -> [window, batch, k] per forward
        self.handles = []
        for name, child in model.named_modules():
            if isinstance(child, TopKRouter):
                local = layer_index(name)
                self.handles.append(child.register_forward_hook(self._hook(local)))

    def _hook(self, local: int):
        def record(router, args, output) -> None:
            if not self.recording:
                return
            window, batch = args[0].shape[0], args[0].shape[1]
            routing_map = output[1].detach().reshape(window * batch, -1)
            if int(routing_map.sum()) != window * batch * self.topk:
                raise RuntimeError(f"layer {self.layers[local]}: the router dropped tokens ({int(routing_map.sum())} "
                                   f"assignments for {window * batch} tokens x top-{self.topk}); routes are recorded "
                                   f"for dropless routing only")
            experts = routing_map.nonzero()[:, 1].reshape(window, batch, self.topk)  # ascending per token
            self.windows.setdefault(local, []).append(experts.to("cpu", ROUTE_DTYPE))

        return record

    def start(self) -> None:
        """Forget earlier forwards and record the next ones (one static batch of a generate call)."""
        self.windows, self.recording = {}, True

    def stop(self) -> torch.Tensor:
        """This stage's routes of the batch recorded since ``start``: [batch, positions, stage layers, k]."""
        self.recording = False
        layers = [torch.cat(self.windows[local], 0) for local in sorted(self.windows)]  # [positions, batch, k] each
        self.windows = {}
        return torch.stack(layers, 2).transpose(0, 1).contiguous()

    def close(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles = []


def gather_layers(routes: torch.Tensor, pp_group, pp_size: int) -> torch.Tensor:
    """This stage's routes [batch, positions, stage layers, k] joined with the other stages' along the layers,
    in stage order (collective over the pipeline group)."""
    if pp_size == 1:
        return routes
    parts: list[torch.Tensor | None] = [None] * pp_size
    dist.all_gather_object(parts, routes, group=pp_group)
    return torch.cat(parts, 2)
