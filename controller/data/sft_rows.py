"""An SFT job's examples: rows of files (or the built-in arithmetic pairs) encoded with the model's tokenizer.

Each row is a prompt/response pair, a chat (``messages``: the loss on assistant turns) or plain text,
by ``data.format`` or, with "auto", by the keys the row has; a pair or chat may hold images
(``data.image_key``, ``<image>`` placeholders), for a vision-language model. Examples longer than ``data.max_length``
are refused, naming how many and the longest, or dropped with ``data.drop_overlong``.
"""

from __future__ import annotations

from typing import Any, Callable

from controller.data.chat_template import PromptFormat, uses_chat_template, with_placeholders
from controller.data.dataset import lookup_key
from controller.data.files import read_rows
from controller.data.images import ImageProcessing, row_images
from controller.data.sft_examples import SFTExample, encode_messages, encode_pair, encode_text, with_images

__all__ = ["SFTData", "load_sft_examples", "arithmetic_pairs"]


class SFTData:
    def __init__(self, train: list[SFTExample], val: list[SFTExample]) -> None:
        self.train, self.val = train, val


def arithmetic_pairs(count: int, seed: int, max_operand: int, operators: str) -> list[dict[str, str]]:
    """The RL demo's task as supervised pairs: ``{"prompt": "7+5=", "response": "12"}``."""
    from controller.data.arithmetic import arithmetic_problems

    return [{"prompt": f"{p.a}{p.op}{p.b}=", "response": str(p.answer)}
            for p in arithmetic_problems(count, seed, max_operand, operators)]


def _encoder(data, tokenizer, images: ImageProcessing | None = None) -> Callable[[dict[str, Any], str], SFTExample]:
    fmt = PromptFormat(data.apply_chat_template, data.chat_wrap, data.system_prompt)
    chat = uses_chat_template(fmt, tokenizer)

    def encode(row: dict[str, Any], where: str) -> SFTExample:
        row_imgs = row_images(row, data.image_key, where)
        if not row_imgs:
            return encode_text_or_chat(row, where)
        if images is None:
            raise ValueError(f"{where} has images (its {data.image_key!r} column), but the model is text only; "
                             "fine-tune a vision-language model (Qwen2.5-VL) or drop the column")
        row = dict(row)
        for key in (data.messages_key, data.prompt_key):
            found, value = lookup_key(row, key)
            if found and "." not in key:
                row[key] = with_placeholders(value, images, len(row_imgs), where)
                break
        else:
            raise ValueError(f"{where} has images: a pair's prompt or a chat's messages must hold their <image> "
                             "placeholders (plain text takes no images)")
        return with_images(encode_text_or_chat(row, where), row_imgs, images, where)

    def encode_text_or_chat(row: dict[str, Any], where: str) -> SFTExample:
        found = {key: lookup_key(row, getattr(data, f"{key}_key"))
                 for key in ("messages", "prompt", "response", "text")}
        kind = data.format
        if kind == "auto":
            kind = ("messages" if found["messages"][0] else "pair" if found["prompt"][0] and found["response"][0]
                    else "text" if found["text"][0] else None)
            if kind is None:
                raise ValueError(f"{where}: no {data.messages_key!r}, {data.prompt_key!r} + {data.response_key!r} "
                                 f"or {data.text_key!r} column (the row has {sorted(row)}); set data.*_key")
        needed = {"messages": ("messages",), "pair": ("prompt", "response"), "text": ("text",)}[kind]
        missing = [getattr(data, f"{k}_key") for k in needed if not found[k][0]]
        if missing:
            raise ValueError(f"{where}: data.format {kind} needs column(s) {missing}; the row has {sorted(row)}")
        if kind == "messages":
            return encode_messages(found["messages"][1], tokenizer, where, tools=row.get("tools") or None)
        if kind == "pair":
            return encode_pair(found["prompt"][1], found["response"][1], tokenizer, fmt, chat, where)
        return encode_text(found["text"][1], tokenizer, where)

    return encode


def _encode_all(rows: list[dict[str, Any]], source: str, encode, data, log) -> list[SFTExample]:
    examples = [encode(row, f"{source} row {i}") for i, row in enumerate(rows)]
    lengths = [len(e.prompt_ids) + len(e.response_ids) for e in examples]
    overlong = [i for i, n in enumerate(lengths) if n > data.max_length]
    if overlong and not data.drop_overlong:
        raise ValueError(f"{source}: {len(overlong)} example(s) are longer than data.max_length {data.max_length} "
                         f"tokens (the longest: {max(lengths)}, row {lengths.index(max(lengths))}); raise "
                         f"data.max_length or set data.drop_overlong=true")
    if overlong:
        log(f"[hybridflow] {source}: dropped {len(overlong)} of {len(rows)} examples over data.max_length "
            f"{data.max_length} tokens")
    kept = [e for i, e in enumerate(examples) if i not in set(overlong)]
    if not kept or not any(e.learned for e in kept):
        raise ValueError(f"{source}: no example with a learned token is left")
    return kept


def load_sft_examples(data, tokenizer, log: Callable[[str], None] | None = None,
                      images: ImageProcessing | None = None) -> SFTData:
    """The train and validation examples of ``data`` (an SFTDataConfig), encoded; raises on bad rows. ``images``:
    a vision-language model's image processing (rows with images need it)."""
    log = log or print
    encode = _encoder(data, tokenizer, images)
    if data.task == "arithmetic":
        train_rows = arithmetic_pairs(data.train_size, data.seed, data.max_operand, data.operators)
        val_rows = arithmetic_pairs(data.val_size, data.seed + 1, data.max_operand, data.operators) if data.val_size else []
        sources = [("arithmetic (train)", train_rows)], [("arithmetic (val)", val_rows)] if val_rows else []
    elif data.task == "calculator_transcripts":
        from controller.data.tool_transcripts import calculator_transcripts

        def transcripts(count: int, seed: int) -> list[dict[str, Any]]:
            return calculator_transcripts(count, seed, tokenizer, data.steps, data.max_operand, data.operators,
                                          data.tool_format)

        train_rows = transcripts(data.train_size, data.seed)
        val_rows = transcripts(data.val_size, data.seed + 1) if data.val_size else []
        sources = ([("calculator transcripts (train)", train_rows)],
                   [("calculator transcripts (val)", val_rows)] if val_rows else [])
    else:
        sources = ([(str(p), read_rows(p)) for p in data.train_files], [(str(p), read_rows(p)) for p in data.val_files])
    train = [e for source, rows in sources[0] for e in _encode_all(rows, source, encode, data, log)]
    val = [e for source, rows in sources[1] for e in _encode_all(rows, source, encode, data, log)]
    if len(train) < data.batch_size:
        raise ValueError(f"{len(train)} training examples are fewer than data.batch_size {data.batch_size}")
    return SFTData(train, val)
