"""Run under torchrun (2 ranks): an fp32 actor and its colocated vLLM rollout served through the OpenAI-compatible
endpoint, driven by the real ``openai`` client; then the calculator environment (with a user who keeps asking,
``talking_env.py``) as the built-in agent loop runs it and as a user's agent through the server, on the same
prompts and seeds. Writes OUT/serving.pt with what the client saw, the sessions' samples, the actor's
log-probs of those samples, and both agent batches."""

import argparse
import asyncio
import json
import os
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import torch

from controller import ResourcePool, WorkerGroup
from controller.data.arithmetic import word_problems
from controller.data.loader import PromptLoader
from controller.rl.schedules import with_sampling
from controller.runtime.process_exit import exit_process
from controller.serving import RolloutServer, session_samples
from controller.serving.served_rollout import ServedRollout
from workers.actor import Actor
from workers.data_proto import DataProto
from workers.rollout import Rollout
from workers.rollout.batch import sequence_tensors
from workers.rollout.config import RolloutConfig
from workers.rollout.sampling import SamplingConfig
from workers.rollout.serving.api_key import bearer, new_api_key

ROLLOUT = {"engine": "vllm", "server": True, "max_prompt_length": 900, "kv_cache_bytes": 64 << 20,
           "sampling": {"max_new_tokens": 12, "temperature": 1.0},
           "agent": {"tools": ["calculator"], "environment": "tests.serving.talking_env:KeepTalking",
                     "entrypoint": "tests.serving.talking_env:agent", "max_turns": 3, "max_response_length": 96}}
KEY = new_api_key()  # the job's: every endpoint, the replicas' included, answers only requests that carry it
TOOLS = [{"type": "function", "function": {"name": "calculator", "description": "Evaluate arithmetic.",
                                           "parameters": {"type": "object",
                                                          "properties": {"expression": {"type": "string"}},
                                                          "required": ["expression"]}}}]


def served(response) -> dict:
    """What the client saw of one non-streamed response's first choice: ids, log-probs, versions."""
    choice = response.choices[0]
    return {"prompt": response.model_extra["prompt_token_ids"], "ids": choice.model_extra["token_ids"],
            "log_probs": choice.model_extra["token_logprobs"], "versions": choice.model_extra["policy_versions"],
            "turns": response.model_extra["hybridflow"]["turns"]}


async def drive(url: str) -> dict:
    import openai

    out: dict = {}
    a = openai.AsyncOpenAI(base_url=f"{url}/sessions/a/v1", api_key=KEY)
    b = openai.AsyncOpenAI(base_url=f"{url}/sessions/b/v1", api_key=KEY)
    # Session a: a chat with tools, continued twice (once streamed), then its history rewritten.
    messages = [{"role": "user", "content": "What is 12*7?"}]
    first = await a.chat.completions.create(model="any-name", messages=messages, tools=TOOLS, temperature=1.0)
    out["a1"] = served(first)
    messages += [first.choices[0].message, {"role": "user", "content": "Check it."}]
    second = await a.chat.completions.create(model="policy", messages=messages, tools=TOOLS, temperature=1.0)
    out["a2"] = served(second)
    messages += [second.choices[0].message, {"role": "user", "content": "Sure?"}]
    stream = await a.chat.completions.create(model="policy", messages=messages, tools=TOOLS, temperature=1.0,
                                             stream=True)
    chunks = [chunk async for chunk in stream]
    last = chunks[-1].choices[0]
    out["a3"] = {"prompt": chunks[-1].model_extra["prompt_token_ids"], "ids": last.model_extra["token_ids"],
                 "log_probs": last.model_extra["token_logprobs"], "versions": last.model_extra["policy_versions"],
                 "text": "".join(c.choices[0].delta.content or "" for c in chunks),
                 "finish_reason": last.finish_reason}
    rewritten = await a.chat.completions.create(model="policy", messages=[{"role": "user", "content": "What is 7*12?"}],
                                                tools=TOOLS, temperature=1.0)
    out["a4"] = served(rewritten)
    # Session b, at the same time as a second request of its own: the other replica; and a text completion.
    b1, b2 = await asyncio.gather(
        b.completions.create(model="policy", prompt="1+2=", max_tokens=6, logprobs=True),
        b.chat.completions.create(model="policy", messages=[{"role": "user", "content": "hi"}], max_tokens=4))
    out["b1"] = {"prompt": b1.model_extra["prompt_token_ids"], "ids": b1.choices[0].model_extra["token_ids"],
                 "logprobs": b1.choices[0].logprobs.token_logprobs, "text": b1.choices[0].text}
    out["b2"] = served(b2)
    out["models"] = [m.id async for m in a.models.list()]
    try:
        await a.chat.completions.create(model="policy", messages=[{"role": "user", "content": "x"}], max_tokens=10_000)
    except openai.BadRequestError as exc:
        out["bad_request"] = str(exc)
    await a.close()
    await b.close()
    return out


