"""HF checkpoint -> megatron shards -> HF checkpoint is bit-exact at every layout (the three kinds exported in
one launch, each by worker groups of its own)."""

import json

import pytest
import torch

from conftest import TESTS, run_torchrun
from tiny_models import all_tensors, make_llama, make_qwen2_5_vl


KINDS = ("llama", "qwen2-tied", "llama-critic", "qwen2.5-vl")


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """kind -> (the source checkpoint, the directory its export went to); one launch exports all three."""
    dirs, cases = {}, []
    for kind in KINDS:
        root = tmp_path_factory.mktemp(kind)
        if kind == "qwen2.5-vl":  # the vision tower replicated on the first (only) stage, TP2 x DP2
            source = make_qwen2_5_vl(root / "source")
        else:
            source = make_llama(root / "source", tie=kind == "qwen2-tied", qkv_bias=kind == "qwen2-tied",
                                classification=kind == "llama-critic")
        dirs[kind] = source, root
        cases.append({"model": str(source), "out": str(root), "tp": 2, "pp": 1 if kind == "qwen2.5-vl" else 2,
                      "precision": "fp32"})
    listing = tmp_path_factory.mktemp("exports") / "cases.json"
    listing.write_text(json.dumps(cases))
    proc = run_torchrun(TESTS / "megatron" / "parity_program.py", ["--role", "export", "--cases", str(listing)], 4)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-5000:]
    return dirs


@pytest.mark.parametrize(
    "kind,tp,pp,nproc",
    # TP2 x PP2 splits both ways at once; the TP-only and PP-only layouts import the same way (test_actor_parity).
    [("llama", 2, 2, 4), ("qwen2-tied", 2, 2, 4), ("llama-critic", 2, 2, 4), ("qwen2.5-vl", 2, 1, 4)],
)
def test_import_then_export_is_bit_exact(exported, kind, tp, pp, nproc):
    source, tmp_path = exported[kind]
    original, exported = all_tensors(source), all_tensors(tmp_path / "exported")
    assert exported.keys() == original.keys()
    for name, tensor in original.items():
        assert exported[name].dtype == tensor.dtype and torch.equal(exported[name], tensor), name
    if pp > 1:  # one file per pipeline stage, none holding the whole model
        files = set(json.loads((tmp_path / "exported" / "model.safetensors.index.json").read_text())["weight_map"].values())
        assert len(files) == pp
    from transformers import AutoConfig

    assert AutoConfig.from_pretrained(tmp_path / "exported").architectures == AutoConfig.from_pretrained(source).architectures
    if kind == "qwen2.5-vl":  # with what its image processor and chat template need
        for extra in ("preprocessor_config.json", "tokenizer_config.json"):
            assert (tmp_path / "exported" / extra).read_bytes() == (source / extra).read_bytes()
