"""Every dispatch/collect rule, as pure functions: no process, no transport."""

import pytest
import torch

from hybridengine.parallel.layout import ParallelLayout
from hybridengine.reshard.plan import GenerationLayout, GenerationMesh
from workers import DataProto, Dispatch, DispatchError, GroupView, RankCall, register, register_dispatch_mode
from workers.dispatch import get_dispatch_rule
from workers.register import registered_methods


def run(mode, view, *args, fn=None, **kwargs):
    """Dispatch, run ``fn`` per rank as a worker would, collect."""
    rule = get_dispatch_rule(mode)
    calls, ctx = rule.dispatch(view, args, kwargs)
    fn = fn or (lambda rank, *a, **k: (rank, a, k))
    outputs = {rank: fn(rank, *c.args, **c.kwargs) for rank, c in enumerate(calls) if c is not None}
    return calls, rule.collect(view, outputs, ctx)


def test_one_to_all_sends_the_same_arguments_everywhere():
    calls, out = run(Dispatch.ONE_TO_ALL, GroupView(3), 5, key="v")
    assert calls == [RankCall((5,), {"key": "v"})] * 3
    assert out == [(r, (5,), {"key": "v"}) for r in range(3)]


def test_all_to_all_gives_each_rank_its_item():
    _, out = run(Dispatch.ALL_TO_ALL, GroupView(3), [1, 2, 3], scale=[10, 20, 30])
    assert out == [(0, (1,), {"scale": 10}), (1, (2,), {"scale": 20}), (2, (3,), {"scale": 30})]


def test_all_to_all_refuses_wrong_lengths_and_non_lists():
    with pytest.raises(DispatchError, match=r"one item per rank \(3\); argument 0 is length 2"):
        run(Dispatch.ALL_TO_ALL, GroupView(3), [1, 2])
    with pytest.raises(DispatchError, match="argument 'x' is int"):
        run(Dispatch.ALL_TO_ALL, GroupView(3), x=4)


def test_rank_zero_runs_only_on_rank_zero():
    calls, out = run(Dispatch.RANK_ZERO, GroupView(4), "a")
    assert calls[0] == RankCall(("a",), {}) and calls[1:] == [None, None, None]
    assert out == (0, ("a",), {})


def double_rows(rank, data, factor=2):
    return DataProto({"y": data.batch["x"] * factor, "rank": torch.full((len(data),), rank)})


def test_dp_compute_proto_splits_and_concatenates():
    data = DataProto({"x": torch.arange(8)})
    calls, out = run(Dispatch.DP_COMPUTE_PROTO, GroupView(4), data, factor=3, fn=double_rows)
    assert [c.args[0]["x"].tolist() for c in calls] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert all(c.kwargs == {"factor": 3} for c in calls)
    assert out["y"].tolist() == [3 * i for i in range(8)]
    assert out["rank"].tolist() == [0, 0, 1, 1, 2, 2, 3, 3]


def test_dp_compute_proto_pads_when_the_batch_does_not_divide():
    data = DataProto({"x": torch.arange(5)})
    calls, out = run(Dispatch.DP_COMPUTE_PROTO, GroupView(4), data, fn=double_rows)
    assert [len(c.args[0]) for c in calls] == [2, 2, 2, 2]
    assert out["y"].tolist() == [0, 2, 4, 6, 8]  # the 3 padded rows are gone
    assert out["rank"].tolist() == [0, 0, 1, 1, 2]


def test_dp_compute_proto_returns_a_list_for_non_proto_outputs():
    _, out = run(Dispatch.DP_COMPUTE_PROTO, GroupView(2), DataProto({"x": torch.arange(4)}), fn=lambda r, d: len(d))
    assert out == [2, 2]


def test_dp_compute_proto_refuses_inputs_that_do_not_fit():
    with pytest.raises(DispatchError, match="needs at least one DataProto argument"):
        run(Dispatch.DP_COMPUTE_PROTO, GroupView(2), [1, 2, 3])
    with pytest.raises(DispatchError, match=r"different lengths \[3, 4\]"):
        run(Dispatch.DP_COMPUTE_PROTO, GroupView(2), DataProto({"x": torch.arange(3)}), DataProto({"x": torch.arange(4)}))
    with pytest.raises(DispatchError, match="empty DataProto"):
        run(Dispatch.DP_COMPUTE_PROTO, GroupView(2), DataProto({"x": torch.zeros(0)}))


def test_mesh_compute_proto_on_a_2x2x2_layout():
    layout = ParallelLayout(tensor_parallel=2, pipeline_parallel=2, data_parallel=2)
    view = GroupView(8, layout)
    data = DataProto({"x": torch.arange(6)})
    calls, out = run(Dispatch.MESH_COMPUTE_PROTO, view, data, fn=double_rows)
    # rank = tp + 2 * (dp + 2 * pp): DP replica 0 is ranks 0,1 (pp0) and 4,5 (pp1).
    chunk = {rank: c.args[0]["x"].tolist() for rank, c in enumerate(calls)}
    for rank in (0, 1, 4, 5):
        assert chunk[rank] == [0, 1, 2]
    for rank in (2, 3, 6, 7):
        assert chunk[rank] == [3, 4, 5]
    # Only TP rank 0 of the last stage answers for its replica: ranks 4 and 6.
    assert out["y"].tolist() == [0, 2, 4, 6, 8, 10]
    assert out["rank"].tolist() == [4, 4, 4, 6, 6, 6]


def test_mesh_compute_proto_pads_over_dp_and_collects_in_dp_order():
    layout = ParallelLayout(tensor_parallel=1, pipeline_parallel=2, data_parallel=2)
    _, out = run(Dispatch.MESH_COMPUTE_PROTO, GroupView(4, layout), DataProto({"x": torch.arange(3)}), fn=double_rows)
    assert out["y"].tolist() == [0, 2, 4]
    assert out["rank"].tolist() == [2, 2, 3]


