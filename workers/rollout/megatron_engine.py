"""Rollout generation with megatron-core's static inference engine, on the resharded weights.

The hybrid engine's Resharder hands each rank its generation shard (TP=t_g,
PP=p_g). ``MegatronGenerator`` turns that shard into a generation-layout
GPTModel whose parameters are the shard's tensors (no copy) and generates
with megatron's own machinery: ``StaticInferenceEngine`` (legacy static
batching) drives ``TextGenerationController.generate_all_output_tokens_static_batch``
over a ``GPTInferenceWrapper`` holding a ``StaticInferenceContext`` KV cache.

megatron's loop right-pads the prompts, prefills up to the shortest one and
then decodes one position at a time for the whole batch; a row keeps its own
prompt tokens until its prompt is used up and samples from then on. So every
prompt sits at RoPE positions 0..len-1, as in a single-prompt forward.

What this module adds to megatron, mixed into its controller (_RolloutSampling):

* the sampler (``sample_from_logits``): padded vocabulary ids cut off,
  logits / T, then top-k and top-p,
  then a draw per row with that row's own ``torch.Generator`` (seeded
  requests) or a generator shared by the unseeded rows, and the log-prob of
  each drawn token under that processed distribution;
* stop handling (``update_generation_status``): rows that produced a stop
  string or already have ``max_new_tokens`` tokens are marked done, so the
  loop can end early.

Every process group the engine uses is the generation model's
(``model.pg_collection``); megatron's global parallel state is never set or
consulted.
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from hybridengine.model.spec import ModelSpec
from hybridengine.reshard.plan import ReshardPlan
from workers.megatron.megatron_compat import (
    prepare_megatron,
    quiet_static_engine,
    rollout_controller_class,
    static_engine_without_reseed,
)
from workers.rollout.batch import Completion, GenerationRequest
from workers.rollout.generator import GeneratorBase, GeneratorContext
from workers.rollout.route_capture import gather_layers, to_training_ids
from workers.rollout.sampling import SamplingConfig

__all__ = ["MegatronGenerator"]


class MegatronGenerator(GeneratorBase):
    """One rank's share of a generation replica, generating with megatron's static engine.

    ``generate`` is collective over this rank's generation TP x PP group:
    every rank of the group passes the same requests and gets the same
    completions back (all ranks sample identically, as megatron's engine
    expects). ``update_weights`` must have been called once before, on every
    rank of the world (the first call creates the generation process groups,
    which is collective over the world). The model's parameters are views of
    the tensors it is given (``borrows_weights``), so nothing is copied; it
    has no checkpoint loader of its own (``loads_checkpoint`` False).
    """

    borrows_weights = True
    loads_checkpoint = False

    @classmethod
    def from_context(cls, context: GeneratorContext) -> "MegatronGenerator":
        if context.spec.vision is not None:
            raise ValueError(f"the megatron rollout engine generates text only; {context.spec.architecture} is a "
                             "vision-language model: generate with rollout.engine vllm")
        if not context.weights_pushed:
            raise ValueError("the megatron rollout generates from the actor's weights; colocate it with an "
                             "actor (actor_role), give it a pool of its own fed by the actor (training=...), "
                             "or use engine='vllm'")
        return cls(context.spec, context.plan, context.rank, {}, eos_token_id=context.eos_token_id,
                   pad_token_id=context.pad_token_id, decode=context.decode,
                   return_routed_experts=getattr(context.config, "return_routed_experts", False))

    def __init__(
        self,
        spec: ModelSpec,
        plan: ReshardPlan,
        rank: int,
        groups_cache: dict,
        eos_token_id: int,
        pad_token_id: int,
        decode: Callable[[list[int]], str] | None = None,
        *,
        max_batch_size: int | None = None,
        return_routed_experts: bool = False,
    ) -> None:
        """``max_batch_size`` caps how many requests share one static batch (None: all of them).
        ``return_routed_experts``: a mixture of experts' completions carry the experts its routers chose
        (``Completion.routed_experts``, training expert ids; ``workers.rollout.route_capture``).

        ``pad_token_id`` is only checked: megatron's engine pads prompts with
        EOS internally, and no padding reaches the completions.
        """
        if spec.is_value_model:
            raise ValueError(
                f"{spec.architecture} with num_labels={spec.num_labels} is a value model (scalar head); "
                f"only a causal LM can generate"
            )
        if not 0 <= rank < plan.train.world_size:
            raise ValueError(f"rank {rank} is outside the plan's world of {plan.train.world_size} ranks")
        for name, token in (("eos_token_id", eos_token_id), ("pad_token_id", pad_token_id)):
            if not isinstance(token, int) or not 0 <= token < spec.vocab_size:
                raise ValueError(f"{name} must be a token id in [0, {spec.vocab_size}), got {token!r}")
        if max_batch_size is not None and (not isinstance(max_batch_size, int) or max_batch_size < 1):
            raise ValueError(f"max_batch_size must be None or a positive integer, got {max_batch_size!r}")
        spec.check_layout(plan.gen.tensor_parallel, plan.gen.pipeline_parallel)
        self.spec, self.plan, self.rank = spec, plan, rank
        self.groups_cache = groups_cache
        self.eos_token_id, self.pad_token_id = eos_token_id, pad_token_id
        self.decode = decode
        self.max_batch_size = max_batch_size
        if return_routed_experts and spec.moe is None:
            raise ValueError(f"return_routed_experts: {spec.architecture} has no routers (it is not a mixture of experts)")
        self.return_routed_experts = return_routed_experts
        self.model = None
        self._controller = None  # megatron's controller with _RolloutSampling, built by the first set_weights
        self._layout: dict[str, tuple] = {}  # parameter name -> (shape, dtype, device) of the installed shard

    # ------------------------------------------------------------------ weights
    def update_weights(self, weights: dict[str, torch.Tensor]) -> dict[str, Any]:
        """Install this rank's generation shard (what ``Resharder.to_generation`` returned); nothing is copied.

        The first call builds the model (collective over the world); later
        calls re-bind parameters whose tensor changed (``param.data = tensor``,
        no copy) and do nothing for tensors that are already installed.
        Names, shapes, dtypes and devices must stay those of the first shard.
        """
        start = time.perf_counter()
        self._install(weights)
        return {"timing_s/weight_sync": time.perf_counter() - start, "weight_sync/bytes": 0}

    def _install(self, weights: dict[str, torch.Tensor]) -> None:
        if self.model is None:
            from megatron.core.inference.model_inference_wrappers.gpt.gpt_inference_wrapper import (
                GPTInferenceWrapper,
            )
            from megatron.core.inference.model_inference_wrappers.inference_wrapper_config import (
                InferenceWrapperConfig,
            )

            from workers.megatron.generation_model import build_generation_model

            prepare_megatron()
            model = build_generation_model(self.spec, self.plan, self.rank, weights, self.groups_cache)
            config = InferenceWrapperConfig(
                hidden_size=self.spec.hidden_size,
                params_dtype=model.config.params_dtype,
                # -1: a pipeline always runs the whole batch as one micro-batch (megatron's "small batch" path).
                inference_batch_times_seqlen_threshold=-1,
                padded_vocab_size=self.spec.vocab_rows,  # megatron gathers the logits of every row, padding too
            )
            wrapper = GPTInferenceWrapper(model, config, _new_context(1, 1), pg_collection=model.pg_collection)
            self._controller = rollout_controller_class(_RolloutSampling)(
                wrapper, _TokenizerShim(self.eos_token_id), pp_group=model.pg_collection.pp
            )
            self.model = model
            self._layout = {name: (tuple(p.shape), p.dtype, p.device) for name, p in model.named_parameters()}
            if self.return_routed_experts:
                from hybridengine.reshard.expert_group import expert_placement
                from workers.rollout.route_capture import RouteRecorder

                gen = self.plan.gen
                self._controller.route_recorder = RouteRecorder(model, self.spec.layers_of_stage(
                    self.plan.ranks[self.rank].gen_pp_rank, gen.pipeline_parallel), self.spec.moe.topk)
                self._controller.placement = expert_placement(self.spec, self.plan)
            return
        params = dict(self.model.named_parameters())
        for name in params:
            if name not in weights:
                raise ValueError(
                    f"rank {self.rank}: generation model parameter {name!r} has no tensor in the new weights"
                )
        for name in weights:
            if name not in params:
                raise ValueError(f"rank {self.rank}: new weight {name!r} is not a parameter of the generation model")
        for name, tensor in weights.items():
            shape, dtype, device = self._layout[name]
            if (tuple(tensor.shape), tensor.dtype, tensor.device) != (shape, dtype, device):
                raise ValueError(
                    f"rank {self.rank}: {name}: new weight is {tuple(tensor.shape)} {tensor.dtype} on {tensor.device}, "
                    f"the model has {shape} {dtype} on {device}"
                )
        for name, param in params.items():
            tensor = weights[name]
            if (param.data_ptr(), param.shape, param.stride()) != (tensor.data_ptr(), tensor.shape, tensor.stride()):
                param.data = tensor

    def release(self) -> None:
        """Let go of the installed tensors (parameters become empty), so their buffer can be freed.

        The model's parameters are views into the reshard buffer and keep it
        alive; call this before the hybrid engine drops the buffer (its
        ``to_training``), and ``update_weights`` again before the next generate.
        """
        if self.model is None:
            return
        for param in self.model.parameters():
            param.data = torch.empty(0, dtype=param.dtype, device=param.device)

    def close(self) -> None:
        """Release the weights and the model; a later ``update_weights`` builds it again (collectively)."""
        self.release()
        if self._controller is not None and self._controller.route_recorder is not None:
            self._controller.route_recorder.close()
        self.model, self._controller, self._layout = None, None, {}

    # --------------------------------------------------------------- generation
    def generate(self, requests: list[GenerationRequest], sampling: SamplingConfig) -> list[Completion]:
        """One completion per request, in order, on every rank of the generation TP x PP group.

        A completion's ``token_ids`` exclude the prompt and end at the first
        of: EOS (included; unless ``sampling.ignore_eos``), the first token
        whose decoded prefix contains a stop string (included), or
        ``sampling.max_new_tokens`` tokens (finish_reason "length"; the other
        two are "stop"). ``log_probs[k]`` is the log-prob of token k under
        log_softmax(logits / sampling.logprob_temperature) restricted to
        top-k / top-p when those are set. A seeded request's sample depends
        only on its seed and the weights; unseeded requests draw from one
        generator seeded from the global torch RNG of the group's first rank.
        """
        if sampling.stop and self.decode is None:
            raise ValueError(
                f"stop strings {list(sampling.stop)!r} need a decode function (token ids -> text); "
                f"pass decode= to MegatronGenerator or drop the stop strings"
            )
        for i, request in enumerate(requests):
            if not request.prompt_ids:
                raise ValueError(f"request {i} has an empty prompt; every request needs at least one prompt token")
            bad = [t for t in request.prompt_ids if not 0 <= t < self.spec.vocab_size]
            if bad:
                raise ValueError(
                    f"request {i}: prompt token ids {bad[:5]} are outside the vocabulary [0, {self.spec.vocab_size})"
                )
        if not requests:
            return []
        if self.model is None:
            raise RuntimeError("MegatronGenerator.generate before update_weights: install the generation weights first")
        from megatron.core.inference.engines.static_engine import StaticInferenceEngine
        from megatron.core.inference.inference_request import InferenceRequest
        from megatron.core.inference.sampling_params import SamplingParams

        prepare_megatron()
        # Temperature, top-k / top-p and seeds are applied by the _RolloutSampling sampler, not by megatron's.
        params = SamplingParams(num_tokens_to_generate=sampling.max_new_tokens)
        if sampling.ignore_eos:
            params.add_attributes({"no_early_termination": True})
        batch = len(requests) if self.max_batch_size is None else min(self.max_batch_size, len(requests))
        max_sequence = max(len(r.prompt_ids) for r in requests) + sampling.max_new_tokens
        wrapper = self._controller.inference_wrapped_model
        # A fresh KV cache sized to this call; the previous one is freed with its context.
        wrapper.inference_wrapper_config.inference_max_requests = batch
        wrapper.inference_wrapper_config.inference_max_seq_length = max_sequence
        wrapper.inference_context = _new_context(batch, max_sequence)
        self._controller.start(requests, sampling, self._unseeded_seed(requests, sampling), self.decode,
                               self.spec.vocab_size)
        megatron_requests = [
            InferenceRequest(request_id=i, prompt="", prompt_tokens=list(r.prompt_ids), sampling_params=params)
            for i, r in enumerate(requests)
        ]
        try:
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message=".*static engine will be deprecated.*")
                engine = StaticInferenceEngine(self._controller, max_batch_size=batch, legacy=True)
            static_engine_without_reseed(engine)  # else it reseeds the global RNG at every generate()
            with quiet_static_engine():
                engine.generate(inference_requests=megatron_requests)
            return [self._controller.completion(i) for i in range(len(requests))]
        finally:
            self._controller.finish()
            wrapper.inference_context = _new_context(1, 1)

    def _unseeded_seed(self, requests: list[GenerationRequest], sampling: SamplingConfig) -> int | None:
        """A seed for the unseeded rows, drawn from the global RNG of the group's first rank and shared.

        Every rank of the group must draw the same tokens, so one draw is
        broadcast over the generation TP x PP group. None when no row needs it
        (greedy, or every request seeded); the condition is the same on every
        rank, since they all pass the same arguments.
        """
        if sampling.is_greedy or all(r.seed is not None for r in requests):
            return None
        group = self.model.pg_collection.mp
        seed = torch.randint(0, 2**62, (1,), dtype=torch.int64)
        if group.size() > 1:
            seed = seed.to(_model_device(self._controller))
            dist.broadcast(seed, src=dist.get_process_group_ranks(group)[0], group=group)
        return int(seed.item())


# ---------------------------------------------------------------------- megatron pieces
def _new_context(max_batch_size: int, max_sequence_length: int):
    from megatron.core.inference.contexts import StaticInferenceContext

    return StaticInferenceContext(max_batch_size, max_sequence_length)


class _TokenizerShim:
    """The little of a tokenizer megatron's static controller reads: ``eod`` ends a response and pads prompts.

    Requests arrive tokenized and text is produced by the caller's ``decode``,
    so ``detokenize`` returns an empty string (megatron only stores it).
    """

    bos = None

    def __init__(self, eos_token_id: int) -> None:
        self.eod = eos_token_id

    def detokenize(self, tokens, **kwargs) -> str:
        return ""

    def tokenize(self, text: str):
        raise TypeError("MegatronGenerator takes token ids; it does not tokenize text")


@dataclass
class _Row:
    """What one request has drawn so far: its tokens, their log-probs, where a stop string ended it."""

    generator: torch.Generator | None
    tokens: list[int] = field(default_factory=list)
    log_probs: list[float] = field(default_factory=list)
    stop_at: int | None = None  # number of tokens up to and including the one completing a stop string
    routes: torch.Tensor | None = None  # [positions, layers, k]: the experts of every position fed to the model


def _process_logits(logits: torch.Tensor, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    """logits / temperature with everything outside top-k, then outside top-p, set to -inf (fp32)."""
    logits = logits.float() / temperature
    if 0 < top_k < logits.size(-1):
        kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        probs = sorted_logits.softmax(dim=-1)
        # Keep the smallest prefix whose mass reaches top_p: drop a token once the mass before it does.
        drop = (probs.cumsum(dim=-1) - probs) >= top_p
        drop[..., 0] = False
        logits = logits.masked_fill(drop.scatter(-1, order, drop), float("-inf"))
    return logits


def _contains_stop(text: str, stops: tuple[str, ...]) -> bool:
    return any(s in text for s in stops)


class _RolloutSampling:
    """The rollout sampler and end conditions, mixed into megatron's TextGenerationController.

    The decode loop is megatron's ``generate_all_output_tokens_static_batch``;
    this mixin only swaps its sampling step and adds end conditions. Every
    row's drawn tokens and log-probs are recorded here, since megatron keeps
    neither an EOS token nor log-probs of the processed distribution.
    ``megatron_compat.rollout_controller_class`` combines the two (megatron
    is imported only when a generator is built).
    """

    route_recorder = None  # a RouteRecorder when completions carry their routed experts
    placement: tuple[int, ...] | None = None  # generation expert -> training expert

    def start(self, requests: list[GenerationRequest], sampling: SamplingConfig, unseeded_seed: int | None,
              decode: Callable[[list[int]], str] | None, vocab_size: int | None = None) -> None:
        """``vocab_size``: the real vocabulary; logits of ids from it on (padding rows) are dropped."""
        self._requests, self._sampling, self._decode = requests, sampling, decode
        self._vocab_size = vocab_size
        self._unseeded_seed = unseeded_seed
        self._rows: dict[int, _Row] = {}
        self._batch_rows: list[_Row] = []
        self._unseeded: torch.Generator | None = None
        # Window of trailing tokens decoded to look for a stop string each step (checked exactly once found).
        self._stop_window = max((len(s) for s in sampling.stop), default=0) + 8

    def finish(self) -> None:
        self._requests, self._rows, self._batch_rows = [], {}, []

    @torch.inference_mode()
    def generate_all_output_tokens_static_batch(self, active_requests, active_streams=None):
        device = _model_device(self)
        self._batch_rows = []
        for request_id in active_requests:
            seed = self._requests[request_id].seed
            generator = None if seed is None else torch.Generator(device=device).manual_seed(seed)
            row = _Row(generator)
            self._rows[request_id] = row
            self._batch_rows.append(row)
        if self.route_recorder is None:
            return super().generate_all_output_tokens_static_batch(active_requests, active_streams)
        self.route_recorder.start()
        try:
            result = super().generate_all_output_tokens_static_batch(active_requests, active_streams)
        finally:
            stage = self.route_recorder.stop()
        pp = self.inference_wrapped_model.model.pg_collection.pp
        routes = gather_layers(stage, pp, pp.size())
        for row, batch_row in zip(self._batch_rows, routes):
            row.routes = batch_row  # [positions, layers, k], generation expert ids
        return result

    def sample_from_logits(self, last_token_logits, sampling_params=None, vocab_size=None,
                           generation_started=None, top_n_logprobs_dict=None, logits=None, **kwargs):
        """Draw one token per row from the processed distribution; record it for rows past their prompt.

        A row draws only once its prompt is used up, so a seeded row's k-th
        draw is its k-th token whatever its neighbours. Rows still reading
        their prompt get the argmax, which megatron discards.
        """
        sampling = self._sampling
        if self._vocab_size is not None:
            # Padded vocabulary ids are not tokens: cut them off before the softmax, so they get no mass.
            last_token_logits = last_token_logits[..., : self._vocab_size]
        processed = _process_logits(last_token_logits, sampling.logprob_temperature, sampling.top_k, sampling.top_p)
        log_probs = torch.log_softmax(processed, dim=-1)
        tokens = torch.argmax(last_token_logits, dim=-1)
        started = torch.nonzero(generation_started).flatten().tolist()
        if not sampling.is_greedy and started:
            probs = log_probs.exp()
            unseeded = [i for i in started if self._batch_rows[i].generator is None]
            for i in started:
                generator = self._batch_rows[i].generator
                if generator is not None:
                    tokens[i] = torch.multinomial(probs[i], 1, generator=generator)[0]
            if unseeded:
                if self._unseeded is None:
                    self._unseeded = torch.Generator(device=probs.device).manual_seed(self._unseeded_seed)
                rows = torch.tensor(unseeded, device=probs.device)
                tokens[rows] = torch.multinomial(probs[rows], 1, generator=self._unseeded).squeeze(-1)
        picked = log_probs.gather(-1, tokens.unsqueeze(-1)).squeeze(-1).tolist()
        token_list = tokens.tolist()
        for i in started:
            self._batch_rows[i].tokens.append(token_list[i])
            self._batch_rows[i].log_probs.append(picked[i])
        return tokens

    def update_generation_status(self, updated_prompts_tokens, generation_started, current_context_end_position,
                                 is_generation_done_tensor, generated_sequence_lengths, termination_id=None):
        done, lengths = super().update_generation_status(
            updated_prompts_tokens, generation_started, current_context_end_position,
            is_generation_done_tensor, generated_sequence_lengths, termination_id,
        )
        sampling = self._sampling
        ended = []
        for i, (row, finished, started) in enumerate(zip(self._batch_rows, done.tolist(), generation_started.tolist())):
            if finished or not started:
                continue
            if len(row.tokens) >= sampling.max_new_tokens:
                ended.append(i)
            elif sampling.stop and row.stop_at is None:
                tail = self._decode(row.tokens[-self._stop_window:])
                if _contains_stop(tail, sampling.stop) and self._find_stop(row, len(row.tokens)):
                    ended.append(i)
        if ended:
            done = done.clone()
            done[ended] = True
        return done, lengths

    def _find_stop(self, row: _Row, upto: int) -> bool:
        """Set ``row.stop_at`` to the first prefix length <= upto whose text holds a stop string, if any."""
        stops = self._sampling.stop
        if not _contains_stop(self._decode(row.tokens[:upto]), stops):
            return False
        k = upto
        while k > 1 and _contains_stop(self._decode(row.tokens[: k - 1]), stops):
            k -= 1
        row.stop_at = k
        return True

    def completion(self, request_id: int) -> Completion:
        """The finished completion of request ``request_id`` (its index in the generate() call)."""
        sampling = self._sampling
        row = self._rows[request_id]
        limit = min(len(row.tokens), sampling.max_new_tokens)
        end, reason = limit, "length"
        if not sampling.ignore_eos and self.tokenizer.eod in row.tokens[:limit]:
            end, reason = row.tokens.index(self.tokenizer.eod) + 1, "stop"
        if sampling.stop:
            if row.stop_at is None:
                self._find_stop(row, end)
            if row.stop_at is not None and row.stop_at <= end:
                end, reason = row.stop_at, "stop"
        if reason == "length" and limit < sampling.max_new_tokens:
            raise RuntimeError(
                f"request {request_id}: the engine stopped after {len(row.tokens)} tokens without EOS, "
                f"stop string or reaching max_new_tokens={sampling.max_new_tokens}"
            )
        routes = None
        if row.routes is not None:  # every position whose output was used: the prompt's and all but the last token's
            used = len(self._requests[request_id].prompt_ids) + end - 1
            routes = to_training_ids(row.routes[:used], self.placement)
        return Completion(token_ids=row.tokens[:end], log_probs=row.log_probs[:end], finish_reason=reason,
                          routed_experts=routes)


def _model_device(controller) -> torch.device:
    return next(controller.inference_wrapped_model.model.parameters()).device
