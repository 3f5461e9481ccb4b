"""The second design document: DataFlow nodes placed by decorators run in worker groups of their own."""

import json
import os
import subprocess
import sys

import pytest
import torch

from conftest import ROOT
from controller.dataflow.graph import DataFlow, DataFlowError, Node
from controller.dataflow.declarations import node_declaration, register_parallelism, register_placement, register_protocol
from controller.dataflow.placed_node import check_machine_devices, gather_values, split_value
from workers.data_proto import DataProto


def test_split_and_gather_rules():
    assert split_value(["a", "b", "c"], 2, "chunk") == [["a", "b"], ["c"]]
    assert split_value(["a", "b", "c"], 2, "broadcast") == [["a", "b", "c"]] * 2
    parts = split_value(torch.arange(5), 2, "chunk")
    assert [p.tolist() for p in parts] == [[0, 1, 2], [3, 4]]
    proto = DataProto({"x": torch.arange(4)})
    assert [p.batch["x"].tolist() for p in split_value(proto, 3, "chunk")] == [[0, 1], [2], [3]]
    assert split_value(0.7, 2, "chunk") == [0.7, 0.7]  # a setting, not data
    assert gather_values([["a", "b"], ["c"]], "concat") == ["a", "b", "c"]
    assert gather_values([torch.tensor([1]), torch.tensor([2, 3])], "concat").tolist() == [1, 2, 3]
    assert gather_values([["x"], ["y"]], "rank0") == ["x"]
    assert gather_values([1, 2], "all") == [1, 2]


def test_declarations_and_their_checks():
    @register_placement("actor", devices=["cuda:0", "cuda:1"])
    @register_parallelism("actor", strategy="TP")
    def generate(prompts):
        return prompts

    declaration = node_declaration(generate)
    assert declaration.devices == ("cuda:0", "cuda:1") and declaration.protocol == ("broadcast", "rank0")
    assert node_declaration(register_protocol("actor", gather="all")(generate)).protocol == ("broadcast", "all")
    with pytest.raises(ValueError, match=r"node 'actor' is placed on cuda:1, which this machine does not have; it has "
                                         r"\['cpu', 'cuda:0'\]"):
        check_machine_devices([declaration], gpus=1)
    with pytest.raises(ValueError, match=r"device\(s\) \['gpu:0'\] are not 'cpu', 'cpu:N' or 'cuda:N'"):
        register_placement("x", devices=["gpu:0"])
    with pytest.raises(ValueError, match=r"strategy 'PP' is not one of \['DP', 'TP'\]"):
        register_parallelism("x", strategy="PP")
    with pytest.raises(ValueError, match="mix CPU and GPU"):
        register_placement("x", devices=["cpu:0", "cuda:0"])
    with pytest.raises(DataFlowError, match="its function is declared for node 'actor'"):
        DataFlow([Node("generate", generate, "prompts", "responses")], [])
    if not torch.cuda.is_available():  # refused when the DataFlow is built, before any process starts
        with pytest.raises(DataFlowError, match="placed on cuda:0, which this machine does not have; it has \\['cpu'\\]"):
            DataFlow([Node("actor", generate, "prompts", "responses")], [])


@pytest.fixture(scope="module")
def documents(tmp_path_factory):
    """The document's placed DataFlow as written, then the same flow streamed on chunks, in one process
    (``tests/documents/streaming_dataflow.py`` runs ``dataflow_document.py`` first): its output, the nodes'
    log, the model."""
    from controller.models.builtin import resolve_model_path

    tmp_path = tmp_path_factory.mktemp("documents")
    model = resolve_model_path("builtin:tiny-arithmetic", tmp_path)
    log = tmp_path / "nodes.jsonl"
    proc = subprocess.run([sys.executable, str(ROOT / "tests" / "documents" / "streaming_dataflow.py"), model, str(log)],
                          capture_output=True, text=True, timeout=300, cwd=tmp_path,
                          env={**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return proc, log, model


def test_the_second_documents_placed_dataflow_runs_as_written(documents):
    """Each placed node runs in its declared number of processes, none of them the driver; the TP node's
    ranks share one process group and get the same input, and transformers' TP plan shards the model over them;
    the output equals HF's generate on the whole model in the driver."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    proc, log, model = documents
    driver = int(proc.stdout.split("driver pid: ")[1].split()[0])
    calls = [json.loads(line) for line in log.read_text().splitlines()]
    actor = [c for c in calls if c["node"] == "actor"]
    reward = [c for c in calls if c["node"] == "reward_model"]
    assert sorted(c["rank"] for c in actor) == [0, 1] and {c["world_size"] for c in actor} == {2}
    assert len({c["pid"] for c in actor}) == 2 and {c["device"] for c in actor} == {"cpu:0", "cpu:1"}
    assert sorted(actor[0]["input"]["tp_group_pids"]) == sorted(c["pid"] for c in actor)
    assert all(c["input"]["prompts"] == ["1+2=", "3+4=", "5+6="] for c in actor)  # TP: the same input on each
    assert all(c["input"]["q_proj_local"] == [64, 128] for c in actor)  # transformers' TP plan: half the rows each
    assert len(reward) == 1 and reward[0]["world_size"] == 1 and reward[0]["device"] == "cpu:2"
    assert driver not in {c["pid"] for c in calls} and reward[0]["pid"] not in {c["pid"] for c in actor}
    tokenizer = AutoTokenizer.from_pretrained(model, padding_side="left")
    hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
    inputs = tokenizer(["1+2=", "3+4=", "5+6="], return_tensors="pt", padding=True)
    expected = tokenizer.batch_decode(hf.generate(**inputs, max_new_tokens=6, do_sample=False,
                                                  pad_token_id=tokenizer.pad_token_id), skip_special_tokens=True)
    responses = json.loads(proc.stdout.split("Generated responses: ")[1].splitlines()[0])
    assert responses == expected and reward[0]["input"] == expected
    assert "Rewards: [1.2000000476837158, 0.800000011920929, 1.5]" in proc.stdout


def test_the_placed_reward_streams_on_the_actors_chunks_with_the_unchunked_and_in_driver_outputs(documents):
    """The document's flow with ``chunks=3`` on the actor (TP over two processes) and the reward model (a third):
    the reward's first chunk starts before generation ends, by the run's timeline; the responses and rewards
    equal the unchunked placed run's and the in-driver chunked run's."""
    proc = documents[0]
    out = json.loads(proc.stdout.split("RESULT ")[1].splitlines()[0])
    placed, chunked, driver = out["placed"], out["placed_chunked"], out["driver_chunked"]
    assert len(placed["responses"]) == 6 and placed["rewards"] == [float(sum(c.isdigit() for c in r))
                                                                   for r in placed["responses"]]
    assert chunked["responses"] == placed["responses"] == driver["responses"]
    assert chunked["rewards"] == placed["rewards"] == driver["rewards"]
    calls = {(node, chunk): (start, end) for node, chunk, start, end in chunked["timeline"]}
    assert sorted(calls) == [("actor", i) for i in range(3)] + [("reward_model", i) for i in range(3)]
    assert calls[("reward_model", 0)][0] < calls[("actor", 2)][1]  # scoring began while the actor generated
    assert all(calls[("reward_model", i)][0] >= calls[("actor", i)][1] for i in range(3))
    assert [(node, chunk) for node, chunk, *_ in placed["timeline"]] == [("actor", None), ("reward_model", None)]