def test_mesh_compute_proto_needs_a_matching_layout():
    data = DataProto({"x": torch.arange(4)})
    with pytest.raises(DispatchError, match=r"call self.set_layout"):
        run(Dispatch.MESH_COMPUTE_PROTO, GroupView(4), data)
    with pytest.raises(DispatchError, match="covers 2 ranks but the group has 4"):
        run(Dispatch.MESH_COMPUTE_PROTO, GroupView(4, ParallelLayout(tensor_parallel=2)), data)


def test_user_dispatch_mode_by_name():
    def evens_only(view, args, kwargs):
        return [RankCall(args, kwargs) if r % 2 == 0 else None for r in range(view.world_size)], "ctx"

    def as_dict(view, outputs, ctx):
        return {"ctx": ctx, **outputs}

    register_dispatch_mode("evens_only", evens_only, as_dict)
    calls, out = run("evens_only", GroupView(4), 1)
    assert calls[1] is None and calls[3] is None
    assert out == {"ctx": "ctx", 0: (0, (1,), {}), 2: (2, (1,), {})}
    with pytest.raises(ValueError, match="built-in dispatch mode"):
        register_dispatch_mode("one_to_all", evens_only, as_dict)
    with pytest.raises(ValueError, match=r"unknown dispatch mode 'nope'; known modes: \[.*'evens_only'"):
        register("nope")


def test_register_records_mode_and_blocking_through_inheritance():
    class Base:
        @register(Dispatch.DP_COMPUTE_PROTO)
        def a(self): ...

    class Child(Base):
        @register(Dispatch.RANK_ZERO, blocking=False)
        def b(self): ...

        def plain(self): ...

    specs = registered_methods(Child)
    assert set(specs) == {"a", "b"}
    assert specs["a"].dispatch_mode == "dp_compute_proto" and specs["a"].blocking
    assert specs["b"].dispatch_mode == "rank_zero" and not specs["b"].blocking


def samples_per_row(k):
    def fn(rank, data):
        x = data["x"].repeat_interleave(k)
        return DataProto({"x": x, "rank": torch.full_like(x, rank)})
    return fn


def test_outputs_with_k_rows_per_input_row_drop_the_padding_rows_outputs():
    # 5 prompts over 2 replicas pad to 6; each prompt yields 3 samples; the padded prompt's 3 go.
    layout = ParallelLayout(tensor_parallel=2, data_parallel=2)
    _, out = run(Dispatch.MESH_COMPUTE_PROTO, GroupView(4, layout), DataProto({"x": torch.arange(5)}), fn=samples_per_row(3))
    assert out["x"].tolist() == [0, 0, 0, 1, 1, 1, 2, 2, 2, 3, 3, 3, 4, 4, 4]
    _, out = run(Dispatch.DP_COMPUTE_PROTO, GroupView(2), DataProto({"x": torch.arange(3)}), fn=samples_per_row(2))
    assert out["x"].tolist() == [0, 0, 1, 1, 2, 2]


def test_outputs_whose_rows_are_not_a_multiple_of_the_inputs_are_refused():
    def ragged(rank, data):
        return DataProto({"x": torch.arange(len(data) + rank)})

    with pytest.raises(DispatchError, match="same whole number of rows per input row"):
        run(Dispatch.DP_COMPUTE_PROTO, GroupView(2), DataProto({"x": torch.arange(4)}), fn=ragged)


def test_mesh_compute_proto_over_a_generation_mesh():
    # Training TP4 on 8 ranks (DP2) -> generation TP2: four generation replicas, TP groups strided.
    mesh = GenerationMesh(ParallelLayout(tensor_parallel=4, data_parallel=2), GenerationLayout(2))
    assert mesh.dp == 4 and mesh.plan.gen_tp_groups == ((0, 2), (1, 3), (4, 6), (5, 7))
    calls, out = run(Dispatch.MESH_COMPUTE_PROTO, GroupView(8, mesh), DataProto({"x": torch.arange(8)}), fn=double_rows)
    chunk = {rank: c.args[0]["x"].tolist() for rank, c in enumerate(calls)}
    # A generation TP group sees one chunk; micro-DP replicas 0 and 1 of training replica 0 get chunks 0 and 1.
    assert chunk[0] == chunk[2] == [0, 1] and chunk[1] == chunk[3] == [2, 3]
    assert chunk[4] == chunk[6] == [4, 5] and chunk[5] == chunk[7] == [6, 7]
    assert out["y"].tolist() == [0, 2, 4, 6, 8, 10, 12, 14]
    assert out["rank"].tolist() == [0, 0, 1, 1, 4, 4, 5, 5]  # generation TP rank 0 of each replica answers


def test_mesh_compute_proto_gives_a_context_parallel_group_the_same_rows():
    # TP2 x CP2 x DP2: rank = tp + 2 * (cp + 2 * dp); ranks 0-3 split the rows of replica 0, ranks 4-7 replica 1
    layout = ParallelLayout(tensor_parallel=2, data_parallel=4, context_parallel=2)
    calls, out = run(Dispatch.MESH_COMPUTE_PROTO, GroupView(8, layout), DataProto({"x": torch.arange(4)}),
                     fn=double_rows)
    chunk = {rank: c.args[0]["x"].tolist() for rank, c in enumerate(calls)}
    assert all(chunk[rank] == [0, 1] for rank in range(4)) and all(chunk[rank] == [2, 3] for rank in range(4, 8))
    # one answer per replica: TP rank 0 of CP rank 0
    assert out["y"].tolist() == [0, 2, 4, 6] and out["rank"].tolist() == [0, 0, 4, 4]
