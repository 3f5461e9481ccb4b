"""DataFlow / Node: construction checks, run order, outputs by type, node callables, node failures."""

from __future__ import annotations

import functools
import time
from concurrent.futures import Future

import pytest

from controller.dataflow.graph import DataFlow, DataFlowError, DataFlowNodeError, Node
from controller.runtime.worker_group import GroupFuture, GroupMethod
from workers.host import Reply
from workers.register import MethodSpec


# ---------------------------------------------------------------- helpers
def generate(prompts: list[str]) -> list[str]:
    return [p + "!" for p in prompts]


def reference(responses: list[str]) -> list[float]:
    return [-float(len(r)) for r in responses]


def reward(responses: list[str]) -> list[float]:
    return [float(len(r)) for r in responses]


def advantage(rewards: list[float], ref_log_probs: list[float]) -> list[float]:
    return [r + k for r, k in zip(rewards, ref_log_probs)]


def ppo_nodes() -> list[Node]:
    # The advantage node is listed before its inputs: order comes from the edges.
    return [
        Node("generate", generate, "prompts", "responses"),
        Node("advantage", advantage, ("rewards", "ref_log_probs"), "advantages"),
        Node("reference", reference, "responses", "ref_log_probs"),
        Node("reward", reward, ("responses",), "rewards"),
    ]


PPO_EDGES = [("generate", "reward"), ("generate", "reference"), ("reward", "advantage"), ("reference", "advantage")]


def expect_error(match_parts: list[str], nodes, edges) -> str:
    with pytest.raises(DataFlowError) as info:
        DataFlow(nodes, edges)
    message = str(info.value)
    for part in match_parts:
        assert part in message, f"{part!r} not in {message!r}"
    return message


# -------------------------------------------------------------- the graph
def test_ppo_graph_runs_in_dependency_order_and_returns_outputs_by_type():
    flow = DataFlow(ppo_nodes(), PPO_EDGES)
    # Ties keep node insertion order: reference is listed before reward.
    assert flow.order == ("generate", "reference", "reward", "advantage")
    results = flow.run(input_data={"prompts": ["ab", "c"], "step": 3})
    assert results == {
        "prompts": ["ab", "c"],
        "step": 3,
        "responses": ["ab!", "c!"],
        "ref_log_probs": [-3.0, -2.0],
        "rewards": [3.0, 2.0],
        "advantages": [0.0, 0.0],
    }


def test_inputs_are_passed_positionally_in_input_types_order():
    seen = []
    flow = DataFlow(
        [
            Node("a", lambda x: "A", "x", "a_out"),
            Node("pair", lambda first, second: seen.append((first, second)) or "done", ("y", "a_out"), "pair_out"),
        ],
        [("a", "pair")],
    )
    assert flow.run({"x": 0, "y": "Y"})["pair_out"] == "done"
    assert seen == [("Y", "A")]


def test_describe_lists_each_node_in_run_order():
    flow = DataFlow(ppo_nodes(), PPO_EDGES)
    lines = flow.describe().splitlines()
    assert len(lines) == 4
    assert lines[0].startswith("generate: (prompts) -> responses")
    assert lines[-1].startswith("advantage: (rewards, ref_log_probs) -> advantages")
    assert "[advantage]" in lines[-1]
    assert "generate" in repr(flow)


def test_node_input_types_and_list_input():
    assert Node("n", generate, "prompts", "responses").input_types == ("prompts",)
    node = Node("n", advantage, ["rewards", "ref_log_probs"], "advantages")
    assert node.input_types == ("rewards", "ref_log_probs")
    assert Node("source", lambda: 1, (), "one").input_types == ()


