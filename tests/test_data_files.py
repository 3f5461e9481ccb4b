"""Prompt files read through HF datasets: every format, verl's row schema, renamed keys, concatenation, errors."""

import json

import pytest

from controller.data import PromptDataset, RowKeys, load_jsonl_prompts, load_prompt_files

CHAT_ROWS = [
    {"prompt": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2 + 3?"}],
     "data_source": "openai/gsm8k", "reward_model": {"style": "rule", "ground_truth": "5"},
     "extra_info": {"split": "train", "index": 0}},
    {"prompt": [{"role": "user", "content": "What is 4 * 4?"}],
     "data_source": "arithmetic", "reward_model": {"style": "rule", "ground_truth": "16"},
     "extra_info": {"split": "train", "index": 1}},
]
TEXT_ROWS = [{"prompt": "7+5=", "ground_truth": 12, "data_source": "arithmetic"}, {"prompt": "3*3=", "ground_truth": 9}]


def write(rows, path):
    """``rows`` in the format ``path``'s suffix names (a directory: datasets' save_to_disk), written by datasets."""
    import datasets

    if path.suffix == ".jsonl":
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    elif path.suffix == ".json":
        path.write_text(json.dumps(rows))  # one JSON array, as people also keep data
    elif path.suffix == ".parquet":
        datasets.Dataset.from_list(rows).to_parquet(str(path))
    else:
        datasets.Dataset.from_list(rows).save_to_disk(str(path))
    return path


@pytest.mark.parametrize("name", ["rows.parquet", "rows.jsonl", "rows.json", "saved"])
def test_chat_rows_in_every_format_keep_verl_fields(tmp_path, name):
    data = load_prompt_files(write(CHAT_ROWS, tmp_path / name))
    assert data.prompts == tuple(r["prompt"] for r in CHAT_ROWS)
    assert data.answers == ("5", "16")  # from reward_model.ground_truth
    assert data.data_sources == ("openai/gsm8k", "arithmetic")
    assert data.extra_infos == ({"split": "train", "index": 0}, {"split": "train", "index": 1})
    assert data.input_ids is None  # tokenized later, with the actor's tokenizer


@pytest.mark.parametrize("name", ["rows.parquet", "rows.jsonl", "rows.json", "saved"])
def test_string_prompts_with_a_plain_ground_truth_column(tmp_path, name):
    data = load_prompt_files(write(TEXT_ROWS, tmp_path / name))
    assert data.prompts == ("7+5=", "3*3=")
    assert data.answers == ("12", "9")  # numbers become text; reward functions compare text
    assert data.data_sources == ("arithmetic", None)
    assert data.extra_infos == ({}, {})


def test_a_list_of_files_is_concatenated_in_order(tmp_path):
    paths = [write(CHAT_ROWS, tmp_path / "a.parquet"), write(TEXT_ROWS, tmp_path / "b.jsonl"),
             write(CHAT_ROWS[:1], tmp_path / "c")]
    data = load_prompt_files(paths)
    assert len(data) == 5
    assert data.answers == ("5", "16", "12", "9", "5")
    assert data.prompts[2] == "7+5=" and data.prompts[4] == CHAT_ROWS[0]["prompt"]


def test_keys_are_configurable_and_dotted_keys_reach_into_columns(tmp_path):
    rows = [{"question": "1+1=", "meta": {"gold": 2}, "origin": "arithmetic", "info": {"level": 1}}]
    path = write(rows, tmp_path / "custom.jsonl")
    data = load_prompt_files(path, RowKeys(prompt="question", answer="meta.gold", data_source="origin", extra_info="info"))
    assert (data.prompts, data.answers, data.data_sources, data.extra_infos) == (
        ("1+1=",), ("2",), ("arithmetic",), ({"level": 1},))
    # The old single-file reader still works, on any format.
    assert load_jsonl_prompts(write(TEXT_ROWS, tmp_path / "old.jsonl")).answers == ("12", "9")


def test_bad_files_name_the_file_the_row_and_what_is_valid(tmp_path):
    with pytest.raises(FileNotFoundError, match="prompt file .*missing.parquet does not exist"):
        load_prompt_files(tmp_path / "missing.parquet")
    (tmp_path / "rows.csv").write_text("prompt\nhi\n")
    with pytest.raises(ValueError, match=r"unsupported format '.csv'; accepted: \['.json', '.jsonl', '.parquet'\]"):
        load_prompt_files(tmp_path / "rows.csv")
    path = write([{"question": "hi"}], tmp_path / "q.jsonl")
    with pytest.raises(ValueError, match=r"q.jsonl row 0 has no prompt column 'prompt' \(data.prompt_key\); columns: \['question'\]"):
        load_prompt_files(path)
    path = write([{"prompt": [{"role": "user"}]}], tmp_path / "broken.jsonl")
    with pytest.raises(ValueError, match=r"broken.jsonl row 0: 'prompt' is list .*expected a string or a non-empty list"):
        load_prompt_files(path)
    (tmp_path / "not_json.jsonl").write_text("{oops\n")
    with pytest.raises(ValueError, match="not_json.jsonl could not be read as json"):
        load_prompt_files(tmp_path / "not_json.jsonl")
    (tmp_path / "plain_dir").mkdir()
    with pytest.raises(ValueError, match="not one written by datasets' save_to_disk"):
        load_prompt_files(tmp_path / "plain_dir")


def test_a_saved_dataset_dict_asks_for_one_split(tmp_path):
    import datasets

    datasets.DatasetDict({"train": datasets.Dataset.from_list(TEXT_ROWS),
                          "test": datasets.Dataset.from_list(TEXT_ROWS)}).save_to_disk(str(tmp_path / "dd"))
    with pytest.raises(ValueError, match=r"DatasetDict with splits \['test', 'train'\]; name one split's directory"):
        load_prompt_files(tmp_path / "dd")
    assert len(load_prompt_files(tmp_path / "dd" / "train")) == 2


def test_hand_built_datasets_and_selection():
    data = PromptDataset(("a", "b", "c"), ("1", None, "3"))
    assert data.data_sources == (None, None, None) and data.extra_infos == ({}, {}, {})
    picked = data.select([2, 0])
    assert picked.prompts == ("c", "a") and picked.answers == ("3", "1")
    with pytest.raises(ValueError, match="answers has 1 rows, prompts has 2"):
        PromptDataset(("a", "b"), ("1",))
