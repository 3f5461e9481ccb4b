"""Keywords checked where they are written: a wrong one fails at the call, naming it and the valid ones.

``check_keywords(owner, fn, kwargs)`` refuses a keyword ``fn`` does not take; ``check_constructor(cls,
kwargs)`` also builds each config section given as a dict (a parameter annotated with a dataclass, such
as ``engine: EngineConfig``) and returns the keywords typed, so that a section's keys and values are
checked where they are written and a worker's constructor takes its typed config as it is. Both run
before any process starts: a ``RoleSpec``, a ``WorkerGroup`` and ``RLTrainer(...)`` call them.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import inspect
import typing
from collections.abc import Callable, Iterable
from typing import Any

__all__ = ["check_constructor", "check_keywords", "keyword_checked", "unknown_keyword_error"]


def unknown_keyword_error(owner: str, key: str, valid: Iterable[str],
                          sections: dict[str, set[str]] | None = None) -> TypeError:
    """The error for ``key``, naming the valid keywords; the hint is the config section that has a field of that
    name (``sections``: keyword -> its dataclass's fields), else the closest valid keyword."""
    valid = sorted(valid)
    owners = [name for name, fields in (sections or {}).items() if key in fields]
    close = difflib.get_close_matches(key, valid, n=1)
    hint = (f" (it is a field of {owners[0]}: {owners[0]}={{{key!r}: ...}})" if owners
            else f" (did you mean {close[0]!r}?)" if close else "")
    return TypeError(f"{owner}: unknown keyword {key!r}{hint}; valid keywords: {valid}")


def _keyword_names(fn: Callable) -> tuple[set[str], bool]:
    params = inspect.signature(fn).parameters.values()
    names = {p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) and p.name != "self"}
    return names, any(p.kind is p.VAR_KEYWORD for p in params)


def check_keywords(owner: str, fn: Callable, kwargs: dict[str, Any], extra: Iterable[str] = (),
                   sections: dict[str, set[str]] | None = None) -> None:
    """TypeError for the first keyword in ``kwargs`` that ``fn`` (or ``extra``) does not name (``sections``: the
    fields of its config-section keywords, for the hint)."""
    names, open_ended = _keyword_names(fn)
    if open_ended:
        return
    names |= set(extra)
    for key in kwargs:
        if key not in names:
            raise unknown_keyword_error(owner, key, names, sections)


def keyword_checked(fn: Callable) -> Callable:
    """``fn`` refusing an unknown keyword with the valid ones named (Python's own error names only the key)."""
    owner = fn.__qualname__.removesuffix(".__init__")

    @functools.wraps(fn)
    def checked(*args: Any, **kwargs: Any) -> Any:
        check_keywords(owner, fn, kwargs)
        return fn(*args, **kwargs)

    return checked


def _config_class(annotation: Any) -> type | None:
    """The dataclass in an annotation like ``EngineConfig | dict | None``."""
    for arg in typing.get_args(annotation) or (annotation,):
        if dataclasses.is_dataclass(arg) and isinstance(arg, type):
            return arg
    return None


def check_constructor(cls: type, kwargs: dict[str, Any], owner: str | None = None) -> dict[str, Any]:
    """``kwargs`` for ``cls(...)`` with every dict given for a dataclass-typed parameter built into that
    dataclass; a keyword ``cls`` does not take, a section's unknown key or a bad value raises here, naming
    the section. A section given typed, and every other keyword, is passed as it is."""
    owner = owner or cls.__name__
    hints = _constructor_hints(cls)
    if hints is None:  # unresolvable annotations: the names are checked, the worker checks the values
        check_keywords(owner, cls.__init__, kwargs)
        return dict(kwargs)
    sections = {name: {f.name for f in dataclasses.fields(config_cls) if f.init}
                for name, annotation in hints.items() if (config_cls := _config_class(annotation)) is not None}
    check_keywords(owner, cls.__init__, kwargs, sections=sections)
    typed = dict(kwargs)
    for key, value in kwargs.items():
        config_cls = _config_class(hints.get(key))
        if config_cls is None or not isinstance(value, dict):
            continue
        for name in value:
            if name not in sections[key]:
                raise unknown_keyword_error(f"{owner}({key}=...)", name, sections[key])
        try:
            typed[key] = config_cls(**value)
        except (TypeError, ValueError) as exc:
            raise type(exc)(f"{owner}({key}=...): {exc}") from None
    return typed


@functools.lru_cache(maxsize=None)
def _constructor_hints(cls: type) -> dict[str, Any] | None:
    try:
        return typing.get_type_hints(cls.__init__)
    except Exception:
        return None
