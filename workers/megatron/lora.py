"""LoRA on megatron-core's tensor-parallel linears: low-rank adapters beside a frozen base.

An adapted linear computes ``W x + (alpha / r) B A x`` with ``A`` [r, in] and
``B`` [out, r], as PEFT's ``LoraLayer`` does, with targets named as in HF
(``q_proj`` ... ``down_proj``). megatron fuses some of them, so one megatron
linear may carry several adapters:

- ``linear_qkv`` (column-parallel) carries q, k and v, each with its own A
  (replicated over TP) and its B cut to the rank's heads (q) or query groups
  (k, v); their outputs are interleaved group by group, as megatron lays out
  the fused QKV rows ([q heads of group g, k of g, v of g] for each local group);
- ``linear_fc1`` (column-parallel) carries gate and up: [gate_r; up_r] per rank;
- ``linear_proj`` (o) and ``linear_fc2`` (down) are row-parallel: A is cut
  along the input features like the weight's columns, B is replicated, and
  the rank-r partial products are summed over TP before B.

The gradients are those of the unsharded adapters: a column adapter's
``A x`` enters megatron's copy-to-TP region (identity forward, all-reduce
backward), so every rank's A sees the whole gradient; a row adapter's partial
product enters the reduce-from-TP region (all-reduce forward, identity backward).

The adapters ride on forward hooks of the linears, so megatron's own layers
and their kernels are untouched. Sequence parallelism (a mixture of experts at
TP > 1) scatters a column linear's input, which a hook would see cut: refused.
"""

from __future__ import annotations

import contextlib
import types
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from hybridengine.model.catalogue import layer_index, projections

__all__ = ["LORA_TARGETS", "LoRAConfig", "LoRAAdapter", "adapters_disabled", "attach_lora", "check_lora", "cut_adapter",
           "adapted_linears", "fused_delta", "lora_parameters", "merged_weights", "whole_adapters"]

# The HF projections an adapter may target ("all-linear": every one). Which megatron linear holds each, its part
# there, its shape and how TP cuts it are the catalogue's (``hybridengine.model.catalogue.projections``).
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True)
class LoRAConfig:
    """``rank`` 0: off. ``target_modules``: HF names (q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj,
    down_proj) or "all-linear"."""

    rank: int = 0
    alpha: float = 16.0
    dropout: float = 0.0
    target_modules: tuple[str, ...] | str = "all-linear"
    # a PEFT adapter directory (a LoRA job's export) to start the adapters from, instead of PEFT's initialisation
    adapter_path: str | None = None

    def __post_init__(self) -> None:
        if isinstance(self.target_modules, (list, tuple)):
            chosen = tuple(self.target_modules)  # a YAML list, or "all-linear" read as a one-item list
            object.__setattr__(self, "target_modules", "all-linear" if chosen == ("all-linear",) else chosen)
        problems = []
        if not isinstance(self.rank, int) or isinstance(self.rank, bool) or self.rank < 0:
            problems.append(f"rank must be a non-negative integer (0: LoRA off), got {self.rank!r}")
        if not isinstance(self.alpha, (int, float)) or self.alpha <= 0:
            problems.append(f"alpha must be a positive number, got {self.alpha!r}")
        if not isinstance(self.dropout, (int, float)) or not 0.0 <= self.dropout < 1.0:
            problems.append(f"dropout must be in [0, 1), got {self.dropout!r}")
        targets = self._chosen()
        unknown = [t for t in targets if t not in LORA_TARGETS]
        if unknown or not targets:
            problems.append(f"target_modules {list(targets) if unknown else targets!r}: "
                            f"{'unknown ' + repr(unknown) if unknown else 'none given'}; valid: "
                            f"{list(LORA_TARGETS)} or 'all-linear'")
        if problems:
            raise ValueError("invalid LoRA config: " + "; ".join(problems))

    @property
    def enabled(self) -> bool:
        return self.rank > 0

    def _chosen(self) -> tuple[str, ...]:
        """``target_modules`` as a tuple of names, "all-linear" expanded."""
        chosen = self.target_modules
        if chosen == "all-linear":
            return tuple(LORA_TARGETS)
        return (chosen,) if isinstance(chosen, str) else tuple(chosen)

    @property
    def targets(self) -> tuple[str, ...]:
        """The HF targets adapted, in a fixed order."""
        chosen = self._chosen()
        return tuple(t for t in LORA_TARGETS if t in chosen)

    @property
    def scaling(self) -> float:
        return self.alpha / self.rank


