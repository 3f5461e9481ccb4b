"""The algorithms past the first five whose paths differ, two steps each through the real CLI.

(test_train_cli.py runs the first five (PPO, GRPO, RLOO, ReMax, REINFORCE++) end to end, over both
launchers and both rollout engines and at the demo's TP2 x PP2, PPO there with sequence-level TIS on
the recompute path; here three later ones run two steps each under torchrun: DAPO (extra generation
rounds, the overlong penalty), GSPO-token (the sequence-level loss with masked IS on the update's own
forward) and CISPO (its own loss, TIS on the recompute path). CISPO generates with vLLM; the others
with the megatron rollout, which starts in a fraction of vLLM's time. GSPO, Dr. GRPO and
REINFORCE++-baseline add no path of their own to these: GSPO is GSPO-token's loss family on the same
forward, and the other two are GRPO's path with another estimator, so they are checked where they
differ, as pure functions and in how ``algorithm.name`` resolves (test_algorithm_hooks). vLLM
generating several times on the same weights, as DAPO's rounds do, is
tests/rollout/test_rollout_engines.py's.)

The estimators, objectives and corrections are pure functions checked by hand elsewhere
(test_policy_losses, test_rollout_correction, test_advantages, test_algorithm_hooks); these runs show
that each one is reachable from ``algorithm.name`` and trains end to end: the actor's loss through the
megatron engine, DAPO's extra generation rounds through the rollout, the rollout correction on the
recompute path and on the update's own forward.
"""

import math

import pytest

from test_train_cli import TINY, hybridflow, model, read_metrics, third_party_lines  # noqa: F401  (model: a fixture)

ON_POLICY = ["ppo.ppo_epochs=1", "ppo.ppo_mini_batch_size=8"]  # 4 prompts x 2 samples: one mini-batch
RUNS = {
    # DAPO: 4 samples per prompt, up to 3 generation rounds, the overlong penalty over the last 2 tokens
    "dapo": ["rollout.sampling.n=4", "ppo.ppo_epochs=1", "ppo.ppo_mini_batch_size=16", "algorithm.max_gen_batches=3",
             "algorithm.overlong_buffer_len=2"],
    # GSPO-token with masked IS over whole sequences, on the update's own forward
    "gspo_token": ["rollout.sampling.n=2", *ON_POLICY, "algorithm.rollout_correction.mode=mis",
                   "algorithm.rollout_correction.level=sequence"],
    # CISPO over two epochs (a separate old-log-prob pass) with truncated IS per token; on LoRA adapters, so that
    # vLLM takes the merged linears alone after its first load
    "cispo": ["rollout.sampling.n=2", "ppo.ppo_epochs=2", "ppo.ppo_mini_batch_size=8",
              "algorithm.rollout_correction.mode=tis", "actor.lora.rank=4", "actor.optim.lr=1e-3"],
}
RECOMPUTED = {"cispo"}  # more than one optimizer step per batch
ON_VLLM = {"cispo"}  # the rest generate with megatron's engine, which starts in a fraction of vLLM's time


