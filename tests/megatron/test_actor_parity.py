"""The megatron actor at TP1, TP2, PP2, DP2 and TP2xPP2 (and with context parallelism and packed sequences) against
HF transformers in one process.

Each layout runs as a real torchrun job on CPU (gloo); the layouts on the same number of processes share one
launch, each with worker groups of its own. The reference is the
HF model in fp32 with a PPO loss written out here by hand; in fp32,
log-probs, entropy, the loss, the gradient norm and the weights after one
Adam step must agree to 1e-5; in bf16 within the tolerances stated there.
"""

import json

import pytest
import torch

from conftest import TESTS, run_torchrun
from state_checks import assert_activations_predicted, assert_state_predicted
from tiny_models import make_llama, make_qwen2_5_vl, make_qwen3, make_rl_batch, make_vl_rl_batch
from workers import DataProto

TEMPERATURE = 0.7
CLIP_LOW, CLIP_HIGH, CLIP_C, ENTROPY_COEFF, KL_COEF, LR = 0.2, 0.2, 3.0, 0.01, 0.1, 1e-3
# Adam's first step is about lr * sign(grad); with eps at 1e-8 an element whose
# gradient is ~1e-8 flips on rounding noise. A larger eps keeps the update a
# smooth function of the gradient, so 1e-5 agreement is meaningful.
ADAM_EPS = 1e-4


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_llama(tmp_path_factory.mktemp("tiny_llama"))


def hf_model(path):
    from transformers import AutoModelForCausalLM, Qwen2_5_VLForConditionalGeneration

    vision = "vision_config" in json.loads((path / "config.json").read_text())
    kind = Qwen2_5_VLForConditionalGeneration if vision else AutoModelForCausalLM
    return kind.from_pretrained(path, dtype=torch.float32, attn_implementation="eager")


def image_kwargs(model, batch: DataProto) -> dict:
    """A vision-language batch's images as transformers' model takes them (HF numbers the positions itself)."""
    rows = [r for r in batch.non_tensor_batch.get("multi_modal_inputs", []) if r is not None]
    if not rows:
        return {"position_ids": batch.batch["position_ids"]}
    ids = batch.batch["input_ids"]
    return {"pixel_values": torch.cat([r["pixel_values"] for r in rows]),
            "image_grid_thw": torch.cat([r["image_grid_thw"] for r in rows]),
            "mm_token_type_ids": (ids == model.config.image_token_id).int()}


def reference_log_probs(model, batch: DataProto):
    b = batch.batch
    logits = model(b["input_ids"], attention_mask=b["attention_mask"], **image_kwargs(model, batch)).logits
    length = b["responses"].shape[1]
    log_p = torch.log_softmax(logits[:, -length - 1 : -1].float() / TEMPERATURE, dim=-1)
    token_log_p = log_p.gather(-1, b["responses"].unsqueeze(-1)).squeeze(-1)
    entropy = -(log_p.exp() * log_p).sum(-1)
    return token_log_p, entropy


def aggregate(values, mask, mode):
    mask = mask.float()
    if mode == "token-mean":
        return (values * mask).sum() / mask.sum()
    if mode == "seq-mean-token-sum":
        return (values * mask).sum(-1).mean()
    return ((values * mask).sum(-1) / mask.sum(-1)).mean()


def hand_written_ppo_loss(log_p, entropy, old, ref, adv, mask, mode):
    ratio = torch.exp(log_p - old)
    surrogate = torch.maximum(-adv * ratio, -adv * ratio.clamp(1 - CLIP_LOW, 1 + CLIP_HIGH))
    surrogate = torch.where(adv < 0, torch.minimum(surrogate, -adv * CLIP_C), surrogate)
    kl = (torch.exp(ref - log_p) - (ref - log_p) - 1).clamp(-10, 10)
    pg = aggregate(surrogate, mask, mode)
    return pg - ENTROPY_COEFF * aggregate(entropy, mask, mode) + KL_COEF * aggregate(kl, mask, mode), pg