class LoRAAdapter(torch.nn.Module):
    """The adapters of one megatron linear: ``parts`` maps an HF target's part (q, k, v, gate, up, o, down) to
    its (A, B) pair on this TP rank. Added to the linear's output by a forward hook."""

    def __init__(self, linear: str, parts: dict[str, tuple[int, int]], rank: int, scaling: float, dropout: float,
                 tp_group, groups: int = 1, dtype: torch.dtype = torch.float32, device=None, tp: int = 1,
                 tp_rank: int = 0, seed: int = 0, row_parallel: bool = False) -> None:
        """``parts``: part -> (in features, out features) of the whole (unsharded) projection; ``groups``: the
        local query groups (the fused QKV's interleave); ``seed``: A's initialisation, the same for the whole A
        at any TP size, so every rank holds the same replicated A and its own cut of a cut one; ``row_parallel``:
        TP cuts the linear's input (o, down)."""
        from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes

        super().__init__()
        self.linear, self.scaling, self.tp_group, self.groups = linear, scaling, tp_group, groups
        self.row_parallel = row_parallel
        self.dropout = torch.nn.Dropout(dropout) if dropout > 0 else torch.nn.Identity()
        self.enabled = True  # False: the linear computes its base weight alone (``adapters_disabled``)
        self.lora_A = torch.nn.ParameterDict()
        self.lora_B = torch.nn.ParameterDict()
        for index, (part, (fan_in, fan_out)) in enumerate(parts.items()):
            # PEFT's default: A Kaiming-uniform over the whole input, B zero (so W starts unchanged)
            whole = torch.empty(rank, fan_in, dtype=torch.float32)
            torch.nn.init.kaiming_uniform_(whole, a=5 ** 0.5, generator=torch.Generator().manual_seed(seed + index))
            a, b = cut_adapter(row_parallel, whole, torch.zeros(fan_out, rank), tp, tp_rank)
            self.lora_A[part] = torch.nn.Parameter(a.to(device, dtype).clone())  # its own storage, not the whole one
            self.lora_B[part] = torch.nn.Parameter(b.to(device, dtype).clone())
            # The side cut over TP is marked as megatron marks its sharded weights, so the gradient norm counts
            # it on every TP rank (the replicated side: once).
            cut, dim = (self.lora_A[part], 1) if self.row_parallel else (self.lora_B[part], 0)
            set_tensor_model_parallel_attributes(cut, is_parallel=True, dim=dim, stride=1)

    def dropped_inputs(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        """Each part's input: ``x`` through a dropout mask of its own, as PEFT's separate q/k/v (gate/up)
        modules each draw one, in the update only. Outside it (old log-probs, reference, values, validation:
        the passes without gradients, or a module in eval mode) nothing is dropped."""
        if isinstance(self.dropout, torch.nn.Identity) or not (self.training and torch.is_grad_enabled()):
            return {part: x for part in self.lora_A}
        return {part: self.dropout(x) for part in self.lora_A}

    def delta(self, x: torch.Tensor) -> torch.Tensor:
        """What the adapters add to the linear's output for input ``x`` [..., in] (this rank's part)."""
        from megatron.core.tensor_parallel.mappings import (copy_to_tensor_model_parallel_region,
                                                            reduce_from_tensor_model_parallel_region)

        inputs = self.dropped_inputs(x)
        outs = {}
        for part, a in self.lora_A.items():
            h = torch.nn.functional.linear(inputs[part], a)  # [..., r]
            if self.row_parallel:
                h = reduce_from_tensor_model_parallel_region(h, self.tp_group)  # the partial products summed
            else:
                h = copy_to_tensor_model_parallel_region(h, self.tp_group)  # A's gradient summed over TP
            outs[part] = torch.nn.functional.linear(h, self.lora_B[part]) * self.scaling
        return _fuse_outputs(self.linear, outs, self.groups)

    def delta_weight(self) -> torch.Tensor:
        """``scaling x B A`` of every adapter, laid out as this rank's shard of the linear's weight (rows of the
        fused QKV interleaved group by group, [gate; up] for fc1): what merging adds to the weight."""
        return fused_delta(self.linear, {part: (self.lora_A[part], self.lora_B[part]) for part in self.lora_A},
                           self.scaling, self.groups)


def _fuse_outputs(linear: str, outs: dict[str, torch.Tensor], groups: int) -> torch.Tensor:
    """The parts' outputs (last dimension) as the linear's fused output lays them out: the QKV's interleaved
    [q of group g, k of g, v of g] for each of ``groups`` local query groups, fc1's [gate; up], else the one."""
    if linear.endswith("linear_qkv"):
        q, k, v = (outs[p] for p in ("q", "k", "v"))
        lead = q.shape[:-1]
        fused = torch.cat([t.reshape(*lead, groups, -1) for t in (q, k, v)], -1)
        return fused.reshape(*lead, -1)
    if linear.endswith("linear_fc1"):
        return torch.cat([outs["gate"], outs["up"]], -1)
    (only,) = outs.values()
    return only


def fused_delta(linear: str, parts: dict[str, tuple[torch.Tensor, torch.Tensor]], scaling: float,
                groups: int) -> torch.Tensor:
    """``scaling x B A`` of each part's (A, B), laid out as the linear's weight shard they are cut for: the
    fused QKV's rows interleaved over its ``groups`` local query groups, fc1's as [gate; up]."""
    # rows as outputs: the forward's layout over the transposed deltas, the input features leading
    return _fuse_outputs(linear, {part: ((b @ a) * scaling).t() for part, (a, b) in parts.items()}, groups).t()


def cut_adapter(row_parallel: bool, a: torch.Tensor, b: torch.Tensor, tp: int, tp_rank: int
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """A whole adapter's (A, B) cut for TP rank ``tp_rank`` of ``tp``: a row linear's A by its input columns, a
    column linear's B by its output rows (the rank's heads, query groups or FFN rows); the other side whole."""
    if tp == 1:
        return a, b
    if row_parallel:
        return a.chunk(tp, 1)[tp_rank], b
    return a, b.chunk(tp, 0)[tp_rank]


def check_lora(spec, config: LoRAConfig) -> None:
    """Refuse adapters the model cannot take: fused parts targeted apart, a rank above a target's dimensions,
    a mixture of experts (its experts are not adapted) or a model with no adaptable linear."""
    if not config.enabled:
        return
    if spec.moe is not None:
        raise ValueError(f"LoRA on a mixture of experts ({spec.architecture}) is not supported yet: its routed "
                         f"experts would stay frozen and unadapted")
    shapes = projections(spec)
    fused: dict[str, list[str]] = {}
    for name, projection in shapes.items():
        fused.setdefault(projection.linear, []).append(name)
    for linear, names in fused.items():
        chosen = [t for t in config.targets if t in names]
        if chosen and len(chosen) != len(names):
            raise ValueError(f"LoRA target_modules must take {names} together (megatron fuses them into "
                             f"{linear}); got {chosen}")
    for target in config.targets:
        fan_in, fan_out = shapes[target].fan_in, shapes[target].fan_out
        if config.rank > min(fan_in, fan_out):
            raise ValueError(f"LoRA rank {config.rank} exceeds {target}'s dimensions ({fan_in} in, {fan_out} out); "
                             f"use a rank of at most {min(fan_in, fan_out)}")


def attach_lora(module: torch.nn.Module, spec, config: LoRAConfig, tp: int, tp_group, tp_rank: int = 0,
                pp_rank: int = 0, pp: int = 1, seed: int = 0) -> dict[str, LoRAAdapter]:
    """Adapters on ``module``'s (pipeline stage ``pp_rank``'s GPTModel) targeted linears, the base frozen;
    returns them by linear name. A is initialised from ``seed`` and the model layer, whatever the layout.

    A fused linear takes an adapter for every part it fuses (q, k and v; gate and up): all of them must be
    targeted together (``check_lora``).
    """
    if not config.enabled:
        return {}
    check_lora(spec, config)
    shapes = projections(spec)
    by_linear: dict[str, list] = {}
    for target in config.targets:
        by_linear.setdefault(shapes[target].linear, []).append(shapes[target])
    groups = max(spec.num_query_groups // tp, 1)
    layers = spec.layers_of_stage(pp_rank, pp)
    module.requires_grad_(False)  # the base is frozen: no gradient, no optimizer state
    probe = next(module.parameters())
    adapters = {}
    for name, child in list(module.named_modules()):
        for linear, parts in by_linear.items():
            if name.endswith(linear) and ".layers." in name:
                layer = layers[layer_index(name)]
                adapter = LoRAAdapter(linear, {p.part: (p.fan_in, p.fan_out) for p in parts}, config.rank,
                                      config.scaling, config.dropout, tp_group, groups, probe.dtype, probe.device, tp,
                                      tp_rank, seed=(seed * 1_000_003 + layer) * 16 + 8 * linear.startswith("mlp"),
                                      row_parallel=parts[0].row_parallel)
                child.lora = adapter
                child.register_forward_hook(_add_delta)
                child.sharded_state_dict = types.MethodType(_sharded_state_dict, child)
                adapters[name] = adapter
    return adapters


def _add_delta(linear, args, output):
    if not linear.lora.enabled:
        return output
    out, bias = output
    return out + linear.lora.delta(args[0]).to(out.dtype), bias


def _sharded_state_dict(linear, prefix: str = "", sharded_offsets=(), metadata=None):
    """An adapted linear's sharded state dict (megatron's dist-checkpointing): the weight and bias cut as the
    linear cuts them, and each adapter's cut side along its own axis (B's rows for a column linear, A's
    columns for a row one); the other side is replicated over TP."""
    from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

    adapter = linear.lora
    if adapter.row_parallel:
        axes = {"weight": 1, **{f"lora.lora_A.{part}": 1 for part in adapter.lora_A}}
    else:
        axes = {"weight": 0, "bias": 0, **{f"lora.lora_B.{part}": 0 for part in adapter.lora_B}}
    return make_sharded_tensors_for_checkpoint(linear.state_dict(prefix="", keep_vars=True), prefix, axes,
                                               sharded_offsets, tp_group=linear.tp_group,
                                               dp_cp_group=(metadata or {})["dp_cp_group"])


def adapted_linears(module: torch.nn.Module) -> Iterator[tuple[str, torch.nn.Module, LoRAAdapter]]:
    """(name, linear, its adapter) of every linear of ``module`` that ``attach_lora`` adapted."""
    for name, child in module.named_modules():
        adapter = getattr(child, "lora", None)
        if isinstance(adapter, LoRAAdapter):
            yield name, child, adapter


@contextlib.contextmanager
def adapters_disabled(module: torch.nn.Module):
    """Within: ``module`` computes as its frozen base (every adapter off), e.g. the reference policy."""
    adapters = [adapter for _, _, adapter in adapted_linears(module)]
    for adapter in adapters:
        adapter.enabled = False
    try:
        yield
    finally:
        for adapter in adapters:
            adapter.enabled = True


def merged_weights(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The adapted linears' weights with their adapters merged (new tensors; the module is unchanged), by
    parameter name: what generation and export take in place of the frozen base's."""
    with torch.no_grad():
        return {f"{name}.weight": linear.weight + adapter.delta_weight().to(linear.weight.dtype)
                for name, linear, adapter in adapted_linears(module)}


def whole_adapters(module: torch.nn.Module, spec, tp: int, tp_group, pp_rank: int = 0, pp: int = 1
                   ) -> dict[tuple[int, str, str], tuple[torch.Tensor, torch.Tensor]]:
    """This stage's adapters whole (gathered over TP, where they live), by (model layer, linear, part) -> (A, B);
    collective over the TP group."""
    layers = spec.layers_of_stage(pp_rank, pp)
    out = {}
    for name, _, adapter in adapted_linears(module):
        for part in adapter.lora_A:
            a, b = adapter.lora_A[part].detach(), adapter.lora_B[part].detach()
            if tp > 1:  # the cut side back whole: a row adapter's A by its columns, a column adapter's B by its rows
                cut, dim = (a, 1) if adapter.row_parallel else (b, 0)
                pieces = [torch.empty_like(cut) for _ in range(tp)]
                torch.distributed.all_gather(pieces, cut.contiguous(), group=tp_group)
                whole = torch.cat(pieces, dim)
                a, b = (whole, b) if adapter.row_parallel else (a, whole)
            out[(layers[layer_index(name)], adapter.linear, part)] = (a, b)
    return out


def lora_parameters(module: torch.nn.Module) -> dict[str, torch.nn.Parameter]:
    """Every adapter parameter of ``module`` by name (what trains, is checkpointed and is synced)."""
    return {name: p for name, p in module.named_parameters() if ".lora.lora_" in name}
