"""Real Ray worker groups of CPU processes (a private local cluster)."""

import pytest

import group_checks
import group_scenarios
from controller import ResourcePool

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