def make_inputs(model_dir):
    batch = make_vl_rl_batch(model_dir) if (model_dir / "preprocessor_config.json").is_file() else make_rl_batch()
    with torch.no_grad():
        log_p, _ = reference_log_probs(hf_model(model_dir), batch)
    g = torch.Generator().manual_seed(3)
    mask = batch.batch["response_mask"]
    train = DataProto({
        "old_log_probs": (log_p + 0.3 * torch.randn(log_p.shape, generator=g)) * mask,
        "ref_log_prob": (log_p + 0.2 * torch.randn(log_p.shape, generator=g)) * mask,
        "advantages": torch.randn(log_p.shape, generator=g) * mask,
    })
    return batch, train


def reference_step(model_dir, batch, train, mode, train_vision=False):
    model = hf_model(model_dir)
    if hasattr(model.model, "visual"):
        model.model.visual.requires_grad_(train_vision)
    log_p, entropy = reference_log_probs(model, batch)
    t, mask = train.batch, batch.batch["response_mask"]
    loss, pg = hand_written_ppo_loss(log_p, entropy, t["old_log_probs"], t["ref_log_prob"], t["advantages"], mask, mode)
    loss.backward()
    trained = [p for p in model.parameters() if p.requires_grad]
    grad_norm = torch.sqrt(sum((p.grad.double() ** 2).sum() for p in trained)).item()
    torch.nn.utils.clip_grad_norm_(trained, 1.0)
    torch.optim.Adam(trained, lr=LR, betas=(0.9, 0.999), eps=ADAM_EPS).step()
    masked = mask.bool()
    return {
        "log_probs": log_p.detach(), "entropy": entropy.detach(), "pg_loss": pg.item(), "grad_norm": grad_norm,
        "ppo_kl": (t["old_log_probs"] - log_p)[masked].mean().item(), "entropy_mean": entropy[masked].mean().item(),
        "state": {k: v.detach().clone() for k, v in model.state_dict().items()},
    }


# Each run: (model, tp, pp, processes, loss aggregation, the program's extra flags). The runs on the same number
# of processes share one launch (each its own worker groups on the same processes).
RUNS = {
    "TP1": ("llama", 1, 1, 1, "token-mean", ()),
    "TP2": ("llama", 2, 1, 2, "token-mean", ()),
    "PP2": ("llama", 1, 2, 2, "token-mean", ()),
    # Data parallelism: the sequence-mean run (DP2) and the distributed optimizer (TP2 x DP2, token-mean).
    "TP2xPP2": ("llama", 2, 2, 4, "token-mean", ()),
    "seq-mean-DP2": ("llama", 1, 1, 2, "seq-mean-token-sum", ()),
    # Also the unfused path: logits from megatron's output layer, then the vocab-parallel log-prob op.
    "dist-opt-TP2xDP2": ("llama", 2, 1, 4, "token-mean", ("--dist-opt", "--logits-output")),
    "qwen2-tied-PP2": ("qwen2", 1, 2, 2, "token-mean", ()),
    "bf16-TP2xDP2": ("llama", 2, 1, 4, "token-mean", ("--precision", "bf16", "--dist-opt")),
    # Qwen2.5-VL: images through the vision tower (frozen, or trained with the language model), mrope positions.
    "VL-TP1": ("vl", 1, 1, 1, "token-mean", ()),
    "VL-TP2": ("vl", 2, 1, 2, "token-mean", ()),
    # ... its rows grouped by a token budget (micro-batches of unequal rows, each with its own images)
    "VL-trained-tower-TP1": ("vl", 1, 1, 1, "token-mean", ("--train-vision", "--token-budget")),
    "VL-trained-tower-TP2": ("vl", 2, 1, 2, "token-mean", ("--train-vision", "--checkpoint")),
    "VL-bf16-TP2": ("vl", 2, 1, 2, "token-mean", ("--precision", "bf16", "--train-vision")),
    # Packed sequences (rows back to back, no padding) and context parallelism (each row in 2 x CP chunks, K/V
    # gathered over the CP group): the batch's rows of 6-11 tokens cut into chunks of 2-3.
    "packed-TP1": ("llama", 1, 1, 1, "token-mean", ("--pack",)),
    "qwen3-TP1": ("qwen3", 1, 1, 1, "token-mean", ()),
    "qwen3-packed-TP1": ("qwen3", 1, 1, 1, "token-mean", ("--pack",)),
    # ... its stepped weights through a checkpoint into a fresh CP2 actor
    "CP2": ("llama", 1, 1, 2, "token-mean", ("--cp2", "--checkpoint")),
    "bf16-CP2-packed": ("llama", 1, 1, 2, "token-mean", ("--precision", "bf16", "--pack", "--cp2")),
    "qwen3-packed-CP2": ("qwen3", 1, 1, 2, "token-mean", ("--pack", "--cp2")),
    "CP2xTP2-packed": ("llama", 2, 1, 4, "token-mean", ("--pack", "--cp2")),
    "CP2xPP2": ("llama", 1, 2, 4, "token-mean", ("--cp2",)),
    # ... and over data-parallel ranks: each sequence counted once by the sequence-mean modes; the distributed
    # optimizer shards over the CP and DP ranks together
    "CP2xDP2-seq-mean-packed": ("llama", 1, 1, 4, "seq-mean-token-mean", ("--pack", "--cp2", "--dist-opt")),
    # On-policy distillation's teacher (workers.teacher) on the same model: its log-probs at temperature 1, and the
    # step's KL term read from the teacher's log-probs (teacher_kl_coef) instead of the reference's
    "teacher-TP2": ("llama", 2, 1, 2, "token-mean", ("--teacher",)),
}
LAYOUTS = ["TP1", "TP2", "PP2", "TP2xPP2"]


