"""HFRewardModel (any HF sequence classifier, data-parallel) against the HF model run directly on the
texts, row by row; in a real 2-process Ray group; and RewardModel.from_pretrained's routing."""

import pytest
import torch

from controller import ResourcePool, WorkerGroup
from controller.models.builtin import resolve_model_path, value_model_from_policy
from tiny_reward_models import CHAT_TEMPLATE, CountingHFRewardModel, make_deberta_rm
from workers import DataProto
from workers.megatron.engine_role import EngineRole
from workers.reward import HFRewardModel, RewardModel
from workers.role_spec import RoleSpec

PROMPTS = ["What is two plus two?", "Name a colour of the sky.", "How many legs does a cat have?",
           "Write a short poem about the sea.", "Ask the tool."]
# Segments (text, made by the model): row 2's response is empty; row 4 is multi-turn and ends on an
# observation (attended, response mask 0), so its last valid token comes before the end of its text.
RESPONSES = [[("The answer is four.", 1)], [("The sky is blue, sometimes grey.", 1)], [],
             [("Waves come and go,", 1), (" the sea is calm.", 1)],
             [("I will ask the tool.", 1), (" tool said : 42 .", 0)]]
PROMPT_WIDTH, RESPONSE_WIDTH = 36, 40


def response_text(segments) -> str:
    return "".join(text for text, _ in segments)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf_rm")
    policy = resolve_model_path("builtin:tiny-arithmetic", root)
    return {
        "policy": policy,
        "pair": make_deberta_rm(root / "pair", seed=0),
        "chat": make_deberta_rm(root / "chat", seed=1, chat_template=CHAT_TEMPLATE),
        "same": make_deberta_rm(root / "same", seed=2, tokenizer_from=policy),  # reads the policy's char ids
        "labels2": make_deberta_rm(root / "labels2", num_labels=2),
        "llama": value_model_from_policy(policy, root / "llama_rm"),
    }


