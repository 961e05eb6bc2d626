"""An operation's options, defined once: a typed dataclass whose fields are the keywords.

``restore``, ``plan`` and ``convert`` take their dataclass's fields as keywords through
``keywords_of`` / ``source_dest_keywords``: the signature a type checker (and ``help()``) sees is
the dataclass's ``__init__``, so each option's name, type, default and doc live in one place. A
leaf module (it imports nothing of jax_ucp), as ``errors``.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import inspect
import os
import sys
from collections.abc import Callable, Iterator
from typing import Any, Concatenate, ParamSpec, TypeVar

P = ParamSpec("P")
R = TypeVar("R")
T = TypeVar("T")

# the public function whose keywords are being checked, so errors say ``restore(casting=)``
_CALLER: contextvars.ContextVar[str | None] = contextvars.ContextVar(
    "jax_ucp_options_caller", default=None
)


def field_namer(options: object) -> Callable[[str], str]:
    """How errors name a field of ``options``: ``restore(casting=)`` when built from a
    function's keywords, else ``UCPRestore.casting`` (its class)."""
    caller = _CALLER.get()
    if caller is not None:
        return lambda name: f"{caller}({name}=)"
    cls = type(options).__name__
    return lambda name: f"{cls}.{name}"


@contextlib.contextmanager
def named_by(caller: str) -> Iterator[None]:
    """Options built inside name their fields as ``caller``'s keywords (``convert(step=)``)."""
    token = _CALLER.set(caller)
    try:
        yield
    finally:
        _CALLER.reset(token)


def user_stacklevel() -> int:
    """The ``stacklevel`` of the first frame outside jax_ucp and Orbax (dataclasses' generated
    ``__init__`` runs in its class's module): the user's line a warning is about."""
    frame, level = sys._getframe(1), 1
    while frame is not None and frame.f_globals.get("__name__", "").split(".")[0] in (
        "jax_ucp",
        "orbax",
    ):
        frame, level = frame.f_back, level + 1
    return level


def _taking(options_type, leading: int):
    """``fn(*leading, options)`` called with ``options_type``'s fields after its ``leading``
    arguments: they are checked by ``options_type`` (errors naming ``fn(field=)``), and
    ``help(fn)`` lists them."""

    def decorate(fn):
        head_params = list(inspect.signature(fn).parameters.values())[:leading]
        fields = list(inspect.signature(options_type).parameters.values())
        names = {f.name for f in fields}
        hint = (  # convert's import options: one object, as restore's and plan's
            "; a source format's options (weights_only, vocab_size, ...) are one object: "
            "importing=ImportOptions(...), MegatronOptions(...), ..."
            if "importing" in names
            else ""
        )

        def call(*args, **kwargs):
            head = list(args[:leading])
            head += [kwargs.pop(p.name) for p in head_params[len(head) :] if p.name in kwargs]
            if unknown := sorted(set(kwargs) - names):
                raise TypeError(f"{fn.__name__}() got unexpected keywords {unknown}{hint}")
            with named_by(fn.__name__):
                options = options_type(*args[leading:], **kwargs)
            return fn(*head, options)

        functools.update_wrapper(call, fn)
        del call.__wrapped__  # inspect.signature would show fn's (path, options)
        call.__signature__ = inspect.Signature(head_params + fields)  # type: ignore[attr-defined]
        return call

    return decorate


def keywords_of(
    options_type: Callable[P, T],
) -> Callable[[Callable[[Any, T], R]], Callable[Concatenate[str | os.PathLike, P], R]]:
    """``fn(path, options)`` called as ``fn(path, <options_type's fields>)``."""
    return _taking(options_type, 1)


def source_dest_keywords(
    options_type: Callable[P, T],
) -> Callable[[Callable[[Any, Any, T], R]], Callable[Concatenate[Any, Any, P], R]]:
    """``fn(source, dest, options)`` called as ``fn(source, dest, <options_type's fields>)``."""
    return _taking(options_type, 2)
