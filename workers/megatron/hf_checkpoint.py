"""Hugging Face checkpoint directories in and out of a megatron model shard.

Import: every rank opens the safetensors files lazily and reads only the
rows or columns of its own TP/PP shard (and of its experts' expert-TP
shards). Export: the TP ranks of each pipeline stage gather their shards,
TP rank 0 of DP replica 0 merges them into HF tensors and writes one
safetensors file per stage; a mixture of experts' routed experts are
gathered over the expert-TP ranks and written, a file per stage and
expert-parallel rank, by the first replica of each. Together with the index
and config that rank 0 writes, transformers loads the directory directly.
No rank ever holds the whole model.
"""

from __future__ import annotations

import json
import os
import shutil
import struct
from pathlib import Path
from typing import Iterable

import torch
import torch.distributed as dist
from safetensors import safe_open
from safetensors.torch import save_file

from hybridengine.model.catalogue import ExpertShard
from hybridengine.model.hf_mapping import cut_shard, hf_source, merge_shards
from hybridengine.model.spec import ModelSpec

__all__ = ["CheckpointError", "HFCheckpointReader", "load_hf_shard", "export_hf_shard", "write_hf_index"]


class CheckpointError(ValueError):
    """A checkpoint directory is missing files, or a file is truncated or lacks a tensor."""


def _safetensors_extent(path: Path) -> tuple[int, list[str]]:
    """Bytes the header says the file holds, and its tensor names."""
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) < 8:
            raise CheckpointError(f"{path} is truncated: {len(raw)} bytes, not even a safetensors header")
        header_len = struct.unpack("<Q", raw)[0]
        header_raw = f.read(header_len)
    if len(header_raw) < header_len:
        raise CheckpointError(f"{path} is truncated inside its header ({len(header_raw)} of {header_len} bytes)")
    header = json.loads(header_raw)
    names = [k for k in header if k != "__metadata__"]
    end = max((header[k]["data_offsets"][1] for k in names), default=0)
    return 8 + header_len + end, names


