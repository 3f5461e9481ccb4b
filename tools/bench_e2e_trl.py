"""The TRL side of tools/bench_e2e.py: one GRPOTrainer run from a JSON spec, per-step results as JSON.

    build/trl-venv/bin/python tools/bench_e2e_trl.py SPEC.json    # run by tools/bench_e2e.py, in TRL's own venv

It runs in the virtual environment that tools/bench_e2e.py creates (trl
1.16.0 and its own transformers, never the project's pins), so it imports
nothing from the project but the reward function's file, loaded by path
(workers/reward/text_rules.py imports only the standard library): the reward
TRL optimises is the project's function itself, behind a thin adapter from
TRL's reward signature to the project's.

The spec (written by ``tools/bench_e2e.py:trl_spec``) holds the model
directory, the parquet file, the shared GRPO settings, the precision, the
reward file and function name, the token ids hybridflow renders for each
prompt row used, and where to write the results. ``grpo_config_kwargs``
(pure) maps it onto GRPOConfig; a test checks it against hybridflow's YAML.

Measured per optimizer step (one GRPO step: ``prompts_per_step`` prompts x
``n`` completions, one update), with callbacks and wrappers around
GRPOTrainer's phases (private methods of trl 1.16.0, hence the pin):
``step`` (on_step_begin to on_step_end), ``gen`` (HF generate), ``reward``,
``old_log_prob`` (no-grad log-prob passes; TRL skips them when generation
and update are aligned, as here, so this is 0), ``prepare_other`` (the rest
of generate-and-score: tokenising, advantages) and ``update_actor`` (the rest
of the step: forward + backward of each micro-batch, clipping, AdamW step).
Also the step's sampled reward (the adapter's mean), its prompt / completion
token counts, whether TRL's prompt token ids equal hybridflow's, and the
dtype the output layer computes in during the update and during generation
(what bf16 really means on each path).
"""

from __future__ import annotations

import importlib.util
import json
import sys
import time
from pathlib import Path
from typing import Any

__all__ = ["BF16_MODES", "TRL_LOSSES", "grpo_config_kwargs", "load_reward_fn", "reward_adapter", "trl_loss"]

# hybridflow's (algorithm.name, ppo.loss_agg_mode) -> TRL's (loss_type, importance_sampling_level): the same
# objective and aggregation. TRL's "dapo" loss type is the token mean over the step's batch (hybridflow's
# token-mean), "grpo" each sequence's token mean (seq-mean-token-mean), "dr_grpo" each sequence's token sum
# over max_completion_length (seq-mean-token-sum-norm); GSPO is TRL's sequence-level importance sampling.
TRL_LOSSES = {
    ("grpo", "token-mean"): ("dapo", "token"),
    ("grpo", "seq-mean-token-mean"): ("grpo", "token"),
    ("dapo", "token-mean"): ("dapo", "token"),
    ("dr_grpo", "seq-mean-token-sum-norm"): ("dr_grpo", "token"),
    ("gspo", "seq-mean-token-mean"): ("grpo", "sequence"),
    ("cispo", "token-mean"): ("cispo", "token"),
}


def trl_loss(settings: dict[str, Any]) -> tuple[str, str]:
    """TRL's loss_type and importance_sampling_level for the settings' algorithm and aggregation."""
    key = (settings.get("algorithm", "grpo"), settings.get("loss_agg_mode", "token-mean"))
    if key not in TRL_LOSSES:
        raise ValueError(f"TRL has no counterpart of algorithm {key[0]!r} with loss aggregation {key[1]!r}; "
                         f"paired: {sorted(TRL_LOSSES)}")
    return TRL_LOSSES[key]

# How TRL runs "bf16" on CPU (both run with trl 1.16.0 and use_cpu=True; the results' matmul_dtypes show
# bf16 linear layers in the update and in HF generate either way): "autocast" is GRPOConfig(bf16=True) with
# the fp32 model (accelerate's bf16 autocast: fp32 weights, gradients and AdamW state, bf16 matmuls), the
# counterpart of megatron's mixed precision; "weights" also loads the model in bf16 (bf16 weights,
# gradients and AdamW state: no fp32 master copy, so small updates round away).
BF16_MODES = ("autocast", "weights")
PRECISIONS = ("fp32", "bf16")


