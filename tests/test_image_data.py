"""Vision-language data without a process: `hybridflow data images` writes rows that load back; each image's token
run is what transformers' processor makes and its model accepts; a bad image, a miscounted placeholder, a video or
images for a text model are refused with the row, and `hybridflow train` refuses them before any launch."""

import io
import json

import pytest
import torch
from PIL import Image

import controller.cli as cli
from conftest import ROOT
from controller.data import load_prompt_files
from controller.data.chat_template import PromptFormat, encode_prompts
from controller.data.dataset import rows_to_dataset
from controller.data.images import ImageProcessing
from controller.data.loader import PromptLoader
from controller.data.writers import write_parquet
from tiny_models import make_llama, make_qwen2_5_vl


@pytest.fixture(scope="module")
def vl_dir(tmp_path_factory):
    return make_qwen2_5_vl(tmp_path_factory.mktemp("vl"))


def png(size, colour) -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", size, colour).save(buffer, format="PNG")
    return buffer.getvalue()


def test_data_images_writes_rows_that_load_back_with_their_pixels(tmp_path, capsys):
    (tmp_path / "a.png").write_bytes(png((56, 56), (255, 0, 0)))
    (tmp_path / "b.jpg").write_bytes(png((84, 112), (0, 0, 255)))  # PNG bytes under another name: the content counts
    source = tmp_path / "rows.jsonl"
    source.write_text("".join(json.dumps(r) + "\n" for r in [
        {"prompt": [{"role": "user", "content": "<image>Which colour?"}], "images": [str(tmp_path / "a.png")],
         "ground_truth": "red"},
        {"prompt": [{"role": "user", "content": "<image> and <image>: same colour?"}],
         "images": [str(tmp_path / "b.jpg"), str(tmp_path / "a.png")], "ground_truth": "no"},
    ]))
    assert cli.main(["data", "images", "--input", str(source), "--out", str(tmp_path / "out")]) == 0
    written = tmp_path / "out" / "train.parquet"
    assert capsys.readouterr().out.split() == [str(written)]
    (tmp_path / "a.png").unlink()  # the file holds the images themselves
    data = load_prompt_files(written)
    assert data.answers == ("red", "no") and [len(i) for i in data.images] == [1, 2]
    assert data.images[0][0].getpixel((3, 3)) == (255, 0, 0) and data.images[1][0].size == (84, 112)

    bad = tmp_path / "bad.jsonl"
    (tmp_path / "cut.png").write_bytes(png((8, 8), (0, 0, 0))[:40])
    (tmp_path / "ok.png").write_bytes(png((8, 8), (0, 0, 0)))
    for row, message in [
        ({"prompt": "<image>?", "images": [str(tmp_path / "missing.png")]}, "row 0 image 0: image file .*missing.png "
                                                                            "does not exist"),
        ({"prompt": "<image>?", "images": [str(tmp_path / "cut.png")]}, "row 0 image 0: the image cannot be read"),
        ({"prompt": "no placeholder", "images": [str(tmp_path / "ok.png")]}, "row 0: the prompt holds 0 <image> "
                                                                             "placeholder"),
        ({"prompt": "<video>?", "videos": ["clip.mp4"], "images": []}, "videos are not supported"),
    ]:
        bad.write_text(json.dumps(row) + "\n")
        assert cli.main(["data", "images", "--input", str(bad), "--out", str(tmp_path / "bad_out")]) == 2
        err = capsys.readouterr().err
        assert __import__("re").search(message, err), err
    assert not (tmp_path / "bad_out").exists()


def test_image_tokens_are_the_processors_and_transformers_model_takes_them(vl_dir):
    from transformers import AutoTokenizer, Qwen2_5_VLForConditionalGeneration

    images = ImageProcessing.for_model(vl_dir)
    assert ImageProcessing.for_model(make_llama(vl_dir.parent / "text")) is None
    rows = [{"prompt": "1<image>2", "images": [{"bytes": png((84, 112), (0, 90, 200))}], "ground_truth": "a"},
            {"prompt": "<image><image>3", "images": [{"bytes": png((56, 56), (9, 9, 9))}, {"bytes": png((200, 90),
                                                                                                        (1, 2, 3))}]},
            {"prompt": "text only", "ground_truth": "b"}]
    tokenizer = AutoTokenizer.from_pretrained(vl_dir)
    data = encode_prompts(rows_to_dataset(rows), tokenizer, PromptFormat(apply_chat_template=False), images=images)
    batch = PromptLoader(data, tokenizer, 3, None, shuffle=False, images=images).batch([0, 1, 2])
    model = Qwen2_5_VLForConditionalGeneration.from_pretrained(vl_dir, dtype=torch.float32).eval()
    pad = model.config.image_token_id
    for row, inputs in enumerate(batch.non_tensor_batch["multi_modal_inputs"]):
        ids = torch.tensor([data.input_ids[row]])
        if inputs is None:
            assert batch.non_tensor_batch["multi_modal_data"][row] is None and pad not in data.input_ids[row]
            continue
        grids = inputs["image_grid_thw"]
        assert int((ids == pad).sum()) == int(grids.prod(-1).sum()) // 4  # the processor's own count
        assert [images.grid(i) for i in data.images[row]] == [tuple(g) for g in grids.tolist()]
        with torch.no_grad():  # transformers checks image tokens against image features itself
            model(input_ids=ids, pixel_values=inputs["pixel_values"], image_grid_thw=grids,
                  mm_token_type_ids=(ids == pad).int())
            with pytest.raises(ValueError, match="Image features and image tokens do not match"):
                model(input_ids=ids[:, 1:] if ids[0, 0] == pad else torch.cat([ids[:, :1], ids[:, 2:]], 1)
                      if ids[0, 1] == pad else ids[:, [i for i in range(ids.shape[1]) if i != int((ids[0] == pad)
                                                                                                  .nonzero()[0])]],
                      pixel_values=inputs["pixel_values"], image_grid_thw=grids)

    wide = [{"prompt": "<image>", "images": [{"bytes": png((4200, 20), (0, 0, 0))}]}]
    with pytest.raises(ValueError, match=r"train row 0: 4200 x 20 pixels is past the image processor's bounds "
                                         r"\(absolute aspect ratio must be smaller than 200"):
        encode_prompts(rows_to_dataset(wide), tokenizer, PromptFormat(apply_chat_template=False), "train", images)
    with pytest.raises(ValueError, match="train row 0: the prompt holds 2 <image> placeholder"):
        encode_prompts(rows_to_dataset([{**rows[0], "prompt": "<image><image>"}]), tokenizer,
                       PromptFormat(apply_chat_template=False), "train", images)
    with pytest.raises(ValueError, match="the train data has images .*, but the model is text only"):
        encode_prompts(rows_to_dataset(rows[:1]), tokenizer, PromptFormat(apply_chat_template=False), "train")


