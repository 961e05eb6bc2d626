"""Command-line options built from the options dataclasses: a flag's name, default and help
are its field's (name, default, the ``Attributes:`` doc), defined once where the Python API
defines them; a command adds only what differs on a command line (a file for a list, a size
parser).

The fields are read from the dataclasses' source (``ast``), not imported: a command that places
no arrays starts without JAX (``restoring.options`` imports it) and without every importer.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import inspect
import os
import re
from collections.abc import Callable
from typing import Any

import typer

_SRC = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # jax_ucp/_src


@dataclasses.dataclass(frozen=True)
class FromField:
    """One option of a command: the field ``name`` of the dataclass ``owner``
    (``"importers.plan.ImportOptions"``, under ``jax_ucp._src``) that documents it.

    Attributes:
      owner: ``<module>.<class>`` under ``jax_ucp._src``, the class whose docstring
        documents the field (and whose body gives its default).
      name: the field, the keyword the command passes on.
      kind: the command line's type (None: ``bool``, ``int`` or ``str`` from the annotation,
        ``| None`` but for a bool). A flag not given is None (the dataclass's default), a
        bool flag not given the field's default.
      flags: the flag's spellings (default: ``--<name>`` with dashes; ``--x/--no-x`` for a
        bool defaulting to True).
      help: the help where the command line takes another thing than the field (a file for a
        list); None: the field's doc.
      prefix: said before the field's doc (``"megatron: "``: the format that takes it).
      callback: parses the value (a size).
      min: the least number accepted.
    """

    owner: str
    name: str
    kind: Any = None
    flags: tuple[str, ...] = ()
    help: str | None = None
    prefix: str = ""
    callback: Callable | None = None
    min: int | None = None

    def parameter(self) -> inspect.Parameter:
        """This option as a keyword parameter of a typer command."""
        annotation, default, doc = _field(self.owner, self.name)
        if default is not True and default is not False:
            default = None  # not given: the dataclass's default
        kind = self.kind or _kind(annotation, default)
        flag = self.name.replace("_", "-")
        flags = self.flags or ((f"--{flag}/--no-{flag}",) if kind is bool else (f"--{flag}",))
        info = typer.Option(
            default,
            *flags,
            help=self.prefix + (self.help or doc),
            callback=self.callback,
            min=self.min,
        )
        return inspect.Parameter(
            self.name, inspect.Parameter.KEYWORD_ONLY, default=info, annotation=kind
        )


def taking(*fields: FromField):
    """A command taking ``fields`` as options, after its own parameters: they reach it in its
    ``**options`` (typer reads the signature set here)."""

    def decorate(fn):
        own = [
            p
            for p in inspect.signature(fn, eval_str=True).parameters.values()
            if p.kind is not inspect.Parameter.VAR_KEYWORD
        ]
        fn.__signature__ = inspect.Signature(own + [f.parameter() for f in fields])
        return fn

    return decorate


def _kind(annotation: str, default: Any):
    """``bool`` / ``int`` / ``str`` (``| None`` when the default is None) for an annotation."""
    names = {part.strip() for part in annotation.split("|")} - {"None"}
    kind = bool if names == {"bool"} else int if names == {"int"} else str
    return kind | None if default is None else kind


@functools.cache
def _source(module: str) -> str:
    path = os.path.join(_SRC, *module.split("."))
    path = os.path.join(path, "__init__.py") if os.path.isdir(path) else path + ".py"
    with open(path, encoding="utf-8") as f:
        return f.read()


@functools.cache
def _class(owner: str) -> ast.ClassDef:
    """The class ``owner`` parsed alone (its lines up to the next top-level statement: a
    command line starts in milliseconds, parsing whole modules took 0.1 s)."""
    module, _, name = owner.rpartition(".")
    found = re.search(rf"^class {name}\b.*?(?=^[^\s#)])", _source(module) + "\nend", re.M | re.S)
    if found is None:
        raise LookupError(f"no class {owner}")
    (cls,) = ast.parse(found.group(0)).body
    assert isinstance(cls, ast.ClassDef)
    return cls


@functools.cache
def _field(owner: str, name: str) -> tuple[str, Any, str]:
    """(annotation, default, doc) of the field ``name`` of ``owner``, read from its source."""
    cls = _class(owner)
    for node in cls.body:
        if isinstance(node, ast.AnnAssign) and getattr(node.target, "id", None) == name:
            try:
                default = ast.literal_eval(node.value) if node.value is not None else None
            except ValueError:  # an expression (5 * 10**9): the dataclass applies it
                default = None
            return (
                ast.unparse(node.annotation),
                default,
                field_doc(ast.get_docstring(cls) or "", name),
            )
    raise LookupError(f"{owner} has no field {name}")  # a renamed field fails at import


def field_doc(docstring: str, name: str) -> str:
    """The ``Attributes:`` entry of ``name`` (its line and the lines indented below it), on one
    line, without reST's double backquotes."""
    lines = docstring.splitlines()
    for i, line in enumerate(lines):
        if line.lstrip().startswith(f"{name}: "):
            indent = len(line) - len(line.lstrip())
            entry = [line.lstrip()[len(name) + 2 :]]
            for more in lines[i + 1 :]:
                if len(more) - len(more.lstrip()) <= indent or not more.strip():
                    break
                entry.append(more)
            return " ".join(" ".join(entry).replace("``", "").split())
    raise LookupError(f"no doc for the field {name}")
