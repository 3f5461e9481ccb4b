"""AgentLoop on a scripted engine: conversations end by stop, max_turns, length or an environment error; tool
failures become observations; a slow tool on one sample does not hold up the others; the ids stay exact."""

import time

import pytest

from chat_tokenizer import save_chat_tokenizer
from workers.rollout.agent import Calculator, Tool, ToolBox
from workers.rollout.agent.loop import AgentLimits, AgentLoop, Environment, ToolEnvironment, agent_metrics
from workers.rollout.agent.trajectory import ChatFormat
from workers.rollout.batch import Completion
from workers.rollout.sampling import SamplingConfig

TEMPLATE = ("{% for m in messages %}<s>{{ m['role'] }}:{{ m['content'] }}</s>;{% endfor %}"
            "{% if add_generation_prompt %}<s>assistant:{% endif %}")


def call(name, **arguments) -> str:
    import json

    return "<tool_call>" + json.dumps({"name": name, "arguments": arguments}) + "</tool_call>"


class Sleep(Tool):
    name = "sleep"
    description = "Waits, then says so."
    parameters = {"type": "object", "properties": {"seconds": {"type": "number"}}, "required": ["seconds"]}
    timeout_s = 5.0

    def call(self, seconds: float) -> str:
        time.sleep(seconds)
        return "slept"


class Boom(Tool):
    name = "boom"
    description = "Always fails."
    parameters = {"type": "object", "properties": {}}

    def call(self) -> str:
        raise RuntimeError("kaboom")


class Hang(Tool):
    name = "hang"
    description = "Overruns its timeout."
    parameters = {"type": "object", "properties": {}}
    timeout_s = 0.2

    def call(self) -> str:
        time.sleep(1.0)
        return "late"


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(save_chat_tokenizer(tmp_path_factory.mktemp("tok"), 256, TEMPLATE)))


class ScriptedEngine:
    """The engine's batch interface; each sample's replies come from its script, turn by turn (the user's text
    names the script). Records which samples each call served and when."""

    def __init__(self, tokenizer, scripts: dict[str, list[str]]) -> None:
        self.tokenizer, self.scripts, self.calls = tokenizer, scripts, []

    def __call__(self, requests, sampling):
        self.calls.append((time.time(), len(requests)))
        completions = []
        for request in requests:
            context = self.tokenizer.decode(request.prompt_ids)
            script = self.scripts[context.split("<s>user:", 1)[1].split("</s>", 1)[0]]
            turn = context.count("<s>assistant:") - 1
            ids = self.tokenizer.encode(script[min(turn, len(script) - 1)], add_special_tokens=False)
            ids = (ids + [self.tokenizer.eos_token_id])[:sampling.max_new_tokens]
            completions.append(Completion(ids, [-0.1] * len(ids), "stop"))
        return completions


def run(tokenizer, scripts, box, limits=AgentLimits(max_turns=4, max_response_length=400), environment=None):
    loop = AgentLoop(ChatFormat(tokenizer), environment or (lambda sample: ToolEnvironment(box, "hermes")), limits)
    engine = ScriptedEngine(tokenizer, scripts)
    samples = [{"messages": [{"role": "user", "content": name}]} for name in scripts]
    return loop.run(samples, engine, SamplingConfig(max_new_tokens=120)), engine


def test_a_tool_conversation_ends_with_the_answer_and_its_ids_are_the_template_rendering(tokenizer):
    with ToolBox([Calculator()]) as box:
        [result], engine = run(tokenizer, {"2+3?": [call("calculator", expression="2+3"), "It is 5."]}, box)
    assert result.finish_reason == "stop" and result.trajectory.turns == 2 and result.tool_calls == 1
    assert [m["role"] for m in result.messages] == ["user", "assistant", "tool", "assistant"]
    assert result.messages[2]["content"] == "5"
    rendered = tokenizer.apply_chat_template(result.messages, tokenize=True)
    rendered = list(rendered["input_ids"] if hasattr(rendered, "keys") else rendered)
    assert result.trajectory.context_ids == rendered[:-1]  # everything up to the last EOS, exactly
    mask = result.trajectory.response_mask
    observation = tokenizer.encode(";<s>tool:5</s>;<s>assistant:", add_special_tokens=False)
    first = len(tokenizer.encode(call("calculator", expression="2+3"), add_special_tokens=False)) + 1
    assert mask == [1] * first + [0] * len(observation) + [1] * (len(mask) - first - len(observation))
    metrics = agent_metrics([result])
    assert metrics["agent/num_turns/mean"] == 2 and metrics["agent/tool_calls/mean"] == 1
    assert metrics["agent/finish_reason/stop"] == 1 and metrics["agent/tool_errors"] == 0
    assert [n for _, n in engine.calls] == [1, 1]


def test_tool_failures_and_malformed_calls_become_observations_and_are_counted(tokenizer):
    scripts = {
        "malformed": ['<tool_call>{"name": "calculator", "arguments": </tool_call>', "done"],
        "unknown": [call("search", query="x"), "done"],
        "arguments": [call("calculator", expr="1"), "done"],
        "raises": [call("boom"), "done"],
        "timeout": [call("hang"), "done"],
        "unsafe": [call("calculator", expression="__import__('os').system('ls')"), "done"],
    }
    with ToolBox([Calculator(), Boom(), Hang()]) as box:
        results, _ = run(tokenizer, scripts, box)
    by_name = dict(zip(scripts, results))
    expected = {"malformed": "malformed", "unknown": "unknown_tool", "arguments": "bad_arguments",
                "raises": "raised", "timeout": "timeout", "unsafe": "raised"}
    for name, kind in expected.items():
        result = by_name[name]
        assert result.finish_reason == "stop" and result.trajectory.turns == 2, (name, result)
        assert result.tool_errors[kind] == 1 and sum(result.tool_errors.values()) == 1, (name, result.tool_errors)
        assert result.messages[2]["role"] == "tool" and result.messages[2]["content"].startswith("error"), result.messages
    metrics = agent_metrics(results)
    assert metrics["agent/tool_errors"] == 6 and metrics["agent/tool_errors/raised"] == 2