@pytest.fixture(scope="module")
def models(model_dir, tmp_path_factory):
    # Qwen2-style: QKV bias, and an embedding shared with the output layer across two stages.
    return {"llama": model_dir, "qwen2": make_llama(tmp_path_factory.mktemp("tiny_qwen2"), tie=True, qkv_bias=True,
                                                      seed=2),
            "vl": make_qwen2_5_vl(tmp_path_factory.mktemp("tiny_qwen2_5_vl")),
            "qwen3": make_qwen3(tmp_path_factory.mktemp("tiny_qwen3"))}


@pytest.fixture(scope="module")
def launched(models, tmp_path_factory):
    """run -> its output directory; the first run asked for on a number of processes launches all of them."""
    done = {}

    def get(run):
        if run not in done:
            nproc = RUNS[run][3]
            together = [r for r, spec in RUNS.items() if spec[3] == nproc]
            cases = []
            for r in together:
                name, tp, pp, _, mode, extra = RUNS[r]
                out = tmp_path_factory.mktemp(f"parity-{r}")
                batch, train = make_inputs(models[name])
                torch.save({"batch": batch, "train": train}, out / "inputs.pt")
                cases.append({"model": str(models[name]), "out": str(out), "tp": tp, "pp": pp, "agg": mode,
                              "dist_opt": "--dist-opt" in extra, "logits_output": "--logits-output" in extra,
                              "precision": "bf16" if "bf16" in extra else "fp32",
                              "freeze_vision_tower": "--train-vision" not in extra,
                              "checkpoint": "--checkpoint" in extra,
                              "token_budget": 80 if "--token-budget" in extra else None,
                              "cp": 2 if "--cp2" in extra else 1, "pack": "--pack" in extra,
                              "teacher": "--teacher" in extra})
                done[r] = out
            listing = tmp_path_factory.mktemp(f"parity-{nproc}-processes") / "cases.json"
            listing.write_text(json.dumps(cases))
            proc = run_torchrun(TESTS / "megatron" / "parity_program.py",
                                ["--cases", str(listing), "--temperature", str(TEMPERATURE)], nproc, timeout=500)
            assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-5000:]
        return done[run]

    return get


@pytest.mark.parametrize("run", LAYOUTS)
def test_actor_matches_hf_reference(models, launched, run):
    run_and_compare(models, launched, run)


def test_actor_sequence_mean_modes_over_data_parallel_ranks(models, launched):
    run_and_compare(models, launched, "seq-mean-DP2")


