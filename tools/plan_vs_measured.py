"""The planner's predicted step time against measured runs on this machine (`--cluster local`).

    python tools/plan_vs_measured.py --fit --rank --json docs/bench/planner/plan_vs_measured.json
    python tools/plan_vs_measured.py --from docs/bench/planner/plan_vs_measured.json --fit   # refit, no runs

Each run is a real `hybridflow train` job on 4 CPU processes: the tiny and the small (76M) built-in models,
colocated, split (actor | critic) and one-step-off (actor | rollout) placements, several TP / PP; and the tiny
model split on 2 processes (actor | critic, one each), its pools' phases at once (``trainer.overlap``, the
default, as in every split run) and in turn. It trains
`--steps` steps; the measured times are the means after the first step (which compiles and warms up): the
step, and each role's phases (generation with its weight update, the forward passes, the updates).

The prediction is the planner's score of the job's own plan (`controller.planner.prelaunch.job_plan`) on this
machine's calibration (`hybridflow plan --calibrate`, run first unless `--no-calibrate`). `--fit` fits the
framework's host costs (`planner.timing.HOST_COSTS`) and the collectives' latency under load to the measured
phases (`planner.fit`), saves them into the calibration, and reports each run's step predicted both by the
fit over every run and by a fit that left that run out. `--rank` asks the planner for the best plan of the
tiny PPO job on 4 processes, runs it, and compares it with the fastest measured run of that job.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from controller.config import load_config  # noqa: E402
from controller.planner.timing import HOST_COSTS  # noqa: E402

COSTS = (*HOST_COSTS, "collective_latency_s")  # what --fit fits

QUIET = ["trainer.val_every=0", "trainer.save_every=0", "trainer.logger=[jsonl]", "trainer.export_hf=false",
         "trainer.plots=false", "data.val_size=8", "data.train_size=512"]
PPO = ["--config", "examples/ppo_tiny.yaml"]
GRPO = [*PPO, "algorithm.name=grpo", "rollout.sampling.n=4", "data.batch_size=16", "ppo.ppo_mini_batch_size=32"]
SMALL = ["model_path=builtin:small-arithmetic", "data.batch_size=16", "ppo.ppo_mini_batch_size=16",
         "critic_ppo.ppo_mini_batch_size=16", "ppo.ppo_epochs=1", "critic_ppo.ppo_epochs=1"]


def layout(role: str, tp: int, pp: int, micro: int = 8) -> list[str]:
    return [f"{role}.engine.tensor_parallel={tp}", f"{role}.engine.pipeline_parallel={pp}",
            f"{role}.engine.micro_batch_size={micro}"]


RUNS = {
    "tiny-colocated-tp2pp2": [*PPO],
    "tiny-colocated-dp4": [*PPO, *layout("actor", 1, 1), *layout("critic", 1, 1)],
    "tiny-colocated-tp2dp2": [*PPO, *layout("actor", 2, 1), *layout("critic", 2, 1)],
    "tiny-colocated-pp2dp2": [*PPO, *layout("actor", 1, 2), *layout("critic", 1, 2)],
    "tiny-split-actor|critic": [*PPO, "trainer.launcher=ray", "trainer.nproc=2", "trainer.placement={critic: 2}",
                                *layout("actor", 1, 1), *layout("critic", 1, 1)],
    # the tiny model on 2 processes, actor | critic one each: the phases of the two pools at once, and in turn
    "pair-split-actor|critic": [*PPO, "trainer.launcher=ray", "trainer.nproc=1", "trainer.placement={critic: 1}",
                                *layout("actor", 1, 1), *layout("critic", 1, 1)],
    "pair-split-actor|critic-in-turn": [*PPO, "trainer.launcher=ray", "trainer.nproc=1", "trainer.placement={critic: 1}",
                                        *layout("actor", 1, 1), *layout("critic", 1, 1), "trainer.overlap=false"],
    "tiny-one-step-off-actor|rollout": [*GRPO, "trainer.launcher=ray", "trainer.nproc=2", "trainer.placement={rollout: 2}",
                                        "trainer.mode=one_step_off", *layout("actor", 1, 1)],
    "small-colocated-tp2dp2": [*PPO, *SMALL, *layout("actor", 2, 1, 4), *layout("critic", 2, 1, 4)],
    "small-colocated-dp4": [*PPO, *SMALL, *layout("actor", 1, 1, 4), *layout("critic", 1, 1, 4)],
}


def processes(config) -> int:
    from controller.checks.placement import distinct_pools, job_pools

    return sum(shape.world_size for shape in distinct_pools(job_pools(config.trainer)))


# Each role's measured phases (the metrics' timing_s/ keys) for each of the planner's stages.
STAGE_PHASES = {
    ("actor", 0): ("rollout",),  # the controller's call: the weight update (the reshard in it) and generation
    ("rollout", 0): ("gen", "weight_update"),  # on a pool of its own: the engine's own timings
    ("actor", 1): ("old_log_prob",), ("ref_policy", 1): ("ref",), ("critic", 1): ("values",),
    ("actor", 2): ("update_actor",), ("critic", 2): ("update_critic",),
}
TINY_PPO = [name for name in RUNS if name.startswith("tiny-") and "algorithm.name=grpo" not in RUNS[name]]


def measure_run(name: str, args: list[str], steps: int, work: Path) -> dict:
    """Train ``steps`` steps of the job ``args``; the mean of each timing after the first step."""
    run_dir = work / name.replace("|", "_")
    command = [sys.executable, "-m", "controller.cli", "train", *args, *QUIET, f"trainer.total_steps={steps}",
               f"trainer.run_dir={run_dir}"]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(command, capture_output=True, text=True, cwd=str(ROOT), env=env)
    if proc.returncode != 0:
        raise SystemExit(f"{name} failed:\n{proc.stderr[-4000:]}")
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    later = rows[1:] or rows
    phases = {k.removeprefix("timing_s/"): statistics.fmean(r[k] for r in later) for k in later[0]
              if k.startswith("timing_s/")}
    return {"run": name, "args": args, "phases_s": phases}


def scored(args: list[str], figures: dict, costs: dict | None = None):
    """The planner's plan of the job ``args`` on this machine with ``costs`` (the host costs and the
    collectives' latency; None: the calibration's)."""
    from controller.planner.calibrate import local_cluster, local_efficiency
    from controller.planner.prelaunch import job_plan
    from controller.planner.workload import job_workload

    overrides = [a for a in args if "=" in a and not a.startswith("--")]
    config = load_config(ROOT / args[args.index("--config") + 1], [*overrides, *QUIET])
    figures = figures if costs is None else {**figures, "host_costs": costs}
    cluster = local_cluster(processes(config), figures)
    return job_plan(config, cluster, job_workload(config, flash_attention=False), local_efficiency(figures))


def predicted_phases(plan) -> dict:
    """(role, stage) -> seconds, for the stages a run measures; "step" and "transfer" too."""
    out = {(option.role, stage): option.times[stage] for group in plan.sets for option in group.options
           for stage in range(3) if (option.role, stage) in STAGE_PHASES and option.times[stage] > 0}
    out["step"] = plan.step_time
    if plan.transfer_time:
        out["transfer"] = plan.transfer_time
    return out


def samples_of(measured: dict, figures: dict) -> list:
    """The run's measured phases as ``fit.Sample``s: the model's base and its growth per second of each cost."""
    from controller.planner.fit import Sample

    zero = {name: 0.0 for name in COSTS}
    base = predicted_phases(scored(measured["args"], figures, zero))
    grown = {name: predicted_phases(scored(measured["args"], figures, {**zero, name: 1.0})) for name in COSTS}
    phases = measured["phases_s"]
    samples = []
    for key, seconds in base.items():
        if key == "step":
            if "one_step_off" in " ".join(measured["args"]):  # max(generation, training): not linear in the costs
                continue
            value = phases["step"]
        elif key == "transfer":
            value = phases.get("weight_transfer", 0.0)
        else:
            if not all(ran_alone(phases, name) for name in STAGE_PHASES[key]):
                continue  # measured beside another pool's phase: the model's phase is the phase alone
            value = sum(phases.get(name, 0.0) for name in STAGE_PHASES[key])
        if value > 0:
            label = key if isinstance(key, str) else f"{key[0]}/{('generate', 'forward', 'update')[key[1]]}"
            samples.append(Sample(f"{measured['run']}/{label}", value, seconds,
                                  {name: grown[name][key] - seconds for name in COSTS}))
    return samples


def ran_alone(phases: dict, name: str) -> bool:
    """Whether phase ``name`` ran while no other pool worked, by the run's timeline (``phase/<pool>/<name>/start``
    and ``/end``, means over the steps); a phase the run did not time counts as alone. The planner predicts a
    phase alone and the step of phases at once (``search.critical_path``), so only the step of an overlapped
    split run is a sample of it."""
    spans = {tuple(k.split("/")[1:3]): (phases[k], phases[k.removesuffix("/start") + "/end"]) for k in phases
             if k.startswith("phase/") and k.endswith("/start") and k.removesuffix("/start") + "/end" in phases}
    own = [(pool, span) for (pool, phase), span in spans.items() if phase == name]
    return not any(pool != other and other != "driver" and start < o_end and o_start < end
                   for pool, (start, end) in own for (other, _), (o_start, o_end) in spans.items())


def main() -> int:
    from controller.planner.calibrate import load_calibration, recalibrate, save_calibration
    from controller.planner.fit import fit_costs, predict

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", nargs="+", default=list(RUNS), choices=list(RUNS))
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--no-calibrate", action="store_true", help="use the saved calibration")
    parser.add_argument("--from", dest="source", metavar="PATH", help="the measured runs of an earlier --json: no runs")
    parser.add_argument("--fit", action="store_true", help="fit the host costs to the runs and save them")
    parser.add_argument("--rank", action="store_true", help="run the planner's best plan of the tiny PPO job too")
    parser.add_argument("--json", metavar="PATH")
    args = parser.parse_args()
    if args.source:
        earlier = json.loads(Path(args.source).read_text())
        figures, measured = earlier["calibration"], earlier["measured"]
    else:
        if not args.no_calibrate:
            recalibrate()
        figures = load_calibration()
        with tempfile.TemporaryDirectory() as tmp:
            measured = [measure_run(name, RUNS[name], args.steps, Path(tmp)) for name in args.runs]
        if args.json:  # the runs first, so that a later failure keeps them (--from reads them back)
            Path(args.json).parent.mkdir(parents=True, exist_ok=True)
            Path(args.json).write_text(json.dumps({"calibration": figures, "measured": measured}, indent=2))
    print(f"calibration: {figures['fp32_flops'] / 1e9:.1f} GFLOP/s fp32, {figures['memory_bandwidth'] / 1e9:.1f} GB/s, "
          f"gloo {figures['gloo_latency_s'] * 1e6:.0f} us / {figures['gloo_bandwidth'] / 1e9:.2f} GB/s")
    costs = figures.get("host_costs")
    report = {"calibration": figures, "measured": measured}
    if args.fit:
        samples = {m["run"]: samples_of(m, figures) for m in measured}
        everything = [s for run in samples.values() for s in run]
        costs = fit_costs(everything, COSTS)
        left_out = {run: fit_costs([s for other, ss in samples.items() if other != run for s in ss], COSTS)
                    for run in samples}
        print("fitted host costs: " + ", ".join(f"{k} {v * 1e3:.3g} ms" for k, v in costs.items()))
        print("| phase | measured s | predicted s | predicted / measured |")
        print("| --- | ---: | ---: | ---: |")
        phases = []
        for sample in everything:
            guess = predict(sample, costs)
            phases.append({"phase": sample.name, "measured_s": sample.measured, "predicted_s": guess})
            print(f"| {sample.name} | {sample.measured:.3f} | {guess:.3f} | {guess / sample.measured:.2f} |")
        report.update(host_costs=costs, left_out_costs=left_out, phases=phases)
        figures = {**figures, "host_costs": {**costs, "fitted_at": time.strftime("%Y-%m-%dT%H:%M:%S"),
                                             "runs": [m["run"] for m in measured]}}
        save_calibration(figures)
    results = []
    print("\n| run | measured s/step | predicted s/step | predicted / measured | left out of the fit |")
    print("| --- | ---: | ---: | ---: | ---: |")
    for m in measured:
        step = m["phases_s"]["step"]
        plan = scored(m["args"], figures, costs)
        row = {"run": m["run"], "measured_step_s": step, "predicted_step_s": plan.step_time,
               "ratio": plan.step_time / step}
        cell = ""
        if args.fit:
            held = scored(m["args"], figures, report["left_out_costs"][m["run"]]).step_time
            row["left_out_ratio"] = held / step
            cell = f"{held / step:.2f}"
        results.append(row)
        print(f"| {m['run']} | {step:.2f} | {plan.step_time:.2f} | {row['ratio']:.2f} | {cell} |", flush=True)
    report["runs"] = results
    if args.rank:
        report["rank"] = rank(measured, figures, args.steps)
    elif args.source and "rank" in earlier:  # the earlier run's, kept
        report["rank"] = earlier["rank"]
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(report, indent=2))
    return 0


def rank(measured: list[dict], figures: dict, steps: int) -> dict:
    """The planner's best plan of the tiny PPO job on 4 processes, run, against the fastest measured one."""
    from controller.planner.calibrate import local_cluster, local_efficiency
    from controller.planner.report import plan_overrides
    from controller.planner.search import search
    from controller.planner.workload import job_workload

    config = load_config(ROOT / PPO[1], QUIET)
    cluster = local_cluster(processes(config), figures)
    best = search(job_workload(config, flash_attention=False), cluster, local_efficiency(figures), top=1).plans[0]
    overrides = plan_overrides(best, cluster)
    with tempfile.TemporaryDirectory() as tmp:
        chosen = measure_run("planner-first", [*PPO, *overrides], steps, Path(tmp))
    others = {m["run"]: m["phases_s"]["step"] for m in measured if m["run"] in TINY_PPO}
    fastest = min(others, key=others.get)
    step = chosen["phases_s"]["step"]
    print(f"\nthe planner's first plan of the tiny PPO job: {' '.join(overrides)}\n"
          f"  predicted {best.step_time:.2f} s, measured {step:.2f} s; the fastest measured alternative: {fastest} "
          f"at {others[fastest]:.2f} s ({step / others[fastest]:.2f}x)")
    return {"overrides": overrides, "predicted_step_s": best.step_time, "measured_step_s": step,
            "fastest_measured": fastest, "fastest_measured_step_s": others[fastest], "phases_s": chosen["phases_s"]}


if __name__ == "__main__":
    raise SystemExit(main())