def grpo_config_kwargs(spec: dict[str, Any]) -> dict[str, Any]:
    """GRPOConfig's keyword arguments for ``spec`` (pure: no TRL import)."""
    s = spec["settings"]
    precision, bf16_mode = spec["precision"], spec.get("bf16_mode", "autocast")
    if precision not in PRECISIONS:
        raise ValueError(f"precision {precision!r} is not one of {PRECISIONS}")
    if bf16_mode not in BF16_MODES:
        raise ValueError(f"bf16_mode {bf16_mode!r} is not one of {BF16_MODES}")
    sequences = s["prompts_per_step"] * s["n"]
    if sequences % s["micro_batch_size"]:
        raise ValueError(f"prompts_per_step x n = {sequences} does not divide into micro-batches of "
                         f"{s['micro_batch_size']}")
    weights_bf16 = precision == "bf16" and bf16_mode == "weights"
    loss_type, level = trl_loss(s)
    return dict(
        output_dir=spec["output_dir"],
        use_cpu=True,
        bf16=precision == "bf16",
        fp16=False,
        model_init_kwargs={"dtype": "bfloat16" if weights_bf16 else "float32"},
        gradient_checkpointing=False,  # GRPOConfig's default is True; hybridflow keeps every activation
        learning_rate=s["lr"],
        lr_scheduler_type="constant",
        warmup_steps=0,
        weight_decay=s["weight_decay"],
        adam_beta1=s["adam_beta1"],
        adam_beta2=s["adam_beta2"],
        adam_epsilon=s["adam_eps"],
        max_grad_norm=s["clip_grad"],
        per_device_train_batch_size=s["micro_batch_size"],
        gradient_accumulation_steps=sequences // s["micro_batch_size"],  # one optimizer step per GRPO step
        num_generations=s["n"],
        max_completion_length=s["max_new_tokens"],
        temperature=s["temperature"],
        top_p=s["top_p"],
        top_k=0,  # TRL's "all tokens"
        num_iterations=s["ppo_epochs"],
        beta=s["kl_coef"],
        epsilon=s["clip_ratio_low"],
        # TRL's CISPO caps the ratio at epsilon_high itself; hybridflow's at 1 + clip_ratio_high
        epsilon_high=s["clip_ratio_high"] + (1.0 if loss_type == "cispo" else 0.0),
        loss_type=loss_type,
        importance_sampling_level=level,
        scale_rewards="group" if s["norm_adv_by_std"] else "none",
        mask_truncated_completions=False,
        entropy_coef=s["entropy_coeff"],
        shuffle_dataset=s["shuffle"],
        max_steps=s["steps"],
        seed=s["seed"],
        logging_steps=1,
        report_to="none",
        save_strategy="no",
        disable_tqdm=True,
        dataloader_pin_memory=False,
        remove_unused_columns=False,
        log_completions=False,
    )