@pytest.mark.parametrize("algorithm", sorted(RUNS))
def test_the_algorithm_trains_two_steps_through_the_cli(tmp_path, model, algorithm, monkeypatch):  # noqa: F811
    # this machine as the planner sees it uncalibrated (nominal figures), whatever `plan --calibrate` wrote here
    monkeypatch.setenv("HYBRIDFLOW_CALIBRATION", str(tmp_path / "none.json"))
    proc = hybridflow("train", "--config", "examples/ppo_tiny.yaml", f"trainer.run_dir={tmp_path}", f"model_path={model}",
                      "trainer.launcher=torchrun", f"algorithm.name={algorithm}",
                      f"rollout.engine={'vllm' if algorithm in ON_VLLM else 'megatron'}", *TINY,
                      "trainer.total_steps=2", "trainer.val_every=2", *RUNS[algorithm])
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-5000:]
    assert third_party_lines(proc.stdout) == [], proc.stdout[-3000:]
    steps = read_metrics(tmp_path)
    assert [s["step"] for s in steps] == [1, 2]
    for s in steps:
        assert math.isfinite(s["actor/pg_loss"]) and math.isfinite(s["actor/grad_norm"])
        assert "critic/vf_loss" not in s  # all critic-free
        # the rollout/train mismatch, reported on every step: bf16 engines agree closely on the sampled tokens
        assert abs(s["rollout_corr/kl_k1"]) < 0.05 and 0.0 <= s["rollout_corr/kl_k3"] < 0.05, s
        assert 0.9 < s["rollout_corr/ppl_ratio"] < 1.1 and s["rollout_corr/chi2"] > -1.0
    assert "val/reward/mean" in steps[-1]
    assert ("timing_s/old_log_prob" in steps[0]) == (algorithm in RECOMPUTED)
    if algorithm == "dapo":
        for s in steps:
            assert 1 <= s["dapo/gen_batches"] <= 3 and s["dapo/filtered_groups"] >= 0
            assert s["dapo/filled_groups"] <= 4 and -1.0 <= s["dapo/overlong_penalty/mean"] <= 0.0
            if s["dapo/filled_groups"] == 0:  # every kept group has a spread of rewards: non-zero advantages
                assert s["critic/advantages/max"] > 0
    if algorithm == "cispo":  # TIS on the recompute path: each weight in (0, cap 2]
        # rollout.lora_sync auto: on a CPU the planner merges (vLLM's CPU LoRA kernels generate 6.3x slower here)
        assert "rollout.lora_sync auto -> merge: " in proc.stderr, proc.stderr[-3000:]
        assert "vLLM's LoRA kernels add 530% to a generation" in proc.stderr
        # LoRA: vLLM loaded the whole model once, then the merged linears (all but embeddings and norms) alone
        assert 0 < steps[1]["weight_sync/bytes"] < 0.95 * steps[0]["weight_sync/bytes"]
        for s in steps:
            assert 0.0 < s["rollout_corr/weight_mean"] <= 2.0 and 0.0 <= s["rollout_corr/truncated_frac"] <= 1.0
            assert s["rollout_corr/masked_frac"] == 0.0
    if algorithm == "gspo_token":  # MIS per sequence: geometric-mean ratios near 1 fall inside [0.5, 2]
        for s in steps:
            assert s["rollout_corr/masked_frac"] == 0.0 and s["rollout_corr/weight_mean"] == pytest.approx(1.0)


def test_a_users_algorithm_with_a_typed_setting_of_its_own_trains_through_the_cli(tmp_path, model):  # noqa: F811
    """my_algos:ScaledGRPO, one file outside the project, with ``algorithm.advantage_scale=0.5`` (its nested
    Config): the advantages the update trained on (the rollout dump) are half of GRPO's, computed here by hand
    from the dumped scores and groups; a wrong type for the setting is refused before any process starts."""
    import json

    import numpy as np

    from test_algorithm_hooks import write_scaled_grpo

    write_scaled_grpo(tmp_path)
    run = ["--config", "examples/ppo_tiny.yaml", f"model_path={model}", "trainer.launcher=torchrun",
           "rollout.engine=megatron", *TINY, "trainer.val_every=0", "algorithm.name=my_algos:ScaledGRPO",
           "rollout.sampling.n=2", *ON_POLICY]
    proc = hybridflow("train", *run, f"trainer.run_dir={tmp_path / 'run'}", "algorithm.advantage_scale=bad",
                      pythonpath=(str(tmp_path),))
    assert proc.returncode == 2 and "algorithm.advantage_scale: expected a number, got 'bad'" in proc.stderr
    assert not (tmp_path / "run" / "metrics.jsonl").exists()
    dump = tmp_path / "samples"
    proc = hybridflow("train", *run, f"trainer.run_dir={tmp_path / 'run'}", "algorithm.advantage_scale=0.5",
                      f"trainer.rollout_data_dir={dump}", pythonpath=(str(tmp_path),))
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-5000:]
    rows = [json.loads(line) for line in (dump / "1.jsonl").read_text().splitlines()]
    groups: dict[str, list[float]] = {}
    for row in rows:
        groups.setdefault(row["uid"], []).append(row["score"])
    for row in rows:
        scores = np.array(groups[row["uid"]])
        grpo = (row["score"] - scores.mean()) / (scores.std(ddof=1) + 1e-6)  # GRPO's, by hand
        tokens = [a for a, m in zip(row["advantages"], row["response_mask"]) if m]
        assert tokens and np.allclose(tokens, 0.5 * grpo, atol=1e-5), (row["uid"], tokens, grpo)
    assert any(len(set(scores)) > 1 for scores in groups.values())  # some group's rewards differ: advantages != 0