def test_limits_end_samples_with_their_finish_reason(tokenizer):
    class Broken(Environment):
        def step(self, messages, reply):
            raise KeyError("no such level")

    with ToolBox([Calculator()]) as box:
        [looping], _ = run(tokenizer, {"loop": [call("calculator", expression="1+1")]}, box,
                           AgentLimits(max_turns=3, max_response_length=1000))
        # The last turn's reply still gets its step (it could have been the answer); its observation is dropped.
        assert looping.finish_reason == "max_turns" and looping.trajectory.turns == 3 and looping.tool_calls == 3
        assert [m["role"] for m in looping.messages].count("tool") == 2
        [long], _ = run(tokenizer, {"long": [call("calculator", expression="1+1")]}, box,
                        AgentLimits(max_turns=10, max_response_length=150))
        assert long.finish_reason == "length" and len(long.trajectory.response_ids) <= 150
        [broken], _ = run(tokenizer, {"x": ["hello"]}, box, environment=lambda sample: Broken())
    assert broken.finish_reason == "environment_error" and broken.error == "KeyError: 'no such level'"
    with pytest.raises(ValueError, match="agent limit max_turns must be a positive integer, got 0"):
        AgentLimits(max_turns=0)


def test_a_slow_tool_on_one_sample_does_not_hold_up_the_others(tokenizer):
    scripts = {"slow": [call("sleep", seconds=1.5), "done"],
               "fast": [call("calculator", expression="1+1"), call("calculator", expression="2+2"),
                        call("calculator", expression="3+3"), "done"]}
    with ToolBox([Calculator(), Sleep()]) as box:
        started = time.time()
        (slow, fast), engine = run(tokenizer, scripts, box)
        wall = time.time() - started
    assert slow.finish_reason == fast.finish_reason == "stop" and fast.trajectory.turns == 4
    # The fast sample took its three further turns alone while the slow tool ran: engine calls of one request.
    before_slow_returns = [n for at, n in engine.calls if at - started < 1.4]
    assert len(before_slow_returns) == 4 and before_slow_returns[1:] == [1, 1, 1], engine.calls
    assert wall < 1.5 + 1.5  # the slow tool's own time, plus little


def test_the_training_batch_holds_the_exact_ids_with_only_model_tokens_in_the_response_mask(tokenizer):
    import torch

    from workers.data_proto import DataProto
    from workers.reward.rule_reward import last_token_scores
    from workers.rollout.agent.batch import build_agent_batch

    scripts = {"2+3?": [call("calculator", expression="2+3"), "It is 5."], "hi": ["hello"]}
    with ToolBox([Calculator()]) as box:
        results, _ = run(tokenizer, scripts, box)
    prompts = DataProto(non_tensor_batch={"uid": ["a", "b"], "ground_truth": ["5", ""]})
    batch = build_agent_batch(prompts, results, tokenizer.pad_token_id, max_response_length=120, max_prompt_length=40)
    assert batch.batch["prompts"].shape == (2, 40) and batch.batch["responses"].shape == (2, 120)
    assert batch.batch["input_ids"].shape == (2, 160)
    for row, result in enumerate(results):
        trajectory = result.trajectory
        real = batch.batch["attention_mask"][row].bool()
        assert batch.batch["input_ids"][row][real].tolist() == trajectory.context_ids  # the exact ids, no re-tokenizing
        length = len(trajectory.response_ids)
        assert batch.batch["response_mask"][row, :length].tolist() == trajectory.response_mask
        assert int(batch.batch["response_mask"][row, length:].sum()) == 0
        assert torch.allclose(batch.batch["rollout_log_probs"][row, :length], torch.tensor(trajectory.log_probs))
        positions = batch.batch["position_ids"][row][real]
        assert positions.tolist() == list(range(len(trajectory.context_ids)))
    mask = batch.batch["response_mask"]
    # The two-turn sample's model tokens are not contiguous: a sequence reward goes on its last model token,
    # not at mask.sum() - 1 (the reward workers' placement already reads the last 1 of the mask).
    placed = last_token_scores(torch.tensor([1.0, 2.0]), mask)
    last = [len(r.trajectory.response_ids) - 1 for r in results]
    assert placed[0, last[0]] == 1.0 and placed[1, last[1]] == 2.0 and int((placed != 0).sum()) == 2
    assert int(mask[0].sum()) - 1 < last[0]
    assert list(batch.non_tensor_batch["finish_reason"]) == ["stop", "stop"]
    assert list(batch.non_tensor_batch["agent_turns"]) == [2, 1] and list(batch.non_tensor_batch["uid"]) == ["a", "b"]
    with pytest.raises(ValueError, match="over max_response_length 10"):
        build_agent_batch(prompts, results, tokenizer.pad_token_id, max_response_length=10, max_prompt_length=40)
    with pytest.raises(ValueError, match="over max_prompt_length 5"):
        build_agent_batch(prompts, results, tokenizer.pad_token_id, max_response_length=120, max_prompt_length=5)
