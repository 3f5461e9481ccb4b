"""The second design document's placed DataFlow, as written, with CPU devices and a local tiny model.

    python dataflow_document.py MODEL_DIR LOG_FILE

Each node function appends (node, pid, rank, world size, its input) to LOG_FILE, so the test can see where
it ran; the actor's also gathers every TP rank's pid over the node's process group, and loads the model
with transformers' tensor-parallel plan, which shards it over the node's processes (logged: the local
shape of a query projection).
"""

import json
import os
import sys

import torch
import torch.distributed as dist

from hybridflow import DataFlow, Node, node_context, register_parallelism, register_placement

MODEL, LOG = sys.argv[1], sys.argv[2]


def log(node, value):
    ctx = node_context()
    with open(LOG, "a") as f:
        f.write(json.dumps({"node": node, "pid": os.getpid(), "rank": ctx.rank, "world_size": ctx.world_size,
                            "device": ctx.device, "input": value}) + "\n")


@register_placement("actor", devices=["cpu:0", "cpu:1"])
@register_parallelism("actor", strategy="TP")
def hf_actor_generate(prompts):
    from transformers import AutoModelForCausalLM, AutoTokenizer, DistributedConfig

    tokenizer = AutoTokenizer.from_pretrained(MODEL, padding_side="left")
    model = AutoModelForCausalLM.from_pretrained(MODEL, dtype=torch.float32,
                                                 distributed_config=DistributedConfig(tp_plan="auto"))
    q_proj = model.model.layers[0].self_attn.q_proj.weight
    inputs = tokenizer(prompts, return_tensors="pt", padding=True)
    outputs = model.generate(**inputs, max_new_tokens=6, do_sample=False, pad_token_id=tokenizer.pad_token_id)
    pids = [None] * node_context().world_size
    dist.all_gather_object(pids, os.getpid(), group=node_context().process_group)  # the node's TP group
    log("actor", {"prompts": list(prompts), "tp_group_pids": pids, "q_proj_local": list(q_proj.to_local().shape)})
    return tokenizer.batch_decode(outputs, skip_special_tokens=True)


@register_placement("reward_model", devices=["cpu:2"])
def mock_reward_score(responses):
    log("reward_model", list(responses))
    return torch.tensor([1.2, 0.8, 1.5])


actor_node = Node(name="actor", func=hf_actor_generate, input_type="prompts", output_type="responses")
reward_node = Node(name="reward_model", func=mock_reward_score, input_type="responses", output_type="rewards")
dataflow = DataFlow(nodes=[actor_node, reward_node], edges=[("actor", "reward_model")])

if __name__ == "__main__":
    prompts = ["1+2=", "3+4=", "5+6="]
    result = dataflow.run(input_data={"prompts": prompts})
    print("driver pid:", os.getpid())
    print("Generated responses:", json.dumps(result["responses"]))
    print("Rewards:", result["rewards"].tolist())
    dataflow.shutdown()
