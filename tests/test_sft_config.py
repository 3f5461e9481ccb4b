"""The SFT job's configuration and batches, with no process: every cross-field problem before launch, the
batch layout the actor's update reads, and a loader that resumes where it stopped."""

from pathlib import Path

import pytest
import torch

from controller.config import ConfigError, check_config, load_config
from controller.data.sft_batches import SFTLoader, collate_sft
from controller.data.sft_examples import SFTExample
from controller.sft.config import SFTConfig, check_sft_config, load_sft_config

EXAMPLE = Path(__file__).parent.parent / "examples" / "sft_tiny.yaml"


def test_the_example_loads_with_overrides_and_defaults_its_run_dir():
    config = load_sft_config(EXAMPLE, ["data.batch_size=8", "actor.optim.lr=1e-3"])
    assert config.data.batch_size == 8 and config.actor.optim.lr == 1e-3
    assert config.actor.engine.tensor_parallel == 2 and config.trainer.run_dir == "runs/sft_tiny"
    assert load_sft_config(None, ["trainer.total_steps=3"]).trainer.run_dir == "runs/sft"
    assert load_sft_config(None, []) == SFTConfig()
    check_sft_config(config)


def test_every_problem_is_listed_before_launch():
    config = load_sft_config(EXAMPLE, [
        "data.batch_size=6",  # 6 examples over 1 DP rank... with TP2 x PP2 on 4: DP 1, micro-batch 8 does not divide
        "trainer.mode=async", "data.format=chat", "trainer.val_every=5", "data.val_size=0", "data.max_length=1",
        "trainer.launcher=slurm", "data.train_files=[x.parquet]"])
    with pytest.raises(ConfigError) as err:
        check_sft_config(config)
    text = str(err.value)
    for expected in ("trainer.mode is a setting of RL training", "data.format 'chat' is not one of",
                     "trainer.val_every 5 needs validation examples", "data.max_length must be >= 2",
                     "trainer.launcher 'slurm' is not one of", "data.train_files / val_files are set but data.task",
                     "data: example file x.parquet does not exist",
                     "not a multiple of actor.engine.micro_batch_size 8"):
        assert expected in text, (expected, text)
    with pytest.raises(ConfigError, match="does not divide the 6 processes"):
        check_sft_config(load_sft_config(EXAMPLE, ["trainer.nproc=6"]))
    with pytest.raises(ConfigError, match=r"unknown key\(s\) \['lr_rate'\]"):
        load_sft_config(EXAMPLE, ["actor.optim.lr_rate=1"])


def test_a_model_that_cannot_take_the_layout_or_the_length_is_refused(tmp_path):
    from hybridengine.model.spec import ModelSpec
    from tiny_models import make_llama

    spec = ModelSpec.from_pretrained(make_llama(tmp_path / "m", heads=4, kv_heads=2))
    with pytest.raises(ConfigError, match="exceeds the model's max_position_embeddings"):
        check_sft_config(load_sft_config(EXAMPLE, [f"data.max_length={spec.max_position_embeddings + 1}"]), spec)
    with pytest.raises(ConfigError, match="actor: "):
        check_sft_config(load_sft_config(EXAMPLE, ["actor.engine.tensor_parallel=4", "actor.engine.pipeline_parallel=1"]),
                         spec)


def test_a_batch_has_the_rollout_layout_with_the_loss_mask_as_response_mask():
    a = SFTExample([5, 6], [7, 8, 2], [1, 0, 1])
    b = SFTExample([9], [10, 2], [1, 1])
    batch = collate_sft([a, b], pad_token_id=0).batch
    assert batch["input_ids"].tolist() == [[5, 6, 7, 8, 2], [0, 9, 10, 2, 0]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1, 1, 1], [0, 1, 1, 1, 0]]
    assert batch["position_ids"].tolist() == [[0, 1, 2, 3, 4], [0, 0, 1, 2, 2]]
    assert batch["responses"].tolist() == [[7, 8, 2], [10, 2, 0]]
    assert batch["response_mask"].tolist() == [[1, 0, 1], [1, 1, 0]]


def test_the_loader_resumes_exactly_and_reshuffles_every_epoch():
    examples = [SFTExample([i + 3], [i + 4, 2], [1, 1]) for i in range(10)]
    full = SFTLoader(examples, 4, 0, seed=3)
    seen = [full.next_batch().batch["input_ids"][:, 0].tolist() for _ in range(5)]
    assert len(set(sum(seen[:2], []))) == 8 and seen[:2] != seen[2:4]  # no repeat within an epoch; epochs differ
    stopped = SFTLoader(examples, 4, 0, seed=3)
    for _ in range(3):
        stopped.next_batch()
    resumed = SFTLoader(examples, 4, 0, seed=3)
    resumed.load_state_dict(stopped.state_dict())
    assert [resumed.next_batch().batch["input_ids"][:, 0].tolist() for _ in range(2)] == seen[3:]
    assert torch.equal(collate_sft(examples[:2], 0).batch["input_ids"], SFTLoader(examples, 2, 0, shuffle=False).next_batch().batch["input_ids"])
    with pytest.raises(ValueError, match="batch_size 11 must be between 1 and the 10 examples"):
        SFTLoader(examples, 11, 0)


def test_the_demo_starts_ppo_from_the_sft_export_on_the_same_task():
    """`make demo` is examples/sft_tiny.yaml, then examples/ppo_from_sft.yaml on its export."""
    root = EXAMPLE.parent.parent
    recipe = root.joinpath("Makefile").read_text().split("\ndemo: setup\n", 1)[1].split("\n\n", 1)[0].splitlines()
    assert [line.split()[1:4] for line in recipe] == [["sft", "--config", "examples/sft_tiny.yaml"],
                                                       ["train", "--config", "examples/ppo_from_sft.yaml"]]
    sft, rl = load_sft_config(EXAMPLE, []), load_config(root / "examples" / "ppo_from_sft.yaml", [])
    check_sft_config(sft)
    check_config(rl)
    assert rl.model_path == f"{sft.trainer.run_dir}/hf_actor"
    task = ("task", "max_operand", "operators", "seed", "val_size")
    assert [getattr(rl.data, k) for k in task] == [getattr(sft.data, k) for k in task] == ["arithmetic", 5, "+-*", 0, 64]
    # Exact answers only, greedy validation of the SFT model before the first step; PPO at TP2 x PP2 into vLLM.
    assert (rl.reward.fn, rl.trainer.val_before_train, rl.algorithm.name, rl.rollout.engine) == (
        "arithmetic_answer", True, "ppo", "vllm")
    assert [(r.engine.tensor_parallel, r.engine.pipeline_parallel) for r in (sft.actor, rl.actor, rl.critic)] == [(2, 2)] * 3
