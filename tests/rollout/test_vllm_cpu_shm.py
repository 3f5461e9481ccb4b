"""vLLM's CPU shared-memory segments get names of their engine's own, and go when the engine closes."""

import os
from pathlib import Path
from types import SimpleNamespace

import pytest

from dist_utils import run_in_processes

pytest.importorskip("vllm")


def communicator(ranks):
    return SimpleNamespace(unique_name="tp:0", ranks=ranks)


def test_names_carry_the_engines_token_and_no_slash(monkeypatch):
    from vllm.distributed.device_communicators.cpu_communicator import _CPUSHMDistributed

    from workers.rollout.vllm_cpu_shm import unique_segment_names

    monkeypatch.setenv("VLLM_DIST_IDENT", "//")  # what vLLM's CPU worker sets under the external launcher
    plain = _CPUSHMDistributed.make_group_name(communicator([0, 1]))
    assert plain == "//-tp:0-[0-1]-cpushm"  # the same on every machine: every engine's ranks 0-1 share it
    with unique_segment_names("hybridflowabc"):
        assert _CPUSHMDistributed.make_group_name(communicator([0, 1])) == "hybridflowabc-tp:0-[0-1]-cpushm"
    assert _CPUSHMDistributed.make_group_name(communicator([0, 1])) == plain  # put back


def _engine_ranks(rank, world_size):
    import torch
    import torch.distributed as dist
    import vllm._C  # noqa: F401  (the shared-memory ops)
    from vllm.distributed.device_communicators.cpu_communicator import _CPUSHMDistributed

    from workers.rollout.vllm_cpu_shm import agree_token, unique_segment_names, unlink_segments

    os.environ["VLLM_DIST_IDENT"] = "//"
    token = agree_token(dist.group.WORLD, [0, 1])
    tokens = [None, None]
    dist.all_gather_object(tokens, token)
    assert tokens[0] == tokens[1] and token.startswith("hybridflow")
    with unique_segment_names(token):
        name = _CPUSHMDistributed.make_group_name(communicator([0, 1]))
    # A killed engine's segments under vLLM's own name are in the way of nothing.
    handle = torch.ops._C.init_shm_manager(name, world_size, rank, 1)
    dist.barrier()
    torch.ops._C.join_shm_manager(handle, name)
    total = torch.full((4,), float(rank + 1))
    torch.ops._C.shm_allreduce(handle, total)
    assert total.tolist() == [3.0] * 4
    dist.barrier()
    ours = sorted(p.name for p in Path("/dev/shm").glob(f"{token}*"))
    assert ours == [f"{name}_0", f"{name}_1"], ours
    dist.barrier()
    if rank == 0:
        assert sorted(unlink_segments(token)) == ours
    dist.barrier()
    assert not list(Path("/dev/shm").glob(f"{token}*"))
    assert (Path("/dev/shm") / "-tp:0-[0-1]-cpushm_0").exists()  # the leftover is not ours to remove


def _has_avx512() -> bool:
    try:
        return " avx512f" in Path("/proc/cpuinfo").read_text()
    except OSError:
        return True  # not Linux's /proc: let the test say


@pytest.mark.skipif(not Path("/dev/shm").is_dir(), reason="no /dev/shm")
@pytest.mark.skipif(not _has_avx512(), reason="vLLM's shared-memory ops called here stop with SIGILL on a CPU "
                                              "without AVX-512 (seen on an AMD EPYC without it)")
def test_an_engines_segments_work_beside_a_killed_ones_and_are_removed_at_close():
    leftover = Path("/dev/shm") / "-tp:0-[0-1]-cpushm_0"
    made = not leftover.exists()
    if made:
        leftover.write_bytes(b"\0" * 64)  # what a killed job's rank 0 leaves under vLLM's own name
    try:
        run_in_processes(_engine_ranks, 2)
    finally:
        if made:
            leftover.unlink()
