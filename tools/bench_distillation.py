"""On-policy distillation on the tiny arithmetic task: the demo's SFT export teaches a fresh model, over seeds.

    python tools/bench_distillation.py [--teacher runs/sft_tiny/hf_actor] [--steps 10] [--seeds 0 1 2] \\
        [--json out.json] [--plot docs/concepts/distillation_curve.png]

Without ``--teacher`` it makes one first, as ``make demo`` does (``hybridflow sft --config examples/sft_tiny.yaml``,
on one process). Each seed runs ``hybridflow train --config examples/distillation/opd_tiny.yaml`` (a random
``builtin:tiny-arithmetic`` student, the teacher's per-token reverse KL its only signal) for ``--steps`` steps and
reports its mean reverse KL to the teacher per step and its greedy exact-answer accuracy on the 64 held-out
prompts (the run's own validation). The teacher's and every trained student's greedy accuracy are measured again
here with transformers' ``generate`` on the same prompts, apart from the trainer. ``--grpo`` also trains each
seed's student with GRPO on the exact-answer reward alone (the same job, no teacher): what the sparse reward
teaches in as many steps.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

EXAMPLE = ROOT / "examples" / "distillation" / "opd_tiny.yaml"


def hybridflow(*args: str) -> float:
    """Run ``hybridflow ARGS`` to its end (its output kept out of ours); its wall seconds."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "controller.cli", *args], capture_output=True, text=True, env=env,
                          cwd=str(ROOT))
    if proc.returncode:
        raise SystemExit(f"hybridflow {' '.join(args)} failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
    return time.perf_counter() - start


def make_teacher(work: Path) -> Path:
    """The demo's SFT export (its data, steps and optimizer; one process)."""
    run = work / "sft"
    hybridflow("sft", "--config", "examples/sft_tiny.yaml", f"trainer.run_dir={run}", "trainer.nproc=1",
               "actor.engine.tensor_parallel=1", "actor.engine.pipeline_parallel=1", "trainer.logger=[jsonl]",
               "trainer.plots=false", "trainer.save_every=0")
    return run / "hf_actor"


def greedy_accuracy(model_path: Path, overrides: list[str]) -> float:
    """Exact-answer accuracy of ``model_path``'s greedy answers to the example's held-out prompts, by transformers."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from controller.config import load_config
    from controller.rl.job_prompts import rl_job_prompts
    from workers.reward.text_rules import arithmetic_answer

    config = load_config(EXAMPLE, overrides)
    val = rl_job_prompts(config, str(model_path)).val
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    correct = 0
    with torch.no_grad():
        for ids, answer, prompt in zip(val.input_ids, val.answers, val.prompt_texts):
            out = model.generate(torch.tensor([ids]), max_new_tokens=config.rollout.sampling.max_new_tokens,
                                 do_sample=False, eos_token_id=tokenizer.eos_token_id,
                                 pad_token_id=tokenizer.pad_token_id)
            response = tokenizer.decode(out[0, len(ids):], skip_special_tokens=True)
            correct += arithmetic_answer(prompt, response, answer, {}) == 1.0
    return correct / len(val)


def train(name: str, seed: int, steps: int, nproc: int, work: Path, *job: str) -> tuple[Path, list[dict], float]:
    run = work / f"{name}-seed{seed}"
    seconds = hybridflow("train", "--config", str(EXAMPLE), *job, f"trainer.seed={seed}", f"trainer.total_steps={steps}",
                         f"trainer.nproc={nproc}", f"trainer.run_dir={run}", "trainer.logger=[jsonl]",
                         "trainer.plots=false", "trainer.save_every=0")
    return run, [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()], seconds


def grpo(seed: int, steps: int, nproc: int, work: Path) -> dict:
    """The same student and job, GRPO on the exact-answer reward alone."""
    run, rows, seconds = train("grpo", seed, steps, nproc, work, "teacher=null", "algorithm.name=grpo")
    return {"seconds": round(seconds, 1), "val_accuracy": {r["step"]: r["val/reward/mean"] for r in rows
                                                            if "val/reward/mean" in r}}


def distil(teacher: Path, seed: int, steps: int, nproc: int, work: Path) -> dict:
    run, rows, seconds = train("opd", seed, steps, nproc, work, f"teacher.model_path={teacher}")
    reverse_kl = [r["actor/opd/reverse_kl"] for r in rows if "actor/opd/reverse_kl" in r]
    return {"seed": seed, "seconds": round(seconds, 1), "reverse_kl": [round(v, 4) for v in reverse_kl],
            "reverse_kl_fall": round(1 - reverse_kl[-1] / reverse_kl[0], 3),
            "val_accuracy": {r["step"]: r["val/reward/mean"] for r in rows if "val/reward/mean" in r},
            "teacher_s_per_step": round(sum(r["timing_s/teacher"] for r in rows if "timing_s/teacher" in r)
                                        / len(reverse_kl), 4),
            "hf_greedy_accuracy": greedy_accuracy(run / "hf_actor", []), "run_dir": str(run)}


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (kl, acc) = plt.subplots(1, 2, figsize=(10, 3.6))
    for run in result["runs"]:
        kl.plot(range(1, len(run["reverse_kl"]) + 1), run["reverse_kl"], marker="o", label=f"seed {run['seed']}")
        steps = sorted(int(s) for s in run["val_accuracy"])
        acc.plot(steps, [run["val_accuracy"][s] for s in steps], marker="o", label=f"seed {run['seed']}")
        if "grpo" in run:
            steps = sorted(int(s) for s in run["grpo"]["val_accuracy"])
            acc.plot(steps, [run["grpo"]["val_accuracy"][s] for s in steps], marker="x", linestyle=":",
                     label=f"seed {run['seed']}, GRPO on the reward alone")
    acc.axhline(result["teacher_hf_greedy_accuracy"], color="black", linestyle="--", label="the teacher")
    kl.set(xlabel="step", ylabel="reverse KL per token", title="KL(student || teacher) on the student's samples")
    acc.set(xlabel="step", ylabel="greedy exact-answer accuracy", title="64 held-out prompts")
    for ax in (kl, acc):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--teacher", help="an SFT export to teach with (default: made here, as the demo makes it)")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--work", default="runs/bench_distillation", help="where the runs are written")
    parser.add_argument("--json", metavar="PATH")
    parser.add_argument("--plot", metavar="PNG")
    parser.add_argument("--grpo", action="store_true", help="also GRPO on the exact-answer reward alone, each seed")
    args = parser.parse_args(argv)
    work = Path(args.work)
    teacher = Path(args.teacher) if args.teacher else make_teacher(work)
    result = {"teacher": str(teacher), "steps": args.steps, "teacher_hf_greedy_accuracy": greedy_accuracy(teacher, []),
              "runs": [distil(teacher, seed, args.steps, args.nproc, work) for seed in args.seeds]}
    if args.grpo:
        for run in result["runs"]:
            run["grpo"] = grpo(run["seed"], args.steps, args.nproc, work)
    for run in result["runs"]:
        val = run["val_accuracy"]
        print(f"seed {run['seed']}: reverse KL {run['reverse_kl'][0]:.3f} -> {run['reverse_kl'][-1]:.3f} "
              f"(-{run['reverse_kl_fall']:.0%}); greedy accuracy {val[min(val)]:.3f} -> {val[max(val)]:.3f} "
              f"(transformers: {run['hf_greedy_accuracy']:.3f}); {run['seconds']:.0f} s, teacher "
              f"{run['teacher_s_per_step']:.3f} s a step")
        if "grpo" in run:
            val = run["grpo"]["val_accuracy"]
            print(f"        GRPO on the exact-answer reward alone: greedy accuracy {val[min(val)]:.3f} -> "
                  f"{val[max(val)]:.3f}")
    print(f"the teacher's greedy accuracy (transformers): {result['teacher_hf_greedy_accuracy']:.3f}")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    if args.plot:
        plot(result, Path(args.plot))
    return 0


if __name__ == "__main__":
    sys.exit(main())
