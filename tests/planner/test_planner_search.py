"""The planner's search, with no process: placements, splits, pruning checked against brute force, pins, errors."""

import itertools
from dataclasses import replace

import pytest

from controller.planner.hardware import GIB, Accelerator, Cluster, ClusterError, parse_cluster
from controller.planner.options import Pin, role_options
from controller.planner.search import (PlanError, allowed_sizes, device_splits, placements, search, set_partitions)
from controller.planner.timing import Efficiency
from controller.planner.workload import RoleWork, Workload
from hybridengine.model.spec import ModelSpec

TINY = ModelSpec.from_hf_config({"architectures": ["LlamaForCausalLM"], "vocab_size": 256, "hidden_size": 64,
                                 "intermediate_size": 128, "num_hidden_layers": 4, "num_attention_heads": 4,
                                 "num_key_value_heads": 2, "max_position_embeddings": 256, "rms_norm_eps": 1e-6})


def toy_device(mib: float) -> Accelerator:
    """A small accelerator, so that memory decides between layouts."""
    return Accelerator("toy", int(mib * 2**20), 1e12, 1e11, 1e10, 1e9, "test", reserved_bytes=0)


def ppo_workload(sequences=16, mini=8, response=32) -> Workload:
    critic = replace(TINY, num_labels=1)
    roles = (RoleWork("actor", TINY, trains=True, forward_passes=1, mini_batch=mini, generates=True),
             RoleWork("critic", critic, trains=True, forward_passes=1, mini_batch=mini),
             RoleWork("ref_policy", TINY, trains=False, forward_passes=1))
    return Workload(sequences, 32, response, roles, max_num_seqs=8)


def test_set_partitions_are_the_bell_numbers_and_distinct():
    for n, bell in [(1, 1), (2, 2), (3, 5), (4, 15), (5, 52)]:
        items = tuple("abcde"[:n])
        found = [frozenset(frozenset(s) for s in p) for p in set_partitions(items)]
        assert len(found) == bell == len(set(found))
        assert all(sorted(x for s in p for x in s) == list(items) for p in found)


def test_device_splits_use_every_device_in_node_sized_pieces_that_pack():
    cluster = Cluster(2, 4, toy_device(64))
    assert allowed_sizes(cluster) == [1, 2, 4, 8]
    splits = list(device_splits(cluster, 3))
    assert splits and all(sum(s) == 8 for s in splits)
    assert (4, 2, 2) in splits and (2, 2, 4) in splits and (4, 4, 1) not in splits
    assert (2, 1, 5) not in splits  # 5 is neither a divisor of a node nor whole nodes
    assert list(device_splits(cluster, 2, fixed=(None, 4))) == [(4, 4)]
    assert list(device_splits(cluster, 2, fixed=(None, 2))) == []  # 6 devices is not a size a set may take


def _brute_force(workload, cluster, efficiency):
    """Every placement, split and combination of layouts, scored with the search's rules written out again."""
    budget = cluster.accelerator.usable_bytes
    roles = workload.role_names
    best = {}  # placement -> its fastest step
    # placements as restricted growth strings: role i joins one of the sets so far or opens the next
    for labels in itertools.product(range(len(roles)), repeat=len(roles)):
        if any(labels[i] > max(labels[:i], default=-1) + 1 for i in range(len(roles))):
            continue
        sets = [tuple(r for r, label in zip(roles, labels) if label == k) for k in range(max(labels) + 1)]
        for split in itertools.product(allowed_sizes(cluster), repeat=len(sets)):
            if sum(split) != cluster.devices or split not in set(device_splits(cluster, len(sets))):
                continue
            per_set = []
            for members, n in zip(sets, split):
                combos = []
                for choice in itertools.product(*[role_options(workload.role(r), workload, cluster, efficiency, n,
                                                               prune=False) for r in members]):
                    resident = sum(o.resident for o in choice)
                    fits = True
                    for stage in range(3):
                        active = [o.extra[stage] for o in choice if o.times[stage] > 0 or o.extra[stage] > 0]
                        if resident + (max(active) if active else 0) > budget:
                            fits = False
                    if fits:
                        combos.append(tuple(sum(o.times[s] for o in choice) for s in range(3)))
                per_set.append(combos)
            for picked in itertools.product(*per_set):
                total = sum(sum(t) for t in picked)  # the controller runs every phase in turn
                key = tuple(sets)
                best[key] = min(best.get(key, total), total)
    return best


