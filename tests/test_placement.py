"""Placement across nodes, with no process: pool shapes, the fit against a cluster's nodes, the config keys."""

from pathlib import Path

import pytest

from controller.checks.placement import job_pools
from controller.config import ConfigError, check_config, load_config
from controller.runtime.placement import ClusterNode, PlacementError, PoolShape, fit_pools, pool_shape


def nodes(*cpus, gpus=0):
    return [ClusterNode(f"10.0.0.{i + 1}", float(c), float(gpus)) for i, c in enumerate(cpus)]


def test_placement_entries_become_pool_shapes():
    assert pool_shape("critic", 4, "x") == PoolShape("critic", 1, 4)
    assert pool_shape("actor", {"nodes": 2, "processes_per_node": 8}, "x").process_on_nodes == [8, 8]
    assert pool_shape("actor", {"processes_per_node": 3}, "x") == PoolShape("actor", 1, 3)
    for bad in (0, -1, True, "4", {"nodes": 2}, {"nodes": 0, "processes_per_node": 2}, {"gpus": 1, "processes_per_node": 2}):
        with pytest.raises(PlacementError, match=r"trainer\.placement\.critic must be a positive number of processes .*"
                                                 r"or \{nodes: N, processes_per_node: P\}, got"):
            pool_shape("critic", bad, "trainer.placement.critic")


def test_a_placement_entry_naming_a_placed_role_shares_its_pool():
    trainer = load_config(None, ["trainer.launcher=ray", "trainer.placement={critic: {nodes: 1, processes_per_node: 4}, "
                                 "reward_model: critic}"]).trainer
    pools = job_pools(trainer)
    assert pools["reward_model"] is pools["critic"] and pools["critic"] == PoolShape("critic", 1, 4)
    with pytest.raises(PlacementError, match=r"trainer\.placement\.reward_model: 'ref_policy' names no role placed on a "
                                             r"pool of its own; name one of \['critic'\]"):
        job_pools(load_config(None, ["trainer.placement={critic: 4, reward_model: ref_policy}"]).trainer)
    with pytest.raises(PlacementError, match=r"a rollout on its own pool shares it with no other role"):
        job_pools(load_config(None, ["trainer.placement={rollout: 4, critic: rollout}"]).trainer)


def test_pools_fit_distinct_nodes_in_creation_order():
    # The default pool takes 2 of 4 CPUs on two nodes; the critic (1 x 4) fits only on the third.
    placed = fit_pools([PoolShape("default", 2, 2), PoolShape("critic", 1, 4)], nodes(4, 4, 4))
    assert len(set(placed["default"])) == 2 and placed["critic"][0] not in placed["default"]
    # Two entries of one pool never share a node, even when one node has room for both.
    with pytest.raises(PlacementError, match=r"pool 'actor' \(2 node\(s\) x 2 process\(es\)\) needs 2 different node"):
        fit_pools([PoolShape("actor", 2, 2)], nodes(16))
    # Uneven entries (ResourcePool([4, 1])), largest first.
    assert sorted(fit_pools([("pool0", [4, 1])], nodes(1, 4))["pool0"]) == ["10.0.0.1", "10.0.0.2"]
    with pytest.raises(PlacementError, match=r"one with 3 CPU free for 3 process\(es\) besides pool\(s\) \['default'\].*"
                                             r"it has 2 node\(s\): 10\.0\.0\.1 \(4 CPU, 0 GPU\), 10\.0\.0\.2 \(4 CPU, 0 GPU\)"):
        fit_pools([PoolShape("default", 2, 2), PoolShape("critic", 1, 3)], nodes(4, 4))


def test_on_a_gpu_cluster_every_process_takes_a_gpu():
    gpu_nodes = nodes(64, 64, gpus=8)
    fit_pools([PoolShape("default", 2, 8)], gpu_nodes)
    with pytest.raises(PlacementError, match=r"one with 4 CPU and 4 GPU free .* besides pool\(s\) \['default'\]"):
        fit_pools([PoolShape("default", 2, 8), PoolShape("critic", 1, 4)], gpu_nodes)
    fit_pools([PoolShape("default", 2, 8), PoolShape("critic", 1, 4)], gpu_nodes, use_gpu=False)  # CPU workers


