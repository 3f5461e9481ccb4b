"""SFT examples as ids: the assistant-only mask of a chat against one built by hand from the template's
text, pairs as the rollout renders prompts, plain text, and the refusals."""

import pytest

from controller.data.chat_template import PromptFormat
from controller.data.sft_examples import ChatTemplateError, encode_messages, encode_pair, encode_text


@pytest.fixture(scope="module")
def chat_tokenizer(tmp_path_factory):
    from transformers import AutoTokenizer

    from controller.models.builtin import resolve_model_path

    return AutoTokenizer.from_pretrained(resolve_model_path("builtin:tiny-chat", tmp_path_factory.mktemp("m")))


def ids(tokenizer, text):
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def test_the_assistant_only_mask_equals_one_built_by_hand_from_the_template(chat_tokenizer):
    tok = chat_tokenizer
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "2+2="},
                {"role": "assistant", "content": "4"}, {"role": "user", "content": "and 3*3?"},
                {"role": "assistant", "content": "9"}]
    # The template writes each turn as <s>role:content</s>; by hand: learned are the assistant contents and
    # their </s> (the end of turn), not the ';' framing after it, nor any header or other turn.
    segments = [("<s>system:be brief</s>;", 0), ("<s>user:2+2=</s>;", 0), ("<s>assistant:", 0), ("4</s>", 1),
                (";", 0), ("<s>user:and 3*3?</s>;", 0), ("<s>assistant:", 0), ("9</s>", 1), (";", 0)]
    expected_ids, expected_mask = [], []
    for text, learned in segments:
        piece = ids(tok, text)
        expected_ids += piece
        expected_mask += [learned] * len(piece)
    example = encode_messages(messages, tok)
    assert example.prompt_ids + example.response_ids == expected_ids
    first = expected_mask.index(1)
    assert example.prompt_ids == expected_ids[:first]  # the context up to the first learned token
    assert example.loss_mask == expected_mask[first:]
    assert tok.decode([t for t, m in zip(example.response_ids, example.loss_mask) if m]) == "4</s>9</s>"


def test_a_pair_renders_its_prompt_as_the_rollout_does_and_learns_the_response_and_eos(chat_tokenizer):
    tok = chat_tokenizer
    chat = encode_pair("7+5=", "12", tok, PromptFormat(chat_wrap=True), chat=True)
    assert tok.decode(chat.prompt_ids) == "<s>user:7+5=</s>;<s>assistant:"
    assert chat.response_ids == ids(tok, "12") + [tok.eos_token_id] and chat.loss_mask == [1, 1, 1]
    plain = encode_pair("7+5=", "12", tok, PromptFormat(apply_chat_template=False))
    assert plain.prompt_ids == ids(tok, "7+5=") and plain.learned == 3


def test_plain_text_learns_every_token_after_the_first(chat_tokenizer):
    tok = chat_tokenizer
    example = encode_text("abc", tok)
    assert example.prompt_ids == ids(tok, "a") and example.response_ids == ids(tok, "bc") + [tok.eos_token_id]
    assert example.loss_mask == [1, 1, 1]
    with pytest.raises(ValueError, match="text is empty"):
        encode_text("", tok)


def test_bad_chats_are_refused_with_what_is_wrong(chat_tokenizer):
    tok = chat_tokenizer
    with pytest.raises(ValueError, match="no assistant message"):
        encode_messages([{"role": "user", "content": "hi"}], tok, where="row 3")
    with pytest.raises(ValueError, match="starts with an assistant turn"):
        encode_messages([{"role": "assistant", "content": "hi"}], tok)
    unstable = tok.__class__.from_pretrained(tok.name_or_path)
    # A template that numbers turns from the end: a longer chat re-renders the earlier turns differently.
    unstable.chat_template = ("{% for m in messages %}<s>{{ messages|length - loop.index }}{{ m['content'] }}</s>"
                              "{% endfor %}{% if add_generation_prompt %}<s>{% endif %}")
    with pytest.raises(ChatTemplateError, match="cannot be cut out"):
        encode_messages([{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"},
                         {"role": "user", "content": "c"}, {"role": "assistant", "content": "d"}], unstable)
