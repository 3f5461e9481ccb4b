"""HF checkpoint -> megatron shards -> HF checkpoint is bit-exact at every layout."""

import json

import pytest
import torch

from conftest import TESTS, run_torchrun
from tiny_models import all_tensors, make_llama, make_qwen2_moe, make_qwen3_moe


@pytest.mark.parametrize(
    "kind,tp,pp,nproc",
    # TP2 x PP2 splits both ways at once; the TP-only and PP-only layouts import the same way (test_actor_parity).
    [("llama", 2, 2, 4), ("qwen2-tied", 2, 2, 4), ("llama-critic", 2, 2, 4)],
)
def test_import_then_export_is_bit_exact(tmp_path, kind, tp, pp, nproc):
    source = make_llama(
        tmp_path / "source", tie=kind == "qwen2-tied", qkv_bias=kind == "qwen2-tied", classification=kind == "llama-critic"
    )
    proc = run_torchrun(TESTS / "megatron" / "parity_program.py",
                        [str(source), str(tmp_path), "--tp", str(tp), "--pp", str(pp), "--role", "export"], nproc)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-5000:]
    original, exported = all_tensors(source), all_tensors(tmp_path / "exported")
    assert exported.keys() == original.keys()
    for name, tensor in original.items():
        assert exported[name].dtype == tensor.dtype and torch.equal(exported[name], tensor), name
    if pp > 1:  # one file per pipeline stage, none holding the whole model
        files = set(json.loads((tmp_path / "exported" / "model.safetensors.index.json").read_text())["weight_map"].values())
        assert len(files) == pp
    assert_loads_as(source, tmp_path / "exported")


def assert_loads_as(source, exported):
    from transformers import AutoConfig

    assert AutoConfig.from_pretrained(exported).architectures == AutoConfig.from_pretrained(source).architectures


@pytest.mark.parametrize("kind,tp,pp,ep,etp", [
    # Experts whole per rank, TP and PP around them; and one expert per rank (EP4 over four data-parallel ranks).
    ("qwen3-moe", 2, 2, 2, 1), ("qwen2-moe", 1, 1, 4, None),
])
def test_moe_import_then_export_is_bit_exact(tmp_path, kind, tp, pp, ep, etp):
    source = (make_qwen3_moe if kind == "qwen3-moe" else make_qwen2_moe)(tmp_path / "source")
    args = ["--tp", str(tp), "--pp", str(pp), "--ep", str(ep), "--role", "export"] + (["--etp", str(etp)] if etp else [])
    proc = run_torchrun(TESTS / "megatron" / "parity_program.py", [str(source), str(tmp_path), *args], 4)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-5000:]
    original, exported = all_tensors(source), all_tensors(tmp_path / "exported")
    assert exported.keys() == original.keys()  # every expert by name, each once
    for name, tensor in original.items():
        assert exported[name].dtype == tensor.dtype and torch.equal(exported[name], tensor), name
    weight_map = json.loads((tmp_path / "exported" / "model.safetensors.index.json").read_text())["weight_map"]
    # A file per stage for the dense tensors, and per stage and expert-parallel rank for the experts.
    assert len(set(weight_map.values())) == pp * (1 + ep)
    expert_files = {f for name, f in weight_map.items() if ".mlp.experts." in name}
    assert len(expert_files) == pp * ep and not expert_files & {f for n, f in weight_map.items() if ".experts." not in n}
    assert_loads_as(source, tmp_path / "exported")
