"""Running a DataFlow: each node as soon as its inputs are there, independent nodes at the same time, and a
chunked node on each part of its input as its producer makes it.

- Every node runs once, on a thread of the driver's (a placed node's work runs in its own processes, so two
  placed nodes compute at the same time; an in-driver node's torch kernels release the GIL). A node is
  never entered twice at once.
- A node with ``chunks=k`` is called ``k`` times, on contiguous parts of its input, split as a placed node's
  data-parallel input is (lists, tuples, tensors, numpy arrays and DataProtos along their first dimension;
  any other value whole to each call), and its output is the parts' outputs joined in order (concatenated
  as a placed node's are). When the node that produces one of its inputs has the same ``chunks``, it takes
  each part as soon as that node has made it: the two pipeline, so a reward scores the first chunk of
  responses while the actor generates the next.
- A row-wise function gives the same output chunked or not, placed or in the driver.
- ``timeline``: each call's node, chunk (None: the whole input) and start and end, in seconds from the
  start of the run.

A node that raises stops the run: nothing else starts, the running calls are waited for, and the error is
raised as ``DataFlowNodeError`` naming the node, with what was complete.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from controller.dataflow.placed_node import gather_values, split_value
from controller.runtime.worker_group import GroupFuture

if TYPE_CHECKING:
    from controller.dataflow.graph import Node

__all__ = ["NodeCall", "run_nodes"]


@dataclass(frozen=True)
class NodeCall:
    """One call of a node's function: its chunk (None: the whole input), start and end from the run's start."""

    node: str
    chunk: int | None
    start: float
    end: float


class NodeFailed(Exception):
    """A node's call raised (``graph.DataFlow.run`` reports it as the node's ``DataFlowNodeError``)."""

    def __init__(self, node: str, error: BaseException, completed: dict[str, Any]) -> None:
        super().__init__(node)
        self.node, self.error, self.completed = node, error, completed


def run_nodes(nodes: list[Node], producer: Mapping[str, str], calls: Mapping[str, Callable],
              inputs: Mapping[str, Any]) -> tuple[dict[str, Any], list[NodeCall]]:
    """Every node's output by type (the inputs included), and the timeline of the calls. ``nodes`` in run
    order; ``producer``: type -> the node that outputs it; ``calls``: node -> what to call (its function, or
    its placed form)."""
    return _Run(nodes, producer, calls, inputs).run()


class _Run:
    def __init__(self, nodes, producer, calls, inputs) -> None:
        self.nodes, self.producer, self.calls = nodes, producer, calls
        self.by_name = {node.name: node for node in nodes}
        self.results: dict[str, Any] = dict(inputs)
        self.made: dict[str, list[Any]] = {}  # type -> its parts as a chunked producer made them
        self.split: dict[tuple[str, int], list[Any]] = {}  # (type, chunks) -> a whole value's parts
        self.next_chunk = {node.name: 0 for node in nodes}
        self.outputs: dict[str, list[Any]] = {node.name: [] for node in nodes if node.chunks}
        self.timeline: list[NodeCall] = []
        self.start = time.perf_counter()

    def run(self) -> tuple[dict[str, Any], list[NodeCall]]:
        waiting = [node.name for node in self.nodes]
        running: dict[Any, str] = {}
        failure: NodeFailed | None = None
        with ThreadPoolExecutor(max_workers=len(self.nodes), thread_name_prefix="hybridflow-node") as threads:
            while waiting or running:
                busy = set(running.values())
                for name in ([] if failure is not None else list(waiting)):
                    args = None if name in busy else self._args(name)
                    if args is not None:
                        chunk = self.next_chunk[name] if self.by_name[name].chunks else None
                        running[threads.submit(self._call, name, chunk, args)] = name
                        self.next_chunk[name] += 1
                        if chunk is None or self.next_chunk[name] == self.by_name[name].chunks:
                            waiting.remove(name)
                if not running:
                    if failure is None and waiting:  # the graph's checks make this unreachable
                        raise RuntimeError(f"DataFlow nodes {waiting} cannot start: their inputs never came")
                    break
                done, _ = wait(running, return_when=FIRST_COMPLETED)
                for future in done:
                    name = running.pop(future)
                    try:
                        chunk, output = future.result()
                    except Exception as exc:  # noqa: BLE001 (raised once the running calls are done)
                        failure = failure or NodeFailed(name, exc, dict(self.results))
                        continue
                    self._took(name, chunk, output)
        if failure is not None:
            raise failure
        return self.results, sorted(self.timeline, key=lambda call: call.start)

    def _args(self, name: str) -> list[Any] | None:
        """The arguments of ``name``'s next call, or None while one of them is not made yet."""
        node = self.by_name[name]
        if not node.chunks:
            if all(kind in self.results for kind in node.input_types):
                return [self.results[kind] for kind in node.input_types]
            return None
        chunk, args = self.next_chunk[name], []
        for kind in node.input_types:
            source = self.producer.get(kind)
            if source is not None and self.by_name[source].chunks == node.chunks:  # streamed: its parts as made
                parts = self.made.get(kind, [])
                if len(parts) <= chunk:
                    return None
                args.append(parts[chunk])
            elif kind in self.results:
                args.append(self._parts(node, kind)[chunk])
            else:
                return None
        return args

    def _parts(self, node: Node, kind: str) -> list[Any]:
        """The whole value of ``kind`` in ``node.chunks`` parts; ValueError when it has fewer items than that."""
        key = (kind, node.chunks)
        if key not in self.split:
            value = self.results[kind]
            parts = split_value(value, node.chunks, "chunk")  # a setting (not data) goes whole to each
            if any(part is not value and len(part) == 0 for part in parts):
                raise ValueError(f"node {node.name!r} runs in chunks={node.chunks} but its input {kind!r} has "
                                 f"{len(value)} item(s); give it at least as many items as chunks")
            self.split[key] = parts
        return self.split[key]

    def _call(self, name: str, chunk: int | None, args: list[Any]) -> tuple[int | None, Any]:
        start = time.perf_counter() - self.start
        output = self.calls[name](*args)
        if isinstance(output, GroupFuture):  # a non-blocking group method
            output = output.result()
        self.timeline.append(NodeCall(name, chunk, start, time.perf_counter() - self.start))
        return chunk, output

    def _took(self, name: str, chunk: int | None, output: Any) -> None:
        node = self.by_name[name]
        if chunk is None:
            self.results[node.output_type] = output
            return
        self.outputs[name].append(output)
        self.made.setdefault(node.output_type, []).append(output)
        if len(self.outputs[name]) == node.chunks:  # every part made: the whole output, joined in order
            self.results[node.output_type] = gather_values(self.outputs[name], "concat")
