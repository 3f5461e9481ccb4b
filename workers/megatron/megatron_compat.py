"""Every patch of megatron-core, and every use of its private names (the guard: ``hybridengine.compat``).

``prepare_megatron()`` is the one entry point that makes megatron-core usable
in a process and thread. With CUDA it does nothing. On a CPU-only torch build
(gloo backend) it applies torch's emulation of ``torch.cuda``
(``hybridengine.device.torch_compat``) and the CPU patches below once per
process, and enters the CUDA-to-CPU mode in the calling thread: call it in
every thread that runs megatron code, before ``model_parallel_cuda_manual_seed``
and model building.

The caller still builds megatron the CPU way: use_cpu_initialization=True, the
local layer spec (no transformer-engine), bias_dropout_fusion /
bias_activation_fusion / masked_softmax_fusion off (fused paths need torch.compile
or CUDA kernels), gradient_accumulation_fusion off.

The other patches are called where their code needs them (the engine, its
checkpoints, RoPE, the static-engine rollout). ``MEGATRON.patches`` says why
each exists and when it can go.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import multiprocessing
from typing import Any, Iterator

import torch

from hybridengine.compat import LibraryShim, Patch
from hybridengine.device import accelerator_available, torch_compat

__all__ = [
    "MEGATRON",
    "ensure_scratch_buffer",
    "fork_checkpoint_results_queue",
    "fuse_cpu_adam",
    "llama3_scaled_inv_freq",
    "prepare_megatron",
    "quiet_static_engine",
    "replace_rotary_inv_freq",
    "return_hidden_states",
    "rollout_controller_class",
    "static_engine_without_reseed",
    "synchronize_chained_steps",
]

MEGATRON = LibraryShim(
    "megatron-core",
    distributions=("megatron-core",),
    written_for=("0.16",),
    module=__name__,
    patches=[
        Patch("torch_norm_sequence_parallel",
              why="without apex, WrappedTorchNorm refuses sequence parallelism; a norm is per token, so it is "
                  "built without it and its weights marked sequence_parallel (their grads reduced over TP).",
              remove_when="megatron-core's torch norm accepts sequence parallelism."),
        Patch("cpu_rng_tracker",
              why="CudaRNGStatesTracker keeps its named states (data-, model-, expert-parallel) in the CUDA "
                  "generator; on CPU they are CPU generator states, swapped in on fork().",
              remove_when="megatron-core's RNG tracker runs on a CPU build."),
        Patch("recompute_rng_states",
              why="activation recomputation saves and restores the CUDA generator (random._get_cuda_rng_state / "
                  "_set_cuda_rng_state); without one its state is empty and restoring it does nothing.",
              remove_when="megatron-core's recomputation skips the CUDA generator on a CPU build."),
        Patch("recompute_mode",
              why="CheckpointFunction.backward reruns the forward inside autograd's backward thread, where the "
                  "thread's CUDA-to-CPU mode is not in effect; it enters one.",
              remove_when="megatron-core runs on a CPU build without the CUDA-to-CPU mode."),
        Patch("host_split_sizes",
              why="the all-to-all token dispatcher moves its split sizes to the host as numpy arrays through "
                  "moe_utils.maybe_move_tensor_to_cpu, which leaves a tensor already on the host a tensor; "
                  "all_to_all_single takes sequences, so a host tensor asked for as numpy becomes one.",
              remove_when="maybe_move_tensor_to_cpu honours as_numpy for host tensors."),
        Patch("uneven_collectives_on_gloo",
              why="with expert tensor parallelism the token dispatcher all-gathers and reduce-scatters uneven "
                  "splits (tensor_parallel.mappings._gather_along_first_dim / _reduce_scatter_along_first_dim "
                  "with split sizes), which gloo refuses; each split is padded to the largest and trimmed after.",
              remove_when="gloo takes uneven all-gather and reduce-scatter lists."),
        Patch("static_inference_on_host",
              why="the static inference engine's pipeline logits broadcast asserts a CUDA tensor "
                  "(communication_utils._is_cuda); the broadcast itself works on gloo, so CPU tensors pass.",
              remove_when="megatron-core's inference communication accepts CPU tensors."),
        Patch("scratch_buffer",
              why="megatron-core's process-wide scratch memory (parallel_state._GLOBAL_MEMORY_BUFFER) is set only "
                  "by initialize_model_parallel, whose global grid this project never builds.",
              remove_when="megatron-core has a public setter for the buffer, or allocates it on first use."),
        Patch("forked_results_queue",
              why="the torch_dist checkpoint writer starts its results manager (filesystem_async._results_queue) "
                  "from the spawn context: 2.4 s of a 2.8 s first save; one forked from here serves as well.",
              remove_when="megatron-core starts that manager from the fork context or lets its caller choose.",
              optional=True),
        Patch("fused_cpu_adam",
              why="without apex or transformer-engine megatron-core wraps torch's Adam, whose default on CPU is "
                  "the per-tensor loop (about 4x slower than its fused kernel).",
              remove_when="megatron-core asks torch's Adam for its fused kernel on CPU."),
        Patch("synchronize_steps",
              why="the distributed optimizer's state is loaded in two steps here, so the chained optimizer's "
                  "step counts are synchronized by its private ChainedOptimizer._synchronize_steps.",
              remove_when="megatron-core loads torch Adam's state under the distributed optimizer itself."),
        Patch("rollout_controller",
              why="the rollout's sampler and stop conditions override three steps of TextGenerationController's "
                  "static loop: generate_all_output_tokens_static_batch, sample_from_logits, "
                  "update_generation_status.",
              remove_when="megatron-core's static engine takes a sampler and an end condition from its caller."),
        Patch("quiet_static_engine",
              why="the static engine draws a tqdm bar per generate() on every rank (static_engine.tqdm); it is "
                  "disabled for the call.",
              remove_when="the static engine takes an option for its progress bar."),
        Patch("static_engine_seed",
              why="StaticInferenceEngine reseeds the global RNG at every generate() unless random_seed is falsy, "
                  "and its constructor turns None into 1234; random_seed is reset after construction.",
              remove_when="the static engine can be built without reseeding."),
        Patch("llama3_rope_bounds",
              why="RotaryEmbedding passes only the factor to its private _apply_scaling (Llama 3.x bounds left at "
                  "their defaults); it is called with all four, and inv_freq replaced (forward's memo cleared).",
              remove_when="megatron-core's RotaryEmbedding takes all four Llama 3.x scaling values."),
        Patch("router_gemm_without_te",
              why="megatron-core's router linear (moe_utils.RouterGatingLinearFunction) tests te_general_gemm, a "
                  "name only bound when transformer-engine imports; without it the name is bound to None, which "
                  "selects the torch matmul megatron-core means to fall back on.",
              remove_when="moe_utils binds te_general_gemm = None when transformer-engine is missing."),
        Patch("frozen_linear_2d",
              why="LinearWithFrozenWeight (the parallel linears' path for a weight without a gradient, a LoRA "
                  "base's) multiplies the [s, b, out] output gradient by the weight as a batched matmul, which "
                  "expands the weight per sequence: on CPU that took 3.2 s of a 4.7 s LoRA step on SmolLM2-135M. "
                  "The backward flattens it to one [s * b, out] GEMM, the same products.",
              remove_when="megatron-core's frozen-weight backward folds the leading dimensions itself."),
        Patch("deferred_output_layer",
              why="the last stage returns hidden states for the fused output layer + log-prob op: the output "
                  "layer's forward is shadowed on the instance, relying on how GPTModel calls it.",
              remove_when="GPTModel can return the hidden states instead of the logits."),
    ],
)
MEGATRON.check_version()

_cpu_patched = False


def _module(name: str, patch: str):
    return MEGATRON.import_module(name, patch=patch)


@MEGATRON.applies("router_gemm_without_te")
def _router_gemm_without_transformer_engine() -> None:
    moe_utils = _module("megatron.core.transformer.moe.moe_utils", "router_gemm_without_te")
    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


@MEGATRON.applies("host_split_sizes")
def _host_split_sizes() -> None:
    patch = "host_split_sizes"
    dispatcher = _module("megatron.core.transformer.moe.token_dispatcher", patch)
    move = MEGATRON.require(dispatcher, "maybe_move_tensor_to_cpu", patch=patch)
    MEGATRON.require_parameters(move, ("tensor", "as_numpy", "record_stream"), patch=patch)

    @functools.wraps(move)
    def to_host(tensor, as_numpy: bool = False, record_stream: bool = False):
        if as_numpy and torch.is_tensor(tensor) and tensor.device.type == "cpu":
            return tensor.numpy()
        return move(tensor, as_numpy=as_numpy, record_stream=record_stream)

    dispatcher.maybe_move_tensor_to_cpu = to_host


@MEGATRON.applies("uneven_collectives_on_gloo")
def _uneven_collectives_on_gloo() -> None:
    patch = "uneven_collectives_on_gloo"
    mappings = _module("megatron.core.tensor_parallel.mappings", patch)
    gather = MEGATRON.require(mappings, "_gather_along_first_dim", patch=patch)
    reduce_scatter = MEGATRON.require(mappings, "_reduce_scatter_along_first_dim", patch=patch)
    MEGATRON.require_parameters(gather, ("input_", "group", "output_split_sizes"), patch=patch)
    MEGATRON.require_parameters(reduce_scatter, ("input_", "group", "input_split_sizes"), patch=patch)

    def padded(part: torch.Tensor, rows: int) -> torch.Tensor:
        return torch.cat([part, part.new_zeros((rows - part.shape[0], *part.shape[1:]))]) if part.shape[0] < rows \
            else part.contiguous()

    @functools.wraps(gather)
    def gather_uneven(input_, group, output_split_sizes=None, use_global_buffer=False):
        sizes = None if output_split_sizes is None else [int(n) for n in output_split_sizes]
        if sizes is None or len(set(sizes)) == 1 or torch.distributed.get_backend(group) != "gloo":
            return gather(input_, group, output_split_sizes, use_global_buffer)
        rows = max(sizes)
        parts = [input_.new_empty((rows, *input_.shape[1:])) for _ in sizes]
        torch.distributed.all_gather(parts, padded(input_, rows), group=group)
        return torch.cat([part[:n] for part, n in zip(parts, sizes)])

    @functools.wraps(reduce_scatter)
    def reduce_scatter_uneven(input_, group, input_split_sizes=None, use_global_buffer=False):
        sizes = None if input_split_sizes is None else [int(n) for n in input_split_sizes]
        if sizes is None or len(set(sizes)) == 1 or torch.distributed.get_backend(group) != "gloo":
            return reduce_scatter(input_, group, input_split_sizes, use_global_buffer)
        rows = max(sizes)
        parts = [padded(part, rows) for part in torch.split(input_, sizes)]
        output = input_.new_empty((rows, *input_.shape[1:]))
        torch.distributed.reduce_scatter(output, parts, group=group)
        return output[:sizes[group.rank()]]

    mappings._gather_along_first_dim = gather_uneven
    mappings._reduce_scatter_along_first_dim = reduce_scatter_uneven


# ------------------------------------------------------------------ the CPU path
def prepare_megatron() -> None:
    """Make megatron-core usable in this process and thread (a no-op with CUDA).

    On a CPU torch build this applies the compatibility patches once per
    process and enters the CUDA-to-CPU mode in the calling thread; call it in
    every thread that runs megatron code.
    """
    global _cpu_patched
    _router_gemm_without_transformer_engine()
    _frozen_linear_as_one_gemm()
    if accelerator_available() or not torch_compat.emulate_cuda_on_cpu():
        return
    if not _cpu_patched:
        _cpu_patched = True
        _allow_torch_norm_with_sequence_parallel()
        _cpu_rng_tracker()
        _recompute_without_cuda_generator()
        _recompute_in_cuda_to_cpu_mode()
        _static_inference_on_host()
        _host_split_sizes()
        _uneven_collectives_on_gloo()
    torch_compat.restore_timing_events()  # vLLM, built in the same process, swaps in its own
    torch_compat.enter_thread()


@functools.cache
@MEGATRON.applies("frozen_linear_2d")
def _frozen_linear_as_one_gemm() -> None:
    patch = "frozen_linear_2d"
    layers = _module("megatron.core.tensor_parallel.layers", patch)
    frozen = MEGATRON.require(layers, "LinearWithFrozenWeight", patch=patch)
    MEGATRON.require(frozen, "backward", patch=patch)

    @staticmethod
    def backward(ctx, grad_output):
        (weight,) = ctx.saved_tensors
        lead = grad_output.shape[:-1]
        grad_input = grad_output.reshape(-1, grad_output.shape[-1]).matmul(weight).view(*lead, weight.shape[-1])
        if ctx.allreduce_dgrad:
            torch.distributed.all_reduce(grad_input, group=ctx.tp_group)
        return grad_input, None, None, None, None

    frozen.backward = backward


@MEGATRON.applies("torch_norm_sequence_parallel")
def _allow_torch_norm_with_sequence_parallel() -> None:
    """Build WrappedTorchNorm without sequence parallelism and mark its weights ``sequence_parallel``
    (as megatron's FusedLayerNorm does), so finalize_model_grads all-reduces them over the TP group."""
    torch_norm = _module("megatron.core.transformer.torch_norm", "torch_norm_sequence_parallel")
    wrapped = MEGATRON.require(torch_norm, "WrappedTorchNorm", patch="torch_norm_sequence_parallel")
    orig_new = wrapped.__new__

    def new(cls, config, hidden_size, eps=1e-5, **kwargs):
        if not config.sequence_parallel:
            return orig_new(cls, config, hidden_size, eps, **kwargs)
        config = copy.copy(config)
        config.sequence_parallel = False
        norm = orig_new(cls, config, hidden_size, eps, **kwargs)
        for p in norm.parameters():
            p.sequence_parallel = True
        return norm

    wrapped.__new__ = staticmethod(new)


@MEGATRON.applies("cpu_rng_tracker")
def _cpu_rng_tracker() -> None:
    """Replace CudaRNGStatesTracker with one that keeps CPU generator states.

    model_parallel_cuda_manual_seed builds the tracker through initialize_rng_tracker, which looks the
    class up by name at call time; the inference tracker subclasses it (its no-op overrides still apply).
    """
    patch = "cpu_rng_tracker"
    random = _module("megatron.core.tensor_parallel.random", patch)
    base = MEGATRON.require(random, "CudaRNGStatesTracker", patch=patch)
    default_name = MEGATRON.require(random, "_MODEL_PARALLEL_RNG_TRACKER_NAME", patch=patch)

    class CpuRNGStatesTracker(base):
        def add(self, name, seed):
            seeds = MEGATRON.require(self, "seeds_", patch=patch)
            states = MEGATRON.require(self, "states_", patch=patch)
            if seed in seeds or name in states:
                raise Exception(f"rng state {name} / seed {seed} already exists")
            self._is_initialized = True
            seeds.add(seed)
            states[name] = torch.Generator().manual_seed(seed).get_state()

        @contextlib.contextmanager
        def fork(self, name=default_name):
            if name not in self.states_:
                raise Exception(f"rng state {name} is not added")
            orig = torch.get_rng_state()
            torch.set_rng_state(self.states_[name])
            try:
                yield
            finally:
                self.states_[name] = torch.get_rng_state()
                torch.set_rng_state(orig)

    random.CudaRNGStatesTracker = CpuRNGStatesTracker


@MEGATRON.applies("recompute_rng_states")
def _recompute_without_cuda_generator() -> None:
    """Recomputation saves and restores the CPU generator, the tracker's states and the CUDA generator;
    everything draws from the first two, so the CUDA generator's state is empty and restoring it does nothing."""
    patch = "recompute_rng_states"
    random = _module("megatron.core.tensor_parallel.random", patch)
    for name in ("_get_cuda_rng_state", "_set_cuda_rng_state"):
        MEGATRON.require(random, name, patch=patch)
    random._get_cuda_rng_state = lambda device=None, clone=False, graph_safe=False: torch.empty(0, dtype=torch.uint8)
    random._set_cuda_rng_state = lambda new_state, device=-1, graph_safe=False: None


@MEGATRON.applies("recompute_mode")
def _recompute_in_cuda_to_cpu_mode() -> None:
    """Run CheckpointFunction.backward (the recomputed forward) inside a CUDA-to-CPU mode of its own."""
    patch = "recompute_mode"
    random = _module("megatron.core.tensor_parallel.random", patch)
    checkpoint_function = MEGATRON.require(random, "CheckpointFunction", patch=patch)
    recompute_backward = MEGATRON.require(checkpoint_function, "backward", patch=patch)

    def backward(ctx, *grads):
        with torch_compat.cuda_to_cpu_mode():
            return recompute_backward(ctx, *grads)

    checkpoint_function.backward = staticmethod(backward)


@MEGATRON.applies("static_inference_on_host")
def _static_inference_on_host() -> None:
    """Accept CPU tensors in the static engine's pipeline logits broadcast (its decode steps are timed on
    the wall clock: torch_compat.restore_timing_events)."""
    patch = "static_inference_on_host"
    communication_utils = _module("megatron.core.inference.communication_utils", patch)
    MEGATRON.require(communication_utils, "_is_cuda", patch=patch)
    torch_compat.restore_timing_events()

    def _is_on_device(tensor):
        assert tensor is not None

    communication_utils._is_cuda = _is_on_device


# ------------------------------------------------------------------ training
@MEGATRON.applies("scratch_buffer")
def ensure_scratch_buffer() -> None:
    """megatron's process-wide scratch memory, which its TP layers and attention draw on whatever the grid.

    Set once per process. It is grid-free: a pool of reusable tensors keyed by name.
    """
    patch = "scratch_buffer"
    parallel_state = _module("megatron.core.parallel_state", patch)
    if MEGATRON.require(parallel_state, "_GLOBAL_MEMORY_BUFFER", patch=patch) is None:
        MEGATRON.require(parallel_state, "_set_global_memory_buffer", patch=patch)()


@MEGATRON.applies("fused_cpu_adam")
def fuse_cpu_adam(optimizer) -> None:
    """Step torch's Adam over CPU parameters with its fused kernel.

    ``optimizer`` is megatron's (a ChainedOptimizer holds its parts as ``chained_optimizers``; each part
    holds torch's optimizer as ``optimizer``). On CUDA torch's default is already the multi-tensor path.
    Set before every step: ``load_state_dict`` restores the param groups as they were saved. Fused and
    looped Adam agree to float rounding.
    """
    for inner in getattr(optimizer, "chained_optimizers", [optimizer]):
        adam = MEGATRON.require(inner, "optimizer", patch="fused_cpu_adam")
        if not isinstance(adam, (torch.optim.Adam, torch.optim.AdamW)):
            continue
        for group in adam.param_groups:
            if group["params"] and all(p.device.type == "cpu" for p in group["params"]):
                group["fused"], group["foreach"] = True, False


@MEGATRON.applies("synchronize_steps")
def synchronize_chained_steps(optimizer) -> None:
    """Make the step count of every optimizer in megatron's ChainedOptimizer ``optimizer`` the same."""
    MEGATRON.require(optimizer, "_synchronize_steps", patch="synchronize_steps")()


@MEGATRON.applies("forked_results_queue")
def fork_checkpoint_results_queue() -> None:
    """Start the torch_dist writer's results manager from the fork context, once per process.

    The writers themselves are forked, and a save waits for them, so a manager forked from here serves
    the same queue (0.4 s instead of 2.8 s for the tiny model's first save on this CPU).
    """
    patch = "forked_results_queue"
    filesystem_async = _module("megatron.core.dist_checkpointing.strategies.filesystem_async", patch)
    queue = MEGATRON.optional(filesystem_async, "_results_queue", patch=patch, default=False)
    if queue is None:  # not made yet
        filesystem_async._results_queue = multiprocessing.get_context("fork").Manager().Queue()


@MEGATRON.applies("deferred_output_layer")
def return_hidden_states(output_layer: torch.nn.Module, sequence_parallel_group: Any = None) -> None:
    """From now on ``output_layer`` (the last stage's ColumnParallelLinear) hands its input back unchanged.

    An instance attribute shadows the class's forward; GPTModel then transposes what it gets
    ([S, B, H]) to [B, S, H] as it would the logits. Under sequence parallelism (``sequence_parallel_group``:
    the TP group) each rank holds a slice of the sequence: it is gathered first; the fused op's backward
    already sums the hidden states' gradient over TP, so each rank keeps its slice of it.
    """
    MEGATRON.require_parameters(type(output_layer).forward, ("weight", "runtime_gather_output"),
                                patch="deferred_output_layer")
    if sequence_parallel_group is None:
        output_layer.forward = lambda hidden_states, weight=None, runtime_gather_output=None: (hidden_states, None)
        return
    from megatron.core.tensor_parallel.mappings import gather_from_sequence_parallel_region

    def forward(hidden_states, weight=None, runtime_gather_output=None):
        return gather_from_sequence_parallel_region(hidden_states, tensor_parallel_output_grad=False,
                                                    group=sequence_parallel_group), None

    output_layer.forward = forward


# ------------------------------------------------------------------ RoPE
@MEGATRON.applies("llama3_rope_bounds")
def llama3_scaled_inv_freq(inv_freq: torch.Tensor, factor: float, low_freq_factor: float, high_freq_factor: float,
                           original_max_position_embeddings: int) -> torch.Tensor:
    """``inv_freq`` with Llama 3.x scaling, by megatron's own scaling function given all four values."""
    patch = "llama3_rope_bounds"
    rotary = _module("megatron.core.models.common.embeddings.rotary_pos_embedding", patch)
    rotary_embedding = MEGATRON.require(rotary, "RotaryEmbedding", patch=patch)
    apply_scaling = MEGATRON.require(rotary_embedding, "_apply_scaling", patch=patch)
    MEGATRON.require_parameters(apply_scaling, ("factor", "low_freq_factor", "high_freq_factor",
                                                "original_max_position_embeddings"), patch=patch)
    # A plain function in all but name: it reads nothing from the instance.
    return apply_scaling(None, inv_freq, factor=factor, low_freq_factor=low_freq_factor,
                         high_freq_factor=high_freq_factor,
                         original_max_position_embeddings=original_max_position_embeddings)


def replace_rotary_inv_freq(rotary: torch.nn.Module, inv_freq: torch.Tensor) -> None:
    """Put ``inv_freq`` in place of a RotaryEmbedding's own, on its device (part of ``llama3_rope_bounds``)."""
    current = MEGATRON.require(rotary, "inv_freq", patch="llama3_rope_bounds")
    rotary.inv_freq = inv_freq.to(current.device)
    cached = getattr(type(rotary).forward, "cache_clear", None)  # megatron memoizes forward per sequence length
    if cached is not None:
        cached()


# ------------------------------------------------------------------ the static engine (rollout)
@functools.cache
@MEGATRON.applies("rollout_controller")
def rollout_controller_class(mixin: type) -> type:
    """megatron's TextGenerationController with ``mixin``'s overrides of three steps of its static loop."""
    patch = "rollout_controller"
    module = _module("megatron.core.inference.text_generation_controllers.text_generation_controller", patch)
    controller = MEGATRON.require(module, "TextGenerationController", patch=patch)
    expected = {
        "generate_all_output_tokens_static_batch": ("active_requests", "active_streams"),
        "sample_from_logits": ("last_token_logits", "sampling_params", "vocab_size", "generation_started"),
        "update_generation_status": ("updated_prompts_tokens", "generation_started", "current_context_end_position",
                                     "is_generation_done_tensor", "generated_sequence_lengths", "termination_id"),
    }
    for name, params in expected.items():
        MEGATRON.require_parameters(MEGATRON.require(controller, name, patch=patch), params, patch=patch)
    return type("RolloutController", (mixin, controller), {})


@MEGATRON.applies("static_engine_seed")
def static_engine_without_reseed(engine: Any) -> None:
    """Keep ``engine`` (a StaticInferenceEngine) from reseeding the global RNG at every generate()."""
    MEGATRON.require(engine, "random_seed", patch="static_engine_seed")
    engine.random_seed = None


@contextlib.contextmanager
@MEGATRON.applies("quiet_static_engine")
def quiet_static_engine() -> Iterator[None]:
    """While active, the static engine's per-generate() progress bar is disabled."""
    static_engine = _module("megatron.core.inference.engines.static_engine", "quiet_static_engine")
    original = MEGATRON.require(static_engine, "tqdm", patch="quiet_static_engine")

    def quiet(*args, **kwargs):
        return original(*args, **{**kwargs, "disable": True})

    static_engine.tqdm = quiet
    try:
        yield
    finally:
        static_engine.tqdm = original
