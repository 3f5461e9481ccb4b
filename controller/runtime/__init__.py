"""The single-controller runtime: resource pools of worker processes on Ray or torchrun, the worker
groups placed on them, the hosts that run calls on each rank, the wire format, and placement of pools
on a cluster's nodes. Nothing here knows of RL."""
