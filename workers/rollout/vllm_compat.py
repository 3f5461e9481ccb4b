"""Every patch of vLLM, and every use of its private names (the guard: ``hybridengine.compat``).

Used by the vLLM rollout: ``permuted_groups`` while its engine is built
(``vllm_engine``), ``layerwise_reload`` / ``materialized_layer`` at each weight
sync (``vllm_weight_sync``), ``shm_group_names`` for the CPU shared-memory
segments' names (``vllm_cpu_shm``) and ``shutdown_engine`` at close.
``VLLM.patches`` says why each patch exists and when it can go. vLLM is
imported only when a patch is applied.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import importlib.util
import logging
import sys
import types
from typing import Any, Callable, Iterator

from hybridengine.compat import LibraryShim, Patch

__all__ = ["VLLM", "after_each_forward", "image_only_processor", "layerwise_reload", "permuted_groups",
           "shm_group_names", "shutdown_engine", "vllm_plugin"]

VLLM = LibraryShim(
    "vLLM",
    distributions=("vllm", "vllm-cpu"),
    written_for=("0.32",),
    module=__name__,
    patches=[
        Patch("permuted_groups",
              why="vLLM derives its tensor-parallel groups as consecutive blocks of the world's ranks; "
                  "parallel_state.init_model_parallel_group sees them through the permutation that makes them "
                  "the hybrid engine's (strided) generation TP groups.",
              remove_when="vLLM's external launcher takes the ranks of its tensor-parallel groups."),
        Patch("layerwise_reload",
              why="the weight sync loads each rank's shard as is through vLLM's private layerwise reload steps "
                  "(reload.layerwise._layerwise_process, get_layerwise_info, reload.meta.materialize_layer); "
                  "its reload_weights takes full checkpoint tensors.",
              remove_when="vLLM can reload weights from per-rank shards through a public call."),
        Patch("shm_group_names",
              why="vLLM's CPU communicator (_CPUSHMDistributed.make_group_name) names a TP group's shared-memory "
                  "segments the same for every engine on a machine; the names get a prefix of the engine's own.",
              remove_when="vLLM names those segments per engine under the external launcher.",
              optional=True),
        Patch("fused_moe_reload",
              why="on a weight update UnquantizedFusedMoEMethod._setup_kernel skips the experts' own "
                  "process_weights_after_loading (it runs only while the kernel is first built), so the CPU "
                  "backend's padding and grouped-GEMM prepack never reach reloaded experts: raw weights land in "
                  "the packed tensors (wrong tokens, or a crash in cpu_fused_moe). It is rerun after a reload.",
              remove_when="vLLM's _setup_kernel reprocesses the experts on a weight update."),
        Patch("image_only_processor",
              why="vLLM's Qwen2.5-VL builds transformers' Qwen2_5_VLProcessor, whose video half needs torchvision, "
                  "and imports image_processing_qwen2_vl, which imports it at the top; PyPI's torchvision is "
                  "CUDA-linked and fails beside the CPU torch. Without torchvision that module is its PIL twin "
                  "(image_processing_pil_qwen2_vl) and the processor is built without its video half, in every "
                  "vLLM process (the vllm.general_plugins entry point, vllm_plugin).",
              remove_when="transformers builds the Qwen-VL processors without torchvision, or a CPU torchvision "
                          "installs beside the CPU torch."),
        Patch("engine_shutdown",
              why="LLM has no close(); its engine core (llm.llm_engine.engine_core) is shut down directly.",
              remove_when="vLLM's LLM has a public shutdown."),
        Patch("route_capture",
              why="vLLM 0.32 returns routed experts only through the auxiliary-output connector of its Model Runner "
                  "V2 (GPU and Triton); the V1 runner's execute_model is wrapped to file each forward's captured "
                  "routes (RoutedExpertsCapturer) under their requests and positions.",
              remove_when="vLLM returns routed experts from every model runner."),
    ],
)
VLLM.check_version()


@contextlib.contextmanager
@VLLM.applies("permuted_groups")
def permuted_groups(perm: list[int]) -> Iterator[None]:
    """While active, vLLM's rank i in every group it creates stands for world rank ``perm[i]``."""
    parallel_state = VLLM.import_module("vllm.distributed.parallel_state", patch="permuted_groups")
    original = VLLM.require(parallel_state, "init_model_parallel_group", patch="permuted_groups")

    def init_group(group_ranks, *args, **kwargs):
        return original([[perm[r] for r in group] for group in group_ranks], *args, **kwargs)

    parallel_state.init_model_parallel_group = init_group
    try:
        yield
    finally:
        parallel_state.init_model_parallel_group = original


