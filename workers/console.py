"""What a run prints: hybridflow's own lines, its progress bar, and real warnings and errors.

vLLM, megatron-core, transformers and torch log at INFO and warn about
optional accelerations that a CPU run (or a run without transformer-engine)
does not use: about 350 lines around a 36-line demo. ``configure_console``
sets third-party loggers to WARNING and filters the warnings listed in
``HARMLESS_WARNINGS`` / ``HARMLESS_LOG_RECORDS`` (each with the reason it is
harmless); everything else still shows. ``verbose=True`` changes nothing,
so every line shows.

The choice travels to worker processes in the environment
(``HYBRIDFLOW_VERBOSE``): torchrun ranks and Ray actors inherit it, and
``WorkerHost`` calls ``configure_console()`` when a worker process starts.
Environment variables that other libraries read at import time
(``VLLM_LOGGING_LEVEL`` ...) are set with ``setdefault``, so a user's own
setting wins.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import sys
import tempfile
import warnings
from pathlib import Path

__all__ = ["HARMLESS_LOG_RECORDS", "HARMLESS_WARNINGS", "HarmlessRecords", "configure_console", "console_env",
           "verbose_console", "vllm_logging_config"]

VERBOSE_ENV = "HYBRIDFLOW_VERBOSE"

# (message regex, category): Python warnings that say nothing about the run's correctness.
HARMLESS_WARNINGS: tuple[tuple[str, type[Warning]], ...] = (
    # megatron-core: transformer-engine and apex are optional GPU accelerations; the torch fallbacks it
    # names are the implementations the engine is tested with.
    (r".*Transformer Engine and Apex are not installed.*", UserWarning),
    (r".*Apex is not installed\. Falling back to Torch Norm.*", UserWarning),
    # megatron-core's TransformerConfig default cuda_graph_scope; the engine captures no CUDA graphs.
    (r".*full scope is deprecated.*", UserWarning),
    # vLLM's kernel dispatcher scans module attributes and touches this deprecated alias; nothing calls it.
    (r".*`torch\.distributed\.reduce_op` is deprecated.*", FutureWarning),
    # megatron's legacy static inference engine (the megatron rollout engine's choice on CPU, see
    # workers/rollout/megatron_engine.py): a deprecation notice for a future release.
    (r".*static engine will be deprecated.*", UserWarning),
)
# On a CPU run only: a GPU performance hint about overlapping TP communication with compute.
CPU_ONLY_HARMLESS_WARNINGS: tuple[tuple[str, type[Warning]], ...] = (
    (r".*CUDA_DEVICE_MAX_CONNECTIONS.*", UserWarning),
)

# Logger name -> message regexes of WARNING records that are expected in every hybridflow run
# ("vllm": the whole vLLM logger tree, through its handler).
HARMLESS_LOG_RECORDS: dict[str, tuple[str, ...]] = {
    "vllm": (
        # The engine seeds the process RNG; hybridflow seeds every request itself (SamplingConfig.seed).
        r"The global random seed is set to",
        # hybridflow builds engines with enforce_eager=True on purpose (compiling costs ~35 s per start).
        r"Enforce eager set",
        r"Inductor compilation was disabled by user settings",
        # vLLM's CPU backend runs without Triton, and falls back to the V1 model runner without it.
        r"Triton is not installed",
        r"Model Runner V2 requires Triton",
        # The supported models have no Mamba / SSM layers.
        r"Reset SSM cache type",
        # Allocator / OpenMP preloads are a serving-throughput tip, not needed for correct results.
        r"is not found in LD_PRELOAD",
        # vLLM's CPU worker replaces torch.set_num_threads after binding threads; the worker set its
        # thread count before the engine started.
        r"CPU backend doesn't allow to use `torch\.set_num_threads`",
        # vLLM's layerwise reload visits the rotary embedding, which has no weights (its tables come
        # from the config); every real parameter is loaded and checked by the weight sync.
        r"RotaryEmbedding: Failed to load weights",
        # With tied embeddings the LM head has no tensor of its own: it is the embedding's, which the sync
        # loads, and whose tied layers it re-processes (workers/rollout/vllm_weight_sync.py).
        r"ParallelLMHead: Failed to load weights",
        # The worker chose its thread count (the trainer in the same process uses them); measured on the
        # SmolLM2 example, 2 threads in one process beat 1 (README, "A real model").
        r"OMP_NUM_THREADS=\d+ is set; leaving Torch threads",
        # rollout.server hands the engine token ids one request at a time (LLMEngine.add_request), as vLLM's
        # own LLM.generate does underneath; the notice is about the call's form.
        r"Passing raw prompts to InputProcessor is deprecated",
        # A LoRA served with rollout.lora_sync: adapter names no tokenizer of its own: the base's serves it.
        r"deprecated support for supporting different tokenizers for different LoRAs",
        # A CPU without the instructions oneDNN's kernel for this matmul needs (no AVX-512): vLLM computes the
        # layer with torch's linear instead, the same product, more slowly.
        r"Failed to create oneDNN linear, fallback to torch linear",
        # An engine that loads its own checkpoint (a generative judge's) in another precision casts each tensor
        # as it loads it (reward.judge.precision against the checkpoint's dtype), once per weight.
        r"Attempted to load weight \S+ with dtype torch\.\w+ into parameter with dtype torch\.\w+",
    ),
    # torch's op library looks for Triton kernels; CPU runs have none.
    "torch._library.triton": (r"Triton not available",),
}

# Third-party loggers set to WARNING (their INFO is engine start-up detail).
THIRD_PARTY_LOGGERS = ("vllm", "megatron", "transformers", "torch", "ray", "datasets", "urllib3", "filelock")


def verbose_console() -> bool:
    return os.environ.get(VERBOSE_ENV, "0") == "1"


def console_env(verbose: bool) -> dict[str, str]:
    """Environment for processes of a run (read by libraries at import time); a user's own values win."""
    env = {VERBOSE_ENV: "1" if verbose else "0"}
    if not verbose:
        env.update({
            "VLLM_LOGGING_LEVEL": "WARNING",
            "TRANSFORMERS_VERBOSITY": "warning",
            "TRANSFORMERS_NO_ADVISORY_WARNINGS": "1",
            "HF_HUB_DISABLE_PROGRESS_BARS": "1",  # checkpoint shard bars; the run's own bar stays
            "HF_DATASETS_DISABLE_PROGRESS_BARS": "1",
            "VLLM_LOGGING_CONFIG_PATH": _vllm_logging_config_file(),
        })
    return env