def _post(address: str, path: str, body: dict):
    request = urllib.request.Request(address + path, data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json", **bearer(KEY)})
    return urllib.request.urlopen(request, timeout=120)


def updates_in_flight(addresses: list[str], prompt: list[int]) -> dict:
    """A long request streams from replica ``k``; once its first tokens are out, every replica takes the policy's
    weights (``POST /update``), by ``pause`` (the request goes on with them) and then by ``finish`` (the request
    ends first). Each request's tokens and policy versions, and each replica's answer to its update."""
    out = {}
    for k, policy in enumerate(("pause", "finish")):
        stream = _post(addresses[k], "/generate", {"prompt_ids": prompt, "stream": True, "sampling": {
            "max_new_tokens": 300, "ignore_eos": True, "greedy": True}})
        first = json.loads(stream.readline())

        def update(index):
            return json.loads(_post(addresses[index], "/update", {"policy": policy}).read())

        with ThreadPoolExecutor(len(addresses)) as pool:
            updates = pool.map(update, range(len(addresses)))
            chunks = [first] + [json.loads(line) for line in stream if line.strip()]
            replies = list(updates)
        out[policy] = {"versions": [v for c in chunks for v in c["versions"]], "replies": replies,
                       "finish_reason": chunks[-1]["finish_reason"]}
    return out


def log_probs_of(actor, samples, pad: int) -> list[torch.Tensor]:
    """The actor's log-probs of each sample's response tokens (every one: the test reads the masked-in ones)."""
    width_p = max(len(s.prompt_ids) for s in samples)
    width_r = max(len(s.response_ids) for s in samples)
    rows = len(samples)
    prompts = torch.full((rows, width_p), pad, dtype=torch.long)
    prompt_mask = torch.zeros(rows, width_p, dtype=torch.long)
    responses = torch.full((rows, width_r), pad, dtype=torch.long)
    real = torch.zeros(rows, width_r, dtype=torch.long)
    mask = torch.zeros(rows, width_r, dtype=torch.long)
    for i, s in enumerate(samples):
        prompts[i, width_p - len(s.prompt_ids):] = torch.tensor(s.prompt_ids)
        prompt_mask[i, width_p - len(s.prompt_ids):] = 1
        responses[i, :len(s.response_ids)] = torch.tensor(s.response_ids)
        real[i, :len(s.response_ids)] = 1
        mask[i, :len(s.response_ids)] = torch.tensor(s.response_mask)
    tensors = sequence_tensors(prompts, prompt_mask, responses, real, mask, torch.zeros(rows, width_r))
    out = actor.compute_log_prob(DataProto(tensors, meta_info={"temperature": 1.0}))
    return [out.batch["old_log_probs"][i, :len(s.response_ids)] for i, s in enumerate(samples)]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("model")
    parser.add_argument("out")
    args = parser.parse_args()
    pool = ResourcePool([int(os.environ["WORLD_SIZE"])])
    actor = WorkerGroup(pool, Actor, role="actor", kwargs=dict(
        model_path=args.model, engine={"precision": "fp32", "micro_batch_size": 2}, optim={"lr": 1e-3}))
    rollout = WorkerGroup(pool, Rollout, role="rollout", kwargs=dict(model_path=args.model, config=ROLLOUT))
    started = rollout.start_serving(KEY)
    serving = rollout.serve.submit()
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(args.model)
    server = RolloutServer(tokenizer, [s["address"] for s in started], SamplingConfig(max_new_tokens=12),
                           max_model_len=started[0]["max_model_len"], api_key=KEY).start()
    server.open_session("a", seed=100)
    server.open_session("b", seed=200)
    seen = asyncio.run(drive(server.url))
    in_flight = updates_in_flight([s["address"] for s in started], seen["a1"]["prompt"][:20])
    placed = {sid: server.router.replica(sid) for sid in ("a", "b")}
    requests = list(server.router.requests)
    sessions = {sid: server.take_session(sid) for sid in ("a", "b")}
    server.close()
    for s in started:
        _post(s["address"], "/stop", {}).read()
    stats = serving.result()
    samples = {sid: session_samples(session.turns) for sid, session in sessions.items()}
    every = [s for sid in ("a", "b") for s in samples[sid]]
    actor_log_probs = log_probs_of(actor, every, tokenizer.pad_token_id or 0)
    # The same conversations by the built-in loop and through the server.
    prompts = PromptLoader(word_problems(4, seed=3, steps=2, max_operand=20), tokenizer, 4, None,
                           shuffle=False).next_batch()
    builtin = rollout.generate_sequences(with_sampling(prompts, {"seed": 11, "n": 2}))
    through_server = ServedRollout(rollout, tokenizer, RolloutConfig(**ROLLOUT)).generate(prompts, {"seed": 11, "n": 2},
                                                                                          pad=False)
    torch.save({"builtin": builtin, "served": through_server, "in_flight": in_flight,
                "seen": seen, "samples": samples, "actor_log_probs": actor_log_probs, "placed": placed,
                "requests": requests, "stats": stats, "parents": {k: [t.parent for t in v.turns]
                                                                  for k, v in sessions.items()}},
               os.path.join(args.out, "serving.pt"))


if __name__ == "__main__":
    main()
    exit_process(0)
