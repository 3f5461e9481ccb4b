"""The second design document's placed DataFlow with the reward streaming on chunks, against the same flow
unchunked and against its in-driver form; first, in the same process, the document's own code as written
(``dataflow_document.py``, run as a script: one Ray start for both).

    python streaming_dataflow.py MODEL_DIR LOG_FILE

The actor generates greedily with HF transformers: placed, on two CPU processes under the TP strategy with
transformers' tensor-parallel plan; in the driver, on the whole model. The reward model is placed on a third
process and scores each response on its own (row-wise), so chunking cannot change its output. Prints one
JSON line: each run's responses and rewards, and the chunked placed run's timeline.
"""

import functools
import json
import runpy
import sys
from pathlib import Path

import torch

from hybridflow import DataFlow, Node, node_context, register_parallelism, register_placement

MODEL = sys.argv[1]
PROMPTS = ["1+2=", "3+4=", "5+6=", "7+1=", "2+2=", "9+0="]


def generate(prompts):
    """Greedy responses; inside a placed TP node the model is sharded over the node's processes."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, DistributedConfig

    try:
        node_context()
        placed = {"distributed_config": DistributedConfig(tp_plan="auto")}
    except RuntimeError:  # the driver: the whole model here
        placed = {}
    tokenizer = AutoTokenizer.from_pretrained(MODEL, padding_side="left")
    model = AutoModelForCausalLM.from_pretrained(MODEL, dtype=torch.float32, **placed)
    inputs = tokenizer(list(prompts), return_tensors="pt", padding=True)
    outputs = model.generate(**inputs, max_new_tokens=6, do_sample=False, pad_token_id=tokenizer.pad_token_id)
    return tokenizer.batch_decode(outputs, skip_special_tokens=True)


def score(responses):
    """One score per response: the digits it holds."""
    return torch.tensor([float(sum(c.isdigit() for c in r)) for r in responses])


def flow(actor, reward, chunks=None):
    return DataFlow(nodes=[Node("actor", actor, "prompts", "responses", chunks=chunks),
                           Node("reward_model", reward, "responses", "rewards", chunks=chunks)],
                    edges=[("actor", "reward_model")])


placed_actor = register_parallelism("actor", strategy="TP")(
    register_placement("actor", devices=["cpu:0", "cpu:1"])(functools.partial(generate)))
placed_reward = register_placement("reward_model", devices=["cpu:2"])(functools.partial(score))

if __name__ == "__main__":
    runpy.run_path(str(Path(__file__).with_name("dataflow_document.py")), run_name="__main__")
    out = {}
    for name, dataflow in (("placed", flow(placed_actor, placed_reward)),
                           ("placed_chunked", flow(placed_actor, placed_reward, chunks=3)),
                           ("driver_chunked", flow(generate, score, chunks=3))):
        with dataflow:
            result = dataflow.run(input_data={"prompts": PROMPTS})
        out[name] = {"responses": result["responses"], "rewards": result["rewards"].tolist(),
                     "timeline": [[c.node, c.chunk, c.start, c.end] for c in dataflow.timeline]}
    print("RESULT " + json.dumps(out))
