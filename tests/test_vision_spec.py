"""A Qwen2.5-VL checkpoint read without a process group: its spec, its tower's parameters (names, shapes, count)
against transformers' module, the mrope positions against transformers' ``get_rope_index``, the planner's count."""

import json

import pytest
import torch

from controller.planner.memory import stage_state, weight_bytes
from hybridengine.model.catalogue import lookup
from hybridengine.model.spec import ModelConfigError, ModelSpec
from hybridengine.model.vision_catalogue import vision_shapes
from tiny_models import make_qwen2_5_vl, make_vl_rl_batch
from workers.megatron.mrope import batch_mrope_positions, mrope_positions
from workers.megatron.vision_tower import image_token_mask, row_grids, scatter_image_embeddings


@pytest.fixture(scope="module")
def vl_dir(tmp_path_factory):
    return make_qwen2_5_vl(tmp_path_factory.mktemp("vl"))


@pytest.fixture(scope="module")
def hf(vl_dir):
    from transformers import Qwen2_5_VLForConditionalGeneration

    return Qwen2_5_VLForConditionalGeneration.from_pretrained(vl_dir, dtype=torch.float32).eval()


def test_the_language_model_is_read_from_text_config_and_the_tower_from_vision_config(vl_dir):
    spec = ModelSpec.from_pretrained(vl_dir)
    assert spec.is_multimodal and spec.qkv_bias and not spec.tie_word_embeddings
    assert (spec.hidden_size, spec.num_layers, spec.num_query_groups, spec.head_dim) == (128, 2, 2, 32)
    assert spec.mrope_section == (4, 6, 6) and spec.rope_theta == 1e6 and spec.norm_epsilon == 1e-5
    assert spec.vision.image_tokens((1, 8, 6)) == 12 and spec.vision.patch_features == 3 * 2 * 14 * 14
    spec.check_layout(2, 1)
    with pytest.raises(ModelConfigError, match="pipeline_parallel 2: a vision-language model .* split it with "
                                               "tensor_parallel instead"):
        spec.check_layout(1, 2)
    config = json.loads((vl_dir / "config.json").read_text())
    config["text_config"]["rope_parameters"]["mrope_section"] = [4, 6, 4]
    with pytest.raises(ModelConfigError, match=r"mrope_section \[4, 6, 4\] must be three sizes that sum to head_dim "
                                               r"/ 2 = 16"):
        ModelSpec.from_hf_config(config)
    del config["image_token_id"]
    with pytest.raises(ModelConfigError, match="needs 'image_token_id'"):
        ModelSpec.from_hf_config(config)


def test_the_towers_parameters_are_transformers_own_and_map_to_its_checkpoint_names(vl_dir, hf):
    spec = ModelSpec.from_pretrained(vl_dir)
    theirs = {name: tuple(p.shape) for name, p in hf.model.visual.named_parameters()}
    assert vision_shapes(spec) == theirs and list(vision_shapes(spec)) == list(theirs)  # the module's order too
    assert spec.vision.parameter_count == sum(p.numel() for p in hf.model.visual.parameters())
    param = lookup("vision_model.blocks.1.attn.qkv.weight", spec, 0, 1, tp=2)
    assert (param.hf_names, param.shape, str(param.kind)) == (("visual.blocks.1.attn.qkv.weight",), (192, 64),
                                                              "replicated")
    with pytest.raises(KeyError, match="not a parameter of the vision tower"):
        lookup("vision_model.blocks.7.attn.qkv.weight", spec, 0, 1)


def test_the_planner_counts_the_tower_frozen_or_trained(vl_dir):
    spec = ModelSpec.from_pretrained(vl_dir)
    text = ModelSpec.from_hf_config({**json.loads((vl_dir / "config.json").read_text()),
                                     "architectures": ["Qwen2ForCausalLM"],
                                     **json.loads((vl_dir / "config.json").read_text())["text_config"]})
    tower = spec.vision.parameter_count
    assert weight_bytes(spec, 2, 1, "bf16") == weight_bytes(text, 2, 1, "bf16") + 2 * tower
    frozen = stage_state(spec, 2, 1, 0, 1, 0, "fp32", True)
    trained = stage_state(spec, 2, 1, 0, 1, 0, "fp32", True, train_vision=True)
    plain = stage_state(text, 2, 1, 0, 1, 0, "fp32", True)
    assert frozen.weights == plain.weights + 4 * tower and frozen.gradients == plain.gradients
    assert trained.gradients == plain.gradients + 4 * tower and trained.optimizer > frozen.optimizer


def test_mrope_positions_are_transformers_get_rope_index(vl_dir, hf):
    spec = ModelSpec.from_pretrained(vl_dir)
    batch = make_vl_rl_batch(vl_dir)
    ids, mask = batch.batch["input_ids"], batch.batch["attention_mask"]
    inputs = list(batch.non_tensor_batch["multi_modal_inputs"])
    grids = torch.cat([r["image_grid_thw"] for r in inputs if r is not None])
    theirs, _ = hf.model.get_rope_index(ids, mm_token_type_ids=(ids == spec.vision.image_token_id).int(),
                                        image_grid_thw=grids, attention_mask=mask)
    for row, row_grid in enumerate(row_grids(inputs)):
        real = mask[row].bool()
        assert torch.equal(mrope_positions(ids[row][real], row_grid, spec.vision), theirs[:, row][:, real])
    # a micro-batch's rows left-aligned: each row's real tokens first, the padding after counting on
    lengths = mask.sum(-1).tolist()
    aligned = torch.stack([torch.cat([ids[r][mask[r].bool()], ids.new_zeros(ids.shape[1] - n)])
                           for r, n in enumerate(lengths)])
    together = batch_mrope_positions(aligned, lengths, row_grids(inputs), spec.vision)
    for row, n in enumerate(lengths):
        assert torch.equal(together[:, row, :n], theirs[:, row][:, mask[row].bool()])
    with pytest.raises(ValueError, match="holds 4 image tokens, its 1 images stand for 12"):
        mrope_positions(ids[0][mask[0].bool()], [(1, 8, 6)], spec.vision)
    # an image token sampled after the prompt is text: it counts on as one
    row = torch.cat([ids[0][mask[0].bool()], torch.tensor([spec.vision.image_token_id, 7])])
    positions = mrope_positions(row, [(1, 4, 4)], spec.vision)
    assert positions[:, -2:].tolist() == [[positions[0, -3] + 1, positions[0, -3] + 2]] * 3


def test_image_embeddings_replace_the_image_tokens_row_by_row():
    ids = torch.tensor([[5, 9, 9, 6, 9], [9, 7, 0, 0, 0]])  # row 0 sampled an image token at its end: text
    mask = image_token_mask(ids, [2, 1], image_token_id=9)
    assert mask.tolist() == [[False, True, True, False, False], [True, False, False, False, False]]
    embeddings = torch.zeros(5, 2, 3)  # megatron's [S, B, H]
    features = torch.arange(9.0).reshape(3, 3)
    out = scatter_image_embeddings(embeddings, mask, features)
    assert torch.equal(out[1, 0], features[0]) and torch.equal(out[2, 0], features[1])
    assert torch.equal(out[0, 1], features[2]) and out[0, 0].abs().sum() == 0 and out[4, 0].abs().sum() == 0
    with pytest.raises(ValueError, match="holds 3 image tokens and its images make 2 embeddings"):
        scatter_image_embeddings(embeddings, mask, features[:2])
