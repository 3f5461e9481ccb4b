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
