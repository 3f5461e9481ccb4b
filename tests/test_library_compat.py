"""Each library's compat module (torch, megatron-core, vLLM, Ray): its registry, its version check at load, and a
clear error when a private name it needs is gone. Fakes stand in for the libraries' modules: nothing here imports
megatron-core, vLLM or Ray."""

import importlib.util
import sys
import types
import warnings
from types import SimpleNamespace

import pytest
import torch

from controller.runtime import ray_compat
from hybridengine import compat
from hybridengine.compat import CompatError, CompatWarning
from hybridengine.device import torch_compat
from workers.megatron import megatron_compat
from workers.rollout import vllm_compat

SHIMS = {
    "torch": (torch_compat, "TORCH"),
    "megatron": (megatron_compat, "MEGATRON"),
    "vllm": (vllm_compat, "VLLM"),
    "ray": (ray_compat, "RAY"),
}


@pytest.fixture(autouse=True)
def no_earlier_warnings(monkeypatch):
    monkeypatch.setattr(compat, "_warned", set())


def compat_warnings(caught):
    return [w for w in caught if issubclass(w.category, CompatWarning)]


@pytest.mark.parametrize("library", SHIMS)
def test_every_patch_has_its_why_and_when_line_and_a_function_whose_docstring_shows_it(library):
    module, name = SHIMS[library]
    shim = getattr(module, name)
    assert shim.patches
    for patch in shim.patches.values():
        assert patch.why.strip() and patch.remove_when.strip(), patch.name
        assert "\n" not in patch.why + patch.remove_when, patch.name
        function = shim.applied_by[patch.name]  # KeyError: a registered patch no function applies
        owner, _, qualname = function.rpartition(".")
        assert owner == module.__name__
        assert patch.line() in getattr(module, qualname).__doc__


@pytest.mark.parametrize("library", SHIMS)
def test_the_installed_version_is_one_the_patches_were_written_for(library):
    module, name = SHIMS[library]
    shim = getattr(module, name)
    assert shim.version_checked  # at load
    version = shim.installed_version()
    if version is None:
        pytest.skip(f"{shim.library} is not installed")
    assert shim.is_written_for(version), f"{shim.library} {version}: written for {shim.written_for}"
    with warnings.catch_warnings():
        warnings.simplefilter("error", CompatWarning)
        assert shim.check_version()


def load_copy(module):
    """A fresh copy of ``module``, executed as at its first import (the real module is left as it is)."""
    spec = importlib.util.spec_from_file_location(f"compat_probe_{module.__name__.replace('.', '_')}", module.__file__)
    copy = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(copy)
    return copy


@pytest.mark.parametrize("library", SHIMS)
def test_an_unknown_version_warns_once_at_load_naming_the_patches_and_both_versions(library, monkeypatch):
    module, name = SHIMS[library]
    shim = getattr(module, name)
    monkeypatch.setattr(compat, "distribution_version", lambda names: "99.1.0")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        copy = load_copy(module)
        assert getattr(copy, name).check_version() is False
    (warning,) = compat_warnings(caught)
    text = str(warning.message)
    assert f"{shim.library} 99.1.0 is installed" in text
    assert f"written for {shim.library} {shim.describe_written_for()}" in text
    for patch in shim.patches:
        assert patch in text


# ---------------------------------------------------------------- a private name gone, per library
def test_torch_without_its_dispatch_key_query(monkeypatch):
    assert torch_compat.has_kernel_for("aten::add.Tensor", "CPU") is True
    monkeypatch.delattr(torch._C, "_dispatch_has_kernel_for_dispatch_key")
    with pytest.raises(CompatError, match=r"torch patch 'dispatch_key_query' needs "
                                          r"torch\._C\._dispatch_has_kernel_for_dispatch_key, which is missing"):
        torch_compat.has_kernel_for("aten::add.Tensor", "CPU")