def make_batch(policy_dir, prompts=PROMPTS, responses=RESPONSES) -> DataProto:
    """Left-padded prompts and right-padded responses in the policy's (character) ids, as rollout hands them over."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(policy_dir)
    rows = len(prompts)
    prompt_ids = torch.full((rows, PROMPT_WIDTH), tok.pad_token_id)
    response_ids = torch.full((rows, RESPONSE_WIDTH), tok.pad_token_id)
    prompt_attention = torch.zeros(rows, PROMPT_WIDTH, dtype=torch.long)
    response_attention = torch.zeros(rows, RESPONSE_WIDTH, dtype=torch.long)
    response_mask = torch.zeros(rows, RESPONSE_WIDTH, dtype=torch.long)
    for i, (prompt, segments) in enumerate(zip(prompts, responses)):
        p = tok.encode(prompt, add_special_tokens=False)
        prompt_ids[i, -len(p):] = torch.tensor(p)
        prompt_attention[i, -len(p):] = 1
        at = 0
        for text, by_model in segments:
            ids = tok.encode(text, add_special_tokens=False)
            response_ids[i, at: at + len(ids)] = torch.tensor(ids)
            response_attention[i, at: at + len(ids)] = 1
            response_mask[i, at: at + len(ids)] = by_model
            at += len(ids)
    attention_mask = torch.cat([prompt_attention, response_attention], dim=1)
    return DataProto({
        "prompts": prompt_ids, "responses": response_ids, "input_ids": torch.cat([prompt_ids, response_ids], dim=1),
        "attention_mask": attention_mask, "position_ids": (attention_mask.cumsum(-1) - 1).clamp(min=0),
        "response_mask": response_mask,
    })


def hf_reference(rm_dir, encode) -> torch.Tensor:
    """The HF model's logit of each row on its own (no padding), fp32; ``encode(tokenizer, prompt, response)``."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(rm_dir)
    model = AutoModelForSequenceClassification.from_pretrained(rm_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        return torch.stack([model(**encode(tok, p, response_text(r))).logits[0, 0]
                            for p, r in zip(PROMPTS, RESPONSES)])


def text_pair(tok, prompt, response):
    """How OpenAssistant's DeBERTa reward models are called; in list form, because transformers' single-text
    call drops an empty second text (no pair at all) where an empty response should still be a pair."""
    return tok([prompt], [response], return_tensors="pt")


def chat_turns(tok, prompt, response):  # CHAT_TEMPLATE written out by hand
    return tok(f"[CLS] user : {prompt} [SEP] [CLS] assistant : {response} [SEP] ", add_special_tokens=False,
               return_tensors="pt")


def policy_ids(tok, prompt, response):
    ids = tok.encode(prompt, add_special_tokens=False) + tok.encode(response, add_special_tokens=False)
    return {"input_ids": torch.tensor([ids])}


def expected_placement(scores: torch.Tensor) -> torch.Tensor:
    """Each row's score on its last model-made response token: by hand from RESPONSES' segments."""
    placed = torch.zeros(len(RESPONSES), RESPONSE_WIDTH)
    for row, segments in enumerate(RESPONSES):
        ends = [sum(len(t) for t, _ in segments[: k + 1]) for k, (_, by_model) in enumerate(segments) if by_model]
        if ends:
            placed[row, ends[-1] - 1] = scores[row]
    return placed


@pytest.mark.parametrize("rm,encode", [("pair", text_pair), ("chat", chat_turns), ("same", policy_ids)],
                         ids=["text-pair", "chat-template", "same-tokenizer"])
def test_scores_match_hf_on_the_texts_and_sit_on_the_last_response_token(models, rm, encode):
    batch = make_batch(models["policy"])
    worker = HFRewardModel(models[rm], tokenizer_path=models["policy"], precision="fp32", micro_batch_size=2)
    assert worker.retokenize == (rm != "same")
    out = worker.compute_rm_score(batch)
    assert set(out.keys()) == {"token_level_scores", "rm_scores"}

    expected = hf_reference(models[rm], encode)
    scores = out.batch["rm_scores"]
    assert scores.shape == (5,) and scores.dtype == torch.float32
    torch.testing.assert_close(scores, expected, atol=1e-5, rtol=0)  # micro-batches of 2 rows, padded, change nothing
    assert (scores - scores.mean()).abs().max() > 1e-2  # the rows score differently: real numbers, not a constant

    token_level = out.batch["token_level_scores"]
    assert token_level.dtype == torch.float32
    assert torch.equal(token_level, expected_placement(scores))
    assert token_level[2].abs().sum() == 0 and scores[2] != 0  # the empty response: scored, carried by no token
    assert token_level[4, 19] == scores[4]  # "I will ask the tool." ends at 19; the observation after carries none


def test_bf16_scores_follow_fp32_and_the_policy_tokenizer_can_be_the_models_own(models):
    batch = make_batch(models["policy"])
    fp32 = HFRewardModel(models["pair"], tokenizer_path=models["policy"], precision="fp32").compute_rm_score(batch)
    bf16_worker = HFRewardModel(models["pair"], tokenizer_path=models["policy"])  # precision="bf16" by default
    assert next(bf16_worker.model.parameters()).dtype == torch.bfloat16
    bf16 = bf16_worker.compute_rm_score(batch).batch["rm_scores"]
    assert bf16.dtype == torch.float32
    torch.testing.assert_close(bf16, fp32.batch["rm_scores"], atol=0.05 * fp32.batch["rm_scores"].abs().max(), rtol=0)

    # tokenizer_path None: the batch is taken to be in the reward model's own ids, used as they are.
    own = HFRewardModel(models["same"], precision="fp32", score_key="cost_scores").compute_rm_score(batch)
    torch.testing.assert_close(own.batch["cost_scores"], hf_reference(models["same"], policy_ids), atol=1e-5, rtol=0)
    # ... and ids the reward model has no row for are refused, pointing at tokenizer_path.
    with pytest.raises(ValueError, match=r"row 0 holds token id \d+, outside the reward model's vocabulary of \d+ ids "
                                         r".*pass tokenizer_path=<the policy's tokenizer>"):
        HFRewardModel(models["pair"], precision="fp32").compute_rm_score(batch)


def test_two_process_group_scores_half_each_and_matches_one_process(models, ray_cluster):
    batch = make_batch(models["policy"])  # 5 rows: padded to 6, 3 per rank
    kwargs = {"model_path": models["pair"], "tokenizer_path": models["policy"], "precision": "fp32", "micro_batch_size": 2}
    single = HFRewardModel(**kwargs).compute_rm_score(batch)
    pool = ResourcePool([2], backend="ray")
    try:
        group = WorkerGroup(pool, CountingHFRewardModel, role="reward_model", kwargs=kwargs)
        out = group.compute_rm_score(batch)
        assert group.scored_rows() == [[3, 3], [3, 3]]  # (every rank's view of the all-gather)
    finally:
        pool.shutdown()
    torch.testing.assert_close(out.batch["rm_scores"], single.batch["rm_scores"], atol=1e-5, rtol=0)
    torch.testing.assert_close(out.batch["token_level_scores"], single.batch["token_level_scores"], atol=1e-5, rtol=0)


# ----------------------------------------------------------------------------------- routing
def test_from_pretrained_routes_by_what_the_megatron_engine_can_hold(models):
    policy, deberta, llama = models["policy"], models["pair"], models["llama"]
    # A DeBERTa: the HF worker, megatron keywords dropped, precision and micro-batch carried over.
    spec = RewardModel.from_pretrained(deberta, tokenizer_path=policy, tensor_parallel=2, pipeline_parallel=1,
                                       engine={"precision": "fp32", "micro_batch_size": 4}, score_key="cost_scores",
                                       device_map="auto")
    assert spec == RoleSpec(HFRewardModel, {"model_path": deberta, "tokenizer_path": policy, "precision": "fp32",
                                            "micro_batch_size": 4, "score_key": "cost_scores", "max_length": None})
    assert RewardModel.from_pretrained(deberta).kwargs == {
        "model_path": deberta, "tokenizer_path": None, "precision": "bf16", "micro_batch_size": 8,
        "score_key": "rm_scores", "max_length": None}
    # The spec builds a worker that scores (what a controller's worker group does with it).
    built = spec.worker_cls(**spec.kwargs).compute_rm_score(make_batch(policy))
    torch.testing.assert_close(built.batch["cost_scores"], hf_reference(deberta, text_pair), atol=1e-5, rtol=0)

    # A Llama classifier: the megatron spec exactly as EngineRole.from_pretrained made it before.
    def before(**kwargs):
        return EngineRole.from_pretrained.__func__(RewardModel, llama, **kwargs)

    assert RewardModel.from_pretrained(llama) == before() == RoleSpec(
        RewardModel, {"model_path": llama, "engine": {"tensor_parallel": 1, "pipeline_parallel": 1, "micro_batch_size": 1}})
    assert (RewardModel.from_pretrained(llama, tensor_parallel=2, engine={"precision": "fp32"}, score_key="cost_scores")
            == before(tensor_parallel=2, engine={"precision": "fp32"}, score_key="cost_scores"))
    # The policy's own tokenizer changes nothing; device_map="auto" lets the controller lay it out.
    assert RewardModel.from_pretrained(llama, tokenizer_path=policy) == before()
    auto = RewardModel.from_pretrained(llama, device_map="auto")
    assert (auto.worker_cls, auto.device_map, auto.explicit_parallelism) == (RewardModel, "auto", False)
    assert RewardModel.from_pretrained(llama, tensor_parallel=2, device_map="auto").explicit_parallelism
    # A Llama classifier under a policy with another vocabulary cannot read its ids: re-tokenized by the HF worker.
    assert RewardModel.from_pretrained(llama, tokenizer_path=deberta).worker_cls is HFRewardModel


def test_from_pretrained_refuses_bad_keywords_values_and_checkpoints(models, tmp_path):
    deberta, llama = models["pair"], models["llama"]
    for path in (deberta, llama):
        with pytest.raises(TypeError, match=r"unknown keyword\(s\) \['tensor_paralel'\]; valid keywords: \['device_map', "
                                            r"'engine', 'max_length', 'micro_batch_size', .*'tensor_parallel'"):
            RewardModel.from_pretrained(path, tensor_paralel=2)
    with pytest.raises(ValueError, match=r"needs num_labels=1 \(one scalar score\); .*labels2 has num_labels=2"):
        RewardModel.from_pretrained(models["labels2"])
    with pytest.raises(ValueError, match=r"needs num_labels=1 .*labels2 has num_labels=2"):
        HFRewardModel(models["labels2"])  # (the config is read before any weight loads)
    with pytest.raises(ValueError, match=r"RewardModel needs a sequence-classification checkpoint with a value head; "
                                         r".* is a LlamaForCausalLM"):
        RewardModel.from_pretrained(models["policy"])
    with pytest.raises(ValueError, match=r"precision must be one of \['bf16', 'fp32'\], got 'fp16'"):
        RewardModel.from_pretrained(deberta, precision="fp16")
    with pytest.raises(ValueError, match=r"micro_batch_size must be a positive integer, got 0"):
        RewardModel.from_pretrained(deberta, micro_batch_size=0)
    with pytest.raises(ValueError, match=r"score_key must be a non-empty name other than 'token_level_scores', got ''"):
        RewardModel.from_pretrained(deberta, score_key="")
    with pytest.raises(ValueError, match=r"device_map 'balanced' is not supported; valid: 'auto' or None"):
        RewardModel.from_pretrained(deberta, device_map="balanced")
    with pytest.raises(ValueError, match=r"max_length applies to HFRewardModel only"):
        RewardModel.from_pretrained(llama, max_length=64)
    with pytest.raises(ValueError, match=r"cannot read a Hugging Face model config from '.*nowhere'"):
        RewardModel.from_pretrained(str(tmp_path / "nowhere"))
