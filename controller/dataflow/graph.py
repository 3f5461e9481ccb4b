"""DataFlow: one RL step written as a graph of nodes, each turning typed inputs into one typed output.

A type is a string label for what flows along an edge ("prompts",
"responses", "rewards", ...). Edges name (source node, destination node); the
source's output type must be one of the destination's input types. Every
check on the graph runs when the DataFlow is built, so a miswired step fails
before any model is touched. Node functions may be plain Python callables or
worker-group methods (``actor.generate_sequences``); a non-blocking group
method's future is waited on before its output moves on.

    flow = DataFlow(
        nodes=[
            Node("generate", actor.generate_sequences, "prompts", "responses"),
            Node("reference", ref.compute_ref_log_prob, "responses", "ref_log_probs"),
            Node("reward", score, "responses", "rewards"),
            Node("advantage", compute_advantages, ("rewards", "ref_log_probs"), "advantages"),
        ],
        edges=[
            ("generate", "reference"),
            ("generate", "reward"),
            ("reward", "advantage"),
            ("reference", "advantage"),
        ],
    )
    print(flow.describe())
    results = flow.run(input_data={"prompts": batch})
    results["advantages"]  # every input and every node's output, by type

A node whose function carries ``@register_placement`` (``controller.dataflow.declarations``) runs in a
worker group of its own, one process per declared device, its input split and its outputs gathered
as its parallelism and protocol say (``controller.dataflow.placed_node``); the others run in the driver. The
devices are checked against the machine when the DataFlow is built. ``run`` starts the placed nodes'
processes on first use and keeps them for the next ``run``; ``shutdown()`` (or a ``with`` block)
stops them. ``ray_address`` (or the ``RAY_ADDRESS`` environment variable, as ``ray start`` prints it)
puts them on a Ray cluster: the same code, unchanged.

Results are returned by type, so each type has one producer: two nodes may
not output the same type, a node may not take its own output type, and
``input_data`` may not supply a type that a node produces. An input type that
some node produces must reach its consumer through an edge; every other input
comes from ``input_data``.
"""

from __future__ import annotations

import heapq
import inspect
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from controller.dataflow.declarations import node_declaration
from controller.dataflow.flow_run import NodeCall, NodeFailed, run_nodes
from controller.dataflow.placed_node import PlacedNode, check_machine_devices

__all__ = ["DataFlow", "DataFlowError", "DataFlowNodeError", "Node"]


class DataFlowError(ValueError):
    """The graph is malformed, or ``run`` was given input that does not fit it; nothing ran."""


class DataFlowNodeError(RuntimeError):
    """A node's function raised during ``run``; the original error is ``__cause__``.

    ``node`` is the failing node's name; ``completed`` maps the types produced
    before the failure (the inputs included) to their values.
    """

    def __init__(self, node: str, func: str, error: BaseException, completed: dict[str, Any]) -> None:
        self.node = node
        self.completed = completed
        super().__init__(f"node {node!r} ({func}) failed: {type(error).__name__}: {error}")


def _func_label(func: Callable) -> str:
    """A short name for logs; works for functions, bound methods, partials and group methods."""
    if inspect.isfunction(func) or inspect.ismethod(func) or inspect.isbuiltin(func):
        return getattr(func, "__qualname__", None) or getattr(func, "__name__", None) or repr(func)
    return repr(func)