def test_a_teacher_scores_at_temperature_1_and_its_kl_term_is_the_references_term(models, launched):
    """The step with KL(actor || teacher) at teacher_kl_coef equals the hand-written step with the reference's KL
    term (the same log-probs given as the teacher's); the Teacher's own log-probs are HF's at temperature 1."""
    run_and_compare(models, launched, "teacher-TP2")
    result = torch.load(launched("teacher-TP2") / "result.pt", weights_only=False)
    batch = make_inputs(models["llama"])[0]
    mask = batch.batch["response_mask"].bool()
    with torch.no_grad():
        logits = hf_model(models["llama"])(batch.batch["input_ids"], attention_mask=batch.batch["attention_mask"]).logits
    length = batch.batch["responses"].shape[1]
    expected = torch.log_softmax(logits[:, -length - 1: -1].float(), dim=-1).gather(
        -1, batch.batch["responses"].unsqueeze(-1)).squeeze(-1)
    got = result["teacher_log_probs"].batch["teacher_log_probs"]
    torch.testing.assert_close(got[mask], expected[mask], atol=1e-5, rtol=0)
    assert all("actor/teacher_kl_loss" in m and "actor/kl_loss" not in m for m in result["metrics"])


def test_distributed_optimizer_over_tp2_dp2_with_megatrons_output_layer(models, launched):
    run_and_compare(models, launched, "dist-opt-TP2xDP2")


def run_and_compare(models, launched, run):
    tmp_path = launched(run)
    model_dir = models[RUNS[run][0]]
    result, batch, ref = run_parity_program(model_dir, tmp_path, *RUNS[run][1:])
    mask = batch.batch["response_mask"].bool()
    got = result["log_probs"]
    torch.testing.assert_close(got.batch["old_log_probs"][mask], ref["log_probs"][mask], atol=1e-5, rtol=0)
    torch.testing.assert_close(got.batch["entropys"][mask], ref["entropy"][mask], atol=1e-5, rtol=0)
    # The reference policy (no optimizer, another micro-batch size) sees the same weights.
    torch.testing.assert_close(result["ref_log_probs"].batch["ref_log_prob"][mask], ref["log_probs"][mask], atol=1e-5, rtol=0)

    metrics = result["metrics"]
    for replica in metrics:  # one dict per DP replica, all describing the same global mini-batch
        assert replica["actor/pg_loss"][0] == pytest.approx(ref["pg_loss"], abs=1e-5)
        assert replica["actor/grad_norm"][0] == pytest.approx(ref["grad_norm"], abs=1e-5)
        assert replica["actor/lr"][0] == pytest.approx(LR)
        assert replica["actor/ppo_kl"][0] == pytest.approx(ref["ppo_kl"], abs=1e-5)
        assert replica["actor/entropy"][0] == pytest.approx(ref["entropy_mean"], abs=1e-5)
    assert ref["grad_norm"] > 1.0  # so clipping was exercised

    after = hf_model(tmp_path / "after_step").state_dict()
    before = hf_model(model_dir).state_dict()
    moved = max((ref["state"][k] - before[k]).abs().max().item() for k in before)
    assert moved > 1e-4  # the step really moved the weights
    for name, expected in ref["state"].items():
        torch.testing.assert_close(after[name], expected, atol=1e-5, rtol=0, msg=lambda m, n=name: f"{n}: {m}")


def run_parity_program(model_dir, tmp_path, tp, pp, nproc, mode, extra=()):
    """The parity program's result at a layout (its launch's output directory ``tmp_path``), the batch, and the
    fp32 HF reference step."""
    inputs = torch.load(tmp_path / "inputs.pt", weights_only=False)
    batch, train = inputs["batch"], inputs["train"]
    result = torch.load(tmp_path / "result.pt", weights_only=False)
    ref = reference_step(model_dir, batch, train, mode, train_vision="--train-vision" in extra)
    dp, cp = nproc // (tp * pp), 2 if "--cp2" in extra else 1
    assert result["layout"] == (f"TP{tp}xCP{cp}xPP{pp}xDP{dp // cp}" if cp > 1 else f"TP{tp}xPP{pp}xDP{dp}")
    # The planner's memory model, to the byte, against the engines' tensors (after the step: Adam's state exists).
    precision = "bf16" if "bf16" in extra else "fp32"
    assert_state_predicted(model_dir, result["state_bytes"], tp, pp, precision, True, "--dist-opt" in extra,
                           train_vision="--train-vision" in extra)
    assert_state_predicted(model_dir, result["ref_state_bytes"], tp, pp, precision, False)
    if pp == 1:  # and its activation model against what autograd keeps (packed rows and CP: one row alone)
        assert_activations_predicted(model_dir, result["activations"], tp, precision,
                                     train_vision="--train-vision" in extra, context_parallel=cp,
                                     packed="--pack" in extra)
    return result, batch, ref


