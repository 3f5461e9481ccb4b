"""The rollout behind its OpenAI-compatible endpoint, driven by the real ``openai`` client (2 torchrun ranks, two
vLLM replicas colocated with an fp32 actor): sessions stay on one replica and spread over both; a chat with
tools continued (once streamed) is one sample whose ids are exactly those served, the engine's tokens masked
in; a rewritten history splits; the served log-probs are the actor's within 1e-4."""

from pathlib import Path

import pytest
import torch

from conftest import run_torchrun

HERE = Path(__file__).parent


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    from controller.models.builtin import resolve_model_path

    root = tmp_path_factory.mktemp("serving")
    model = resolve_model_path("builtin:tiny-chat", root)
    proc = run_torchrun(HERE / "serving_program.py", [model, str(root)], nproc=2, timeout=400)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return model, torch.load(root / "serving.pt", weights_only=False)


def test_the_openai_client_is_served_and_its_sessions_are_the_ids_served(served):
    from transformers import AutoTokenizer

    model, out = served
    seen, samples = out["seen"], out["samples"]
    tokenizer = AutoTokenizer.from_pretrained(model)
    # Routing: a new session goes to the idler replica, and each stays where it started.
    assert out["placed"] == {"a": 0, "b": 1} and out["requests"] == [4, 2]
    assert [s["serving/requests"] for s in out["stats"]] == [4 + 1, 2 + 1]  # and one long request each, below
    assert seen["models"] == ["policy"]
    assert "max_tokens 10000 is over this rollout's 12 tokens a turn" in seen["bad_request"]
    # The chat with tools: three requests extend each other (the third streamed), the fourth rewrites history.
    assert out["parents"]["a"] == [None, 0, 1, None]
    a1, a2, a3, a4 = seen["a1"], seen["a2"], seen["a3"], seen["a4"]
    assert "calculator" in tokenizer.decode(a1["prompt"])  # the tools reach the prompt (as instructions here)
    assert a2["prompt"][:len(a1["prompt"]) + len(a1["ids"])] == a1["prompt"] + a1["ids"]
    assert a3["prompt"][:len(a2["prompt"]) + len(a2["ids"])] == a2["prompt"] + a2["ids"]
    assert a3["text"] == tokenizer.decode(a3["ids"], skip_special_tokens=True)  # the streamed deltas, joined
    whole, rewritten = samples["a"]
    assert whole.prompt_ids == a1["prompt"] and whole.context_ids == a3["prompt"] + a3["ids"]
    model_ids = [t for t, m in zip(whole.response_ids, whole.response_mask) if m]
    assert model_ids == a1["ids"] + a2["ids"] + a3["ids"] and whole.turns == 3
    assert [lp for lp, m in zip(whole.log_probs, whole.response_mask) if m] == (
        a1["log_probs"] + a2["log_probs"] + a3["log_probs"])
    client_sent = len(whole.response_ids) - len(model_ids)
    assert client_sent == len(a3["prompt"]) - len(a1["prompt"]) - len(a1["ids"]) - len(a2["ids"]) > 0
    assert rewritten.prompt_ids == a4["prompt"] and rewritten.response_ids == a4["ids"]
    assert all(v == 0 for v in whole.versions if v != -1) and set(whole.versions) == {-1, 0}
    # Session b: a text completion and a chat at once, each a sample of its own.
    b1, b2 = seen["b1"], seen["b2"]
    assert b1["prompt"] == tokenizer("1+2=", add_special_tokens=False)["input_ids"]
    assert b1["text"] == tokenizer.decode(b1["ids"], skip_special_tokens=True)
    assert sorted((s.prompt_ids, s.response_ids) for s in samples["b"]) == sorted(
        [(b1["prompt"], b1["ids"]), (b2["prompt"], b2["ids"])])
    # The served log-probs are the actor's on the same ids (fp32).
    every = [s for sid in ("a", "b") for s in samples[sid]]
    for sample, actor in zip(every, out["actor_log_probs"]):
        mask = torch.tensor(sample.response_mask).bool()
        torch.testing.assert_close(actor[mask], torch.tensor(sample.log_probs)[mask], atol=1e-4, rtol=0)


