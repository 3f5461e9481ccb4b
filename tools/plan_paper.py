"""The planner on the HybridFlow paper's PPO workloads: Llama-2 7B to 70B on 16 to 128 A100-80GB.

    python tools/plan_paper.py --json docs/bench/planner/plan_paper.json   # every model and cluster size
    python tools/plan_paper.py --models 13b --gpus 16 64 128 --sequential   # the controller's phases in turn

Each workload is examples/paper_ppo.yaml with the four models of one size (section 8.1: 1024 prompts,
1024 + 1024 tokens, one PPO epoch of 8 mini-batches, bf16 with fp32 gradients and Adam) on 8-GPU nodes
with 200 Gb/s per GPU between them. For each it prints the chosen placement, the devices per set, the
actor's layout, the memory per GPU, the predicted step time and the search's own time, and the best step
time of the paper's three fixed placements (colocate, split: actor+reference | critic+reward, standalone).
The table is the one in docs/concepts/planner.md; ``--json`` adds every role's layout and the stage times.

Phases on disjoint pools run at the same time (``trainer.overlap``, the planner's ``critical_path``);
``--sequential`` scores the controller that runs them one after another (``trainer.overlap: false``).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from controller.config import load_config  # noqa: E402
from controller.planner.hardware import parse_cluster  # noqa: E402
from controller.planner.search import search  # noqa: E402
from controller.planner.workload import job_workload  # noqa: E402

MODELS = ("7b", "13b", "34b", "70b")
GPUS = (16, 32, 64, 96, 128)
FIXED = {"colocate": (("actor", "critic", "ref_policy", "reward_model"),),
         "split": (("actor", "ref_policy"), ("critic", "reward_model")),
         "standalone": (("actor",), ("critic",), ("ref_policy",), ("reward_model",))}
SHORT = {"ref_policy": "ref", "reward_model": "reward"}  # the table's names


def describe(plan) -> str:
    parts = []
    for group in plan.sets:
        layouts = ", ".join(f"{o.role} {o.layout}" for o in group.options)
        parts.append(f"{'+'.join(group.roles)} on {group.devices}: {layouts}")
    return "; ".join(parts)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=MODELS)
    parser.add_argument("--gpus", nargs="+", type=int, default=list(GPUS))
    parser.add_argument("--network-gbps", type=float, default=200.0)
    parser.add_argument("--json", metavar="PATH")
    parser.add_argument("--sequential", action="store_true",
                        help="score every phase in turn, as trainer.overlap: false runs them")
    args = parser.parse_args()
    rows = []
    print("| model | GPUs | chosen placement (GPUs) | actor layout | peak GiB/GPU | step s | colocate s | split s | "
          "standalone s | search s |")
    print("| --- | ---: | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for size in args.models:
        models = ROOT / "examples" / "models"
        config = load_config(ROOT / "examples/paper_ppo.yaml",
                             [f"model_path={models / f'llama2-{size}'}", f"reward.model_path={models / f'llama2-{size}-reward'}"])
        workload = replace(job_workload(config), overlap=not args.sequential)
        for gpus in args.gpus:
            cluster = parse_cluster(f"{gpus // 8}x8xA100-80GB").with_network(args.network_gbps)
            started = time.perf_counter()
            result = search(workload, cluster, top=1)
            took = time.perf_counter() - started
            fixed = {}
            for name, placement in FIXED.items():
                best = [r.best.step_time for r in result.rejected if r.placement == placement and r.best is not None]
                won = [p.step_time for p in result.plans if p.placement == placement]
                fixed[name] = (won or best or [None])[0]
            if not result.plans:
                need = min((r.need for r in result.rejected if r.need), default=None)
                print(f"| {size.upper()} | {gpus} | fits no plan: the smallest needs {need / 2**30:.0f} GiB a GPU "
                      f"| | | | | | | {took:.1f} |")
                rows.append({"model": size, "gpus": gpus, "overlap": workload.overlap, "fits": False, "need_bytes": need,
                             "search_s": took})
                continue
            plan = result.plans[0]
            placement = " / ".join("+".join(SHORT.get(r, r) for r in s.roles) + f" ({s.devices})" for s in plan.sets)
            cells = [f"{fixed[k]:.0f}" if fixed[k] is not None else "-" for k in FIXED]
            print(f"| {size.upper()} | {gpus} | {placement} | {plan.option('actor').layout} | "
                  f"{plan.peak_memory / 2**30:.1f} | {plan.step_time:.0f} | {' | '.join(cells)} | {took:.1f} |")
            rows.append({"model": size, "gpus": gpus, "overlap": workload.overlap, "fits": True,
                         "placement": [list(s.roles) for s in plan.sets], "devices": [s.devices for s in plan.sets],
                         "layouts": describe(plan), "peak_bytes": plan.peak_memory, "step_s": plan.step_time,
                         "stage_s": list(plan.stage_times), "set_phase_s": [list(s.phases) for s in plan.sets],
                         "fixed_placements_s": fixed, "search_s": took})
            sys.stdout.flush()
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