class _LayerwiseReload:
    """vLLM's layerwise reload steps, looked up once (every name checked before the model is touched)."""

    def __init__(self) -> None:
        patch = "layerwise_reload"
        reload = VLLM.import_module("vllm.model_executor.model_loader.reload", patch=patch)
        layerwise = VLLM.import_module("vllm.model_executor.model_loader.reload.layerwise", patch=patch)
        meta = VLLM.import_module("vllm.model_executor.model_loader.reload.meta", patch=patch)
        self.initialize = VLLM.require(reload, "initialize_layerwise_reload", patch=patch)
        self.finalize = VLLM.require(reload, "finalize_layerwise_reload", patch=patch)
        self.get_info = VLLM.require(layerwise, "get_layerwise_info", patch=patch)
        self.process = VLLM.require(layerwise, "_layerwise_process", patch=patch)
        self.materialize = VLLM.require(meta, "materialize_layer", patch=patch)


@contextlib.contextmanager
@VLLM.applies("layerwise_reload")
def layerwise_reload(model: Any, model_config: Any, partial: bool = False
                     ) -> Iterator[Callable[[Any], contextlib.AbstractContextManager]]:
    """A layerwise reload of ``model``: yields ``materialized``, and finalizes the reload at exit.

    Within ``with materialized(layer):`` the layer's parameters are in
    checkpoint format (per-rank shapes), to be filled in; at the end of the
    block vLLM's post-load processing runs on it (on CPU it repacks linear
    weights for oneDNN) and the result is copied into the engine's tensors.
    ``partial``: some layers are left as they are; vLLM puts their tensors back, and its warning that they
    "failed to load" is dropped.
    """
    steps = _LayerwiseReload()
    reprocess_fused_experts_on_reload()
    steps.initialize(model)
    quiet = _UnloadedLayers() if partial else None
    logger = logging.getLogger("vllm.model_executor.model_loader.reload.layerwise")
    if quiet is not None:
        logger.addFilter(quiet)
    try:
        yield functools.partial(_materialized_layer, steps)
    finally:
        try:
            steps.finalize(model, model_config)
        finally:
            if quiet is not None:
                logger.removeFilter(quiet)


class _UnloadedLayers(logging.Filter):
    """Drops vLLM's "Failed to load weights" for the layers a partial reload leaves as they are."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "Failed to load weights" not in record.getMessage()


@functools.cache
@VLLM.applies("fused_moe_reload")
def reprocess_fused_experts_on_reload() -> None:
    """Make a weight update rerun the fused experts' own post-load step (padding, the CPU prepack); once."""
    patch = "fused_moe_reload"
    module = VLLM.import_module("vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method", patch=patch)
    method = VLLM.require(module, "UnquantizedFusedMoEMethod", patch=patch)
    original = VLLM.require(method, "_setup_kernel", patch=patch)

    @functools.wraps(original)
    def setup_kernel(self, layer, w13, w2):
        updating = self.moe_kernel is not None
        original(self, layer, w13, w2)
        if updating:
            self.moe_kernel.fused_experts.process_weights_after_loading(layer)

    method._setup_kernel = setup_kernel


@contextlib.contextmanager
def _materialized_layer(steps: _LayerwiseReload, layer: Any) -> Iterator[None]:
    """``layer`` materialized in checkpoint format for the block; processed and copied back after it."""
    info = steps.get_info(layer)
    steps.materialize(layer, info)
    yield
    VLLM.require(info, "loaded_weights", patch="layerwise_reload")
    info.loaded_weights = []  # no buffered weights for it to load: the shard was copied in directly
    steps.process(layer, info)  # post-load processing, then copy into the kernel tensors


@contextlib.contextmanager
@VLLM.applies("shm_group_names")
def shm_group_names(rename: Callable[[str], str]) -> Iterator[None]:
    """While active, vLLM's CPU communicator names a group's shared-memory segments ``rename(its own name)``.

    Does nothing where vLLM has no CPU communicator module (a build without it: nothing to rename).
    """
    patch = "shm_group_names"
    try:
        cpu_communicator = importlib.import_module("vllm.distributed.device_communicators.cpu_communicator")
    except ImportError:
        yield
        return
    shm = VLLM.optional(cpu_communicator, "_CPUSHMDistributed", patch=patch)
    if shm is None or not callable(VLLM.optional(shm, "make_group_name", patch=patch)):
        yield
        return
    original = shm.__dict__["make_group_name"]
    name_of = original.__func__ if isinstance(original, staticmethod) else original

    def make_group_name(communicator) -> str:
        return rename(name_of(communicator))

    shm.make_group_name = staticmethod(make_group_name)
    try:
        yield
    finally:
        shm.make_group_name = original


