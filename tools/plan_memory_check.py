"""The planner's model-state memory against the engine's own tensors, at the sizes the tests do not reach.

    python tools/plan_memory_check.py --json docs/bench/planner/memory_check.json

For the 100M (tools/bench_models.py's shape) and SmolLM2-135M (its exact shape) models, random-initialized,
each case is one torchrun launch of 4 CPU processes: an Actor at the case's TP x PP x DP, precision and
optimizer takes one PPO update (so Adam's state exists), then every rank reports the bytes its weights,
gradient buffers and optimizer state hold (``EngineRole.state_bytes``: each storage once). The planner's
``stage_state`` predicts each rank's three figures; the tool prints both and exits 1 on any difference.
(The tiny models' layouts are held to the byte in the actor and critic parity tests.)
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tools.bench_gpu_train import write_checkpoint  # noqa: E402
from tools.bench_models import make_checkpoint  # noqa: E402

# (model, TP, PP, precision, distributed optimizer) on 4 processes. SmolLM2's 3 KV heads allow TP 1 (or 3).
CASES = [
    ("100m", 4, 1, "bf16", False),
    ("100m", 2, 2, "fp32", True),
    ("100m", 2, 1, "bf16", True),
    ("100m", 1, 2, "fp32", False),
    ("smollm2", 1, 1, "bf16", True),
    ("smollm2", 1, 2, "bf16", False),
]
WORLD = 4


def inner(args) -> None:
    """One case, under torchrun: an update, then each rank's state bytes to ``args.out``."""
    import torch

    from controller import ResourcePool, WorkerGroup
    from controller.runtime.process_exit import exit_process
    from workers import DataProto
    from workers.actor import Actor

    pool = ResourcePool([int(os.environ["WORLD_SIZE"])])
    actor = WorkerGroup(pool, Actor, role="actor", kwargs=dict(
        model_path=args.model_dir,
        engine={"precision": args.precision, "tensor_parallel": args.tp, "pipeline_parallel": args.pp,
                "micro_batch_size": 2},
        optim={"lr": 1e-5, "use_distributed_optimizer": args.dist_opt}, ppo={"ppo_mini_batch_size": 8}))
    rows, prompt, response = 8, 8, 8
    ids = torch.randint(3, 200, (rows, prompt + response), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    batch = DataProto({"input_ids": ids, "attention_mask": mask, "position_ids": torch.arange(ids.shape[1]).expand_as(ids),
                       "responses": ids[:, prompt:], "response_mask": mask[:, prompt:]})
    batch.meta_info["temperature"] = 1.0
    update = batch.union(actor.compute_log_prob(batch))
    update.batch["advantages"] = torch.randn(rows, response, generator=torch.Generator().manual_seed(1))
    actor.update_actor(update)
    measured = actor.state_bytes()
    if int(os.environ["RANK"]) == 0:
        Path(args.out).write_text(json.dumps(measured))
    exit_process(0)


def check(case: tuple, model_dir: Path, work: Path) -> dict:
    from controller.planner.memory import stage_state
    from hybridengine.model.spec import ModelSpec
    from hybridengine.parallel.layout import ParallelLayout

    name, tp, pp, precision, dist_opt = case
    out = work / f"{name}-tp{tp}-pp{pp}-{precision}-{int(dist_opt)}.json"
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={WORLD}", __file__,
               "--inner", "--model-dir", str(model_dir), "--out", str(out), "--tp", str(tp), "--pp", str(pp),
               "--precision", precision, *(["--dist-opt"] if dist_opt else [])]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(command, capture_output=True, text=True, env=env, cwd=str(ROOT))
    if proc.returncode != 0 or not out.exists():
        raise SystemExit(f"{case} failed:\n{proc.stderr[-4000:]}")
    measured = json.loads(out.read_text())
    spec = ModelSpec.from_pretrained(model_dir).with_padded_vocab(128, tp)
    layout = ParallelLayout.for_world(WORLD, tp, pp)
    ranks = []
    for rank, got in enumerate(measured):
        at = layout.coordinate(rank)
        want = stage_state(spec, tp, pp, at.pp_rank, layout.dp, at.dp_rank, precision, True, dist_opt)
        predicted = {"weights": want.weights, "gradients": want.gradients, "optimizer": want.optimizer}
        ranks.append({"rank": rank, "measured": got, "predicted": predicted, "equal": got == predicted})
    return {"model": name, "tp": tp, "pp": pp, "dp": layout.dp, "precision": precision, "distributed_optimizer": dist_opt,
            "ranks": ranks, "equal": all(r["equal"] for r in ranks)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--inner", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--model-dir", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    parser.add_argument("--tp", type=int, default=1, help=argparse.SUPPRESS)
    parser.add_argument("--pp", type=int, default=1, help=argparse.SUPPRESS)
    parser.add_argument("--precision", default="bf16", help=argparse.SUPPRESS)
    parser.add_argument("--dist-opt", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--json", metavar="PATH")
    args = parser.parse_args()
    if args.inner:
        inner(args)
        return 0
    results = []
    print("| model | layout | precision | distributed optimizer | rank 0 weights / gradients / optimizer bytes | "
          "every rank equal |")
    print("| --- | --- | --- | --- | --- | --- |")
    with tempfile.TemporaryDirectory() as tmp:
        models = {}
        for case in CASES:
            if case[0] not in models:
                models[case[0]] = Path(tmp) / case[0]
                if case[0] == "smollm2":
                    write_checkpoint("smollm2", models[case[0]])
                else:
                    make_checkpoint(case[0], models[case[0]], tokenizer=True)
            result = check(case, models[case[0]], Path(tmp))
            results.append(result)
            first = result["ranks"][0]["measured"]
            print(f"| {result['model']} | TP{result['tp']} PP{result['pp']} DP{result['dp']} | {result['precision']} | "
                  f"{'on' if result['distributed_optimizer'] else 'off'} | {first['weights']:,} / {first['gradients']:,} / "
                  f"{first['optimizer']:,} | {'yes' if result['equal'] else 'NO'} |", flush=True)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(results, indent=2))
    return 0 if all(r["equal"] for r in results) else 1


if __name__ == "__main__":
    raise SystemExit(main())
