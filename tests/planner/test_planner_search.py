"""The planner's search, with no process: placements, splits, pruning checked against brute force, pins, errors."""

import itertools
from dataclasses import replace

import pytest

from controller.planner.hardware import GIB, Accelerator, Cluster, ClusterError, parse_cluster
from controller.planner.options import Pin, role_options
from controller.planner.search import (PlanError, allowed_sizes, best_on_split, device_splits, placements, search,
                                       set_partitions, shared_host, step_time)
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
    """Every placement, split and combination of layouts, scored with the search's rules written out again
    (``workload`` has no scoring role: its stage 1 is log-probs and values alone)."""
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
                if workload.overlap:  # within a stage the sets work at once, the slowest last; stages in turn
                    total = sum(max(t[s] for t in picked) for s in range(3))
                else:  # the sequential controller runs every phase in turn
                    total = sum(sum(t) for t in picked)
                key = tuple(sets)
                best[key] = min(best.get(key, total), total)
    return best


# Budgets where the fastest plan is split, as no colocated one fits (1.9 MiB), all colocated (3 and 2 MiB),
# nothing (1.3 MiB), and across two nodes.
@pytest.mark.parametrize("overlap", [True, False])
@pytest.mark.parametrize("mib,nodes,per_node", [(1.9, 1, 4), (3.0, 1, 4), (2.0, 1, 4), (1.3, 1, 4), (2.5, 2, 2)])
def test_the_search_finds_the_brute_force_optimum(mib, nodes, per_node, overlap):
    workload = replace(ppo_workload(), overlap=overlap)
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


def _by_hand(plan):
    """Each set's own seconds per phase (its roles in turn), from the plan's options: generation, scoring
    (the reward model's forward), log-probs and values (every other forward), updates."""
    sets = []
    for group in plan.sets:
        score = sum(o.times[1] for o in group.options if o.role == "reward_model")
        sets.append((sum(o.times[0] for o in group.options), score,
                     sum(o.times[1] for o in group.options) - score, sum(o.times[2] for o in group.options)))
    return sets


def test_a_split_placement_takes_the_slowest_set_of_each_stage():
    """Actor (generating) on one set, critic on another: the log-probs beside the values, the two updates at once."""
    workload = ppo_workload()
    workload = replace(workload, roles=workload.roles[:2])  # actor and critic
    cluster = Cluster(1, 4, toy_device(64))
    plan, _ = best_on_split(workload, cluster, (("actor",), ("critic",)), (2, 2))
    (gen_a, _, prep_a, train_a), (gen_c, _, prep_c, train_c) = _by_hand(plan)
    assert gen_c == 0 and min(prep_a, prep_c, train_a, train_c) > 0  # both sets work in both later stages
    assert plan.stage_times == pytest.approx((gen_a, max(prep_a, prep_c), max(train_a, train_c)), rel=1e-12)
    assert plan.step_time == pytest.approx(gen_a + max(prep_a, prep_c) + max(train_a, train_c), rel=1e-12)
    sequential, stages = step_time(replace(workload, overlap=False), plan.sets, 0.0, accelerator=cluster.accelerator)
    assert sequential == pytest.approx(gen_a + prep_a + prep_c + train_a + train_c, rel=1e-12)
    assert stages == pytest.approx((gen_a, prep_a + prep_c, train_a + train_c), rel=1e-12)
    assert plan.step_time < sequential


def test_scoring_takes_turns_and_shared_sets_take_turns():
    """actor+ref | critic+reward: the reward model scores alone after generation; the actor's and reference's
    log-probs take turns on their set while the critic's values run on the other."""
    critic = replace(TINY, num_labels=1)
    workload = replace(ppo_workload(), roles=ppo_workload().roles + (
        RoleWork("reward_model", critic, trains=False, forward_passes=1),))
    cluster = Cluster(1, 4, toy_device(64))
    plan, _ = best_on_split(workload, cluster, (("actor", "ref_policy"), ("critic", "reward_model")), (2, 2))
    (gen_a, score_a, prep_a, train_a), (gen_c, score_c, prep_c, train_c) = _by_hand(plan)
    assert score_a == 0 and score_c > 0 and prep_a == sum(plan.option(r).times[1] for r in ("actor", "ref_policy"))
    expected = gen_a + score_c + max(prep_a, prep_c) + max(train_a, train_c)
    assert plan.step_time == pytest.approx(expected, rel=1e-12)
    assert plan.stage_times[1] == pytest.approx(score_c + max(prep_a, prep_c), rel=1e-12)
    sequential, _ = step_time(replace(workload, overlap=False), plan.sets, 0.0, accelerator=cluster.accelerator)
    assert sequential == pytest.approx(sum(sum(o.times) for g in plan.sets for o in g.options), rel=1e-12)


def test_a_colocated_placement_is_scored_as_before():
    workload = ppo_workload()
    cluster = Cluster(1, 4, toy_device(64))
    placement = (("actor", "critic", "ref_policy"),)
    plan, _ = best_on_split(workload, cluster, placement, (4,))
    alone, _ = best_on_split(replace(workload, overlap=False), cluster, placement, (4,))
    assert plan.step_time == alone.step_time == pytest.approx(sum(plan.sets[0].times), rel=1e-12)
    assert plan.stage_times == alone.stage_times


