"""The configuration reference, written from the typed config tree: every key, its type, default, meaning and checks.

    python tools/config_reference.py > docs/reference/configuration.md   # the docs build does this itself

The meaning of a key is the comment its dataclass field carries (on its line, or the comment lines just
above it). Its checks are the problems that ``check_config`` / ``check_sft_config`` and the section's own
``__post_init__`` report about it, read from their source: a message that names the dotted key (or, in a
section's own checks, the field), with each value it formats shown as ``…``.
"""

from __future__ import annotations

import ast
import collections.abc
import dataclasses
import inspect
import io
import re
import sys
import textwrap
import tokenize
import types
import typing
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

__all__ = ["render"]

# The module whose problems name the keys of each tree.
# the RL job's checks: the tree's own, then each feature's room (controller/checks)
RL_CHECKS = ["controller/config.py", *sorted(str(p.relative_to(ROOT)) for p in (ROOT / "controller" / "checks").glob("*.py"))]
SFT_CHECKS = "controller/sft/config.py"


def _type_name(hint) -> str:
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        return " | ".join(_type_name(a) for a in typing.get_args(hint))
    if origin is not None:
        args = typing.get_args(hint)
        name = getattr(origin, "__name__", str(origin))
        if name == "Callable":
            return "function"
        return f"{name}[{', '.join(_type_name(a) for a in args if a is not Ellipsis)}]" if args else name
    if hint is type(None):
        return "null"
    if hint is typing.Any:
        return "any"
    if hint is type:
        return "class"
    if hint is collections.abc.Callable:
        return "function"
    return getattr(hint, "__name__", str(hint))


def _default(field: dataclasses.Field) -> str:
    if field.default is not dataclasses.MISSING:
        value = field.default
    elif field.default_factory is not dataclasses.MISSING:
        value = field.default_factory()
    else:
        return "(required)"
    if dataclasses.is_dataclass(value):
        return "(section)"
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, tuple):
        value = list(value)
    return f"`{value!r}`"


def _field_comments(cls: type) -> dict[str, str]:
    """Each field's comment: the one on its line, after the comment lines just above it."""
    try:
        source = textwrap.dedent(inspect.getsource(cls))
    except (OSError, TypeError):
        return {}
    lines = source.splitlines()
    comments: dict[int, str] = {}
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type == tokenize.COMMENT:
            comments[token.start[0]] = token.string.lstrip("#").strip()
    out = {}
    body = ast.parse(source).body[0].body
    for node in body:
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            above, line = [], node.lineno - 1
            while line >= 1 and lines[line - 1].strip().startswith("#"):
                above.insert(0, comments.get(line, ""))
                line -= 1
            text = " ".join([*above, *([comments[node.lineno]] if node.lineno in comments else [])])
            out[node.target.id] = text
    return out


