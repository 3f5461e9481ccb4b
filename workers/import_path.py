"""``"package.module:Name"``: a function or class named in a config, imported when the job is declared."""

from __future__ import annotations

import importlib
from typing import Any

__all__ = ["import_object"]


def import_object(path: str, what: str) -> Any:
    """The object ``path`` names; ValueError naming ``what``, the path and what went wrong otherwise."""
    module_name, _, attribute = path.partition(":")
    if not module_name or not attribute:
        raise ValueError(f"{what} {path!r} is neither a built-in nor an import path 'package.module:Name'")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ValueError(f"{what} {path!r}: cannot import {module_name!r} ({exc})") from None
    try:
        return getattr(module, attribute)
    except AttributeError:
        raise ValueError(f"{what} {path!r}: module {module_name!r} has no {attribute!r}") from None
