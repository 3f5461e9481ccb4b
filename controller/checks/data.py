"""``data:``: the prompts' task, files, sizes and chat template."""

from __future__ import annotations

from pathlib import Path

from controller.checks.facts import JobFacts

__all__ = ["data_problems", "data_section_problems"]


def data_section_problems(job: JobFacts) -> list[str]:
    data, problems = job.config.data, []
    if data.batch_size < 1:
        problems.append(f"data.batch_size must be >= 1, got {data.batch_size}")
    return problems + data_problems(data)


def data_problems(data) -> list[str]:
    from controller.config import BUILTIN_DATA_TASKS, DATA_TASKS
    from controller.data.arithmetic import ARITHMETIC_OPERATORS
    from controller.data.chat_template import apply_chat_template_problem

    problems = []
    if data.task not in DATA_TASKS:
        return [f"data.task {data.task!r} is not one of {DATA_TASKS} ('jsonl' is the old name of 'files')"]
    for old, new in (("train_file", "train_files"), ("val_file", "val_files")):
        if getattr(data, old) and getattr(data, new):
            problems.append(f"data.{old} and data.{new} are both set; give the paths once, in data.{new}")
    if data.task in BUILTIN_DATA_TASKS:
        if data.train_paths or data.val_paths:
            problems.append(f"data.train_files / val_files are set but data.task is {data.task!r} (the built-in "
                            "generator); set data.task=files to train on them")
        if data.task == "word_problems" and data.steps < 1:
            problems.append(f"data.steps must be >= 1 (operations per word problem), got {data.steps}")
        if data.train_size < 1 or data.val_size < 0:
            problems.append(f"data.train_size must be >= 1 and data.val_size >= 0, got {data.train_size}, {data.val_size}")
        if not data.operators or set(data.operators) - set(ARITHMETIC_OPERATORS):
            problems.append(f"data.operators {data.operators!r}: each must be one of {ARITHMETIC_OPERATORS!r}")
    elif not data.train_paths:
        problems.append(f"data.task {data.task!r} needs data.train_file or data.train_files (one path or a list)"
                        if data.task == "jsonl" else "data.task 'files' needs data.train_files (one path or a list)")
    for path in (*data.train_paths, *data.val_paths):
        if not Path(path).exists():
            problems.append(f"data: prompt file {path} does not exist")
    if problem := apply_chat_template_problem(data.apply_chat_template):
        problems.append(problem)
    return problems