@dataclass(frozen=True)
class Node:
    """One step of a DataFlow: ``func(*inputs)`` with inputs in ``input_types`` order.

    ``input_type`` is one type or a tuple of them (an empty tuple: the node
    takes nothing); ``output_type`` names the single value it returns.
    ``chunks``: call ``func`` on that many contiguous parts of its input, one
    after another, and pass each part's output on as soon as it is made
    (``controller.dataflow.flow_run``); None: once, on the whole input.
    """

    name: str
    func: Callable[..., Any]
    input_type: str | tuple[str, ...]
    output_type: str
    chunks: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise DataFlowError(f"a node name must be a non-empty string, got {self.name!r}")
        if not callable(self.func):
            raise DataFlowError(
                f"node {self.name!r}: func must be callable (a function, a callable object or a "
                f"worker-group method), got {self.func!r} ({type(self.func).__name__})"
            )
        if isinstance(self.input_type, list):
            object.__setattr__(self, "input_type", tuple(self.input_type))
        if not isinstance(self.input_type, (str, tuple)):
            raise DataFlowError(
                f"node {self.name!r}: input_type must be a type string or a tuple of them, "
                f"got {self.input_type!r} ({type(self.input_type).__name__})"
            )
        for kind in self.input_types:
            if not isinstance(kind, str) or not kind:
                raise DataFlowError(
                    f"node {self.name!r}: input types must be non-empty strings, got {kind!r} in {self.input_type!r}"
                )
        duplicates = sorted({kind for kind in self.input_types if self.input_types.count(kind) > 1})
        if duplicates:
            raise DataFlowError(
                f"node {self.name!r}: input type(s) {duplicates} listed more than once in {self.input_types}; "
                "each input type may appear once"
            )
        if not isinstance(self.output_type, str) or not self.output_type:
            raise DataFlowError(
                f"node {self.name!r}: output_type must be a non-empty string, got {self.output_type!r}"
            )
        if self.chunks is not None and (isinstance(self.chunks, bool) or not isinstance(self.chunks, int)
                                        or self.chunks < 1):
            raise DataFlowError(f"node {self.name!r}: chunks must be a positive int (or None: the whole input at "
                                f"once), got {self.chunks!r}")
        if self.output_type in self.input_types:
            raise DataFlowError(
                f"node {self.name!r} takes and outputs {self.output_type!r}; results are kept by type, "
                "so give the output a new type name"
            )

    @property
    def input_types(self) -> tuple[str, ...]:
        """The input types as a tuple, in the order ``func`` receives them."""
        return (self.input_type,) if isinstance(self.input_type, str) else tuple(self.input_type)

    def describe(self) -> str:
        """``name: (in_a, in_b) -> out  [func]`` (``in chunks of N`` when chunked)."""
        chunked = f" in {self.chunks} chunks" if self.chunks else ""
        return f"{self.name}: ({', '.join(self.input_types)}) -> {self.output_type}{chunked}  [{_func_label(self.func)}]"


