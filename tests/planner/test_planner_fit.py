"""The host-cost fit (planner.fit) against least squares written out another way, and the costs in the model."""

import math

import numpy as np
import pytest

from controller.planner.fit import Sample, fit_costs, predict
from controller.planner.hardware import Accelerator
from controller.planner.timing import HOST_COSTS, Efficiency, Link, PassShape, forward_time, generation_time, train_time
from hybridengine.model.spec import ModelSpec

NAMES = ("a", "b", "c")


def test_exact_samples_give_back_the_costs_that_made_them():
    rng = np.random.default_rng(0)
    truth = {"a": 0.02, "b": 0.0015, "c": 0.3}
    samples = []
    for i in range(12):
        counts = {n: float(rng.integers(0, 40)) for n in NAMES}
        base = float(rng.uniform(0.01, 2.0))
        samples.append(Sample(f"s{i}", base + sum(truth[n] * counts[n] for n in NAMES), base, counts))
    fitted = fit_costs(samples, NAMES)
    assert fitted == pytest.approx(truth, rel=1e-9)
    assert all(predict(s, fitted) == pytest.approx(s.measured, rel=1e-9) for s in samples)


def test_a_cost_the_data_would_make_negative_is_held_at_zero():
    # Unconstrained least squares puts "a" below zero (measured times shrink as its count grows).
    samples = [Sample("x", 1.0, 0.5, {"a": 1.0, "b": 1.0}), Sample("y", 1.2, 0.5, {"a": 3.0, "b": 2.0}),
               Sample("z", 0.9, 0.5, {"a": 5.0, "b": 1.0})]
    w = np.array([1 / s.measured for s in samples])
    full, *_ = np.linalg.lstsq(np.array([[s.counts["a"], s.counts["b"]] for s in samples]) * w[:, None],
                               np.array([s.measured - s.base for s in samples]) * w, rcond=None)
    assert full[0] < 0  # the case this test is about
    fitted = fit_costs(samples, ("a", "b"))
    # With a = 0, weighted least squares in b alone: b = sum(w^2 x y) / sum(w^2 x^2).
    x = np.array([s.counts["b"] for s in samples])
    y = np.array([s.measured - s.base for s in samples])
    assert fitted["a"] == 0.0
    assert fitted["b"] == pytest.approx(float((w**2 * x * y).sum() / (w**2 * x * x).sum()), rel=1e-12)


def test_bad_samples_are_refused_naming_them():
    with pytest.raises(ValueError, match="at least one"):
        fit_costs([], NAMES)
    with pytest.raises(ValueError, match=r"> 0 s; not so for \['late'\]"):
        fit_costs([Sample("late", 0.0, 0.1, {"a": 1.0})], NAMES)


def test_each_host_cost_adds_its_count_of_events_to_a_phase():
    spec = ModelSpec.from_hf_config({"architectures": ["LlamaForCausalLM"], "vocab_size": 256, "hidden_size": 64,
                                     "intermediate_size": 128, "num_hidden_layers": 4, "num_attention_heads": 4,
                                     "num_key_value_heads": 2, "max_position_embeddings": 256, "rms_norm_eps": 1e-6})
    device = Accelerator("toy", 1 << 30, 1e12, 1e11, 1e10, 1e9, "test", reserved_bytes=0)
    link = Link(1e10, 1e-5)
    shape = PassShape(sequences=16, seq_len=32, micro_batch=2)  # DP 2: 8 sequences a rank, 4 micro-batches
    zero = Efficiency()
    for name in HOST_COSTS:
        assert getattr(zero, name) == 0.0

    def grows(fn, **cost):
        return fn(Efficiency(**cost)) - fn(zero)

    forward = lambda e: forward_time(spec, 1, 1, 2, shape, device, "fp32", link, e)  # noqa: E731
    assert grows(forward, call_s=0.5) == pytest.approx(0.5)
    assert grows(forward, micro_batch_layer_s=1.0) == pytest.approx(4 * 4)  # micro-batches x layers
    # PP 2: each stage's 2 layers, stretched by the 1F1B bubble (PP - 1) / micro-batches
    forward_pp = lambda e: forward_time(spec, 1, 2, 1, shape, device, "fp32", link, e)  # noqa: E731
    assert grows(forward_pp, micro_batch_layer_s=1.0) == pytest.approx(8 * 2 * (1 + 1 / 8))
    # Training: 2 optimizer steps of 8 sequences (2 micro-batches a rank each), 3 passes, one call.
    train = lambda e: train_time(spec, 1, 1, 2, shape, 2, device, "fp32", link, link, e)  # noqa: E731
    assert grows(train, micro_batch_layer_s=1.0) == pytest.approx(2 * 2 * 4 * 3)
    assert grows(train, call_s=1.0) == pytest.approx(1.0)
    assert grows(train, optimizer_step_s=1.0) == pytest.approx(2.0)
    # Generation: 2 waves (16 sequences, 2 replicas, 4 at once) of 10 decode steps.
    generate = lambda e: generation_time(spec, 1, 2, 16, 8, 10, 4, device, link, e)  # noqa: E731
    assert grows(generate, decode_step_s=1.0) == pytest.approx(2 * 10)
    assert grows(generate, call_s=1.0) == pytest.approx(1.0)
    assert not math.isnan(generate(zero))
