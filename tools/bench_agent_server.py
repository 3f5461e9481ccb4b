"""What the rollout server costs: agent sessions through it against the built-in agent loop on the same task.

    python tools/bench_agent_server.py --json docs/bench/agent_server.json

One torchrun process holds an actor and its colocated vLLM rollout (one replica). The task is the calculator
environment with a simulated user who asks again after every answer, so that each sample takes ``--turns``
model turns whatever the model writes: ``--prompts`` word problems x ``--n`` samples.

- the built-in loop (``rollout.agent.environment``): all samples in one ``generate_sequences``, the engine
  batching every ready sample;
- the same environment as a user's agent through the server (``controller.serving.environment_agent``), for
  each concurrency in ``--concurrency`` (``rollout.agent.max_concurrent_sessions``).

Each is timed over ``--repeats`` runs after one warm-up run (median): sessions a second and model tokens a
second. The server's batches are the loop's batches (``tests/serving``); only the time differs.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

ENVIRONMENT = "tools.bench_agent_server:AskAgain"


def _environment_class():
    from workers.rollout.agent.arithmetic_env import ArithmeticEnvironment
    from workers.rollout.agent.calculator import Calculator
    from workers.rollout.agent.loop import StepResult
    from workers.rollout.agent.tool import ToolBox

    box = ToolBox([Calculator()])

    class AskAgain(ArithmeticEnvironment):
        """The calculator environment; after an answer, the user asks again."""

        def __init__(self, tools=box, tool_format: str = "hermes", tokenizer=None) -> None:
            super().__init__(tools, tool_format, tokenizer)

        def step(self, messages, reply):
            step = super().step(messages, reply)
            if step.done:
                return StepResult([{"role": "user", "content": "Check it with the calculator."}], step.reward, False,
                                  step.info)
            return step

    return AskAgain, box


AskAgain, _BOX = _environment_class()


async def agent(client, row):
    """The entrypoint the served rollout imports: AskAgain through the server, ``--turns`` turns."""
    from controller.serving.environment_agent import environment_agent

    turns = int(os.environ.get("HYBRIDFLOW_BENCH_TURNS", "3"))
    return await environment_agent(AskAgain, _BOX.schemas(), turns)(client, row)


def worker(args) -> None:
    from transformers import AutoTokenizer

    from controller import ResourcePool, WorkerGroup
    from controller.data.arithmetic import word_problems
    from controller.data.loader import PromptLoader
    from controller.rl.schedules import with_sampling
    from controller.runtime.process_exit import exit_process
    from controller.serving.served_rollout import ServedRollout
    from workers.actor import Actor
    from workers.rollout import Rollout
    from workers.rollout.config import RolloutConfig

    rollout_config = {
        "engine": "vllm", "server": True, "max_prompt_length": 700, "kv_cache_bytes": 256 << 20,
        "sampling": {"max_new_tokens": args.max_new_tokens, "temperature": 1.0},
        "agent": {"tools": ["calculator"], "environment": ENVIRONMENT, "entrypoint": "tools.bench_agent_server:agent",
                  "max_turns": args.turns, "max_response_length": args.turns * (args.max_new_tokens + 48)}}
    pool = ResourcePool([1])
    actor = WorkerGroup(pool, Actor, role="actor", kwargs=dict(model_path=args.model, engine={"micro_batch_size": 4}))
    rollout = WorkerGroup(pool, Rollout, role="rollout", kwargs=dict(model_path=args.model, config=rollout_config))
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    prompts = PromptLoader(word_problems(args.prompts, seed=1, steps=2, max_operand=20), tokenizer, args.prompts, None,
                           shuffle=False).next_batch()
    sampling = {"seed": 3, "n": args.samples}

    def timed(run) -> dict:
        times, tokens = [], None
        run()  # warm-up
        for _ in range(args.repeats):
            start = time.perf_counter()
            batch = run()
            times.append(time.perf_counter() - start)
            tokens = int(batch.batch["response_mask"].sum())
        seconds = statistics.median(times)
        sessions = args.prompts * args.samples
        return {"seconds": seconds, "sessions_per_s": sessions / seconds, "tokens_per_s": tokens / seconds,
                "model_tokens": tokens}

    results = {"built-in loop": timed(lambda: rollout.generate_sequences(with_sampling(prompts, sampling)))}
    for concurrency in args.concurrency:
        config = RolloutConfig(**{**rollout_config, "agent": {**rollout_config["agent"],
                                                               "max_concurrent_sessions": concurrency}})
        served = ServedRollout(rollout, tokenizer, config)
        results[f"server, {concurrency} at once"] = timed(lambda: served.generate(prompts, sampling, pad=False))
    Path(args.out).write_text(json.dumps(results))
    del actor
    exit_process(0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="builtin:tiny-chat")
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--samples", type=int, default=4, help="samples per prompt (rollout.sampling.n)")
    parser.add_argument("--turns", type=int, default=3)
    parser.add_argument("--max-new-tokens", type=int, default=16)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16, 64])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", help="write the figures here")
    parser.add_argument("--worker-out", dest="out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.out:
        worker(args)
        return
    from controller.models.builtin import resolve_model_path

    work = ROOT / "runs" / "bench_agent_server"
    work.mkdir(parents=True, exist_ok=True)
    model = resolve_model_path(args.model, work) if args.model.startswith("builtin:") else args.model
    out = work / "figures.json"
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=1", __file__,
               "--model", model, "--prompts", str(args.prompts), "--samples", str(args.samples), "--turns", str(args.turns),
               "--max-new-tokens", str(args.max_new_tokens), "--repeats", str(args.repeats),
               "--concurrency", *map(str, args.concurrency), "--worker-out", str(out)]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "2"),
           "HYBRIDFLOW_BENCH_TURNS": str(args.turns)}
    proc = subprocess.run(command, env=env, cwd=ROOT)
    if proc.returncode != 0:
        sys.exit(proc.returncode)
    results = json.loads(out.read_text())
    loop = results["built-in loop"]
    print(f"{args.prompts} prompts x {args.samples} samples, {args.turns} turns of up to {args.max_new_tokens} tokens, "
          f"{args.model}")
    print(f"{'':<24} {'sessions/s':>10} {'tokens/s':>9} {'vs loop':>8}")
    for name, figures in results.items():
        print(f"{name:<24} {figures['sessions_per_s']:>10.2f} {figures['tokens_per_s']:>9.1f} "
              f"{figures['sessions_per_s'] / loop['sessions_per_s']:>8.2f}")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({"model": args.model, "prompts": args.prompts, "n": args.samples,
                                               "turns": args.turns, "max_new_tokens": args.max_new_tokens,
                                               "results": results}, indent=2))


if __name__ == "__main__":
    main()
