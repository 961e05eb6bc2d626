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
    """The option of a command that is the field ``name`` of the dataclass ``owner``
    (``"importers.plan.ImportOptions"``, under ``_src``: the class whose body and docstring
    define it), of its type on a command line: ``bool``, ``int | None``, else ``str | None``. Not
    given, it is None (the dataclass's default), a bool flag the field's default.

    Attributes:
      flags: its spellings (None: ``--<name>``, ``--<name>/--no-<name>`` for a bool).
      help: said instead of the field's doc where the command line takes another thing (a
        file for a list); ``prefix`` is said before either (the format that takes it).
      callback, min: as ``typer.Option``'s.
    """

    owner: str
    name: str
    flags: tuple[str, ...] = ()
    help: str | None = None
    prefix: str = ""
    callback: Callable | None = None
    min: int | None = None

    def parameter(self) -> inspect.Parameter:
        """This option as a keyword parameter of a typer command."""
        annotation, default, doc = _field(self.owner, self.name)
        names = {part.strip() for part in annotation.split("|")} - {"None"}
        kind = bool if names == {"bool"} else int | None if names == {"int"} else str | None
        flag = self.name.replace("_", "-")
        info = typer.Option(
            default if kind is bool else None,
            *(self.flags or ((f"--{flag}/--no-{flag}",) if kind is bool else (f"--{flag}",))),
            help=self.prefix + (self.help or doc),
            callback=self.callback,
            min=self.min,
        )
        return inspect.Parameter(
            self.name, inspect.Parameter.KEYWORD_ONLY, default=info, annotation=kind
        )


def taking(*fields: FromField):
    """A command taking ``fields`` as options after its own parameters, in its ``**options``
    (typer reads the signature set here)."""

    def decorate(fn):
        own = inspect.signature(fn, eval_str=True).parameters.values()
        own = [p for p in own if p.kind is not inspect.Parameter.VAR_KEYWORD]
        fn.__signature__ = inspect.Signature(own + [f.parameter() for f in fields])
        return fn

    return decorate


@functools.cache
def _class(owner: str) -> ast.ClassDef:
    """The class ``owner`` parsed alone (its lines up to the next top-level statement: parsing
    whole modules took 0.1 s of every command's start)."""
    module, _, name = owner.rpartition(".")
    path = os.path.join(_SRC, *module.split("."))
    path = os.path.join(path, "__init__.py") if os.path.isdir(path) else path + ".py"
    with open(path, encoding="utf-8") as f:
        found = re.search(rf"^class {name}\b.*?(?=^[^\s#)])", f.read() + "\nend", re.M | re.S)
    if found is None:
        raise LookupError(f"no class {owner}")
    (cls,) = ast.parse(found.group(0)).body
    assert isinstance(cls, ast.ClassDef)
    return cls


def _field(owner: str, name: str) -> tuple[str, Any, str]:
    """(annotation, the default when it is a literal True or False, doc) of a field."""
    cls = _class(owner)
    for node in cls.body:
        if isinstance(node, ast.AnnAssign) and getattr(node.target, "id", None) == name:
            default = getattr(node.value, "value", None)
            return (
                ast.unparse(node.annotation),
                default,
                field_doc(ast.get_docstring(cls) or "", name),
            )
    raise LookupError(f"{owner} has no field {name}")  # a renamed field fails at import


def field_doc(docstring: str, name: str) -> str:
    """The ``Attributes:`` entry of ``name`` (its line and the lines indented below it) on one
    line, without reST's double backquotes."""
    lines = docstring.splitlines()
    for i, line in enumerate(lines):
        if line.lstrip().startswith(f"{name}: "):
            indent, entry = len(line) - len(line.lstrip()), [line.lstrip()[len(name) + 2 :]]
            for more in lines[i + 1 :]:
                if len(more) - len(more.lstrip()) <= indent or not more.strip():
                    break
                entry.append(more)
            return " ".join(" ".join(entry).replace("``", "").split())
    raise LookupError(f"no doc for the field {name}")
