"""HF checkpoint -> megatron shards -> HF checkpoint is bit-exact at every layout."""

import json

import pytest
import torch

from conftest import TESTS, run_torchrun
from tiny_models import all_tensors, make_llama


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
    from transformers import AutoConfig

    assert AutoConfig.from_pretrained(tmp_path / "exported").architectures == AutoConfig.from_pretrained(source).architectures