# ------------------------------------------------------- callable objects
class FakeGroupMethod:
    """Stands in for ``group.generate_sequences``: callable, and without ``__name__``."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, prompts):
        self.calls += 1
        return [p.upper() for p in prompts]


def test_callable_object_and_partial_nodes():
    method = FakeGroupMethod()
    assert callable(method) and not hasattr(method, "__name__")

    def scale(factor: float, responses: list[str]) -> list[float]:
        return [factor * len(r) for r in responses]

    score = functools.partial(scale, 0.5)
    flow = DataFlow(
        [Node("generate", method, "prompts", "responses"), Node("reward", score, "responses", "rewards")],
        [("generate", "reward")],
    )
    results = flow.run({"prompts": ["ab", "xyz"]})
    assert results["responses"] == ["AB", "XYZ"]
    assert results["rewards"] == [1.0, 1.5]
    assert method.calls == 1
    flow.describe()  # no __name__ needed


class StubGroup:
    """Just enough of a WorkerGroup for GroupMethod and GroupFuture: answers from one rank."""

    role = "actor"

    def __init__(self, fn) -> None:
        self.fn = fn

    def _submit(self, spec, args, kwargs) -> GroupFuture:
        rank_future: Future = Future()
        rank_future.set_result(Reply(ok=True, value=self.fn(*args, **kwargs)))
        return GroupFuture(self, spec.name, {0: rank_future}, lambda outputs: outputs[0], None)

    def _note_layout(self, replies) -> None:
        pass

    def _rank_error(self, rank, method, error):
        return error


@pytest.mark.parametrize("blocking", [True, False])
def test_worker_group_method_nodes(blocking: bool):
    # A non-blocking group method returns a GroupFuture; DataFlow waits on it.
    group = StubGroup(lambda prompts: [p * 2 for p in prompts])
    method = GroupMethod(group, MethodSpec("generate_sequences", "one_to_all", blocking))
    flow = DataFlow(
        [Node("generate", method, "prompts", "responses"), Node("reward", reward, "responses", "rewards")],
        [("generate", "reward")],
    )
    results = flow.run({"prompts": ["a", "bc"]})
    assert results["responses"] == ["aa", "bcbc"]
    assert results["rewards"] == [2.0, 4.0]
    assert "actor.generate_sequences" in flow.describe()


# ------------------------------------------------------ node validation
@pytest.mark.parametrize(
    "fields, parts",
    [
        (("", generate, "p", "r"), ["non-empty string", "''"]),
        (("g", 3, "p", "r"), ["node 'g'", "must be callable", "3 (int)"]),
        (("g", generate, "", "r"), ["node 'g'", "non-empty strings", "''"]),
        (("g", generate, ("p", 1), "r"), ["node 'g'", "got 1"]),
        (("g", generate, 5, "r"), ["node 'g'", "5 (int)"]),
        (("g", generate, ("p", "q", "p"), "r"), ["node 'g'", "['p']", "once"]),
        (("g", generate, "p", ""), ["node 'g'", "output_type", "''"]),
        (("g", generate, ("p", "r"), "r"), ["node 'g'", "takes and outputs 'r'"]),
    ],
)
def test_node_refuses_bad_fields(fields, parts):
    with pytest.raises(DataFlowError) as info:
        Node(*fields)
    for part in parts:
        assert part in str(info.value)


# ---------------------------------------------------- construction errors
def test_duplicate_node_names():
    nodes = [Node("reward", reward, "responses", "rewards"), Node("reward", reference, "responses", "ref")]
    expect_error(["duplicate node name 'reward'", "nodes 0 and 1"], nodes, [])


def test_unknown_node_in_edge_lists_known_nodes():
    expect_error(
        ["edge generate -> rewrd", "unknown node 'rewrd'", "['generate', 'advantage', 'reference', 'reward']"],
        ppo_nodes(),
        [("generate", "rewrd")],
    )


def test_edge_type_mismatch_names_both_nodes_and_types():
    nodes = [Node("generate", generate, "prompts", "responses"), Node("reward", reward, "prompts", "rewards")]
    message = expect_error([], nodes, [("generate", "reward")])
    assert message == "edge generate -> reward: generate outputs 'responses' but reward takes ('prompts',)"


def test_cycle_is_refused_naming_its_nodes():
    nodes = [
        Node("start", lambda s: s, "seed", "x0"),
        Node("a", lambda x0, y: y, ("x0", "y"), "x"),
        Node("b", lambda x: x, "x", "y"),
    ]
    expect_error(["cycle: a -> b -> a", "acyclic"], nodes, [("start", "a"), ("a", "b"), ("b", "a")])


def test_two_upstream_nodes_for_one_input_type_is_ambiguous():
    nodes = [
        Node("generate", generate, "prompts", "responses"),
        Node("reward", reward, "responses", "rewards"),
        Node("reward_v2", reward, "responses", "rewards"),
        Node("advantage", lambda r: r, "rewards", "advantages"),
    ]
    edges = [("generate", "reward"), ("generate", "reward_v2"), ("reward", "advantage"), ("reward_v2", "advantage")]
    expect_error(
        ["node 'advantage' gets 'rewards' from two edges", "reward -> advantage", "reward_v2 -> advantage"],
        nodes,
        edges,
    )


def test_two_nodes_with_the_same_output_type_are_refused():
    nodes = [Node("reward", reward, "responses", "rewards"), Node("reward_v2", reward, "responses", "rewards")]
    expect_error(["nodes 'reward' and 'reward_v2' both output 'rewards'"], nodes, [])


def test_produced_type_without_an_edge_is_refused():
    expect_error(
        ["node 'advantage' takes 'ref_log_probs'", "node 'reference' outputs", "no edge reference -> advantage"],
        ppo_nodes(),
        [edge for edge in PPO_EDGES if edge != ("reference", "advantage")],
    )


def test_duplicate_edge_and_malformed_edge_and_empty_graph():
    expect_error(["edge generate -> reward is listed twice"], ppo_nodes(), PPO_EDGES + [("generate", "reward")])
    expect_error(["(source node name, destination node name)", "('generate',)"], ppo_nodes(), [("generate",)])
    expect_error(["at least one node"], [], [])
    expect_error(["Node instances", "'generate'"], ["generate"], [])


# ------------------------------------------------------------------- run
def test_missing_input_names_node_type_and_what_is_available():
    calls = []
    nodes = [Node("generate", lambda p: calls.append(p) or p, "prompts", "responses")]
    flow = DataFlow(nodes, [])
    with pytest.raises(DataFlowError) as info:
        flow.run(input_data={"prompt": ["typo"]})
    message = str(info.value)
    assert "node 'generate' needs 'prompts'" in message
    assert "input_data has ['prompt']" in message
    assert calls == []  # checked before any node ran


def test_input_data_may_not_supply_a_produced_type():
    flow = DataFlow(ppo_nodes(), PPO_EDGES)
    with pytest.raises(DataFlowError, match="input_data gives 'rewards', which node 'reward' outputs"):
        flow.run({"prompts": ["a"], "rewards": [1.0]})
    with pytest.raises(DataFlowError, match="mapping"):
        flow.run([("prompts", ["a"])])


def test_node_error_names_the_node_and_chains_the_original():
    original = ValueError("reward model exploded")

    def broken(responses):
        raise original

    flow = DataFlow(
        [Node("generate", generate, "prompts", "responses"), Node("reward", broken, "responses", "rewards")],
        [("generate", "reward")],
    )
    with pytest.raises(DataFlowNodeError) as info:
        flow.run({"prompts": ["a"]})
    error = info.value
    assert error.node == "reward"
    assert error.__cause__ is original
    assert "node 'reward'" in str(error) and "ValueError: reward model exploded" in str(error)
    assert error.completed == {"prompts": ["a"], "responses": ["a!"]}
    assert not isinstance(error, DataFlowError)


def test_cycle_is_named_from_its_first_listed_node():
    nodes = [
        Node("c", lambda y: y, "y", "z"),
        Node("a", lambda z: z, "z", "x"),
        Node("b", lambda x: x, "x", "y"),
    ]
    expect_error(["cycle: c -> a -> b -> c"], nodes, [("a", "b"), ("b", "c"), ("c", "a")])


def test_failing_non_blocking_group_method_is_reported_as_the_node_error():
    from controller.errors import RemoteWorkerError

    class FailingGroup(StubGroup):
        def _submit(self, spec, args, kwargs) -> GroupFuture:
            rank_future: Future = Future()
            rank_future.set_result(Reply(ok=False, error_type="RuntimeError", remote_traceback="Traceback: boom"))
            return GroupFuture(self, spec.name, {0: rank_future}, lambda outputs: outputs[0], None)

    method = GroupMethod(FailingGroup(None), MethodSpec("generate_sequences", "one_to_all", blocking=False))
    flow = DataFlow([Node("generate", method, "prompts", "responses")], [])
    with pytest.raises(DataFlowNodeError) as info:
        flow.run({"prompts": ["a"]})
    assert info.value.node == "generate"
    assert isinstance(info.value.__cause__, RemoteWorkerError)


# ------------------------------------------------- concurrency and chunks
def napping(seconds: float, fn):
    def node(*args):
        time.sleep(seconds)
        return fn(*args)
    return node


def spans(flow: DataFlow, node: str) -> list[tuple[float, float]]:
    return [(call.start, call.end) for call in flow.timeline if call.node == node]


def test_independent_nodes_run_at_the_same_time():
    flow = DataFlow([Node("generate", generate, "prompts", "responses"),
                     Node("reference", napping(0.3, reference), "responses", "ref_log_probs"),
                     Node("reward", napping(0.3, reward), "responses", "rewards"),
                     Node("advantage", advantage, ("rewards", "ref_log_probs"), "advantages")], PPO_EDGES)
    start = time.perf_counter()
    results = flow.run({"prompts": ["ab", "c"]})
    assert time.perf_counter() - start < 0.55  # the two 0.3 s nodes side by side
    (ref,), (rew,) = spans(flow, "reference"), spans(flow, "reward")
    assert ref[0] < rew[1] and rew[0] < ref[1]
    assert spans(flow, "advantage")[0][0] >= max(ref[1], rew[1])
    assert results == DataFlow(ppo_nodes(), PPO_EDGES).run({"prompts": ["ab", "c"]})  # the same outputs


def test_a_chunked_consumer_takes_each_part_as_its_producer_makes_it():
    prompts = [f"{i}+{i}=" for i in range(6)]
    whole = DataFlow([Node("actor", generate, "prompts", "responses"),
                      Node("reward_model", reward, "responses", "rewards")], [("actor", "reward_model")])
    streamed = DataFlow([Node("actor", napping(0.1, generate), "prompts", "responses", chunks=3),
                         Node("reward_model", napping(0.05, reward), "responses", "rewards", chunks=3)],
                        [("actor", "reward_model")])
    out = streamed.run({"prompts": prompts})
    assert out == whole.run({"prompts": prompts})  # parts joined in order
    actor, scored = spans(streamed, "actor"), spans(streamed, "reward_model")
    assert len(actor) == len(scored) == 3
    assert scored[0][0] < actor[-1][1]  # the reward began on the first chunk while generation went on
    assert all(scored[i][0] >= actor[i][1] for i in range(3))  # each part after it was made
    assert all(a[1] <= b[0] for a, b in zip(actor, actor[1:]))  # a node is never entered twice at once
    assert "actor: (prompts) -> responses in 3 chunks" in streamed.describe()


def test_chunks_of_another_count_wait_for_the_whole_input_and_too_few_items_are_refused():
    flow = DataFlow([Node("actor", napping(0.05, generate), "prompts", "responses", chunks=2),
                     Node("reward_model", reward, "responses", "rewards", chunks=3)], [("actor", "reward_model")])
    out = flow.run({"prompts": ["a", "bb", "ccc"]})
    assert out["rewards"] == [2.0, 3.0, 4.0]
    assert min(s for s, _ in spans(flow, "reward_model")) >= max(e for _, e in spans(flow, "actor"))
    with pytest.raises(ValueError, match=r"node 'actor' runs in chunks=2 but its input 'prompts' has 1 item"):
        flow.run({"prompts": ["a"]})


@pytest.mark.parametrize("chunks", [0, -1, True, 2.0])
def test_chunks_must_be_a_positive_int(chunks):
    with pytest.raises(DataFlowError, match=f"node 'g': chunks must be a positive int .*got {chunks!r}"):
        Node("g", generate, "p", "r", chunks=chunks)


def test_a_failing_chunk_is_the_nodes_error():
    def flaky(prompts):
        if prompts == ["b"]:
            raise RuntimeError("chunk 1 broke")
        return prompts

    flow = DataFlow([Node("actor", flaky, "prompts", "responses", chunks=2)], [])
    with pytest.raises(DataFlowNodeError, match="node 'actor'.*chunk 1 broke") as info:
        flow.run({"prompts": ["a", "b"]})
    assert info.value.node == "actor" and "responses" not in info.value.completed