def test_train_refuses_a_bad_image_before_any_launch(tmp_path, vl_dir, monkeypatch, capsys):
    calls = []
    monkeypatch.setattr(cli, "_torchrun", lambda nproc, argv: calls.append(argv) or 0)
    rows = write_parquet([{"prompt": "<image>?", "images": [{"bytes": png((56, 56), (1, 1, 1))}], "ground_truth": "x"},
                          {"prompt": "<image>?", "images": [{"bytes": b"not an image"}], "ground_truth": "y"}],
                         tmp_path / "rows.parquet")
    code = cli.main(["train", "--config", str(ROOT / "examples" / "vision" / "grpo_colour.yaml"), f"model_path={vl_dir}",
                     f"trainer.run_dir={tmp_path / 'run'}", f"data.train_files={rows}", "data.val_files=[]",
                     "data.batch_size=2", "ppo.ppo_mini_batch_size=8"])
    assert (code, calls) == (2, [])
    assert "row 1 image 0: the image cannot be read" in capsys.readouterr().err


@pytest.mark.parametrize("override,message", [
    ("rollout.engine=megatron", "rollout.engine 'megatron' generates text only; Qwen2_5_VLForConditionalGeneration is a "
                                "vision-language model: generate with rollout.engine vllm"),
    ("algorithm.name=ppo", "algorithm 'ppo' trains a critic, and a critic on a vision-language model"),
    ("trainer.mode=one_step_off", "a rollout on a pool of its own takes its weights across pools, which carry no "
                                  "vision tower yet"),
])
def test_train_refuses_what_does_not_take_images_yet(tmp_path, vl_dir, monkeypatch, capsys, override, message):
    calls = []
    monkeypatch.setattr(cli, "_torchrun", lambda nproc, argv: calls.append(argv) or 0)
    code = cli.main(["train", "--config", str(ROOT / "examples" / "vision" / "grpo_colour.yaml"), f"model_path={vl_dir}",
                     f"trainer.run_dir={tmp_path / 'run'}", override])
    assert (code, calls) == (2, [])
    assert message in capsys.readouterr().err


def test_sft_examples_with_images_learn_the_answers_not_the_image_tokens(vl_dir):
    from types import SimpleNamespace

    from transformers import AutoTokenizer

    from controller.data.sft_rows import _encoder

    tokenizer = AutoTokenizer.from_pretrained(vl_dir)
    tokenizer.chat_template = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}</s>{% endfor %}"
                               "{% if add_generation_prompt %}<assistant>{% endif %}")
    images = ImageProcessing.for_model(vl_dir)
    data = SimpleNamespace(apply_chat_template="auto", chat_wrap=False, system_prompt=None, format="auto",
                           messages_key="messages", prompt_key="prompt", response_key="response", text_key="text",
                           image_key="images")
    encode = _encoder(data, tokenizer, images)
    pad = images.vision.image_token_id
    small, large = {"bytes": png((56, 56), (1, 2, 3))}, {"bytes": png((84, 112), (4, 5, 6))}
    pair = encode({"prompt": "<image>colour?", "response": "red", "images": [small]}, "row 0")
    assert pair.prompt_ids.count(pad) == 4 and pad not in pair.response_ids and pair.loss_mask == [1] * 4
    assert len(pair.images) == 1
    chat = encode({"messages": [{"role": "user", "content": "<image>a?"}, {"role": "assistant", "content": "x"},
                                {"role": "user", "content": "and <image>?"}, {"role": "assistant", "content": "y"}],
                   "images": [small, large]}, "row 1")
    assert chat.prompt_ids.count(pad) == 4 and chat.response_ids.count(pad) == 12  # the second image, 12 tokens
    learned = [t for t, m in zip(chat.response_ids, chat.loss_mask) if m]
    assert pad not in learned and tokenizer.decode(learned) == "x</s>y</s>"
    with pytest.raises(ValueError, match=r"row 2 has images: .* \(plain text takes no images\)"):
        encode({"text": "<image> words", "images": [small]}, "row 2")
