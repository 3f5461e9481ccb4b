"""Run a function in N real processes joined by a gloo process group."""

import os
import tempfile

import torch.distributed as dist
import torch.multiprocessing as mp

from controller.runtime.process_exit import exit_process


def _entry(rank, world_size, init_file, fn, args):
    os.environ["OMP_NUM_THREADS"] = "1"
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size)
    try:
        fn(rank, world_size, *args)
    finally:
        dist.destroy_process_group()
    exit_process(0)  # a success: skip the interpreter's seconds of teardown (torch's operator registry)


def run_in_processes(fn, world_size: int, *args) -> None:
    """``fn(rank, world_size, *args)`` in ``world_size`` spawned processes; raises if any fails."""
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_entry, args=(world_size, os.path.join(tmp, "init"), fn, args), nprocs=world_size, join=True)