def test_torch_without_del_library_skips_the_exit_speed_up_with_one_warning(monkeypatch):
    monkeypatch.setitem(sys.modules, "torch.library", types.ModuleType("torch.library"))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch_compat.skip_operator_unregistering()
        torch_compat.skip_operator_unregistering()
    (warning,) = compat_warnings(caught)
    assert "torch patch 'operator_library_finalizers' skipped: torch.library._del_library is missing" in str(warning.message)


def fake_module(monkeypatch, name, **attributes):
    module = types.ModuleType(name)
    module.__dict__.update(attributes)
    monkeypatch.setitem(sys.modules, name, module)
    return module


def test_megatron_scratch_buffer(monkeypatch):
    made = []
    state = fake_module(monkeypatch, "megatron.core.parallel_state", _GLOBAL_MEMORY_BUFFER=None)
    state._set_global_memory_buffer = lambda: made.append(setattr(state, "_GLOBAL_MEMORY_BUFFER", "buffer"))
    megatron_compat.ensure_scratch_buffer()
    megatron_compat.ensure_scratch_buffer()
    assert made == [None] and state._GLOBAL_MEMORY_BUFFER == "buffer"  # set once

    fake_module(monkeypatch, "megatron.core.parallel_state")
    with pytest.raises(CompatError) as error:
        megatron_compat.ensure_scratch_buffer()
    text = str(error.value)
    assert "megatron-core patch 'scratch_buffer' needs megatron.core.parallel_state._GLOBAL_MEMORY_BUFFER" in text
    assert f"written for megatron-core {megatron_compat.MEGATRON.describe_written_for()}" in text


def test_megatron_optimizer_without_its_inner_optimizer():
    with pytest.raises(CompatError, match=r"'fused_cpu_adam' needs types\.SimpleNamespace instance\.optimizer"):
        megatron_compat.fuse_cpu_adam(SimpleNamespace(chained_optimizers=[SimpleNamespace()]))
    with pytest.raises(CompatError, match=r"'synchronize_steps' needs .*\._synchronize_steps"):
        megatron_compat.synchronize_chained_steps(SimpleNamespace(chained_optimizers=[]))


def test_vllm_group_permutation(monkeypatch):
    def init_model_parallel_group(group_ranks, local_rank, backend):
        return group_ranks, local_rank, backend

    state = fake_module(monkeypatch, "vllm.distributed.parallel_state", init_model_parallel_group=init_model_parallel_group)
    with vllm_compat.permuted_groups([0, 2, 1, 3]):
        assert state.init_model_parallel_group([[0, 1], [2, 3]], 0, "gloo") == ([[0, 2], [1, 3]], 0, "gloo")
    assert state.init_model_parallel_group is init_model_parallel_group

    fake_module(monkeypatch, "vllm.distributed.parallel_state")
    with pytest.raises(CompatError, match=r"vLLM patch 'permuted_groups' needs "
                                          r"vllm\.distributed\.parallel_state\.init_model_parallel_group"):
        with vllm_compat.permuted_groups([0, 1]):
            pass


def test_vllm_without_its_shared_memory_naming_skips_it_with_one_warning(monkeypatch):
    fake_module(monkeypatch, "vllm.distributed.device_communicators.cpu_communicator")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):
            with vllm_compat.shm_group_names(lambda name: "token" + name):
                pass
    (warning,) = compat_warnings(caught)
    assert "vLLM patch 'shm_group_names' skipped" in str(warning.message)
    assert "cpu_communicator._CPUSHMDistributed is missing" in str(warning.message)


def test_vllm_engine_without_its_engine_core():
    with pytest.raises(CompatError, match=r"vLLM patch 'engine_shutdown' needs .*\.engine_core"):
        vllm_compat.shutdown_engine(SimpleNamespace(llm_engine=SimpleNamespace()))


def test_ray_actor_handle_without_its_id():
    assert ray_compat.actor_id_hex(SimpleNamespace(_actor_id=bytes.fromhex("ab01"))) == "ab01"
    with pytest.raises(CompatError, match=r"ray patch 'actor_handle_id' needs builtins\.object instance\._actor_id, "
                                          r"which is missing"):
        ray_compat.actor_id_hex(object())