class DataFlow:
    """A checked, acyclic graph of nodes; ``run`` executes it by its dependencies, independent nodes at the
    same time (``controller.dataflow.flow_run``).

    ``order`` holds node names in a dependency order: a node comes after every node
    that feeds it, and ties keep the order ``nodes`` were given in. ``timeline``: the last run's calls.
    """

    def __init__(self, nodes: Sequence[Node], edges: Sequence[tuple[str, str]], *, ray_address: str | None = None,
                 backend: str = "ray") -> None:
        self.nodes: tuple[Node, ...] = tuple(nodes)
        self.edges: tuple[tuple[str, str], ...] = tuple(self._check_edge_shape(edge) for edge in edges)
        self._by_name = self._index_nodes(self.nodes)
        # (destination, input type) -> source name
        self._feeds: dict[tuple[str, str], str] = self._check_edges()
        self._producer = self._check_producers()
        self._check_wired()
        self.order: tuple[str, ...] = self._topological_order()
        ray_address = ray_address if ray_address is not None else os.environ.get("RAY_ADDRESS")
        self.placed: dict[str, PlacedNode] = self._placed_nodes(backend, ray_address)
        self.timeline: list[NodeCall] = []

    # ------------------------------------------------------------ checks
    @staticmethod
    def _check_edge_shape(edge: Any) -> tuple[str, str]:
        if not (isinstance(edge, (tuple, list)) and len(edge) == 2 and all(isinstance(n, str) for n in edge)):
            raise DataFlowError(f"an edge is a (source node name, destination node name) pair, got {edge!r}")
        return (edge[0], edge[1])

    @staticmethod
    def _index_nodes(nodes: tuple[Node, ...]) -> dict[str, Node]:
        if not nodes:
            raise DataFlowError("a DataFlow needs at least one node")
        by_name: dict[str, Node] = {}
        first_index: dict[str, int] = {}
        for index, node in enumerate(nodes):
            if not isinstance(node, Node):
                raise DataFlowError(f"nodes must be Node instances, got {node!r} ({type(node).__name__}) at index {index}")
            if node.name in by_name:
                raise DataFlowError(
                    f"duplicate node name {node.name!r} (nodes {first_index[node.name]} and {index}); "
                    "node names must be unique"
                )
            by_name[node.name] = node
            first_index[node.name] = index
        return by_name

    def _check_edges(self) -> dict[tuple[str, str], str]:
        known = list(self._by_name)
        seen: set[tuple[str, str]] = set()
        feeds: dict[tuple[str, str], str] = {}
        for source, destination in self.edges:
            for end in (source, destination):
                if end not in self._by_name:
                    raise DataFlowError(f"edge {source} -> {destination}: unknown node {end!r}; nodes: {known}")
            if (source, destination) in seen:
                raise DataFlowError(f"edge {source} -> {destination} is listed twice; list each edge once")
            seen.add((source, destination))
            produced = self._by_name[source].output_type
            takes = self._by_name[destination].input_types
            if produced not in takes:
                raise DataFlowError(
                    f"edge {source} -> {destination}: {source} outputs {produced!r} but {destination} takes {takes}"
                )
            earlier = feeds.get((destination, produced))
            if earlier is not None:
                raise DataFlowError(
                    f"node {destination!r} gets {produced!r} from two edges, {earlier} -> {destination} and "
                    f"{source} -> {destination}; each input type of a node has one upstream node"
                )
            feeds[(destination, produced)] = source
        return feeds

    def _check_producers(self) -> dict[str, str]:
        producer: dict[str, str] = {}
        for node in self.nodes:
            earlier = producer.get(node.output_type)
            if earlier is not None:
                raise DataFlowError(
                    f"nodes {earlier!r} and {node.name!r} both output {node.output_type!r}; results are "
                    "returned by type, so each output type needs a single producing node"
                )
            producer[node.output_type] = node.name
        return producer

    def _check_wired(self) -> None:
        for node in self.nodes:
            for kind in node.input_types:
                source = self._producer.get(kind)
                if source is not None and (node.name, kind) not in self._feeds:
                    raise DataFlowError(
                        f"node {node.name!r} takes {kind!r}, which node {source!r} outputs, but there is no edge "
                        f"{source} -> {node.name}; add the edge (only types no node produces come from input_data)"
                    )

    def _topological_order(self) -> tuple[str, ...]:
        position = {node.name: index for index, node in enumerate(self.nodes)}
        successors: dict[str, list[str]] = {node.name: [] for node in self.nodes}
        indegree = {node.name: 0 for node in self.nodes}
        for source, destination in self.edges:
            successors[source].append(destination)
            indegree[destination] += 1
        ready = [position[name] for name, degree in indegree.items() if degree == 0]
        heapq.heapify(ready)
        order: list[str] = []
        while ready:
            name = self.nodes[heapq.heappop(ready)].name
            order.append(name)
            for after in successors[name]:
                indegree[after] -= 1
                if indegree[after] == 0:
                    heapq.heappush(ready, position[after])
        if len(order) < len(self.nodes):
            stuck = {name for name, degree in indegree.items() if degree > 0}
            raise DataFlowError(f"cycle: {self._find_cycle(stuck, position)}; a DataFlow must be acyclic")
        return tuple(order)

    def _find_cycle(self, stuck: set[str], position: dict[str, int]) -> str:
        # Every stuck node has a stuck predecessor, so walking predecessors must repeat a node.
        predecessors: dict[str, list[str]] = {name: [] for name in stuck}
        for source, destination in self.edges:
            if source in stuck and destination in stuck:
                predecessors[destination].append(source)
        walk: list[str] = []
        name = min(stuck, key=position.__getitem__)
        while name not in walk:
            walk.append(name)
            name = min(predecessors[name], key=position.__getitem__)
        cycle = list(reversed(walk[walk.index(name):]))  # forward direction
        start = cycle.index(min(cycle, key=position.__getitem__))
        cycle = cycle[start:] + cycle[:start]
        return " -> ".join(cycle + [cycle[0]])

    def _placed_nodes(self, backend: str, ray_address: str | None) -> dict[str, PlacedNode]:
        placed = {}
        for node in self.nodes:
            declaration = node_declaration(node.func)
            if declaration is None:
                continue
            if declaration.name != node.name:
                raise DataFlowError(f"node {node.name!r}: its function is declared for node {declaration.name!r} "
                                    f"(@register_placement / register_parallelism); use one name")
            if declaration.devices is not None:
                placed[node.name] = PlacedNode(declaration, node.func, backend, ray_address)
            elif declaration.strategy != "DP" or declaration.split or declaration.gather:
                raise DataFlowError(f"node {node.name!r} declares its parallelism but no devices; add "
                                    f"@register_placement({node.name!r}, devices=[...])")
        try:
            check_machine_devices([p.declaration for p in placed.values()])
        except ValueError as exc:
            raise DataFlowError(str(exc)) from None
        return placed

    def shutdown(self) -> None:
        """Stop the placed nodes' processes (a later ``run`` starts them again)."""
        for node in self.placed.values():
            node.shutdown()

    def __enter__(self) -> "DataFlow":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.shutdown()

    # --------------------------------------------------------------- run
    def run(self, input_data: Mapping[str, Any]) -> dict[str, Any]:
        """Run every node once (a chunked node once a chunk), each as soon as its inputs are made; return the
        inputs and every node's output, by type. ``timeline`` then holds each call's start and end.

        Inputs are all checked before the first node runs. A node that raises
        is reported as ``DataFlowNodeError`` naming it, the original chained.
        """
        if not isinstance(input_data, Mapping):
            raise DataFlowError(f"input_data must be a mapping of type -> value, got {type(input_data).__name__}")
        self._check_input_data(input_data)
        for placed in self.placed.values():  # their processes, from this thread (Ray starts here once)
            placed.start()
        nodes = [self._by_name[name] for name in self.order]
        calls = {node.name: self.placed.get(node.name, node.func) for node in nodes}
        try:
            results, self.timeline = run_nodes(nodes, self._producer, calls, input_data)
        except NodeFailed as failed:  # reported as this node's failure
            node = self._by_name[failed.node]
            raise DataFlowNodeError(node.name, _func_label(node.func), failed.error, failed.completed) from failed.error
        return results

    def _check_input_data(self, input_data: Mapping[str, Any]) -> None:
        given = list(input_data)
        for kind in given:
            if not isinstance(kind, str):
                raise DataFlowError(f"input_data keys are type strings, got {kind!r} ({type(kind).__name__})")
            if kind in self._producer:
                raise DataFlowError(
                    f"input_data gives {kind!r}, which node {self._producer[kind]!r} outputs; results are kept "
                    "by type, so leave it out of input_data (or rename one of the types)"
                )
        missing = [
            f"node {node.name!r} needs {kind!r}"
            for node in self.nodes
            for kind in node.input_types
            if kind not in self._producer and kind not in input_data
        ]
        if missing:
            raise DataFlowError(
                f"missing input: {'; '.join(missing)}; no edge feeds {'it' if len(missing) == 1 else 'them'} "
                f"and input_data has {given}"
            )

    # ----------------------------------------------------------- display
    def describe(self) -> str:
        """One line per node, in run order: ``name: (inputs) -> output  [func]``."""
        return "\n".join(self._by_name[name].describe() for name in self.order)

    def __repr__(self) -> str:
        return f"DataFlow(order={list(self.order)}, {len(self.edges)} edges)"