def problems(*overrides, cluster=None, path=None) -> str:
    with pytest.raises(ConfigError) as info:
        check_config(load_config(path, list(overrides)), cluster=cluster)
    return str(info.value)


def test_multi_node_config_keys_are_checked():
    assert job_pools(load_config(None, ["trainer.nnodes=2", "trainer.nproc=8"]).trainer)["default"].process_on_nodes == [8, 8]
    assert "trainer.nnodes must be >= 1, got 0" in problems("trainer.nnodes=0")
    assert "trainer.ray_address '10.0.0.1:6379' needs trainer.launcher=ray" in problems("trainer.ray_address=10.0.0.1:6379")
    assert "trainer.ray_address must be null (a private local cluster), 'auto' or 'host:port', got 'head'" in problems(
        "trainer.launcher=ray", "trainer.ray_address=head")
    assert "trainer.rdzv_endpoint must be 'host:port', got 'node01'" in problems("trainer.rdzv_endpoint=node01")
    assert "trainer.rdzv_endpoint is torchrun's rendezvous" in problems("trainer.launcher=ray", "trainer.rdzv_endpoint=h:1")
    # The layout checks use the whole world, nnodes x nproc.
    demo = Path(__file__).parent.parent / "examples" / "ppo_tiny.yaml"  # TP2 x PP2
    assert "= 4 does not divide trainer.nnodes x nproc = 2 x 3 = 6" in problems("trainer.nnodes=2", "trainer.nproc=3",
                                                                                 path=demo)
    check_config(load_config(None, ["trainer.launcher=ray", "trainer.ray_address=auto", "trainer.nnodes=2", "trainer.nproc=2"]))
    check_config(load_config(None, ["trainer.nnodes=2", "trainer.nproc=2", "trainer.rdzv_endpoint=node01:29500"]))


def test_check_config_refuses_a_placement_the_cluster_cannot_hold_naming_what_it_has():
    placed = ["trainer.launcher=ray", "trainer.nproc=4", "trainer.placement={critic: {nodes: 2, processes_per_node: 4}}",
              "critic.engine.micro_batch_size=1"]
    check_config(load_config(None, placed), cluster=nodes(8, 8))
    text = problems(*placed, cluster=nodes(8, 2))
    assert "do not fit the Ray cluster: pool 'critic' (2 node(s) x 4 process(es)) needs 2 different node(s)" in text
    assert "it has 2 node(s): 10.0.0.1 (8 CPU, 0 GPU), 10.0.0.2 (2 CPU, 0 GPU)" in text
    assert "'reward_model' is not a placeable role" not in problems("trainer.launcher=ray", "trainer.placement={oracle: 1}")
    assert "'oracle' is not a placeable role" in problems("trainer.launcher=ray", "trainer.placement={oracle: 1}")


def test_trainer_placement_across_nodes_by_declaration():
    from controller.data import arithmetic_prompts
    from controller.rl.trainer import RLTrainer
    from workers.actor import Actor
    from workers.critic import Critic
    from workers.rollout import Rollout

    trainer = RLTrainer(actor=Actor.from_pretrained("policy"), rollout=Rollout.from_pretrained("policy"),
                        critic=Critic.from_pretrained("value"), reward_fn="arithmetic_answer", train_data=arithmetic_prompts(8, seed=0), batch_size=4)
    trainer.register_placement("actor", nodes=2, processes_per_node=4)
    trainer.register_placement("reward", pool="actor")  # colocated with the actor
    trainer.register_placement("critic", 4)  # a node of its own
    assert trainer.pool_shapes["actor"].process_on_nodes == [4, 4]
    assert trainer.placement == {"actor": "actor", "rollout": "actor", "critic": "critic", "reward": "actor"}
    assert trainer.pool_sizes == {"default": 1, "actor": 8, "critic": 4}
    with pytest.raises(ConfigError, match=r"pool 'actor' is 2 node\(s\) x 4 process\(es\), not 1 node\(s\) x 8"):
        trainer.register_placement("critic", nodes=1, processes_per_node=8, pool="actor")
    with pytest.raises(ConfigError, match="give devices .* or nodes and processes_per_node, not both"):
        trainer.register_placement("reward", 2, nodes=2, processes_per_node=1)
    with pytest.raises(ConfigError, match=r"nodes=2\): give processes_per_node too"):
        trainer.register_placement("reward", nodes=2)
    with pytest.raises(ConfigError, match=r"register_placement\('reward'\) must be a positive number of processes .*"
                                          r"got \{'nodes': 2, 'processes_per_node': 0\}"):
        trainer.register_placement("reward", nodes=2, processes_per_node=0)


