"""The device module's process settings: the collective cost model, and torch.compile deferred on the CPU
path."""

import subprocess
import sys

import pytest

from hybridengine.device import PROFILE_ENV, CollectiveProfile, collective_profile


def test_collective_profile_from_the_environment(monkeypatch):
    monkeypatch.setenv(PROFILE_ENV, "1e-5,5e10,1e12")
    assert collective_profile() == CollectiveProfile(1e-5, 5e10, 1e12)
    monkeypatch.setenv(PROFILE_ENV, "fast")
    with pytest.raises(ValueError, match="expected three numbers"):
        collective_profile()
    monkeypatch.setenv(PROFILE_ENV, "0,1,1")
    with pytest.raises(ValueError, match="must be positive"):
        collective_profile()
    monkeypatch.delenv(PROFILE_ENV)
    assert collective_profile().latency_s > 0


def test_importing_the_workers_defers_torch_compile_and_compiled_code_still_runs():
    program = """
import sys, torch
import workers, megatron.core  # megatron decorates its fusions with torch.compile at import
assert "torch._inductor.compile_fx" not in sys.modules, "inductor was imported"

@torch.compile(backend="eager")
def double(x):
    return 2 * x

assert double.__name__ == "double" and torch.equal(double(torch.ones(3)), torch.full((3,), 2.0))
module = torch.compile(torch.nn.Linear(2, 2), backend="eager")  # modules are compiled as before
assert type(module).__name__ == "OptimizedModule"
print("ok")
"""
    proc = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr[-3000:]
