"""Each bad training input fails before any process group forms, with one clear message."""

import json

import pytest

from tiny_models import make_llama
from workers.megatron.config import EngineConfig, OptimConfig
from workers.megatron.hf_checkpoint import CheckpointError
from hybridengine.model.spec import ModelConfigError
from workers.megatron.preflight import check_training_setup, mini_batch_plan


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return make_llama(tmp_path_factory.mktemp("model"))  # 4 heads, 2 KV groups, FFN 256, vocab 256, 4 layers


def test_a_good_setup_passes(model):
    spec, layout, _ = check_training_setup(str(model), EngineConfig(tensor_parallel=2, micro_batch_size=2), 4, 8, 4)
    assert str(layout) == "TP2xPP1xDP2" and spec.num_layers == 4


@pytest.mark.parametrize(
    "engine,world,message",
    [
        (EngineConfig(tensor_parallel=3), 3, "tensor_parallel 3 does not divide the attention heads 4"),
        (EngineConfig(tensor_parallel=4), 4, r"does not divide the key/value heads \(query groups\) 2; TP sizes .*: \[1, 2\]"),
        (EngineConfig(pipeline_parallel=3), 3, r"pipeline_parallel 3 does not divide the 4 layers; valid PP sizes: \[1, 2, 4\]"),
        (EngineConfig(tensor_parallel=2), 3, r"world size 3 is not divisible by tensor_parallel \* pipeline_parallel = 2 \* 1 = 2"),
    ],
)
def test_layouts_that_cannot_work(model, engine, world, message):
    with pytest.raises((ModelConfigError, ValueError), match=message):
        check_training_setup(str(model), engine, world)


def test_ffn_and_vocab_that_tp_does_not_divide(tmp_path):
    for key, value, message in (("intermediate_size", 255, "FFN hidden size 255"), ("vocab_size", 255, "vocab size 255")):
        path = make_llama(tmp_path / key)
        config = json.loads((path / "config.json").read_text())
        config[key] = value
        (path / "config.json").write_text(json.dumps(config))
        # Unpadded (as before vocabulary padding, now the default, existed): TP must divide the vocabulary.
        with pytest.raises(ModelConfigError, match=f"tensor_parallel 2 does not divide the {message}"):
            check_training_setup(str(path), EngineConfig(tensor_parallel=2, make_vocab_size_divisible_by=None), 2)


def test_unsupported_architecture(model, tmp_path):
    path = make_llama(tmp_path / "m")
    config = json.loads((path / "config.json").read_text())
    config["architectures"] = ["GPTNeoXForCausalLM"]
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelConfigError, match=r"architecture \['GPTNeoXForCausalLM'\] is not supported; supported: \["):
        check_training_setup(str(path), EngineConfig(), 1)


def test_missing_and_truncated_safetensors(tmp_path):
    path = make_llama(tmp_path / "m")
    weights = path / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) - 1000])
    with pytest.raises(CheckpointError, match=r"model.safetensors is truncated: its header describes \d+ bytes, the file has \d+"):
        check_training_setup(str(path), EngineConfig(), 1)
    weights.write_bytes(data[:4])
    with pytest.raises(CheckpointError, match="not even a safetensors header"):
        check_training_setup(str(path), EngineConfig(), 1)
    weights.unlink()
    with pytest.raises(CheckpointError, match="has no model.safetensors or model.safetensors.index.json"):
        check_training_setup(str(path), EngineConfig(), 1)


def test_missing_shard_named_in_the_index(tmp_path):
    path = make_llama(tmp_path / "m")
    (path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"lm_head.weight": "model-00002-of-00002.safetensors"}}))
    with pytest.raises(CheckpointError, match="model-00002-of-00002.safetensors is listed in model.safetensors.index.json but missing"):
        check_training_setup(str(path), EngineConfig(), 1)


@pytest.mark.parametrize(
    "batch,mini,dp,micro,message",
    [
        (10, 4, 1, 1, "batch of 10 sequences does not divide into PPO mini-batches of 4"),
        (12, 6, 4, 1, "ppo_mini_batch_size 6 does not divide over 4 data-parallel ranks"),
        (16, 8, 2, 3, "gives each DP rank 4 sequences, not a multiple of micro_batch_size 3"),
    ],
)
def test_batch_sizes_that_do_not_split(batch, mini, dp, micro, message):
    with pytest.raises(ValueError, match=message):
        mini_batch_plan(batch, mini, dp, micro)


def test_bad_engine_and_optimizer_settings():
    with pytest.raises(ValueError, match="micro_batch_size must be a positive integer, got 0"):
        EngineConfig(micro_batch_size=0)
    with pytest.raises(ValueError, match="lr_decay_style 'step' is not one of"):
        OptimConfig(lr_decay_style="step")
    with pytest.raises(ValueError, match=r"lr_decay_steps \(5\) must exceed lr_warmup_steps \(10\)"):
        OptimConfig(lr_warmup_steps=10, lr_decay_steps=5)


def test_roles_refuse_the_wrong_kind_of_checkpoint(model, tmp_path):
    from workers.actor import Actor
    from workers.critic import Critic

    with pytest.raises(ValueError, match="Critic needs a sequence-classification checkpoint with a value head; .* LlamaForCausalLM"):
        Critic(str(model))
    critic_dir = make_llama(tmp_path / "critic", classification=True)
    with pytest.raises(ValueError, match="Actor needs a causal LM checkpoint; .* LlamaForSequenceClassification"):
        Actor(str(critic_dir))
