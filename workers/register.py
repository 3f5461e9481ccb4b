"""``@register``: marks a worker method as callable on a whole worker group."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, TypeVar

from workers.dispatch import Dispatch, get_dispatch_rule

__all__ = ["register", "MethodSpec", "registered_methods"]

_SPEC_ATTR = "__hybridflow_dispatch__"
F = TypeVar("F", bound=Callable)


@dataclass(frozen=True)
class MethodSpec:
    """How a registered method is called: its dispatch mode, whether the call blocks, whether it writes its inputs."""

    name: str
    dispatch_mode: str
    blocking: bool = True
    writes_inputs: bool = False


def register(
    dispatch_mode: Dispatch | str = Dispatch.ONE_TO_ALL, blocking: bool = True, writes_inputs: bool = False
) -> Callable[[F], F]:
    """Make a worker method a group method.

    ``dispatch_mode`` is a ``Dispatch`` member or the name given to
    ``register_dispatch_mode``. A blocking method returns the collected result;
    a non-blocking one returns a future (``.result()`` waits for it). Every
    group method also offers ``.submit(...)``, which never blocks.

    On Ray a method's input tensors are zero-copy views of the object store,
    and a chunk that several ranks receive is one shared object. A method
    that writes into its input tensors in place says ``writes_inputs=True``:
    each rank then gets its own copy.
    """
    mode = get_dispatch_rule(dispatch_mode).name

    def mark(fn: F) -> F:
        setattr(fn, _SPEC_ATTR, MethodSpec(fn.__name__, mode, blocking, writes_inputs))
        return fn

    return mark


def registered_methods(cls: type) -> dict[str, MethodSpec]:
    """Every ``@register``-ed method of ``cls``, its base classes included."""
    specs: dict[str, MethodSpec] = {}
    for klass in reversed(cls.__mro__):
        for name, member in vars(klass).items():
            spec = getattr(member, _SPEC_ATTR, None)
            if isinstance(spec, MethodSpec):
                specs[name] = MethodSpec(name, spec.dispatch_mode, spec.blocking, spec.writes_inputs)
    return specs