@VLLM.applies("engine_shutdown")
def shutdown_engine(llm: Any) -> None:
    """Shut down the engine core of ``llm`` (a ``vllm.LLM``)."""
    engine = VLLM.require(llm, "llm_engine", patch="engine_shutdown")
    VLLM.require(engine, "engine_core", patch="engine_shutdown").shutdown()


@VLLM.applies("route_capture")
def after_each_forward(runner: Any, then: Callable[[Any], None]) -> None:
    """Call ``then(scheduler_output)`` after each forward of the model runner ``runner`` (its execute_model)."""
    execute = VLLM.require(runner, "execute_model", patch="route_capture")

    def execute_model(scheduler_output, *args, **kwargs):
        out = execute(scheduler_output, *args, **kwargs)
        then(scheduler_output)
        return out

    runner.execute_model = execute_model


def vllm_plugin() -> None:
    """vLLM's general plugin (the ``vllm.general_plugins`` entry point): run in every vLLM process, the model
    registry's inspection subprocess included, before any model module is imported."""
    image_only_processor()


@functools.cache
@VLLM.applies("image_only_processor")
def image_only_processor() -> None:
    """Without torchvision: transformers' Qwen2-VL image processing from its PIL twin, and ``Qwen2_5_VLProcessor``
    (as vLLM builds it, ``from_pretrained``) made without its video half; once a process. With torchvision,
    nothing."""
    if importlib.util.find_spec("torchvision") is not None:
        return
    patch = "image_only_processor"
    name = "transformers.models.qwen2_vl.image_processing_qwen2_vl"
    pil = VLLM.import_module("transformers.models.qwen2_vl.image_processing_pil_qwen2_vl", patch=patch)
    twin = types.ModuleType(name, "transformers' Qwen2-VL image processing, its PIL backend (no torchvision)")
    twin.__dict__.update({k: v for k, v in vars(pil).items() if not k.startswith("__")})
    twin.Qwen2VLImageProcessor = VLLM.require(pil, "Qwen2VLImageProcessorPil", patch=patch)
    sys.modules[name] = twin
    processing = VLLM.import_module("transformers.models.qwen2_5_vl.processing_qwen2_5_vl", patch=patch)
    whole = VLLM.require(processing, "Qwen2_5_VLProcessor", patch=patch)
    whole.from_pretrained = classmethod(_image_only_from_pretrained)


def _image_only_from_pretrained(cls, path, *args, **kwargs):
    """A Qwen2.5-VL processor from a checkpoint's tokenizer, image-processor config and chat template."""
    from transformers import AutoTokenizer, Qwen2VLImageProcessorPil

    loading = {k: kwargs[k] for k in ("revision", "trust_remote_code", "token", "cache_dir") if k in kwargs}
    tokenizer = AutoTokenizer.from_pretrained(path, **loading)
    image_sizes = {k: kwargs[k] for k in ("min_pixels", "max_pixels", "size") if k in kwargs}
    images = Qwen2VLImageProcessorPil.from_pretrained(path, **loading, **image_sizes)
    return _image_only_class()(images, tokenizer, chat_template=getattr(tokenizer, "chat_template", None))


@functools.cache
def _image_only_class() -> type:
    from transformers.models.qwen2_5_vl.processing_qwen2_5_vl import Qwen2_5_VLProcessor
    from transformers.processing_utils import ProcessorMixin, VideosKwargs

    class NoVideos:
        """The video half's place: vLLM reads the kwargs it would take; anything else is refused."""

        valid_kwargs = VideosKwargs

        def __getattr__(self, name):
            raise ValueError("videos are not supported: this Qwen2.5-VL processor is built without torchvision, "
                             "for images and text only")

    class ImageOnlyQwen2_5_VLProcessor(Qwen2_5_VLProcessor):
        """Qwen2.5-VL's processor without its video half: images and text only."""

        def __init__(self, image_processor=None, tokenizer=None, chat_template=None, **kwargs):
            self.image_token, self.video_token = "<|image_pad|>", "<|video_pad|>"
            self.image_token_id = tokenizer.convert_tokens_to_ids(self.image_token)
            self.video_token_id = tokenizer.convert_tokens_to_ids(self.video_token)
            ProcessorMixin.__init__(self, image_processor, tokenizer, chat_template=chat_template)
            self.video_processor = NoVideos()

    return ImageOnlyQwen2_5_VLProcessor