def test_the_calculator_environment_through_the_server_is_the_built_in_loop(served):
    """Same prompts, same seeds: the built-in loop's batch and the served agent's are equal tensor for tensor,
    over several turns (the user keeps asking) and the token budget's cut."""
    _, out = served
    builtin, through_server = out["builtin"], out["served"]
    assert len(builtin) == len(through_server) == 8  # 4 prompts x 2 samples
    for key in ("prompts", "responses", "response_mask", "attention_mask", "position_ids", "rollout_log_probs"):
        assert torch.equal(builtin.batch[key], through_server.batch[key]), key
    turns = builtin.non_tensor_batch["agent_turns"]
    assert list(turns) == list(through_server.non_tensor_batch["agent_turns"]) and min(turns) >= 2
    mask = builtin.batch["response_mask"]
    real = builtin.batch["attention_mask"][:, -mask.shape[1]:]
    assert ((real == 1) & (mask == 0)).any(dim=1).all()  # every sample holds an observation between its turns
    assert list(builtin.non_tensor_batch["agent_reward"]) == list(through_server.non_tensor_batch["agent_reward"])


def test_weights_change_under_requests_in_flight_by_pause_or_finish(served):
    """``POST /update`` while a 300-token request streams: ``pause`` takes the weights between two steps and the
    request goes on with them, each token saying which version sampled it; ``finish`` lets it end on the old
    weights first."""
    _, out = served
    paused, finished = out["in_flight"]["pause"], out["in_flight"]["finish"]
    versions = paused["versions"]
    assert len(versions) == 300 and versions == sorted(versions) and versions[0] == 0 and versions[-1] == 1
    # What each replica's stepping thread saw (the order the client reads its sockets in is not evidence):
    # replica 0 paused its request for the weights, the idle replica 1 had none.
    assert [(r["update/requests_paused"], r["update/requests_finished_first"]) for r in paused["replies"]] == [
        (1, 0), (0, 0)]
    assert [reply["version"] for reply in paused["replies"]] == [1, 1]
    assert finished["versions"] == [1] * 300  # all on the weights it started with (replica 1's)
    # finish: replica 1 let its request end first, the idle replica 0 had none to wait for.
    assert [(r["update/requests_paused"], r["update/requests_finished_first"]) for r in finished["replies"]] == [
        (0, 0), (0, 1)]
    assert finished["replies"][1]["update/wait_s"] > finished["replies"][0]["update/wait_s"]
    assert [reply["version"] for reply in finished["replies"]] == [2, 2]
    assert all(reply["weight_sync/bytes"] > 0 for reply in paused["replies"] + finished["replies"])


def test_served_lora_adapters_are_the_latest_update_s(tmp_path):
    """``rollout.lora_sync: adapter`` behind the server: vLLM serves the actor's adapters unmerged. After the
    actor's adapters change and ``POST /update`` registers the new ones (deleting the old ones' folder), the next
    reply is sampled with the new adapters: its log-probs are the actor's (1e-4), where the reply before the
    update is far from them. (The server's engine loop kept the adapter it started with before.)"""
    from tiny_models import make_llama

    from controller.models.char_tokenizer import save_char_tokenizer

    model = save_char_tokenizer(make_llama(tmp_path / "model"), 256)
    proc = run_torchrun(HERE / "lora_serving_program.py", [str(model), str(tmp_path)], nproc=1, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    out = torch.load(tmp_path / "lora_serving.pt", weights_only=False)
    first, second = out["first"], out["second"]
    assert len(first["token_ids"]) == len(second["token_ids"]) == 8
    assert out["update"]["version"] == 1 and out["update"]["weight_sync/bytes"] > 0
    assert first["versions"] == [0] * 8 and second["versions"] == [1] * 8
    torch.testing.assert_close(torch.tensor(second["log_probs"]), out["now"]["second"], atol=1e-4, rtol=0)
    # the adapters moved the policy well past that tolerance: served on the old adapters, the reply would not match
    assert (torch.tensor(first["log_probs"]) - out["now"]["first"]).abs().max() > 1e-2
