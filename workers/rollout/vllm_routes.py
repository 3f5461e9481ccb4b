"""The experts vLLM's routers chose for every position of every request, on any model runner.

vLLM 0.32 returns routed experts (``enable_return_routed_experts``) through
its auxiliary-output connector, which only its Model Runner V2 drives (a GPU
and Triton). The capture itself is vLLM's own and runner-independent:
``RoutedExpertsCapturer`` bound to the model's MoE routers fills one row per
scheduled token of each forward. ``VLLMRouteCapture`` (mixed into the worker
extension, so ``self`` is vLLM's worker) binds it and, after each forward of
the V1 runner, files each request's rows under its positions: the runner
lays a step's tokens out request by request in its input batch's order, each
request's from its computed-token count on.

Every position must be computed for its own request, so a capturing engine
runs without prefix caching (a cached prefix is not routed again). A request
that vLLM preempts (its KV cache freed under memory pressure) is computed again
from its start when it resumes: the routes of that recomputation replace what
was filed for those positions before (the routers see the same tokens; with
sampling, the positions after the preemption point are the resumed ones).
The wrapping of the runner's forward is a patch of vLLM's internals, registered
with its why and remove-when in ``vllm_compat`` (``after_each_forward``).
"""

from __future__ import annotations

from typing import Any

import torch

from workers.rollout.vllm_compat import after_each_forward

__all__ = ["VLLMRouteCapture", "file_routes"]


def file_routes(pieces: dict[int, torch.Tensor], start: int, rows: torch.Tensor) -> bool:
    """File ``rows`` (the routes of positions ``start`` on) into one request's ``pieces`` (first position ->
    rows). Rows filed before for ``start`` or later positions are dropped: the request was preempted and is
    being computed again, and the new forward's routes are the ones its tokens now have. A piece that runs past
    ``start`` is cut there. Returns whether anything filed before was replaced (a recomputation)."""
    replaced = False
    for first in [first for first in pieces if first >= start]:
        del pieces[first]
        replaced = True
    for first, piece in list(pieces.items()):
        if first + len(piece) > start:
            pieces[first] = piece[:start - first]
            replaced = True
    pieces[start] = rows
    return replaced


class VLLMRouteCapture:
    """Worker-extension methods: ``capture_routes`` once, then ``take_routes`` after each generate."""

    def capture_routes(self) -> None:
        """Bind vLLM's capturer to the model's routers and record every forward's routes from now on."""
        from vllm.model_executor.layers.fused_moe.routed_experts_capturer import (
            RoutedExpertsCapturer,
            bind_routed_experts_capturer,
        )

        runner = self.model_runner
        config = runner.vllm_config
        self._route_capturer = RoutedExpertsCapturer(config.scheduler_config.max_num_batched_tokens, config)
        bind_routed_experts_capturer(runner.model, self._route_capturer)
        self._routes: dict[str, dict[int, torch.Tensor]] = {}  # request -> first position -> [tokens, layers, k]
        self._recomputed = 0  # forwards that computed a request's positions again (after a preemption)
        after_each_forward(runner, self._file_routes)

    def _file_routes(self, scheduler_output: Any) -> None:
        total = scheduler_output.total_num_scheduled_tokens
        if not total:
            return
        rows = self._route_capturer.snapshot_routing_data(total).to("cpu", torch.int16)
        batch = self.model_runner.input_batch
        offset = 0
        for index, request in enumerate(batch.req_ids):
            count = scheduler_output.num_scheduled_tokens.get(request, 0)
            if count:
                start = int(batch.num_computed_tokens_cpu[index])
                self._recomputed += file_routes(self._routes.setdefault(request, {}), start,
                                                rows[offset:offset + count].clone())
                offset += count
        if offset != total:
            raise RuntimeError(f"routed experts: filed {offset} of the step's {total} tokens")

    def take_routes(self, requests: list[str]) -> tuple[list[torch.Tensor], int]:
        """The routes of ``requests`` (the ids of vLLM's outputs), each [positions, layers, k] from position 0
        on, and how many forwards recomputed positions since the last call; forget every request's. (The engine
        core runs each request under its id and a suffix.)"""
        internal = {name.rsplit("-", 1)[0]: name for name in self._routes}
        out = []
        for request in requests:
            pieces = self._routes.get(internal.get(request, request), {})
            expected = 0
            for start in sorted(pieces):
                if start != expected:
                    raise RuntimeError(f"routed experts of request {request}: positions {expected}..{start - 1} "
                                       f"were not computed for it (a cached prefix?)")
                expected += len(pieces[start])
            out.append(torch.cat([pieces[s] for s in sorted(pieces)]) if pieces else torch.empty(0, dtype=torch.int16))
        self._routes = {}
        recomputed, self._recomputed = getattr(self, "_recomputed", 0), 0
        return out, recomputed
