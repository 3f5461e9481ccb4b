"""Real Ray worker groups of CPU processes (a private local cluster). (That a stale cluster address does not stop
a private cluster is test_docs_examples' worker example, run under one.)"""

import pytest
import torch

import group_checks
import group_scenarios
from controller import ResourcePool, WorkerGroup
from workers import DataProto

pytestmark = pytest.mark.usefixtures("ray_cluster")


def test_every_dispatch_mode_on_ray():
    group_checks.check_modes(group_scenarios.modes("ray"))


def test_colocated_roles_and_split_pools_on_ray():
    group_checks.check_colocated_and_split(group_scenarios.colocated_and_split("ray"))


def test_raised_exception_timeout_and_killed_worker_on_ray():
    group_checks.check_faults(group_scenarios.faults("ray"))


def test_pool_that_cannot_be_placed_fails_with_the_cluster_resources():
    with pytest.raises(RuntimeError, match=r"could not reserve \[2\] bundles of \{'CPU': 1000\}"):
        ResourcePool([2], backend="ray", cpus_per_process=1000, init_timeout_s=2)


def test_bad_pool_arguments():
    with pytest.raises(ValueError, match=r"process_on_nodes must be positive process counts per node, got \[2, 0\]"):
        ResourcePool([2, 0])
    with pytest.raises(ValueError, match="unknown backend 'mpi'"):
        ResourcePool([2], backend="mpi")
    with pytest.raises(RuntimeError, match="not started by torchrun"):
        ResourcePool([2], backend="torchrun")


def test_inputs_are_zero_copy_views_of_the_object_store_and_writers_get_their_own_copy():
    pool = ResourcePool([2], backend="ray")
    try:
        group = WorkerGroup(pool, group_scenarios.ScenarioWorker, role="memory")
        big = DataProto({"x": torch.zeros(1 << 16, dtype=torch.int64)})  # 512 KiB: through the object store
        small = DataProto({"x": torch.zeros(8, dtype=torch.int64)})  # inside the call itself
        assert all(m.startswith("/dev/shm/plasma") for m in group.input_memory(big)), group.input_memory(big)
        assert not any(m.startswith("/dev/shm") for m in group.input_memory(small))
        # One shared object would let rank 0's write show at rank 1 (1 + 2); each rank writes its own copy.
        assert group.add_rank_in_place(big) == [[1, 1, 1], [2, 2, 2]]
        assert group.add_rank_in_place(big) == [[1, 1, 1], [2, 2, 2]]  # and the caller's batch is untouched
        assert int(big.batch["x"].abs().sum()) == 0
    finally:
        pool.shutdown()
