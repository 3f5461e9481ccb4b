"""Prompts into token ids: chats through the tokenizer's chat template exactly, plain text as is,
the loader's batches and fields, and overlong prompts dropped or refused when the data loads."""

import pytest
import torch
from chat_tokenizer import save_chat_tokenizer
from transformers import AutoTokenizer

from controller.config import DataConfig
from controller.data import OverlongPromptError, PromptDataset, PromptFormat, PromptLoader, encode_prompts
from controller.data.prepare import load_job_prompts

CHAT = [{"role": "user", "content": "What is 2 + 3?"}]


@pytest.fixture(scope="module")
def chat_tokenizer(tmp_path_factory):
    return AutoTokenizer.from_pretrained(str(save_chat_tokenizer(tmp_path_factory.mktemp("chat_tok"))))


@pytest.fixture(scope="module")
def plain_tokenizer(tmp_path_factory):
    return AutoTokenizer.from_pretrained(str(save_chat_tokenizer(tmp_path_factory.mktemp("plain_tok"), chat_template=None)))


def template_ids(tokenizer, messages):
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)


def test_chat_prompts_are_exactly_the_templates_tokens(chat_tokenizer):
    data = encode_prompts(PromptDataset((CHAT, "7+5="), ("5", "12")), chat_tokenizer)
    assert list(data.input_ids[0]) == template_ids(chat_tokenizer, CHAT)
    assert data.input_ids[0].count(chat_tokenizer.bos_token_id) == 1  # the template's BOS, not a second one
    assert data.prompt_texts[0] == "<s><|user|>What is 2 + 3?\n<|assistant|>"
    # A string prompt stays plain text, without special tokens (what the built-in task trains on).
    assert list(data.input_ids[1]) == chat_tokenizer("7+5=", add_special_tokens=False)["input_ids"]
    assert data.prompt_texts[1] == "7+5="


def test_chat_wrap_and_system_prompt(chat_tokenizer):
    fmt = PromptFormat(chat_wrap=True, system_prompt="Answer with a number.")
    data = encode_prompts(PromptDataset(("What is 2 + 3?", CHAT), ("5", "5")), chat_tokenizer, fmt)
    expected = template_ids(chat_tokenizer, [{"role": "system", "content": "Answer with a number."}, *CHAT])
    assert list(data.input_ids[0]) == expected and list(data.input_ids[1]) == expected
    # A chat that opens with its own system message keeps it.
    own = [{"role": "system", "content": "Be brief."}, *CHAT]
    assert list(encode_prompts(PromptDataset((own,), ("5",)), chat_tokenizer, fmt).input_ids[0]) == template_ids(
        chat_tokenizer, own)


def test_template_settings_and_their_errors(chat_tokenizer, plain_tokenizer):
    chats = PromptDataset((CHAT,), ("5",))
    with pytest.raises(ValueError, match="apply_chat_template is true but the tokenizer .* has no chat template"):
        encode_prompts(chats, plain_tokenizer, PromptFormat(apply_chat_template=True))
    with pytest.raises(ValueError, match=r"data row 0: it is a list of chat messages, but the chat template is off "
                                         r"\(data.apply_chat_template='auto'; the tokenizer has no chat template\)"):
        encode_prompts(chats, plain_tokenizer)
    with pytest.raises(ValueError, match="chat template is off .*apply_chat_template=False; the tokenizer has a chat"):
        encode_prompts(chats, chat_tokenizer, PromptFormat(apply_chat_template=False))
    with pytest.raises(ValueError, match="data.system_prompt is set: a system prompt needs a chat; set data.chat_wrap=true"):
        encode_prompts(PromptDataset(("7+5=",), ("12",)), chat_tokenizer, PromptFormat(system_prompt="hi"))
    with pytest.raises(ValueError, match="must be true, false or 'auto', got 'yes'"):
        PromptFormat(apply_chat_template="yes")
    # Without a template, string prompts still work as plain text.
    plain = encode_prompts(PromptDataset(("7+5=",), ("12",)), plain_tokenizer)
    assert list(plain.input_ids[0]) == plain_tokenizer("7+5=", add_special_tokens=False)["input_ids"]