def _message(node: ast.AST) -> str | None:
    """A problem's text: literal parts kept, each formatted value as ``…``."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.JoinedStr):
        return "".join(v.value if isinstance(v, ast.Constant) else "…" for v in node.values)
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
        left, right = _message(node.left), _message(node.right)
        return left + right if left is not None and right is not None else None
    return None


def _problems(source: str) -> list[str]:
    """Every message given to ``problems.append`` or raised, in ``source``."""
    found = []
    nodes = sorted((n for n in ast.walk(ast.parse(source)) if hasattr(n, "lineno")), key=lambda n: (n.lineno, n.col_offset))
    for node in nodes:
        arg = None
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "append" \
                and isinstance(node.func.value, ast.Name) and node.func.value.id == "problems" and node.args:
            arg = node.args[0]
        elif isinstance(node, ast.Raise) and isinstance(node.exc, ast.Call) and node.exc.args:
            arg = node.exc.args[0]
        message = _message(arg) if arg is not None else None
        if message and len(message) > 12:
            found.append(" ".join(message.split()))
    return found


def _section_checks(cls: type) -> list[str]:
    post_init = cls.__dict__.get("__post_init__")
    if post_init is None:
        return []
    try:
        return _problems(inspect.cleandoc("\n" + inspect.getsource(post_init)))
    except (OSError, TypeError, SyntaxError):
        return []


def _checks_for(key: str, field: str, global_checks: list[str], own: list[str]) -> list[str]:
    pattern = re.compile(rf"(?<![\w.]){re.escape(key)}(?![\w])")
    local = re.compile(rf"(?<![\w.]){re.escape(field)}(?![\w])")
    hits = [m for m in global_checks if pattern.search(m)]
    hits += [m for m in own if local.search(m) and m not in hits]
    return list(dict.fromkeys(hits))


def _section(cls: type, prefix: str, global_checks: list[str], out: list[str], seen: set, title: str | None = None) -> None:
    hints = typing.get_type_hints(cls)
    comments = _field_comments(cls)
    own = _section_checks(cls)
    fields = [f for f in dataclasses.fields(cls) if f.init]
    title = title or (f"`{prefix}`" if prefix else "top level")
    doc = (inspect.getdoc(cls) or "").split("\n\n")[0]
    if doc.startswith(f"{cls.__name__}("):  # the signature dataclasses write for a class without a docstring
        doc = ""
    out += [f"### {title}", "", f"`{cls.__name__}`. {doc}".strip(), "",
            "| key | type | default | meaning |", "|---|---|---|---|"]
    nested = []
    checks = []
    for f in fields:
        key = f"{prefix}.{f.name}" if prefix else f.name
        hint = hints[f.name]
        section = next((a for a in (typing.get_args(hint) or (hint,))
                        if dataclasses.is_dataclass(a) and isinstance(a, type)), None)
        meaning = comments.get(f.name, "").replace("|", "\\|")
        kind = f"section ({section.__name__})" if section is not None else _type_name(hint).replace("|", "\\|")
        if section is not None and type(None) in typing.get_args(hint):
            kind += " \\| null"
        out.append(f"| `{key}` | {kind} | {_default(f)} | {meaning} |")
        if section is not None:  # its keys' own checks are listed in its table
            nested.append((section, key))
            continue
        for message in _checks_for(key, f.name, global_checks, own):
            checks.append(f"- `{key}`: {message}")
    out.append("")
    if checks:
        out += ["Checked before any process starts:", "", *checks, ""]
    for section, key in nested:
        if (section, key) not in seen:
            seen.add((section, key))
            _section(section, key, global_checks, out, seen)


def _registered(global_checks: list[str], out: list[str]) -> None:
    """The sections of the registered roles hybridflow ships (the teacher), and the built-in algorithms' own
    settings (their ``Config``, read from the ``algorithm:`` section)."""
    from controller.algorithms.algorithm import ALGORITHMS, NoSettings
    from controller.rl.role_registry import ROLE_TYPES

    for name, role in sorted(ROLE_TYPES.items()):
        module = inspect.getsource(sys.modules[role.section.__module__])
        _section(role.section, name, [*global_checks, *_problems(module)], out, set(),
                 title=f"`{name}` (a registered role: its section is the job's `roles.{name}`)")
    for name, (cls, _) in sorted(ALGORITHMS.items()):
        if cls.Config is not NoSettings and cls.__module__.startswith("controller."):
            _section(cls.Config, "algorithm", global_checks, out, set(),
                     title=f"`algorithm` with `algorithm.name: {name}` (its own settings)")


def render() -> str:
    from controller.config import RLConfig
    from controller.sft.config import SFTConfig

    out = ["# Configuration reference", "",
           "Every key of the two job configs, written from the typed dataclasses (`controller/config.py`,",
           "`controller/sft/config.py` and the sections they hold) when the site is built, so it cannot drift",
           "from the code. A YAML file gives values (`hybridflow train --config job.yaml`), `key.sub=value`",
           "arguments override them, and the Python API fills the same tree (`RLTrainer(config)`, or its",
           "keyword form). An unknown key is refused with the valid ones named; the checks listed under each",
           "table run before any process starts (`…` stands for the value the message names).", "",
           "## RL jobs (`hybridflow train`)", ""]
    checks = [m for path in RL_CHECKS for m in _problems((ROOT / path).read_text())]
    _section(RLConfig, "", checks, out, set())
    _registered(checks, out)
    out += ["## SFT jobs (`hybridflow sft`)", ""]
    _section(SFTConfig, "", _problems((ROOT / SFT_CHECKS).read_text()), out, set())
    return "\n".join(out).rstrip() + "\n"


if __name__ == "__main__":
    sys.stdout.write(render())
