"""The extension examples run as written: a custom advantage estimator and reward worker, a KL-loss hook, and a
user's algorithm that changes one hook."""

import os
import re
import subprocess
import sys

from conftest import ROOT


def run_example(name: str) -> str:
    proc = subprocess.run([sys.executable, str(ROOT / "examples" / name)], capture_output=True, text=True, timeout=400,
                          cwd=str(ROOT), env={**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return proc.stdout


def test_custom_estimator_and_reward_worker_plug_in():
    out = run_example("custom_estimator.py")
    steps = re.findall(r"step (\d): reward (\S+)  advantages in \[(\S+), (\S+)\]", out)
    assert [s[0] for s in steps] == ["1", "2"], out
    for _, _, low, high in steps:
        # A median baseline over 4 samples: some responses above it, some below (or all equal).
        assert float(low) <= 0.0 <= float(high)
    assert "estimator used: median_baseline" in out


def test_kl_loss_hook_with_a_decaying_beta():
    out = run_example("dynamic_kl_beta.py")
    rows = re.findall(r"step (\d): beta (\S+)  kl_loss (\S+)", out)
    assert [(r[0], r[1]) for r in rows] == [("1", "0.200"), ("2", "0.100")], out
    assert float(rows[0][2]) < 1e-6  # the policy equals the reference before its first update
    assert float(rows[1][2]) > 0.0  # after it the hook's KL term is non-zero


def test_a_user_algorithm_changes_one_hook():
    out = run_example("custom_algorithm.py")
    steps = re.findall(r"step (\d): reward (\S+)  advantages in \[(\S+), (\S+)\]  clipped (\S+)", out)
    assert [s[0] for s in steps] == ["1", "2"], out
    for _, _, low, high, _ in steps:
        # the hook clips GRPO's group-normalized advantages, so the batch's stay within [-1, 1] ...
        assert -1.0 <= float(low) <= 0.0 <= float(high) <= 1.0
    # ... although some reached beyond (one sample of four unlike the others is 1.5 group-stds out)
    assert sum(float(s[4]) for s in steps) > 0.0, out
