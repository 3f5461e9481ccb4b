"""The hybrid engine on a real megatron actor: generation weights, bytes, and training after return (the three
cases in one launch, each its own actors on the same processes)."""

import json

import pytest
import torch

from conftest import TESTS, run_torchrun
from hybridengine.model.hf_mapping import cut_shard, hf_source
from hybridengine.parallel.layout import ParallelLayout
from hybridengine.model.spec import ModelSpec
from hybridengine.reshard.plan import GenerationLayout, plan_reshard
from hybridengine.reshard.weight_plan import expected_bytes_received
from hybridengine.model.catalogue import stage_params
from tiny_models import make_llama
from workers.megatron.hf_checkpoint import HFCheckpointReader


# More training -> generation pairs (PP2 x DP2 among them) are exercised without training in test_resharder.py.
# In bf16 the engine moves bf16 shards: exactly the lower bound, at 2 bytes an element instead of 4.
CASES = [((2, 1), (1, 1), "fp32"), ((2, 2), (2, 1), "fp32"), ((2, 2), (2, 1), "bf16")]


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    """(train, gen, precision) -> its output directory; the three cases run in one launch of 4 processes."""
    model = make_llama(tmp_path_factory.mktemp("model"))
    dirs = {case: tmp_path_factory.mktemp("hybrid") for case in CASES}
    listing = tmp_path_factory.mktemp("cases") / "cases.json"
    listing.write_text(json.dumps([{"model": str(model), "out": str(out), "tp": train[0], "pp": train[1],
                                    "gen_tp": gen[0], "gen_pp": gen[1], "precision": precision}
                                   for (train, gen, precision), out in dirs.items()]))
    proc = run_torchrun(TESTS / "megatron" / "hybrid_program.py", ["--cases", str(listing)], 4, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-5000:]
    return dirs


@pytest.mark.parametrize("train,gen,precision", CASES, ids=["TP2xDP2->TP1", "TP2xPP2->TP2", "TP2xPP2->TP2-bf16"])
def test_actor_reshards_and_trains_on_as_if_it_never_had(launched, train, gen, precision):
    tmp_path = launched[(train, gen, precision)]
    result = torch.load(tmp_path / "hybrid.pt", weights_only=False)

    spec = ModelSpec.from_pretrained(tmp_path / "trained")
    reader = HFCheckpointReader(tmp_path / "trained")  # the trained weights, exported independently (in `precision`)
    element_size = {"fp32": 4, "bf16": 2}[precision]
    plan = plan_reshard(ParallelLayout.for_world(4, *train), GenerationLayout(*gen))
    for rank, rank_stats in enumerate(result["micro_dp"]["stats"]):
        assert rank_stats["reshard/bytes_received"] == expected_bytes_received(spec, plan, rank, element_size)
    bytes_by_method = {}
    for method in ("micro_dp", "full_allgather", "tp_pp_gather"):
        stats, weights = result[method]["stats"], result[method]["weights"]
        bytes_by_method[method] = sum(s["reshard/bytes_received"] for s in stats)
        for rank_stats, rank_weights in zip(stats, weights):
            gtp, gpp = rank_stats["gen_tp_rank"], rank_stats["gen_pp_rank"]
            expected = {p.name: cut_shard(hf_source(p.name, spec, gpp, gen[1]), reader.read, spec, gtp, gen[0])
                        for p in stage_params(spec, gen[0], gen[1], gpp)}
            assert rank_weights.keys() == expected.keys()
            for name, tensor in expected.items():
                assert rank_weights[name].dtype == {"fp32": torch.float32, "bf16": torch.bfloat16}[precision]
                assert torch.equal(rank_weights[name], tensor), (method, name)
    # Equal to the TP/PP gather only when a micro-DP group is a whole model-parallel group (t_g = p_g = 1).
    assert bytes_by_method["micro_dp"] <= bytes_by_method["tp_pp_gather"] <= bytes_by_method["full_allgather"]
    if gen != (1, 1):
        assert bytes_by_method["micro_dp"] * 2 < bytes_by_method["tp_pp_gather"]
    first, second = result["first"], result["second"]
    assert first[0] == first[1]
    assert second[0] == second[1]  # the resharded actor trains on exactly like its twin