class HarmlessRecords(logging.Filter):
    """Drops the WARNING (and lower) records of ``HARMLESS_LOG_RECORDS[logger_prefix]``; errors always pass."""

    def __init__(self, logger_prefix: str = "vllm") -> None:  # a key of HARMLESS_LOG_RECORDS
        super().__init__()
        self.pattern = re.compile("|".join(f"(?:{p})" for p in HARMLESS_LOG_RECORDS[logger_prefix]))

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno >= logging.ERROR:
            return True
        try:
            message = record.getMessage()
        except Exception:  # a malformed record is not ours to drop
            return True
        return not self.pattern.search(message)


def vllm_logging_config() -> dict:
    """vLLM's logging setup (its stdout handler at WARNING) with ``HarmlessRecords`` on the handler.

    vLLM re-runs ``dictConfig`` while an engine starts, which replaces any
    handler filter added from outside; a config file of its own
    (``VLLM_LOGGING_CONFIG_PATH``) is the supported way to shape its output.
    """
    return {
        "version": 1,
        "disable_existing_loggers": False,
        "formatters": {"vllm": {"format": "(vllm pid=%(process)d) %(levelname)s %(asctime)s "
                                          "[%(filename)s:%(lineno)d] %(message)s",
                                "datefmt": "%m-%d %H:%M:%S"}},
        "filters": {"harmless": {"()": f"{__name__}.HarmlessRecords", "logger_prefix": "vllm"}},
        "handlers": {"vllm": {"class": "logging.StreamHandler", "formatter": "vllm", "level": "WARNING",
                              "stream": "ext://sys.stdout", "filters": ["harmless"]}},
        "loggers": {"vllm": {"handlers": ["vllm"], "level": "WARNING", "propagate": False}},
    }


def _vllm_logging_config_file() -> str:
    """The config above as a JSON file (named by its content, so every process may write it)."""
    text = json.dumps(vllm_logging_config(), sort_keys=True)
    digest = hashlib.sha1(text.encode()).hexdigest()[:12]
    path = Path(tempfile.gettempdir()) / f"hybridflow-vllm-logging-{digest}.json"
    if not path.is_file():
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        tmp.write_text(text)
        os.replace(tmp, path)
    return str(path)


# What set_verbosity_warning() and disable_progress_bar() do, as transformers reads it from the environment at import
_HF_QUIET_ENV = {"TRANSFORMERS_VERBOSITY": "warning", "HF_HUB_DISABLE_PROGRESS_BARS": "1"}


def configure_console(verbose: bool | None = None) -> None:
    """Quiet this process's third-party output (unless ``verbose``); ``None`` reads HYBRIDFLOW_VERBOSE.

    Given explicitly, the choice is also written to the environment, so that
    processes started afterwards make the same one.
    """
    if verbose is not None:
        os.environ[VERBOSE_ENV] = "1" if verbose else "0"
    verbose = verbose_console()
    for key, value in console_env(verbose).items():
        os.environ.setdefault(key, value)
    if verbose:
        return
    from hybridengine.device import accelerator_available

    harmless = HARMLESS_WARNINGS + (() if accelerator_available() else CPU_ONLY_HARMLESS_WARNINGS)
    for message, category in harmless:
        warnings.filterwarnings("ignore", message=message, category=category)
    for name in THIRD_PARTY_LOGGERS:
        logger = logging.getLogger(name)
        if logger.level == logging.NOTSET or logger.level < logging.WARNING:
            logger.setLevel(logging.WARNING)
    # vLLM's records pass the filter on its own handler (vllm_logging_config); the others are filtered
    # where they are logged (a logger's filters see only its own records, not its children's).
    for name in HARMLESS_LOG_RECORDS.keys() - {"vllm"}:
        logger = logging.getLogger(name)
        if not any(isinstance(f, HarmlessRecords) for f in logger.filters):
            logger.addFilter(HarmlessRecords(name))
    if "transformers" not in sys.modules and all(os.environ.get(k) == v for k, v in _HF_QUIET_ENV.items()):
        return  # transformers, imported later, reads both from the environment: importing it here costs seconds
    try:  # transformers' own verbosity switch also covers its progress bars
        import transformers.utils.logging as hf_logging

        hf_logging.set_verbosity_warning()
        hf_logging.disable_progress_bar()
    except ImportError:
        pass