def test_a_job_config_places_roles_on_shared_pools(tmp_path, monkeypatch):
    from controller.rl.trainer import RLTrainer

    config = load_config(None, ["trainer.launcher=ray", f"trainer.run_dir={tmp_path}",
                                "trainer.placement={reward: actor, actor: {nodes: 2, processes_per_node: 4}, critic: 4}"])
    trainer = RLTrainer(config)
    assert trainer.placement == {"actor": "actor", "rollout": "actor", "critic": "critic", "reward": "actor"}
    assert trainer.pool_sizes == {"default": 4, "actor": 8, "critic": 4}
    # Its pre-launch check sees the shared pool once: the reward's entry names the actor's pool.
    seen = []
    monkeypatch.setattr("controller.rl.job_assembly.check_config", lambda config, *a, **k: seen.append(config))
    trainer.check()
    assert seen[0].trainer.placement == {"actor": {"nodes": 2, "processes_per_node": 4}, "critic":
                                         {"nodes": 1, "processes_per_node": 4}, "reward": "actor"}


def test_placement_declarations_are_a_value_that_resolve_writes_into_the_config():
    """RolePlacement: each register_placement gives a new value (the old one unchanged), a config's own pools read
    back as they were written, and resolve writes the declared pools into trainer.placement, the rest of the
    config untouched. Pure: no process, no trainer."""
    from dataclasses import replace

    from controller.algorithms import build_algorithm
    from controller.rl.resolve import resolve
    from controller.rl.role_placement import RolePlacement

    config = load_config(None, ["trainer.launcher=ray", "algorithm.name=grpo", "rollout.lora_sync=merge",
                                "trainer.placement={reward: actor, actor: {nodes: 2, processes_per_node: 4}, critic: 4}"])
    roles = ("actor", "rollout", "critic", "reward")
    own = RolePlacement.of(config.trainer, roles)
    written = own.into(config)  # the config's own pools, read and written back (each pool's size spelled out)
    assert written.trainer.placement == {"actor": {"nodes": 2, "processes_per_node": 4},
                                         "critic": {"nodes": 1, "processes_per_node": 4}, "reward": "actor"}
    assert RolePlacement.of(written.trainer, roles) == own and replace(written, trainer=config.trainer) == config
    bare = RolePlacement.of(replace(config.trainer, placement={}), roles)
    placed = bare.placed("actor", nodes=2, processes_per_node=4).placed("reward", pool="actor").placed("critic", 4)
    assert bare.roles == dict.fromkeys(roles, "default") and not bare.rollout_apart  # unchanged by placed()
    assert placed.roles == own.roles and placed.pool_sizes == own.pool_sizes == {"default": 4, "actor": 8, "critic": 4}
    apart = placed.placed("rollout", 2)
    assert apart.rollout_apart and apart.into(config).trainer.placement["rollout"] == {"nodes": 1, "processes_per_node": 2}
    with pytest.raises(ConfigError, match="unknown role 'judge'; roles of this trainer"):
        placed.placed("judge", 1)

    def no_cluster():
        raise AssertionError("nothing to choose: the cluster is not asked for")

    unplaced = replace(config, trainer=replace(config.trainer, placement={}))
    resolved = resolve(unplaced, build_algorithm(config.algorithm), "policy", no_cluster, False, apart)
    assert resolved.config == apart.into(unplaced) and resolved.config.trainer.placement["critic"] == {
        "nodes": 1, "processes_per_node": 4}
    assert replace(resolved.config, trainer=unplaced.trainer) == unplaced  # nothing else changed
