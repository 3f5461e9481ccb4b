"""GeneratorTraits: what a generation engine can do, stated as data beside its name and import path.

The config checks, the planner and the weight plan ask an engine's traits, never its name, so that an engine
registered by a user (``register_generator("sglang", "my_pkg.engine:Gen", GeneratorTraits(...))``) is
checked and planned by what it declares::

    generator_traits("vllm").pipeline_parallel        # False: generation PP 1 only
    generator_traits("megatron").serves_adapters      # False: LoRA adapters arrive merged

Reading traits imports nothing of the engine's library.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["GeneratorTraits", "MEGATRON_TRAITS", "VLLM_TRAITS"]


@dataclass(frozen=True)
class GeneratorTraits:
    """A generation engine's capabilities (the defaults: the least an engine of the protocol offers)."""

    # generates over pipeline stages (generation pipeline_parallel > 1)
    pipeline_parallel: bool = False
    # serves requests one by one behind the rollout server (``RequestServing``: a serving loop)
    serves_requests: bool = False
    # the LoRA ranks it serves unmerged on the frozen base (``AdapterServing``); empty: adapters arrive merged
    adapter_ranks: tuple[int, ...] = ()
    # generates a mixture of experts at generation tensor_parallel > 1 (the resharded experts cut over TP)
    experts_at_tensor_parallel: bool = False
    # its KV cache's block, in tokens, where attention has no flash kernel (a CPU); 16 with one
    kv_block_tokens_without_flash: int = 16
    # generates from images: a vision-language model's prompts with their images (``GenerationRequest.images``)
    takes_images: bool = False

    @property
    def serves_adapters(self) -> bool:
        return bool(self.adapter_ranks)

    @property
    def max_adapter_rank(self) -> int:
        return max(self.adapter_ranks, default=0)

    def adapter_rank_for(self, rank: int) -> int | None:
        """The smallest rank it serves that holds adapters of ``rank`` (None: none does)."""
        return next((r for r in sorted(self.adapter_ranks) if r >= rank), None)


# vLLM: one engine per generation rank at PP 1, requests one by one (its engine loop), LoRA at its
# max_lora_rank choices, experts cut over TP; on a CPU its paged KV cache comes in 128-token blocks.
VLLM_TRAITS = GeneratorTraits(pipeline_parallel=False, serves_requests=True,
                              adapter_ranks=(1, 8, 16, 32, 64, 128, 256, 320, 512),
                              experts_at_tensor_parallel=True, kv_block_tokens_without_flash=128, takes_images=True)
# megatron's own generation: batches over pipeline stages; adapters merged; a mixture of experts at TP 1.
MEGATRON_TRAITS = GeneratorTraits(pipeline_parallel=True)
