"""Calculator tool-call transcripts for SFT, with no process: each is exactly the conversation the agent
rollout would hold had the model written those turns (the rollout's prompt, the observations' ids), its calls
parse in the configured format to the steps of the problem, and its answer is the problem's."""

import pytest

from controller.data.arithmetic import word_problem_draws, word_problems
from controller.data.sft_examples import encode_messages
from controller.data.tool_transcripts import calculator_transcripts
from workers.rollout.agent import Calculator, ToolBox, parse_tool_calls
from workers.rollout.agent.trajectory import ChatFormat


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    from transformers import AutoTokenizer

    from controller.models.builtin import resolve_model_path

    return AutoTokenizer.from_pretrained(resolve_model_path("builtin:tiny-chat", tmp_path_factory.mktemp("m")))


@pytest.mark.parametrize("tool_format", ["hermes", "json"])
def test_a_transcript_is_the_rollouts_conversation_with_the_problems_calls(tokenizer, tool_format):
    problems = word_problems(6, seed=4, steps=3, max_operand=20)
    rows = calculator_transcripts(6, 4, tokenizer, steps=3, max_operand=20, tool_format=tool_format)
    box = ToolBox([Calculator()])
    chat = ChatFormat(tokenizer, tools=box.schemas(), end_of_turn_id=tokenizer.eos_token_id, tool_format=tool_format)
    for row, messages, answer, draw in zip(rows, problems.prompts, problems.answers,
                                           word_problem_draws(6, 4, 3, 20)):
        assert row["ground_truth"] == answer and row["tools"] == box.schemas()
        example = encode_messages(row["messages"], tokenizer, tools=row["tools"])
        # The prompt is the one the agent rollout builds from the problem's messages.
        assert example.prompt_ids == chat.prompt_ids(list(messages))
        # After each assistant turn, the tool message's ids are the rollout's observation ids.
        ids = example.prompt_ids + example.response_ids
        assistant = [m for m in row["messages"] if m["role"] == "assistant"]
        position = len(example.prompt_ids)
        value = draw.start
        for turn, (op, b) in zip(assistant, draw.operations):
            turn_ids = list(tokenizer(turn["content"], add_special_tokens=False)["input_ids"])
            assert ids[position:position + len(turn_ids)] == turn_ids
            position += len(turn_ids) + 1  # and its end-of-turn token
            assert ids[position - 1] == tokenizer.eos_token_id
            (call,) = parse_tool_calls(turn["content"], tool_format).calls
            assert call.name == "calculator" and call.arguments == {"expression": f"{value} {op} {b}"}
            value = int(Calculator().call(expression=call.arguments["expression"]))
            observation = chat.observation_ids([{"role": "tool", "content": str(value)}], closed=True)
            assert ids[position:position + len(observation)] == observation
            position += len(observation)
        assert str(value) == answer and assistant[-1]["content"] == answer
        # Learned: the assistant turns (each through its end-of-turn token) and nothing else.
        learned = [t for t, m in zip(example.response_ids, example.loss_mask) if m]
        expected = []
        for turn in assistant:
            expected += list(tokenizer(turn["content"], add_special_tokens=False)["input_ids"]) + [tokenizer.eos_token_id]
        assert learned == expected


def test_bad_transcript_settings_are_refused():
    from pathlib import Path

    from controller.sft.config import ConfigError, check_sft_config, load_sft_config

    example = Path(__file__).parent.parent / "examples" / "calculator_sft.yaml"
    for override, message in (("data.tool_format=xml", "data.tool_format 'xml' is not one of"),
                              ("data.steps=0", "data.steps must be >= 1")):
        with pytest.raises(ConfigError, match=message):
            check_sft_config(load_sft_config(example, [override, "model_path=builtin:tiny-chat"]))