class HFCheckpointReader:
    """Lazy, slice-wise access to the tensors of a HF checkpoint directory."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        index_file = self.path / "model.safetensors.index.json"
        if index_file.is_file():
            weight_map = json.loads(index_file.read_text())["weight_map"]
            files = sorted(set(weight_map.values()))
        elif (self.path / "model.safetensors").is_file():
            files, weight_map = ["model.safetensors"], None
        else:
            raise CheckpointError(
                f"{self.path} has no model.safetensors or model.safetensors.index.json; "
                "save the model with safe_serialization=True"
            )
        self.file_of: dict[str, Path] = {}
        for name in files:
            file = self.path / name
            if not file.is_file():
                raise CheckpointError(f"{file} is listed in model.safetensors.index.json but missing")
            expected, tensors = _safetensors_extent(file)
            actual = file.stat().st_size
            if actual < expected:
                raise CheckpointError(f"{file} is truncated: its header describes {expected} bytes, the file has {actual}")
            for tensor in tensors:
                self.file_of[tensor] = file
        if weight_map is not None:
            missing = sorted(set(weight_map) - set(self.file_of))
            if missing:
                raise CheckpointError(f"tensors {missing[:5]} are in the index but in none of its files")
        self._handles: dict[Path, object] = {}

    def read(self, name: str, index: tuple = ()) -> torch.Tensor:
        file = self.file_of.get(name)
        if file is None:
            raise CheckpointError(f"{self.path} has no tensor {name!r}")
        if file not in self._handles:
            self._handles[file] = safe_open(str(file), framework="pt")
        view = self._handles[file].get_slice(name)
        return view[index] if index else view[:]


def _trainable_state(model: torch.nn.Module) -> Iterable[tuple[str, torch.Tensor]]:
    """The model's own tensors by name; LoRA adapters (``workers.megatron.lora``) are not the model's."""
    for name, tensor in model.state_dict(keep_vars=True).items():
        if "_extra_state" in name or ".lora.lora_" in name or not isinstance(tensor, torch.Tensor):
            continue
        yield name, tensor


def load_hf_shard(model: torch.nn.Module, reader: HFCheckpointReader, spec: ModelSpec, tp_rank: int, tp: int, pp_rank: int, pp: int,
                  experts: ExpertShard | None = None, etp_rank: int = 0) -> None:
    """Copy this rank's shard of every parameter of ``model`` from the checkpoint; routed experts those of
    ``experts``, cut for expert-TP rank ``etp_rank``."""
    experts = experts or ExpertShard()
    with torch.no_grad():
        for name, param in _trainable_state(model):
            source = hf_source(name, spec, pp_rank, pp, experts)
            rank, size = (etp_rank, experts.size(tp)) if source.is_expert else (tp_rank, tp)
            shard = cut_shard(source, reader.read, spec, rank, size)
            if tuple(shard.shape) != tuple(param.shape):
                raise CheckpointError(
                    f"{name}: checkpoint gives shape {tuple(shard.shape)} for TP rank {rank}, "
                    f"the model expects {tuple(param.shape)}; does config.json match the weights?"
                )
            param.copy_(shard.to(param.dtype))


def export_hf_shard(
    model: torch.nn.Module, spec: ModelSpec, out_dir: Path, tp_rank: int, tp: int, pp_rank: int, pp: int, tp_group, write: bool,
    dtype: torch.dtype | None = None, experts: ExpertShard | None = None, etp_group=None, write_experts: bool = False,
    replaced: dict[str, torch.Tensor] | None = None,
) -> dict[str, str]:
    """Gather the stage's TP shards; where ``write``, merge and save them (in ``dtype``; None: the model's).
    Routed experts (those of ``experts``) are gathered over ``etp_group`` and saved where ``write_experts``.
    ``replaced``: tensors written in place of the model's, by name (a LoRA model's merged weights).

    Returns the weight map of what this rank wrote.
    """
    experts = experts or ExpertShard()
    dense: dict[str, torch.Tensor] = {}
    routed: dict[str, torch.Tensor] = {}
    for name, param in _trainable_state(model):
        if name == "output_layer.weight" and spec.tie_word_embeddings and not spec.is_value_model:
            continue  # a copy of the embedding that the last stage keeps for tied weights
        source = hf_source(name, spec, pp_rank, pp, experts)
        size, group, writes, into = ((experts.size(tp), etp_group, write_experts, routed) if source.is_expert
                                     else (tp, tp_group, write, dense))
        param = (replaced or {}).get(name, param)
        local = param.detach().to(dtype or param.dtype).contiguous()
        if size > 1 and source.kind != "replicated":
            shards = [torch.empty_like(local) for _ in range(size)]
            dist.all_gather(shards, local, group=group)
        else:
            shards = [local]
        if writes:
            into.update({k: v.clone() for k, v in merge_shards(source, shards, spec).items()})
    weight_map = {}
    stage_file = f"model-{pp_rank + 1:05d}-of-{pp:05d}"
    for tensors, file_name, writes in (
            (dense, f"{stage_file}.safetensors", write),
            (routed, f"{stage_file}-experts-{experts.ep_rank + 1:03d}-of-{experts.ep:03d}.safetensors",
             write_experts and spec.moe is not None)):
        if writes:
            save_file(tensors, str(out_dir / file_name), metadata={"format": "pt"})
            weight_map.update({name: file_name for name in tensors})
    return weight_map


def write_hf_index(out_dir: Path, weight_maps: list[dict[str, str]], config_source: Path,
                   dtype: torch.dtype | None = None) -> None:
    """The safetensors index, the tokenizer and chat template, a vision-language model's image processor config,
    and config.json (its dtype set to ``dtype`` when given)."""
    weight_map = {k: v for m in weight_maps for k, v in m.items()}
    total = sum(os.path.getsize(out_dir / f) for f in set(weight_map.values()))
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (out_dir / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    for extra in ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                  "chat_template.jinja", "chat_template.json", "preprocessor_config.json", "processor_config.json"):
        if (config_source / extra).is_file():
            shutil.copy(config_source / extra, out_dir / extra)
    if dtype is not None and (out_dir / "config.json").is_file():
        config = json.loads((out_dir / "config.json").read_text())
        name = str(dtype).removeprefix("torch.")
        config.update({key: name for key in ("torch_dtype", "dtype") if key in config} or {"torch_dtype": name})
        (out_dir / "config.json").write_text(json.dumps(config, indent=2))
