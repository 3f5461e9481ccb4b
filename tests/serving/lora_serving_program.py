"""Run under torchrun (1 rank): a LoRA actor and its colocated vLLM rollout serving the adapters unmerged
(``lora_sync: adapter``) behind a replica's endpoint. A request is served; the actor's adapters change (as a
step would change them: B moved off zero, here from the controller's thread while the rank serves, since the
rank's one call thread is busy serving); ``POST /update`` (``finish``) brings them in; the same request is
served again. Writes OUT/lora_serving.pt: both served replies, the update's reply, and, once serving stopped,
the actor's log-probs of each reply's tokens."""

import argparse
import json
import os
import urllib.request
from types import SimpleNamespace

import torch

from controller import ResourcePool, WorkerGroup
from controller.runtime.process_exit import exit_process
from controller.runtime.torchrun_backend import TorchrunRuntime
from workers.actor import Actor
from workers.megatron.lora import LoRAConfig
from workers.rollout import Rollout
from workers.rollout.serving.api_key import bearer, new_api_key

from serving_program import log_probs_of  # noqa: E402  (the tests folder is on the path under torchrun)

KEY = new_api_key()
PROMPT = [5, 9, 33, 7, 100, 4]
LORA = {"rank": 4, "alpha": 8.0}


def post(address: str, path: str, body: dict) -> dict:
    request = urllib.request.Request(address + path, data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json", **bearer(KEY)})
    return json.loads(urllib.request.urlopen(request, timeout=120).read())


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("model")
    parser.add_argument("out")
    args = parser.parse_args()
    pool = ResourcePool([int(os.environ["WORLD_SIZE"])])
    actor = WorkerGroup(pool, Actor, role="actor", kwargs=dict(
        model_path=args.model, engine={"precision": "fp32", "micro_batch_size": 1}, optim={"lr": 1e-3}, lora=LORA))
    rollout = WorkerGroup(pool, Rollout, role="rollout", kwargs=dict(model_path=args.model, config={
        "engine": "vllm", "server": True, "lora_sync": "adapter", "max_prompt_length": 8,
        "sampling": {"max_new_tokens": 8},
        "lora_adapter": LoRAConfig(**LORA)}))
    (started,) = rollout.start_serving(KEY)
    serving = rollout.serve.submit()
    address = started["address"]
    request = {"prompt_ids": PROMPT, "sampling": {"greedy": True, "ignore_eos": True}}
    first = post(address, "/generate", request)
    engine = TorchrunRuntime.get().host.workers["actor"].engine
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for adapter in engine.adapters.values():
            for b in adapter.lora_B.values():
                b.add_(torch.randn(b.shape, generator=g) * 0.5)
    update = post(address, "/update", {"policy": "finish"})
    second = post(address, "/generate", request)
    post(address, "/stop", {})
    serving.result()
    replies = [SimpleNamespace(prompt_ids=PROMPT, response_ids=r["token_ids"], response_mask=[1] * len(r["token_ids"]))
               for r in (first, second)]
    now = dict(zip(("first", "second"), log_probs_of(actor, replies, pad=0)))  # the actor's, as the server test's
    torch.save({"first": first, "second": second, "update": update, "now": now},
               os.path.join(args.out, "lora_serving.pt"))


if __name__ == "__main__":
    main()
    exit_process(0)
