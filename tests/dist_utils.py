"""Run a function in N real processes joined by a gloo process group."""

import os
import tempfile
import traceback
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from controller.runtime.process_exit import exit_process


# The processes fork from one server process per pytest process that has imported these once (a spawned
# process would import torch, megatron-core and transformers afresh: seconds each, on every call).
PRELOAD = ["torch", "torch.distributed", "megatron.core", "transformers", "safetensors.torch", "hybridengine.reshard.resharder",
           "workers.megatron.hf_checkpoint"]
_context = mp.get_context("forkserver")
_context.set_forkserver_preload(PRELOAD)


def _entry(rank, world_size, init_file, fn, args):
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)  # torch was imported before the fork: the variable alone comes too late
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size)
    try:
        fn(rank, world_size, *args)
    finally:
        dist.destroy_process_group()
    exit_process(0)  # a success: skip the interpreter's seconds of teardown (torch's operator registry)


def run_in_processes(fn, world_size: int, *args) -> None:
    """``fn(rank, world_size, *args)`` in ``world_size`` spawned processes; raises if any fails."""
    with tempfile.TemporaryDirectory() as tmp:
        mp.start_processes(_entry, args=(world_size, os.path.join(tmp, "init"), fn, args), nprocs=world_size,
                           join=True, start_method="forkserver")


def _cases(rank, world_size, fn, cases, done_dir):
    for name, args in cases.items():
        fn(rank, world_size, *args)
        dist.barrier()  # every rank finished this case before any starts the next
        if rank == 0:
            (Path(done_dir) / name).touch()


def run_cases_in_processes(fn, world_size: int, cases: dict[str, tuple]) -> dict[str, str | None]:
    """``fn(rank, world_size, *args)`` for every case of ``cases`` (name -> args), in turn, in one set of
    ``world_size`` spawned processes: the processes start (and import torch) once for all of them.

    Returns name -> None for a case that passed on every rank, else why it did not: the failure's
    traceback for the case that failed (which stops the processes), "not run" for the cases after it.
    """
    outcome: dict[str, str | None] = {}
    with tempfile.TemporaryDirectory() as done_dir:
        try:
            run_in_processes(_cases, world_size, fn, cases, done_dir)
            failure = None
        except Exception:  # noqa: BLE001 - a rank failed: mp.spawn's exception carries its traceback
            failure = traceback.format_exc()
        for name in cases:
            if (Path(done_dir) / name).exists():
                outcome[name] = None
            else:
                outcome[name], failure = failure or "not run: an earlier case stopped the processes", None
    return outcome