def test_loader_batches_are_left_padded_with_every_field(chat_tokenizer):
    data = PromptDataset((CHAT, "7+5="), ("5", "12"), ("openai/gsm8k", "arithmetic"), ({"index": 0}, {"index": 1}))
    loader = PromptLoader(data, chat_tokenizer, batch_size=2, max_prompt_length=64, shuffle=False)
    batch = loader.next_batch()
    ids, mask = batch.batch["input_ids"], batch.batch["attention_mask"]
    chat_ids = template_ids(chat_tokenizer, CHAT)
    assert ids.shape == (2, len(chat_ids))
    assert ids[0].tolist() == chat_ids and mask[0].all()
    short = chat_tokenizer("7+5=", add_special_tokens=False)["input_ids"]
    assert ids[1, -len(short):].tolist() == short and mask[1].tolist() == [0] * (len(chat_ids) - 4) + [1] * 4
    assert (ids[1, : -len(short)] == chat_tokenizer.pad_token_id).all()
    fields = batch.non_tensor_batch
    assert list(fields["ground_truth"]) == ["5", "12"] and list(fields["uid"]) == ["p0", "p1"]
    assert list(fields["data_source"]) == ["openai/gsm8k", "arithmetic"]
    assert list(fields["extra_info"]) == [{"index": 0}, {"index": 1}]
    assert fields["prompt_text"][0].startswith("<s><|user|>") and fields["prompt_text"][1] == "7+5="
    assert batch.batch["input_ids"].dtype == torch.long


def test_overlong_prompts_are_dropped_or_named_when_the_data_loads(tmp_path, chat_tokenizer):
    import datasets

    rows = [{"prompt": "1+1=", "ground_truth": "2"}, {"prompt": "x" * 30, "ground_truth": "0"},
            {"prompt": "2+2=", "ground_truth": "4"}, {"prompt": "y" * 20, "ground_truth": "0"}]
    path = tmp_path / "rows.parquet"
    datasets.Dataset.from_list(rows).to_parquet(str(path))
    data = DataConfig(task="files", train_files=(str(path),), batch_size=2)
    with pytest.raises(OverlongPromptError) as info:
        load_job_prompts(data, chat_tokenizer, max_prompt_length=8)
    message = str(info.value)
    assert "2 of 4 training prompts are longer than rollout.max_prompt_length=8 tokens" in message
    assert "row 1 (30 tokens" in message and "row 3 (20 tokens" in message
    assert "Set data.filter_overlong_prompts=true to drop them" in message
    logged = []
    kept = load_job_prompts(DataConfig(task="files", train_files=(str(path),), batch_size=2, filter_overlong_prompts=True),
                            chat_tokenizer, max_prompt_length=8, log=logged.append).train
    assert kept.prompts == ("1+1=", "2+2=") and kept.answers == ("2", "4")
    assert logged == ["[hybridflow] data: dropped 2 of 4 training prompts longer than rollout.max_prompt_length=8 "
                      "tokens (data.filter_overlong_prompts)"]
    # Too few left for a batch: said now, not by the loader after launch.
    with pytest.raises(ValueError, match="data.batch_size 3 is larger than the 2 training prompts left after dropping"):
        load_job_prompts(DataConfig(task="files", train_files=(str(path),), batch_size=3, filter_overlong_prompts=True),
                         chat_tokenizer, max_prompt_length=8, log=logged.append)
    # rollout.truncation=left keeps a long prompt's end: nothing to refuse.
    assert len(load_job_prompts(data, chat_tokenizer, max_prompt_length=8, truncation="left").train) == 4
    # The loader refuses them too, for code that builds one by hand.
    with pytest.raises(OverlongPromptError, match="row 1 .30 tokens"):
        PromptLoader(PromptDataset(tuple(r["prompt"] for r in rows), ("2", "0", "4", "0")), chat_tokenizer, 2, 8)
