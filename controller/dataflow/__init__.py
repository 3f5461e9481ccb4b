"""DataFlow: a step written as a checked graph of typed nodes (``graph``), and nodes placed on devices of
their own by decorators (``declarations``, ``placed_node``)."""

from controller.dataflow.declarations import register_parallelism, register_placement, register_protocol
from controller.dataflow.graph import DataFlow, DataFlowError, DataFlowNodeError, Node

__all__ = ["DataFlow", "DataFlowError", "DataFlowNodeError", "Node", "register_parallelism", "register_placement",
           "register_protocol"]
