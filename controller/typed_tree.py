"""The typed tree's plumbing: YAML values into typed dataclass sections (errors naming the dotted key), back
into plain values, and ``key.sub=value`` overrides.

``build(cls, value, where)`` builds ``value`` as type ``cls``: a dataclass from a mapping of its fields
(unknown keys refused, listing the valid ones; a section may own keys of its own, ``split_section``),
unions, tuples, mappings, functions and classes given from Python, and YAML's scalars.
"""

from __future__ import annotations

import collections.abc
import dataclasses
import types
import typing
from pathlib import Path
from typing import Any

import yaml

from controller.errors import ConfigError

__all__ = ["apply_overrides", "build", "config_to_dict", "read_config_values"]


def build(cls: Any, value: Any, where: str) -> Any:
    """``value`` (from YAML) as type ``cls``; errors name the dotted key."""
    origin = typing.get_origin(cls)
    if dataclasses.is_dataclass(cls):
        return _build_section(cls, value, where)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(cls)
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return build(arg, value, where)
            except ConfigError as exc:
                errors.append(str(exc))
        raise ConfigError(errors[0] if errors else f"{where}: cannot be {value!r}")
    if origin is tuple:
        if not isinstance(value, (list, tuple)):
            value = [value]
        inner = typing.get_args(cls)[0]
        return tuple(build(inner, v, f"{where}[{i}]") for i, v in enumerate(value))
    if origin is dict or cls is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{where}: expected a mapping, got {value!r}")
        return dict(value)
    if cls is Any:
        return value
    if origin is collections.abc.Callable:
        if not callable(value):
            raise ConfigError(f"{where}: expected a function, got {value!r}")
        return value
    if cls is type:
        if not isinstance(value, type):
            raise ConfigError(f"{where}: expected a class, got {value!r}")
        return value
    return _build_scalar(cls, value, where)


def _build_section(cls: Any, value: Any, where: str) -> Any:
    """A dataclass section from a mapping of its fields, each built as its type says."""
    if isinstance(value, cls):
        return value
    if not isinstance(value, dict):
        raise ConfigError(f"{where or 'config'}: expected a mapping of {cls.__name__} fields, got {value!r}")
    if hasattr(cls, "split_section"):  # a section whose keys a part of it owns (an algorithm's own settings)
        value = cls.split_section(value, where, build)
    hints = typing.get_type_hints(cls)
    fields = {f.name for f in dataclasses.fields(cls) if f.init}
    unknown = sorted(set(value) - fields)
    if unknown:
        raise ConfigError(f"{where or 'config'}: unknown key(s) {unknown}; valid keys: {sorted(fields)}")
    kwargs = {k: build(hints[k], v, f"{where}.{k}" if where else k) for k, v in value.items()}
    try:
        return cls(**kwargs)
    except ConfigError:
        raise
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"{where or 'config'}: {exc}") from None


def _build_scalar(cls: Any, value: Any, where: str) -> Any:
    """A bool, int, float or str as YAML gives it (a float also from YAML 1.1's dotless 1e-4 string)."""
    if cls is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{where}: expected true or false, got {value!r}")
        return value
    if cls is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{where}: expected an integer, got {value!r}")
        return value
    if cls is float:
        if isinstance(value, str):  # YAML 1.1 reads 1e-4 (no dot) as a string
            try:
                return float(value)
            except ValueError:
                pass
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{where}: expected a number, got {value!r}")
        return float(value)
    if cls is str:
        if not isinstance(value, str):
            raise ConfigError(f"{where}: expected a string, got {value!r}")
        return value
    return value


def config_to_dict(config: Any) -> Any:
    if dataclasses.is_dataclass(config):
        return {f.name: config_to_dict(getattr(config, f.name)) for f in dataclasses.fields(config) if f.init}
    if isinstance(config, tuple):
        return [config_to_dict(v) for v in config]
    if isinstance(config, dict):
        return {k: config_to_dict(v) for k, v in config.items()}
    if callable(config):  # a function or class given from Python: its import path, as YAML names it
        return f"{config.__module__}:{config.__qualname__}"
    return config


def apply_overrides(values: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """``key.sub=value`` strings applied to a nested dict; values are parsed as YAML scalars/lists."""
    values = yaml.safe_load(yaml.safe_dump(values)) or {}
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"override {item!r} is not of the form key.sub=value")
        node = values
        parts = key.split(".")
        for part in parts[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ConfigError(f"override {item!r}: {part!r} is a value, not a section")
        node[parts[-1]] = yaml.safe_load(raw) if raw != "" else ""
    return values


def read_config_values(path: str | Path | None, overrides: list[str] | None) -> dict[str, Any]:
    """A YAML file's mapping (None: empty) with ``key.sub=value`` overrides applied."""
    values: dict[str, Any] = {}
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"config file {path} does not exist")
        values = yaml.safe_load(path.read_text()) or {}
        if not isinstance(values, dict):
            raise ConfigError(f"{path} must hold a mapping at the top level, got {type(values).__name__}")
    return apply_overrides(values, overrides or [])