# Budgets where the fastest plan is split, as no colocated one fits (1.9 MiB), all colocated (3 and 2 MiB),
# nothing (1.3 MiB), and across two nodes.
@pytest.mark.parametrize("mib,nodes,per_node", [(1.9, 1, 4), (3.0, 1, 4), (2.0, 1, 4), (1.3, 1, 4), (2.5, 2, 2)])
def test_the_search_finds_the_brute_force_optimum(mib, nodes, per_node):
    workload = ppo_workload()
    cluster = Cluster(nodes, per_node, toy_device(mib))
    efficiency = Efficiency()
    result = search(workload, cluster, efficiency, top=3)
    expected = _brute_force(workload, cluster, efficiency)
    if not expected:
        assert not result.plans
        return
    assert result.plans, result.rejected
    found = {p.placement: p.step_time for p in result.plans}
    found.update({r.placement: r.best.step_time for r in result.rejected if r.best is not None})
    assert found.keys() == expected.keys()
    for placement, step in expected.items():  # every placement's optimum, not only the winner's
        assert found[placement] == pytest.approx(step, rel=1e-12), placement
    assert result.plans[0].step_time == pytest.approx(min(expected.values()), rel=1e-12)
    assert [p.step_time for p in result.plans] == sorted(p.step_time for p in result.plans)
    # the plan's memory fits every stage on every set, as reported
    for group in result.plans[0].sets:
        assert max(group.memory) <= cluster.accelerator.usable_bytes


def test_memory_decides_the_layouts_and_the_search_is_deterministic():
    workload = ppo_workload()
    roomy = search(workload, Cluster(1, 4, toy_device(64)))
    tight = search(workload, Cluster(1, 4, toy_device(2.0)))
    assert roomy.plans and tight.plans
    assert roomy.plans[0].step_time <= tight.plans[0].step_time  # room never makes a plan slower
    assert all(max(s.memory) <= 2.0 * 2**20 for s in tight.plans[0].sets)
    assert roomy.plans[0].peak_memory > 2.0 * 2**20  # the roomy winner would not fit the tight device
    layouts = lambda plan: [(o.role, o.tp, o.pp, o.dp, o.micro_batch, o.gen_tp, o.concurrency)  # noqa: E731
                            for group in plan.sets for o in group.options]
    assert layouts(roomy.plans[0]) != layouts(tight.plans[0])  # memory, not speed, chose the tight plan's layouts
    again = search(workload, Cluster(1, 4, toy_device(2.0)))
    assert [(p.step_time, p.placement, [s.devices for s in p.sets]) for p in again.plans] == \
           [(p.step_time, p.placement, [s.devices for s in p.sets]) for p in tight.plans]


def test_a_job_that_fits_nowhere_reports_the_smallest_need():
    result = search(ppo_workload(), Cluster(1, 2, toy_device(0.05)))
    assert not result.plans
    needs = [r.need for r in result.rejected if r.need]
    assert needs and min(needs) > 0.05 * 2**20


def test_pins_hold_and_contradictions_are_refused():
    workload = ppo_workload()
    cluster = Cluster(1, 4, toy_device(64))
    pinned = search(workload, cluster, pins={"actor": Pin(tp=2), "critic": Pin(colocate_with="actor")})
    for plan in pinned.plans:
        assert plan.option("actor").tp == 2
        assert any({"actor", "critic"} <= set(s.roles) for s in plan.sets)
    assert all(any({"actor", "critic"} <= set(s) for s in p) for p in placements(workload, {"critic": Pin(colocate_with="actor")}))
    with pytest.raises(PlanError, match=r"different device counts"):
        search(workload, cluster, pins={"actor": Pin(devices=2), "critic": Pin(devices=4, colocate_with="actor")})


def test_clusters_are_read_and_bad_ones_named():
    c = parse_cluster("4x8xH100-80GB")
    assert (c.nodes, c.devices_per_node, c.accelerator.name) == (4, 8, "H100-80GB")
    assert parse_cluster("8xa100-80gb").nodes == 1 and parse_cluster("2x4xH200").accelerator.memory_bytes == 141 * GIB
    with pytest.raises(ClusterError, match=r"unknown accelerator 'V100'.*A100-80GB"):
        parse_cluster("2x8xV100")
    with pytest.raises(ClusterError, match=r"'4x' is not NODESxDEVICESxTYPE"):
        parse_cluster("4x")
    with pytest.raises(ClusterError, match=r"devices_per_node must be a positive integer, got 0"):
        parse_cluster("2x0xA100-80GB")
