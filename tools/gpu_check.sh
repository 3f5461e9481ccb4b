#!/usr/bin/env bash
# The op library's GPU check, as one script for a machine with a CUDA GPU, a CUDA build of torch and nvcc:
# build the extension with its CUDA kernels, run the op tests (they cover every visible device), then the
# kernel benchmark at its GPU shapes. Needs only torch and pytest (no megatron, vLLM or Ray).
#   OUT=/some/dir bash tools/gpu_check.sh      # logs and bench_kernels_gpu.json land in $OUT (default build/gpu)
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-build/gpu}"
mkdir -p "$OUT"
PY="${PYTHON:-python3}"
export PYTHONUNBUFFERED=1
status=0
"$PY" setup.py build_ext --inplace > "$OUT/build.log" 2>&1 || { tail -60 "$OUT/build.log"; exit 1; }
"$PY" -c "import torch; from hybridengine.device import kernel_devices; from hybridengine.ops.library import kernels_on; \
d = kernel_devices()[-1]; print('torch', torch.__version__, 'devices', kernel_devices()); \
assert d.type != 'cpu', 'no GPU visible'; assert kernels_on(d), 'the GPU kernels were not built'" || exit 1
"$PY" -m pytest -q -p no:cacheprovider tests/ops 2>&1 | tee "$OUT/tests.log" || status=1
"$PY" tools/bench_kernels.py --device gpu --json "$OUT/bench_kernels_gpu.json" 2>&1 | tee "$OUT/bench.log" || status=1
exit $status
