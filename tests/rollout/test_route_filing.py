"""Routes filed per request as vLLM's forwards compute them, with no engine: a request that vLLM preempts and
computes again from its start has the new forward's routes, not an error (KV-cache pressure during a replayed
rollout used to end the step: "positions 7..4 were not computed for it")."""

import torch

from workers.rollout.vllm_routes import VLLMRouteCapture, file_routes


def rows(first: int, count: int, tag: int) -> torch.Tensor:
    """[count, layers 2, k 2] routes whose values say which forward filed them (tag) and the position."""
    positions = torch.arange(first, first + count, dtype=torch.int16)
    return torch.stack([positions, torch.full_like(positions, tag)], -1).unsqueeze(1).expand(count, 2, 2).clone()


def take(pieces: dict[int, torch.Tensor]) -> torch.Tensor:
    capture = VLLMRouteCapture()
    capture._routes = {"request-0": pieces}
    (routes,), _ = capture.take_routes(["request-0"])
    return routes


def test_a_recomputed_request_keeps_the_routes_of_its_last_computation():
    pieces: dict[int, torch.Tensor] = {}
    file_routes(pieces, 0, rows(0, 5, tag=1))  # the prompt
    file_routes(pieces, 5, rows(5, 1, tag=1))  # two decoded tokens
    file_routes(pieces, 6, rows(6, 1, tag=1))
    assert file_routes(pieces, 0, rows(0, 7, tag=2))  # preempted, computed again: prompt and both tokens at once
    assert not file_routes(pieces, 7, rows(7, 1, tag=2))  # and on
    routes = take(pieces)
    assert routes.shape == (8, 2, 2)
    assert routes[:, 0, 0].tolist() == list(range(8)) and set(routes[:, 0, 1].tolist()) == {2}
    # An unpressured run files the same positions once: the same routes where the forwards agree.
    calm: dict[int, torch.Tensor] = {}
    file_routes(calm, 0, rows(0, 7, tag=2))
    file_routes(calm, 7, rows(7, 1, tag=2))
    assert torch.equal(take(calm), routes)


def test_a_recomputation_that_stops_short_cuts_what_was_filed_past_it():
    pieces: dict[int, torch.Tensor] = {}
    file_routes(pieces, 0, rows(0, 6, tag=1))
    file_routes(pieces, 0, rows(0, 4, tag=2))  # recomputed in chunks: the first four positions so far
    assert sorted(pieces) == [0] and len(pieces[0]) == 4
    file_routes(pieces, 4, rows(4, 2, tag=2))
    assert take(pieces)[:, 0, 1].tolist() == [2] * 6
    gap: dict[int, torch.Tensor] = {}
    file_routes(gap, 0, rows(0, 3, tag=1))
    file_routes(gap, 5, rows(5, 1, tag=1))  # positions 3 and 4 never filed: still refused
    try:
        take(gap)
    except RuntimeError as exc:
        assert "positions 3..4 were not computed for it" in str(exc)
    else:
        raise AssertionError("a gap in the routes was not refused")