@pytest.mark.parametrize("run", ["VL-TP1", "VL-TP2", "VL-trained-tower-TP1", "VL-trained-tower-TP2"])
def test_vision_language_actor_matches_hf_on_image_prompts(models, launched, run):
    """Qwen2.5-VL: log-probs, entropy, loss, gradient norm and the weights after a step equal transformers' on
    prompts with images of two sizes (and a text-only row), the tower frozen (the default) or trained."""
    run_and_compare(models, launched, run)
    model_dir = models["vl"]
    batch = torch.load(launched(run) / "inputs.pt", weights_only=False)["batch"]
    model = hf_model(model_dir)
    with torch.no_grad():  # the images matter: other pixels give other log-probs
        own, _ = reference_log_probs(model, batch)
        for row in batch.non_tensor_batch["multi_modal_inputs"]:
            if row is not None:
                row["pixel_values"] = row["pixel_values"].flip(0)
        other, _ = reference_log_probs(model, batch)
    assert (own - other).abs().max() > 1e-3
    after, before = hf_model(launched(run) / "after_step").state_dict(), model.state_dict()
    tower = max((after[k] - before[k]).abs().max().item() for k in before if k.startswith("model.visual."))
    assert (tower > 1e-4) if "trained" in run else tower == 0
    restored = torch.load(launched(run) / "result.pt", weights_only=False)["restored_log_probs"]
    assert (restored is not None) == ("--checkpoint" in RUNS[run][5])
    if restored is not None:  # the stepped actor through a checkpoint, its tower too: the stepped model's log-probs
        with torch.no_grad():
            stepped, _ = reference_log_probs(hf_model(launched(run) / "after_step"), batch_of(launched(run)))
        mask = batch.batch["response_mask"].bool()
        torch.testing.assert_close(restored.batch["old_log_probs"][mask], stepped[mask], atol=1e-5, rtol=0)


@pytest.mark.parametrize("run", ["CP2", "CP2xTP2-packed", "CP2xPP2", "CP2xDP2-seq-mean-packed", "qwen3-packed-CP2"])
def test_context_parallel_actor_matches_hf(models, launched, run):
    """Each sequence split over two CP ranks (four zigzag chunks), alone and with TP2, PP2 or DP2 (and the
    distributed optimizer), packed or not: log-probs, entropy, loss, gradient norm and every weight after the step
    equal HF's within 1e-5; a checkpoint of the stepped CP2 actor restores it (its log-probs: the stepped model's)."""
    run_and_compare(models, launched, run)
    restored = torch.load(launched(run) / "result.pt", weights_only=False)["restored_log_probs"]
    assert (restored is not None) == ("--checkpoint" in RUNS[run][5])
    if restored is not None:
        mask = batch_of(launched(run)).batch["response_mask"].bool()
        with torch.no_grad():
            stepped, _ = reference_log_probs(hf_model(launched(run) / "after_step"), batch_of(launched(run)))
        torch.testing.assert_close(restored.batch["old_log_probs"][mask], stepped[mask], atol=1e-5, rtol=0)