def load_reward_fn(path: str | Path, name: str):
    """Function ``name`` of the Python file ``path``, loaded by path (the project's reward module)."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"reward file {path} does not exist")
    module_spec = importlib.util.spec_from_file_location("hybridflow_reward_functions", path)
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    fn = getattr(module, name, None)
    if not callable(fn):
        raise AttributeError(f"{path} has no reward function {name!r}")
    return fn


def _text(item: Any) -> str:
    """A prompt or completion as text: TRL gives chat rows as message lists (the last message's content)."""
    if isinstance(item, list):
        return str(item[-1]["content"]) if item else ""
    return str(item)


def reward_adapter(fn, scores: list[float] | None = None):
    """TRL's ``reward(prompts, completions, **columns) -> list[float]`` around a project reward function.

    The project's signature is ``fn(prompt, response, ground_truth, extra)``; the ground truth is the row's
    ``reward_model.ground_truth`` (verl's schema), ``extra`` its ``data_source`` and ``extra_info``. Each
    call's mean score is appended to ``scores`` (the step's sampled reward).
    """
    def reward(prompts, completions, reward_model, data_source=None, extra_info=None, **_):
        out = []
        for i, (prompt, completion, truth) in enumerate(zip(prompts, completions, reward_model, strict=True)):
            extra = {"data_source": data_source[i] if data_source else None,
                     "extra_info": extra_info[i] if extra_info else None}
            out.append(float(fn(_text(prompt), _text(completion), truth["ground_truth"], extra)))
        if scores is not None:
            scores.append(sum(out) / len(out))
        return out

    reward.__name__ = getattr(fn, "__name__", "reward")
    return reward


def _versions() -> dict[str, str]:
    from importlib.metadata import version

    return {name: version(name) for name in ("torch", "trl", "transformers", "accelerate", "datasets")}


def run(spec: dict[str, Any]) -> dict[str, Any]:
    import torch
    from datasets import load_dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    torch.set_num_threads(spec["threads"])
    kwargs = grpo_config_kwargs(spec)
    args = GRPOConfig(**kwargs)
    dataset = load_dataset("parquet", data_files=spec["train_file"], split="train")
    expected = spec["expected_prompt_ids"]  # hybridflow's token ids of rows 0, 1, ... in order
    n = spec["settings"]["n"]
    scores: list[float] = []
    clock: dict[str, float] = {}
    step_info: dict[str, Any] = {}
    steps: list[dict[str, Any]] = []

    def add(name: str, seconds: float) -> None:
        clock[name] = clock.get(name, 0.0) + seconds

    class TimedGRPOTrainer(GRPOTrainer):
        def _generate_single_turn(self, *a, **k):
            start = time.perf_counter()
            try:
                return super()._generate_single_turn(*a, **k)
            finally:
                add("gen", time.perf_counter() - start)

        def _calculate_rewards(self, *a, **k):
            start = time.perf_counter()
            try:
                return super()._calculate_rewards(*a, **k)
            finally:
                add("reward", time.perf_counter() - start)

        def _get_per_token_logps_and_entropies(self, *a, **k):
            if torch.is_grad_enabled():  # the loss's own forward: part of the update
                return super()._get_per_token_logps_and_entropies(*a, **k)
            start = time.perf_counter()
            try:
                return super()._get_per_token_logps_and_entropies(*a, **k)
            finally:
                add("old_log_prob", time.perf_counter() - start)

        def _generate_and_score_completions(self, inputs):
            start = time.perf_counter()
            out = super()._generate_and_score_completions(inputs)
            add("generate_and_score", time.perf_counter() - start)
            prompt_ids = [ids[mask.bool()].tolist() for ids, mask in zip(out["prompt_ids"], out["prompt_mask"])]
            first = len(steps) * len(prompt_ids) // n
            want = [expected[first + i // n] if first + i // n < len(expected) else None
                    for i in range(len(prompt_ids))]
            step_info.update(sequences=len(prompt_ids), prompt_tokens=int(out["prompt_mask"].sum()),
                             response_tokens=int(out["completion_mask"].sum()),
                             prompt_ids_match=prompt_ids == want, first_row=first)
            return out

    class StepClock(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            clock.clear()
            step_info.clear()
            step_info["start"] = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            step_s = time.perf_counter() - step_info.pop("start")
            score_s = clock.pop("generate_and_score", 0.0)
            phases = {name: clock.get(name, 0.0) for name in ("gen", "reward", "old_log_prob")}
            phases["prepare_other"] = score_s - sum(phases.values())
            phases["update_actor"] = step_s - score_s
            steps.append({"step": state.global_step, "step_s": step_s, "phases": phases,
                          "reward": scores[-1] if scores else None, **step_info, "logs": {}})

        def on_log(self, args, state, control, logs=None, **kwargs):
            if steps and logs:
                steps[-1]["logs"].update({k: v for k, v in logs.items() if isinstance(v, (int, float))})

    trainer = TimedGRPOTrainer(
        model=spec["model_path"],
        reward_funcs=reward_adapter(load_reward_fn(spec["reward_file"], spec["reward_fn"]), scores),
        args=args, train_dataset=dataset, callbacks=[StepClock()],
    )
    # Which dtype the matmuls really run in: the first block linear layer's result dtype in the update (grad on)
    # and in generation (grad off); with autocast the weights stay fp32 while these are bf16. (The output layer
    # is no probe: TRL's update computes it fused, without calling the module.)
    seen: dict[str, set[str]] = {"update": set(), "generation": set()}

    def probe(module, inputs, output):
        seen["update" if torch.is_grad_enabled() else "generation"].add(str(output.dtype).removeprefix("torch."))

    first_linear = next(m for m in trainer.model.modules() if isinstance(m, torch.nn.Linear))
    hook = first_linear.register_forward_hook(probe)
    start = time.perf_counter()
    trainer.train()
    hook.remove()
    model = trainer.model
    return {
        "framework": "trl",
        "steps": steps,
        "wall_s": time.perf_counter() - start,
        "versions": _versions(),
        "threads": torch.get_num_threads(),
        "model_dtype": str(next(model.parameters()).dtype).removeprefix("torch."),
        "matmul_dtypes": {k: sorted(v) for k, v in seen.items()},
        "mixed_precision": str(trainer.accelerator.mixed_precision),
        "optim": str(args.optim),
        "attn_implementation": getattr(model.config, "_attn_implementation", None),
        "grpo_config": {k: v for k, v in kwargs.items() if isinstance(v, (int, float, str, bool, dict, type(None)))},
    }


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if len(argv) != 1:
        print("usage: python tools/bench_e2e_trl.py SPEC.json", file=sys.stderr)
        return 2
    spec = json.loads(Path(argv[0]).read_text())
    result = run(spec)
    Path(spec["results_path"]).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
