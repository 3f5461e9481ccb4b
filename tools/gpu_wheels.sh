#!/usr/bin/env bash
# The wheels tools/gpu_check.sh installs on a GPU machine that reaches no package index. Run HERE (a machine
# with PyPI); they land in build/gpu-wheels (ignored by git: name it in the device tool's `carry`).
#   bash tools/gpu_wheels.sh                                   # cp312, manylinux x86_64 (the lent H200 machine)
#   GPU_WHEELS_PYTHON=3.11 GPU_WHEELS_DIR=build/gpu-wheels-py311 bash tools/gpu_wheels.sh   # same pins, this
#                                                              # machine's Python: the CPU dry run of gpu_check.sh
# What is in the set, and why (the GPU check's path: torchrun launcher, megatron training engine in bf16,
# megatron rollout engine, built-in arithmetic task and reward, JSONL/console metrics):
#   megatron-core==0.16.1, without its dependencies: it names torch, and the GPU machine has its own
#   transformers, tokenizers, safetensors, huggingface-hub: model/tokenizer files, HF import and export
#   cloudpickle: controller/runtime/wire.py, the torchrun transport (setup.py gets it through ray, which cannot travel)
#   psutil: megatron's checkpoint writer (dist_checkpointing filesystem_async), at every save
#   numpy, pyyaml, einops, tqdm: the project's and megatron's own imports
#   and every dependency of those, resolved by pip (never torch: nothing above but megatron-core names it).
# Left out on purpose: torch (the machine's CUDA build stays), vLLM and Ray (far over the 64 MiB a call can
# carry; the GPU check uses the torchrun backend and `rollout.engine: megatron`), datasets + pyarrow and
# math-verify (imported lazily, only for data.task=files and MATH rewards: the check's built-in arithmetic task
# and arithmetic_shaped reward never import them), tensorboard and matplotlib (the check logs console + JSONL and
# writes no plots). The versions are the ones this project's CPU venv runs (ENVIRONMENT.md).
# Ends with the set's total size; fails if it is over GPU_WHEELS_MAX_MIB (60: the working tree that travels
# with the wheels must stay under 64 MiB).
set -euo pipefail
cd "$(dirname "$0")/.."
DEST="${GPU_WHEELS_DIR:-build/gpu-wheels}"
PYVER="${GPU_WHEELS_PYTHON:-3.12}"
MAX_MIB="${GPU_WHEELS_MAX_MIB:-60}"
PY="${PYTHON:-python3}"
[ -x .venv/bin/python ] && PY="${PYTHON:-.venv/bin/python}"

MEGATRON="megatron-core==0.16.1"
REQUIREMENTS=(
  transformers==5.19.0 tokenizers==0.23.3 safetensors==0.8.0 huggingface-hub==2.4.0
  cloudpickle==3.1.3 psutil==7.2.2 numpy==2.3.5 pyyaml==6.0.4 einops==0.8.2 tqdm==4.70.1
  pillow==13.0.0
)
# pip matches a manylinux_2_N tag only when N is named; 2_28 is what torch's CUDA 13 wheels need anyway.
PLATFORMS=(manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux1_x86_64)
TARGET=(--python-version "$PYVER" --implementation cp --only-binary=:all:)
for p in "${PLATFORMS[@]}"; do TARGET+=(--platform "$p"); done

rm -rf "$DEST"
mkdir -p "$DEST"
# This machine's pip config lists local indexes that may not exist; their warnings say nothing about the set.
QUIET='is ignored: it is neither a file nor a directory'
"$PY" -m pip download -q --no-deps -d "$DEST" "${TARGET[@]}" "$MEGATRON" 2>&1 | { grep -v "$QUIET" || true; }
"$PY" -m pip download -q -d "$DEST" "${TARGET[@]}" "${REQUIREMENTS[@]}" 2>&1 | { grep -v "$QUIET" || true; }

# gpu_check.sh installs every wheel here with --no-deps: two versions of one package would break that.
dupes=$(ls "$DEST"/*.whl | xargs -n1 basename | cut -d- -f1 | tr 'A-Z-' 'a-z_' | sort | uniq -d)
[ -z "$dupes" ] || { echo "gpu_wheels: FAILED: more than one wheel of: $dupes" >&2; exit 1; }
if ls "$DEST" | grep -qiE '^(torch|nvidia|triton)[-_]'; then
  echo "gpu_wheels: FAILED: torch or a CUDA library got into $DEST (the GPU machine has its own):" >&2
  ls "$DEST" | grep -iE '^(torch|nvidia|triton)[-_]' >&2; exit 1
fi
# What gpu_check.sh's install section compares against to skip a second install.
(cd "$DEST" && ls *.whl | sort > wheels.txt)

ls -l "$DEST"/*.whl | awk '{printf "%10.2f MiB  %s\n", $5 / 1048576, $NF}' | sort -n
bytes=$(cat "$DEST"/*.whl | wc -c)
mib=$(awk -v b="$bytes" 'BEGIN { printf "%.1f", b / 1048576 }')
count=$(ls "$DEST"/*.whl | wc -l)
echo "gpu_wheels: $count wheels for cp${PYVER/./} manylinux x86_64 in $DEST: $mib MiB (limit $MAX_MIB MiB)"
if awk -v m="$mib" -v l="$MAX_MIB" 'BEGIN { exit !(m > l) }'; then
  echo "gpu_wheels: FAILED: $mib MiB is over $MAX_MIB MiB; the device tool carries 64 MiB a call, working tree included" >&2
  exit 1
fi