@pytest.mark.parametrize("packed, unpacked", [("packed-TP1", "TP1"), ("qwen3-packed-TP1", "qwen3-TP1")])
def test_packed_sequences_equal_padded_rows(models, launched, packed, unpacked):
    """The same rows packed back to back (Llama, and Qwen3 with its q/k norm) give what padded rows give, within
    1e-5: log-probs, entropy and the weights after the step; and each equals HF's."""
    run_and_compare(models, launched, packed)
    run_and_compare(models, launched, unpacked)
    mask = batch_of(launched(packed)).batch["response_mask"].bool()
    results = [torch.load(launched(run) / "result.pt", weights_only=False) for run in (packed, unpacked)]
    for key in ("old_log_probs", "entropys"):
        torch.testing.assert_close(results[0]["log_probs"].batch[key][mask], results[1]["log_probs"].batch[key][mask],
                                   atol=1e-5, rtol=0)
    assert results[0]["metrics"][0]["actor/grad_norm"][0] == pytest.approx(
        results[1]["metrics"][0]["actor/grad_norm"][0], abs=1e-5)
    # padding is paid by the padded rows only
    assert results[0]["metrics"][0]["actor/padding_fraction_after"][0] == 0.0
    assert results[1]["metrics"][0]["actor/padding_fraction_after"][0] > 0.05
    after = [hf_model(launched(run) / "after_step").state_dict() for run in (packed, unpacked)]
    for name in after[1]:
        torch.testing.assert_close(after[0][name], after[1][name], atol=1e-5, rtol=0)


def batch_of(out):
    return torch.load(out / "inputs.pt", weights_only=False)["batch"]


def test_tied_embeddings_and_qkv_bias_over_pipeline_stages(models, launched):
    """Qwen2-style model: QKV bias, and an embedding shared with the output layer across two stages."""
    run_and_compare(models, launched, "qwen2-tied-PP2")


@pytest.mark.parametrize("run", ["bf16-TP2xDP2", "VL-bf16-TP2", "bf16-CP2-packed"])
def test_bf16_actor_stays_close_to_the_fp32_reference(models, launched, run):
    """bf16 parameters and activations with fp32 master weights (megatron's mixed-precision optimizer), over
    TP2 x DP2 with the distributed optimizer (and a Qwen2.5-VL at TP2 on image prompts, its tower trained in bf16
    too; and a Llama at CP2, rows packed), against the fp32 HF reference. Tolerances (measured: log-prob
    0.025 max / 0.007 mean, loss 1.4e-3, grad norm 0.14%, KL 2e-3):
      log-probs within 0.05 (max) and 0.015 (mean), entropies within 0.01;
      the PPO loss and KL within 5e-3, the gradient norm within 1%;
      each weight after the Adam step within half a bf16 spacing of its value (2^-8 relative) plus
      2 x lr (Adam's near-sign step may differ for gradients near zero), and the update as a whole
      pointing the reference's way (cosine > 0.95)."""
    tmp_path = launched(run)
    model_dir = models[RUNS[run][0]]
    result, batch, ref = run_parity_program(model_dir, tmp_path, *RUNS[run][1:])
    mask = batch.batch["response_mask"].bool()
    got = result["log_probs"].batch
    diff = (got["old_log_probs"] - ref["log_probs"]).abs()[mask]
    assert diff.max() < 0.05 and diff.mean() < 0.015, (diff.max(), diff.mean())
    assert diff.max() > 0  # really bf16: fp32 agrees to 1e-5
    torch.testing.assert_close(got["entropys"][mask], ref["entropy"][mask], atol=0.01, rtol=0)
    for replica in result["metrics"]:
        assert replica["actor/pg_loss"][0] == pytest.approx(ref["pg_loss"], abs=5e-3)
        assert replica["actor/ppo_kl"][0] == pytest.approx(ref["ppo_kl"], abs=5e-3)
        assert replica["actor/grad_norm"][0] == pytest.approx(ref["grad_norm"], rel=0.01)

    config = __import__("json").loads((tmp_path / "after_step" / "config.json").read_text())
    assert config.get("torch_dtype", config.get("dtype")) == "bfloat16"  # exported in the engine's precision
    after = hf_model(tmp_path / "after_step").state_dict()
    before = hf_model(model_dir).state_dict()
    ours, theirs = [], []
    for name, expected in ref["state"].items():
        bound = expected.abs() * 2 ** -8 + 2 * LR
        assert ((after[name] - expected).abs() <= bound).all(), name
        ours.append((after[name] - before[name]).flatten())
        theirs.append((expected - before[name]).flatten())
    assert torch.nn.functional.cosine_similarity(torch.cat(ours), torch.cat(theirs), dim=0) > 0.95
