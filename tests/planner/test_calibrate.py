"""This machine as the planner's device: measured, saved atomically, read back as a cluster of CPU processes."""

import json

import pytest

from conftest import ROOT
from controller.cli import main
from controller.planner.calibrate import load_calibration, local_cluster, measure, save_calibration
from controller.planner.hardware import ClusterError


def test_measured_figures_are_saved_read_back_and_shared_among_the_processes(tmp_path, monkeypatch):
    figures = measure(gemm_size=256, copy_bytes=16 << 20, repeats=3, gloo_bytes=4 << 20)
    assert 1e8 < figures["fp32_flops"] < 1e14 and 1e8 < figures["bf16_flops"] < 1e14
    assert 1e8 < figures["memory_bandwidth"] < 1e13 and 1e6 < figures["gloo_bandwidth"] < 1e12
    assert 0 < figures["gloo_latency_s"] < 0.1 and figures["machine"]["cores"] >= 1
    path = save_calibration(figures, tmp_path / "calibration.json")
    assert load_calibration(path) == json.loads(path.read_text()) == figures
    cluster = local_cluster(4, figures)
    device = cluster.accelerator
    assert (cluster.nodes, cluster.devices) == (1, 4)
    assert device.flops("fp32") == pytest.approx(figures["fp32_flops"] / 4)  # each process: cores / 4 threads
    assert device.memory_bytes == figures["machine"]["memory_bytes"] // 4
    assert device.link_latency == figures["gloo_latency_s"] and "measured by hybridflow plan --calibrate" in device.source
    with pytest.raises(ClusterError, match=r"run `hybridflow plan --calibrate` first"):
        load_calibration(tmp_path / "none.json")
    # The CLI plans a job on this machine's processes from the saved figures.
    monkeypatch.setenv("HYBRIDFLOW_CALIBRATION", str(path))
    assert main(["plan", "--config", str(ROOT / "examples/ppo_tiny.yaml"), "--cluster", "local",
                 "trainer.launcher=ray", "--json", str(tmp_path / "plans.json")]) == 0
    saved = json.loads((tmp_path / "plans.json").read_text())
    assert saved["cluster"].startswith("1x4xcpu-process") and saved["plans"]


def test_fitted_host_costs_are_read_back_and_a_process_alone_runs_faster(tmp_path):
    from controller.planner.calibrate import local_efficiency
    from controller.planner.timing import HOST_COSTS

    figures = {"machine": {"cpu": "test", "cores": 2, "memory_bytes": 8 << 30}, "fp32_flops": 1e11, "bf16_flops": 2e11,
               "memory_bandwidth": 2e10, "gloo_latency_s": 1e-4, "gloo_bandwidth": 1e9}
    assert all(getattr(local_efficiency(figures), name) == 0.0 for name in HOST_COSTS)  # not fitted: zero
    fitted = {**figures, "host_costs": {"call_s": 0.03, "step_s": 0.1, "collective_latency_s": 2e-3, "runs": ["a"]}}
    efficiency = local_efficiency(fitted)
    assert (efficiency.call_s, efficiency.step_s, efficiency.micro_batch_layer_s) == (0.03, 0.1, 0.0)
    device = local_cluster(4, fitted).accelerator
    assert device.link_latency == 2e-3  # the collectives' latency under a job's load, as fitted
    # 4 processes of 1 thread on 2 cores: each gets half a core while all work, a whole one while 2 do.
    assert device.cores_per_device == 0.5 and device.working(4) is device
    alone = device.working(2)
    assert alone.cores_per_device == 1.0 and alone.flops("fp32") == pytest.approx(2 * device.flops("fp32"))
    assert alone.memory_bandwidth == pytest.approx(2 * device.memory_bandwidth)
    assert efficiency.on_faster_host(2.0).call_s == pytest.approx(0.015) and efficiency.on_faster_host(2.0).step_s == 0.1