def test_a_rollout_pool_off_policy_generates_while_the_others_work():
    roles = (RoleWork("actor", TINY, trains=True, forward_passes=1, mini_batch=8),
             RoleWork("rollout", TINY, trains=False, generates=True, vocab_multiple=None),
             RoleWork("critic", replace(TINY, num_labels=1), trains=True, forward_passes=1, mini_batch=8))
    workload = Workload(16, 32, 32, roles, mode="one_step_off", max_num_seqs=8)
    cluster = Cluster(1, 4, toy_device(64))
    plan, _ = best_on_split(workload, cluster, (("actor",), ("rollout",), ("critic",)), (2, 1, 1))
    (_, _, prep_a, train_a), (gen_r, _, _, _), (_, _, prep_c, train_c) = _by_hand(plan)
    assert plan.transfer_time > 0
    others = max(prep_a, prep_c) + max(train_a, train_c)
    assert plan.step_time == pytest.approx(max(gen_r, others) + plan.transfer_time, rel=1e-12)
    sequential, _ = step_time(replace(workload, overlap=False), plan.sets, plan.transfer_time,
                              accelerator=cluster.accelerator)
    assert sequential == pytest.approx(max(gen_r, prep_a + prep_c + train_a + train_c) + plan.transfer_time,
                                       rel=1e-12)


def test_cpu_processes_working_at_once_share_the_cores():
    """Two sets of 2 processes, 1 s and 3 s alone (each process 1 core). On 2 cores both at once take turns
    in effect: 4 s, the sum. On 8 cores nothing is shared: 3 s. On 3 cores: both at 3/4 of a core a process
    until the first ends (1 / 0.75 s, the other then 1 s of its 3 done), then the other alone for 2 s."""
    cpu = lambda cores: replace(toy_device(64), host_cores=cores, threads_per_device=1)  # noqa: E731
    assert shared_host((2, 2), cpu(2.0))([1.0, 3.0]) == pytest.approx(4.0, rel=1e-12)
    assert shared_host((2, 2), cpu(8.0))([1.0, 3.0]) == pytest.approx(3.0, rel=1e-12)
    assert shared_host((2, 2), cpu(3.0))([1.0, 3.0]) == pytest.approx(1 / 0.75 + 2.0, rel=1e-12)
    assert shared_host((2, 2), cpu(3.0))([0.0, 3.0]) == pytest.approx(3.0, rel=1e-12)  # one set alone
    assert shared_host((2, 2), toy_device(64)) is max  # accelerators are their own


def test_a_split_on_saturated_cpu_cores_gains_nothing_from_overlap():
    """4 processes on 2 cores (``--cluster local`` here): each set of 2 keeps both cores busy alone, so the
    overlapped step is the sequential one."""
    cpu = replace(toy_device(64), host_cores=2.0, threads_per_device=1, cores_per_device=0.5)
    workload = ppo_workload()
    workload = replace(workload, roles=workload.roles[:2])
    plan, _ = best_on_split(workload, Cluster(1, 4, cpu), (("actor",), ("critic",)), (2, 2))
    sequential, _ = step_time(replace(workload, overlap=False), plan.sets, 0.0, accelerator=cpu)
    assert plan.step_time > step_time(workload, plan.sets, 0.0, accelerator=None)[0]  # as if the cores were not shared
    assert plan.step_time == pytest.approx(sequential, rel=1e-12)


def test_context_parallelism_divides_activations_and_adds_a_kv_all_gather():
    """By hand: at CP2 a rank keeps half of a sequence's activations (the gathered K/V of the whole sequence
    beside them), and a training pass costs what data parallelism costs plus each layer's K/V all-gather (forward)
    and reduce-scatter (backward) over the CP link."""
    from controller.planner.memory import ActivationShape, layer_activation_bytes
    from controller.planner.timing import Link, PassShape, all_gather_time, train_time

    h, heads, groups, d, f = TINY.hidden_size, 4, 2, TINY.head_dim, TINY.ffn_hidden_size
    for cp in (1, 2, 4):
        shape = ActivationShape(2, 128, "bf16", flash_attention=True, context_parallel=cp, packed=True)
        per_token = 4 * h + (2 * heads + 2 * cp * groups) * d + 3 * f
        assert layer_activation_bytes(TINY, 1, shape) == 2 * (128 // cp) * per_token * 2
    device, link = toy_device(1024), Link(1e9, 1e-5)
    args = dict(device=device, precision="bf16", tp_link=link, dp_link=link, efficiency=Efficiency())
    data = train_time(TINY, 1, 1, 2, PassShape(16, 128, 2), 2, **args)
    split = train_time(TINY, 1, 1, 2, PassShape(16, 128, 2, context_parallel=2, cp_link=link), 2, **args)
    kv = 2 * 2 * 128 * groups * d * 2  # K and V of a micro-batch's 2 sequences, whole, bf16
    micro_batches = 8 // 2  # each optimizer step: 8 sequences on the one replica, 2 at a time
    expected = 2 * micro_batches * TINY.num_layers * 2 * all_gather_time(kv, 2, link, Efficiency())
    assert split - data == pytest.approx(expected, rel=1e-9)
