"""The version guard behind every patch of another library's internals.

Each library whose internals the project patches or reads has one compat
module, and every such patch lives there: torch in
``hybridengine/device/torch_compat.py``, megatron-core in
``workers/megatron/megatron_compat.py``, vLLM in
``workers/rollout/vllm_compat.py``, Ray in
``controller/runtime/ray_compat.py``. Each builds one ``LibraryShim``: the
library's name, the release series its patches were written for, and the
registry of its patches, each with one line on why it exists and one on when
it can go.

At load a compat module calls ``check_version``: an installed version outside
the series it was written for gives one ``CompatWarning`` per process, naming
the patches and both versions. A private name a patch needs and the installed
version lacks raises ``CompatError`` (naming the patch, the name and both
versions) when the patch is applied or the name first used.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import inspect
import re
import warnings
from dataclasses import dataclass
from types import ModuleType
from typing import Any, Callable, Iterable, TypeVar

__all__ = ["CompatError", "CompatWarning", "LibraryShim", "Patch", "distribution_version"]

F = TypeVar("F", bound=Callable[..., Any])

# What this process has warned about: library names (unknown version), (library, patch) pairs (patch skipped).
_warned: set[Any] = set()


class CompatError(RuntimeError):
    """A patch needs a name of a library's internals that the installed version does not have."""


class CompatWarning(UserWarning):
    """A library's installed version is not one its patches were written for, or an optional patch was skipped."""


@dataclass(frozen=True)
class Patch:
    """One patch of a library's internals: ``why`` it exists and when it can go (``remove_when``), a line each."""

    name: str
    why: str
    remove_when: str
    optional: bool = False  # a speed-up only: a missing name skips it with a warning instead of failing

    def line(self) -> str:
        return f"Patch ``{self.name}``: {self.why} Remove when: {self.remove_when}"


def distribution_version(distributions: Iterable[str]) -> str | None:
    """The installed version of the first of ``distributions`` that is installed (None: none is)."""
    for name in distributions:
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def _release(version: str) -> tuple[int, ...]:
    """The leading release numbers of a version string: '2.13.0+cpu' -> (2, 13, 0)."""
    match = re.match(r"\d+(?:\.\d+)*", version)
    return tuple(int(part) for part in match.group(0).split(".")) if match else ()


