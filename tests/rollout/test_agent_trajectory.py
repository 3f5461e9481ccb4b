"""Token-exact trajectories: observation framing cut from the chat template as ids, masks, log-probs, drift."""

import pytest

from chat_tokenizer import save_chat_tokenizer
from workers.rollout.agent.trajectory import ChatFormat, ChatTemplateError, Trajectory

# ChatML's shape: a header, the content, an end-of-turn token ("</s>", the EOS) and a separator after it (";").
TEMPLATE = ("{% for m in messages %}<s>{{ m['role'] }}:{{ m['content'] }}</s>;{% endfor %}"
            "{% if add_generation_prompt %}<s>assistant:{% endif %}")
CALL = '<tool_call>{"name": "calculator", "arguments": {"expression": "2+3"}}</tool_call>'


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(save_chat_tokenizer(tmp_path_factory.mktemp("tok"), 256, TEMPLATE)))


def ids(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


def render(tokenizer, messages, generation_prompt=False) -> list[int]:
    out = tokenizer.apply_chat_template(messages, add_generation_prompt=generation_prompt, tokenize=True)
    return list(out["input_ids"] if hasattr(out, "keys") else out)


@pytest.mark.parametrize("closed", [True, False], ids=["turn-ends-with-eos", "turn-stopped-at-a-stop-string"])
def test_a_two_turn_trajectory_is_the_template_rendering_of_the_conversation_and_masks_the_observation(
        tokenizer, closed):
    chat = ChatFormat(tokenizer)
    eos = tokenizer.eos_token_id
    assert chat.after_turn == ids(tokenizer, ";")
    messages = [{"role": "user", "content": "What is 2+3?"}]
    trajectory = Trajectory(chat.prompt_ids(messages))
    assert tokenizer.decode(trajectory.prompt_ids) == "<s>user:What is 2+3?</s>;<s>assistant:"
    first = ids(tokenizer, CALL) + ([eos] if closed else [])  # a stop string ends the turn before EOS
    trajectory.add_model_turn(first, [-0.5] * len(first))
    observation = chat.observation_ids([{"role": "tool", "content": "5"}], closed=closed)
    assert tokenizer.decode(observation) == ("" if closed else "</s>") + ";<s>tool:5</s>;<s>assistant:"
    trajectory.add_observation(observation)
    second = ids(tokenizer, "It is 5.") + [eos]
    trajectory.add_model_turn(second, [-0.25] * len(second))
    # With no drift, the exact ids are what the template makes of the whole conversation (up to the last EOS).
    conversation = messages + [{"role": "assistant", "content": CALL}, {"role": "tool", "content": "5"},
                               {"role": "assistant", "content": "It is 5."}]
    assert trajectory.context_ids == render(tokenizer, conversation)[:-len(chat.after_turn)]
    mask = trajectory.response_mask
    assert mask == [1] * len(first) + [0] * len(observation) + [1] * len(second)
    assert trajectory.model_tokens == len(first) + len(second) and trajectory.turns == 2
    assert trajectory.log_probs == [-0.5] * len(first) + [0.0] * len(observation) + [-0.25] * len(second)


def test_re_tokenizing_the_decoded_text_changes_the_ids_and_the_trajectory_keeps_the_sampled_ones(tokenizer):
    chat = ChatFormat(tokenizer)
    eos = tokenizer.eos_token_id
    trajectory = Trajectory(chat.prompt_ids([{"role": "user", "content": "Say </s>"}]))
    # The model spells "</s>" out character by character: four sampled ids that decode to the EOS token's text.
    sampled = ids(tokenizer, "ok") + [tokenizer.convert_tokens_to_ids(c) for c in "</s>"] + [eos]
    trajectory.add_model_turn(sampled, [-1.0] * len(sampled))
    text = tokenizer.decode(trajectory.response_ids)
    assert text == "ok</s></s>"
    again = ids(tokenizer, text)
    first_difference = next(i for i, (a, b) in enumerate(zip(again, sampled)) if a != b)
    assert first_difference == 2 and again[2] == eos  # re-tokenized, the spelled-out text became one EOS
    assert len(again) == 4 and len(sampled) == 7  # and the trainer would score 4 tokens the model never sampled
    assert trajectory.response_ids == sampled  # the trajectory keeps what was sampled, mask and log-probs aligned
    assert trajectory.response_mask == [1] * 7 and len(trajectory.log_probs) == 7


def test_templates_that_cannot_frame_observations_as_ids_are_refused(tmp_path):
    from transformers import AutoTokenizer

    def tokenizer_with(template, name):
        return AutoTokenizer.from_pretrained(str(save_chat_tokenizer(tmp_path / name, 256, template)))

    no_eos = "{% for m in messages %}[{{ m['role'] }}]{{ m['content'] }}{% endfor %}"
    with pytest.raises(ChatTemplateError, match=r"does not end an assistant turn with the end-of-turn token id 2"):
        ChatFormat(tokenizer_with(no_eos, "no_eos"))
    last_two = ("{% for m in messages[-2:] %}<s>{{ m['role'] }}:{{ m['content'] }}</s>{% endfor %}"
                "{% if add_generation_prompt %}<s>assistant:{% endif %}")
    chat = ChatFormat(tokenizer_with(last_two, "last_two"))
    with pytest.raises(ChatTemplateError, match="cannot be cut out as ids"):
        chat.observation_ids([{"role": "tool", "content": "5"}])
    with pytest.raises(ChatTemplateError, match="has no chat template"):
        ChatFormat(tokenizer_with(None, "none"))
    with pytest.raises(ValueError, match="a model turn of 2 ids came with 1 log-probs"):
        Trajectory([1]).add_model_turn([5, 6], [-1.0])


def test_a_template_that_ignores_tools_gets_them_in_the_system_message(tokenizer):
    from workers.rollout.agent import Calculator

    tools = [Calculator().schema()]
    chat = ChatFormat(tokenizer, tools=tools)  # this template renders no tools
    assert chat.tool_instructions.startswith('To call a tool, write <tool_call>{"name": NAME')
    assert '"name":"calculator"' in chat.tool_instructions
    text = tokenizer.decode(chat.prompt_ids([{"role": "user", "content": "2+3?"}]))
    assert text == f"<s>system:{chat.tool_instructions}</s>;<s>user:2+3?</s>;<s>assistant:"
    with_system = tokenizer.decode(chat.prompt_ids([{"role": "system", "content": "Be brief."},
                                                    {"role": "user", "content": "2+3?"}]))
    assert with_system.startswith(f"<s>system:Be brief. {chat.tool_instructions}</s>;")
    assert ChatFormat(tokenizer, tools=tools, tool_format="json").tool_instructions.startswith(
        'To call a tool, write a line {"tool": NAME')
    assert ChatFormat(tokenizer).tool_instructions is None  # no tools, nothing to say


def test_a_template_that_renders_tools_gets_them_from_the_template(tmp_path):
    from transformers import AutoTokenizer

    from workers.rollout.agent import Calculator

    template = "{% if tools %}<s>tools:{{ tools | length }}</s>;{% endif %}" + TEMPLATE
    tokenizer = AutoTokenizer.from_pretrained(str(save_chat_tokenizer(tmp_path / "t", 256, template)))
    chat = ChatFormat(tokenizer, tools=[Calculator().schema()])
    assert chat.tool_instructions is None
    assert tokenizer.decode(chat.prompt_ids([{"role": "user", "content": "x"}])).startswith("<s>tools:1</s>;<s>user:x")
    observation = chat.observation_ids([{"role": "tool", "content": "5"}])
    assert tokenizer.decode(observation) == ";<s>tool:5</s>;<s>assistant:"  # the tools' block is not repeated
