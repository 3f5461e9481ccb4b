"""The pre-launch memory check: the job's own plan scored on its devices, refused with the nearest plan that fits."""

import pytest

from conftest import ROOT
from controller.config import load_config
from controller.planner.hardware import matching_accelerator, parse_cluster
from controller.planner.prelaunch import MemoryCheckError, check_job_memory, job_plan, job_sets, local_cluster
from controller.planner.report import plan_overrides
from controller.planner.search import search
from controller.planner.workload import job_workload

MODELS = ROOT / "examples" / "models"
PAPER_7B = [f"model_path={MODELS / 'llama2-7b'}", f"reward.model_path={MODELS / 'llama2-7b-reward'}",
            "trainer.nnodes=2", "trainer.nproc=8"]


def test_a_job_that_does_not_fit_is_refused_with_the_table_and_a_plan_that_fits():
    cluster = parse_cluster("2x8xA100-80GB")
    config = load_config(ROOT / "examples/paper_ppo.yaml", PAPER_7B)  # every role at TP1 x PP1 on 16 GPUs
    with pytest.raises(MemoryCheckError) as refused:
        check_job_memory(config, cluster)
    message = str(refused.value)
    assert "predicted not to fit its devices (2x8xA100-80GB, 78.00 GiB usable each)" in message
    assert "actor+critic+ref_policy+reward_model (16)" in message and "> usable" in message
    assert "the nearest plan that fits" in message and "--force" in message
    # The nearest plan, applied as overrides, passes the check, and the job's plan is then the search's own.
    best = search(job_workload(config), cluster, top=1).plans[0]
    fitted = load_config(ROOT / "examples/paper_ppo.yaml", [*PAPER_7B, *plan_overrides(best, cluster)])
    plan = check_job_memory(fitted, cluster)
    assert plan.step_time == pytest.approx(best.step_time, rel=1e-12)
    assert [max(s.memory) for s in plan.sets] == [max(s.memory) for s in best.sets]


def test_the_jobs_pools_become_the_plans_sets():
    config = load_config(ROOT / "examples/paper_ppo.yaml", [
        *PAPER_7B, "trainer.placement={critic: {nodes: 1, processes_per_node: 8}, reward_model: critic}"])
    workload = job_workload(config)
    assert job_sets(config, workload) == [(("actor", "ref_policy"), 16), (("critic", "reward_model"), 8)]
    plan = job_plan(config, parse_cluster("3x8xH100-80GB"), workload)
    assert [s.roles for s in plan.sets] == [("actor", "ref_policy"), ("critic", "reward_model")]
    with pytest.raises(ValueError, match=r"actor: TP 3 x PP 1 does not divide its pool's 16 devices"):
        job_plan(load_config(ROOT / "examples/paper_ppo.yaml", [*PAPER_7B, "actor.engine.tensor_parallel=3"]),
                 parse_cluster("2x8xA100-80GB"))


def test_devices_are_matched_to_the_table_by_name_and_this_cpu_machine_is_not_checked():
    h100 = matching_accelerator("NVIDIA H100 80GB HBM3", 85_000_000_000)
    assert h100.name == "H100-80GB" and h100.memory_bytes == 85_000_000_000
    assert matching_accelerator("NVIDIA A100-SXM4-40GB", 42_000_000_000).name == "A100-40GB"
    unknown = matching_accelerator("Some Future GPU", 10 * 2**30)
    assert unknown.memory_bytes == 10 * 2**30 and "assumed" in unknown.source
    assert local_cluster(load_config(None, [])) is None  # no GPU here: hybridflow train skips the check


def test_the_python_api_with_register_placement_is_checked_at_build_before_any_worker(monkeypatch, tmp_path):
    """RLTrainer.build runs the same check on its pools as declared (register_placement's included), on this
    machine's GPUs (stubbed here: 4 small ones); trainer.memory_check=false (--force) skips it."""
    import controller.planner.prelaunch as prelaunch
    from controller.models.builtin import resolve_model_path
    from controller.planner.hardware import Accelerator, Cluster
    from controller.rl.trainer import RLTrainer

    model = resolve_model_path("builtin:tiny-arithmetic", tmp_path)
    job = [f"model_path={model}", "trainer.launcher=ray", "trainer.nproc=2", "actor.engine.tensor_parallel=1",
           "actor.engine.pipeline_parallel=1", "critic.engine.tensor_parallel=1", "critic.engine.pipeline_parallel=1",
           "trainer.run_dir=null"]

    def gpus(mib):
        return Cluster(1, 4, Accelerator("small-gpu", int(mib * 2**20), 1e14, 1e12, 1e11, 1e10, "test", reserved_bytes=0))

    def trainer(*extra):
        built = RLTrainer(load_config(ROOT / "examples/ppo_tiny.yaml", [*job, *extra]))
        built.register_placement("critic", 2)
        return built

    monkeypatch.setattr(prelaunch, "local_cluster", lambda config: gpus(64))
    roomy = prelaunch.check_before_launch(trainer().placed_config())
    assert [s.roles for s in roomy.sets] == [("actor",), ("critic",)]  # the declared pool is a set of its own
    monkeypatch.setattr(prelaunch, "local_cluster", lambda config: gpus(4))
    small = trainer()
    with pytest.raises(MemoryCheckError, match=r"predicted not to fit its devices \(1x4xsmall-gpu, 0.00 GiB usable each\)"):
        small.build()
    assert not small.groups  # refused before any worker started
    assert prelaunch.check_before_launch(trainer("trainer.memory_check=false").placed_config()) is None


def test_hybridflow_train_refuses_before_any_process_and_force_skips_the_check(monkeypatch, capsys):
    import controller.planner.prelaunch as prelaunch
    from controller.cli import main

    monkeypatch.setattr(prelaunch, "local_cluster", lambda config: parse_cluster("2x8xA100-80GB"))
    # Every role at TP1: too big. (torchrun: no Ray cluster to join for the placement check that follows.)
    command = ["train", "--config", str(ROOT / "examples/paper_ppo.yaml"), *PAPER_7B, "trainer.launcher=torchrun",
               "trainer.rdzv_endpoint=127.0.0.1:29999"]
    assert main(command) == 2
    assert "predicted not to fit its devices (2x8xA100-80GB" in capsys.readouterr().err
    # --force: past the memory check, to the next one (the config-only model has no tokenizer to load)
    assert main([*command[:1], "--force", *command[1:]]) == 2
    err = capsys.readouterr().err
    assert "predicted not to fit" not in err and "tokenizer" in err, err