class LibraryShim:
    """One library's patches, the release series they were written for, and the checks that guard them.

    ``distributions``: the package names the library installs under (the first installed one is read);
    ``written_for``: release series such as ``"0.16"`` (any 0.16.x) or ``"2.13.0"`` (that release only).
    """

    def __init__(self, library: str, distributions: Iterable[str], written_for: Iterable[str],
                 patches: Iterable[Patch], module: str) -> None:
        self.library = library
        self.distributions = tuple(distributions)
        self.written_for = tuple(written_for)
        self.module = module  # the compat module that holds the patches
        self.patches: dict[str, Patch] = {}
        for patch in patches:
            if patch.name in self.patches:
                raise ValueError(f"{library}: patch {patch.name!r} is registered twice")
            if not patch.why.strip() or not patch.remove_when.strip():
                raise ValueError(f"{library}: patch {patch.name!r} needs a why and a remove_when line")
            self.patches[patch.name] = patch
        if not self.distributions or not self.written_for:
            raise ValueError(f"{library}: name its distributions and the versions its patches were written for")
        self.applied_by: dict[str, str] = {}  # patch name -> the function that applies it
        self.version_checked = False

    # ------------------------------------------------------------ versions
    def installed_version(self) -> str | None:
        return distribution_version(self.distributions)

    def is_written_for(self, version: str) -> bool:
        release = _release(version)
        return any(release[: len(series)] == series for series in map(_release, self.written_for))

    def describe_written_for(self) -> str:
        return " or ".join(s + ".x" if s.count(".") == 1 else s for s in self.written_for)

    def check_version(self) -> bool:
        """Warn once per process when the installed version is not one the patches were written for.

        Returns whether it is (True too when the library is not installed: nothing is patched then).
        """
        self.version_checked = True
        installed = self.installed_version()
        if installed is None or self.is_written_for(installed):
            return True
        if self.library not in _warned:
            _warned.add(self.library)
            warnings.warn(
                f"{self.library} {installed} is installed; hybridflow's patches of its internals "
                f"({self.module}) were written for {self.library} {self.describe_written_for()}. "
                f"They may no longer apply: {', '.join(self.patches)}. A patch whose private name is gone "
                f"raises CompatError when applied; check each patch against {installed} and add the series "
                f"to written_for.",
                CompatWarning,
                stacklevel=2,
            )
        return False

    # ------------------------------------------------------------- patches
    def patch(self, name: str) -> Patch:
        try:
            return self.patches[name]
        except KeyError:
            raise ValueError(f"{self.library} has no registered patch {name!r}; registered: "
                             f"{sorted(self.patches)}") from None

    def applies(self, patch: str) -> Callable[[F], F]:
        """Decorator: ``fn`` applies (or uses) ``patch``; its docstring gets the patch's why / remove-when line."""
        entry = self.patch(patch)

        def mark(fn: F) -> F:
            self.applied_by[patch] = f"{fn.__module__}.{fn.__qualname__}"
            doc = inspect.cleandoc(fn.__doc__ or "")
            fn.__doc__ = f"{doc}\n\n{entry.line()}" if doc else entry.line()
            return fn

        return mark

    # ---------------------------------------------------------- private names
    def _where(self) -> str:
        installed = self.installed_version() or "(not installed)"
        return (f"{self.library} {installed} is installed; the patch was written for "
                f"{self.library} {self.describe_written_for()}")

    def require(self, obj: Any, name: str, *, patch: str) -> Any:
        """``obj.name``, or CompatError naming the patch, the missing name and both versions."""
        entry = self.patch(patch)
        try:
            return getattr(obj, name)
        except AttributeError:
            raise CompatError(f"{self.library} patch {entry.name!r} needs {_owner(obj)}.{name}, which is "
                              f"missing: {self._where()}. ({entry.why})") from None

    def import_module(self, module: str, *, patch: str) -> ModuleType:
        """The module named ``module``, or CompatError naming the patch when it cannot be imported."""
        entry = self.patch(patch)
        try:
            return importlib.import_module(module)
        except ImportError as exc:
            raise CompatError(f"{self.library} patch {entry.name!r} needs the module {module}, which cannot be "
                              f"imported ({exc}): {self._where()}. ({entry.why})") from None

    def require_parameters(self, func: Callable, names: Iterable[str], *, patch: str) -> None:
        """CompatError unless ``func`` takes every parameter in ``names`` (what the patch passes or accepts)."""
        entry = self.patch(patch)
        params = inspect.signature(func).parameters
        missing = [n for n in names if n not in params]
        if missing:
            raise CompatError(f"{self.library} patch {entry.name!r} needs {func.__qualname__} to take parameters "
                              f"{missing}; it takes {list(params)}: {self._where()}. ({entry.why})")

    def optional(self, obj: Any, name: str, *, patch: str, default: Any = None) -> Any:
        """``obj.name`` for an optional patch; ``default`` and one warning per process when it is missing."""
        entry = self.patch(patch)
        if not entry.optional:
            raise ValueError(f"{self.library} patch {patch!r} is not optional; use require()")
        try:
            return getattr(obj, name)
        except AttributeError:
            self.skip(patch, f"{_owner(obj)}.{name} is missing")
            return default

    def skip(self, patch: str, reason: str) -> None:
        """Warn, once per process, that the optional ``patch`` is skipped for ``reason``."""
        entry = self.patch(patch)
        key = (self.library, entry.name)
        if key not in _warned:
            _warned.add(key)
            warnings.warn(f"{self.library} patch {entry.name!r} skipped: {reason}; {self._where()}. "
                          f"Without it: {entry.why}", CompatWarning, stacklevel=3)


def _owner(obj: Any) -> str:
    if isinstance(obj, ModuleType):
        return obj.__name__
    if isinstance(obj, type):
        return f"{obj.__module__}.{obj.__qualname__}"
    return f"{type(obj).__module__}.{type(obj).__qualname__} instance"
