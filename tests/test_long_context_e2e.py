"""Context parallelism and packed sequences through the real CLI (`hybridflow train`), on the built-in tiny model.

GRPO for 2 steps in fp32 on 2 processes, two ways: data-parallel (DP2, the reference), and each sequence split
over two context-parallel ranks with packed micro-batches (CP2 and ``pack_sequences``: the actor and its reference
policy see every row back to back, each rank a half of every sequence; CP2 on padded rows and packing at CP1 are
held to HF by tests/megatron/test_actor_parity.py). Generation is the same vLLM layout in both (to the weights CP
ranks are data-parallel ranks), so the samples are the same and every training metric must agree within 1e-5.
"""

import pytest

from test_train_cli import ALGORITHMS, TINY, hybridflow, read_metrics

GRPO_FP32 = ["--config", "examples/ppo_tiny.yaml", "trainer.launcher=torchrun", "algorithm.name=grpo",
             "rollout.engine=vllm", *TINY, *ALGORITHMS["grpo"], "trainer.nproc=2", "actor.engine.precision=fp32",
             "trainer.total_steps=2", "trainer.val_every=2", "ppo.use_kl_loss=true", "ppo.kl_loss_coef=0.1"]
# what a layout may change: how long it took, and how much padding its micro-batches paid
LAYOUT_METRICS = ("timing_s", "perf/", "memory/", "rollout/tokens_per_s", "actor/padding_fraction_after")


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> str:
    from controller.models.builtin import resolve_model_path

    return resolve_model_path("builtin:tiny-arithmetic", tmp_path_factory.mktemp("model"))


@pytest.fixture(scope="module")
def runs(tmp_path_factory, model) -> dict[str, list[dict]]:
    """name -> the run's metrics per step: dp2 and cp2_packed."""
    out = {}
    for name, extra in (("dp2", []),
                        ("cp2_packed", ["actor.engine.context_parallel=2", "actor.engine.pack_sequences=true"])):
        run_dir = tmp_path_factory.mktemp(name)
        proc = hybridflow("train", *GRPO_FP32, *extra, f"trainer.run_dir={run_dir}", f"model_path={model}")
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-5000:]
        out[name] = read_metrics(run_dir)
    return out


def test_a_context_parallel_packed_run_trains_as_the_data_parallel_run(runs):
    ours, reference = runs["cp2_packed"], runs["dp2"]
    assert [m["step"] for m in ours] == [m["step"] for m in reference] == [1, 2]
    compared = 0
    for got, expected in zip(ours, reference):
        for key, value in expected.items():
            if not isinstance(value, (int, float)) or key.startswith(LAYOUT_METRICS) or key not in got:
                continue
            assert got[key] == pytest.approx(value, abs=1e-5, rel=1e-5), (key, got[key], value)
            compared += 1
    assert {"actor/pg_loss", "actor/grad_norm", "actor/kl_loss", "actor/entropy"} <= set(reference[1])
    assert compared > 40
    # the second step trained on weights the first step's update changed: its log-probs agree with vLLM's
    assert ours[1]["rollout/logprob_diff_max"] < 1e-3
    # packed micro-batches pay no padding (what padded rows pay: the parity tests)
    assert ours[0]["actor/padding_fraction_after"] == 0.0
