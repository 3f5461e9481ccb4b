"""Engines are checked and planned by their traits, never their names: an engine registered by a user gets what
it declares (no process, no engine built)."""

from pathlib import Path

import pytest

from workers.rollout import generator as registry
from workers.rollout.config import RolloutConfig
from workers.rollout.generator import GeneratorTraits, generator_traits, register_generator

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def engines(monkeypatch):
    """The registry, restored after the test."""
    monkeypatch.setattr(registry, "_ENGINES", dict(registry._ENGINES))
    monkeypatch.setattr(registry, "_TRAITS", dict(registry._TRAITS))


def test_a_registered_engine_is_checked_by_what_it_declares(engines):
    register_generator("streamer", "my_pkg.engine:Streamer",
                       GeneratorTraits(serves_requests=True, adapter_ranks=(8, 16)))
    RolloutConfig(engine="streamer", server=True, lora_sync="adapter")  # it serves requests and adapters
    with pytest.raises(ValueError, match="the streamer engine runs pipeline_parallel=1 only, got 2"):
        RolloutConfig(engine="streamer", pipeline_parallel=2)
    register_generator("batcher", "my_pkg.engine:Batcher")  # no traits: the least an engine offers
    assert generator_traits("batcher") == GeneratorTraits()
    with pytest.raises(ValueError) as refused:
        RolloutConfig(engine="batcher", server=True, lora_sync="adapter")
    assert "server: true serves requests one by one" in str(refused.value)
    assert "the 'batcher' engine takes them merged" in str(refused.value)
    with pytest.raises(ValueError, match="traits must be a GeneratorTraits, got dict"):
        register_generator("odd", "my_pkg.engine:Odd", {"serves_requests": True})
    with pytest.raises(ValueError, match=r"rollout engine 'nope' is not one of \('vllm', 'megatron'"):
        generator_traits("nope")


def test_the_planner_reads_the_traits(engines):
    """LoRA modes come from the adapter ranks an engine serves; the built-in engines keep their behaviour."""
    import dataclasses

    from controller.planner.workload import Workload

    register_generator("streamer", "my_pkg.engine:Streamer", GeneratorTraits(adapter_ranks=(8, 16)))
    work = Workload(8, 8, 8, (), generation_engine="streamer", lora_rank=16, lora_sync="auto")
    assert work.lora_modes() == ("merge", "adapter")
    assert dataclasses.replace(work, lora_rank=32).lora_modes() == ("merge",)  # past its largest rank
    assert dataclasses.replace(work, generation_engine="megatron").lora_modes() == ("merge",)
    assert dataclasses.replace(work, generation_engine="vllm", lora_rank=512).lora_modes() == ("merge", "adapter")
    assert generator_traits("vllm").adapter_rank_for(9) == 16 and generator_traits("vllm").adapter_rank_for(513) is None


def test_no_engine_name_is_compared_outside_the_engines_own_files():
    """The config checks, the planner and the weight plan ask traits; only the engines' own files (and the
    registry that names them) spell an engine's name in a comparison."""
    import re

    pattern = re.compile(r"""[!=]=\s*["'](vllm|megatron)["']|["'](vllm|megatron)["']\s*[!=]=""")
    found = []
    for folder in ("controller", "workers", "hybridengine", "hybridflow", "tools"):
        for path in (ROOT / folder).rglob("*.py"):
            relative = path.relative_to(ROOT).as_posix()
            if relative.startswith(("workers/rollout/vllm_", "workers/rollout/megatron_")):
                continue
            found += [f"{relative}:{n}" for n, line in enumerate(path.read_text().splitlines(), 1)
                      if pattern.search(line)]
    assert found == []
