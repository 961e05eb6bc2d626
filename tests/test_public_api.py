"""The typed public surface: ``py.typed`` ships, and every name of ``jax_ucp.__all__`` is one a
type checker can see (imported eagerly, or in the ``TYPE_CHECKING`` block from the module the
lazy loader takes it from), so ``jax_ucp.save`` & co. are not ``Any`` to pyright or mypy."""

from __future__ import annotations

import ast
import importlib
import pathlib
import tomllib

import jax_ucp

ROOT = pathlib.Path(jax_ucp.__file__).parent


def _init_imports() -> tuple[dict[str, str], dict[str, str]]:
    """(eager imports, TYPE_CHECKING imports) of ``jax_ucp/__init__.py``: name -> module."""
    tree = ast.parse((ROOT / "__init__.py").read_text())
    eager: dict[str, str] = {}
    typed: dict[str, str] = {}
    for node in tree.body:
        if isinstance(node, ast.ImportFrom) and node.module:
            eager.update({a.asname or a.name: node.module for a in node.names})
        elif (
            isinstance(node, ast.If)
            and isinstance(node.test, ast.Name)
            and node.test.id == "TYPE_CHECKING"
        ):
            for sub in node.body:
                assert isinstance(sub, ast.ImportFrom) and sub.module, ast.dump(sub)
                typed.update({a.asname or a.name: sub.module for a in sub.names})
    return eager, typed


def test_py_typed_ships():
    assert (ROOT / "py.typed").is_file()
    pyproject = tomllib.loads((ROOT.parent / "pyproject.toml").read_text())
    assert "py.typed" in pyproject["tool"]["setuptools"]["package-data"]["jax_ucp"]


def test_every_public_name_is_typed():
    eager, typed = _init_imports()
    untyped = [n for n in jax_ucp.__all__ if n not in eager and n not in typed]
    assert untyped == [], f"in __all__ but invisible to a type checker: {untyped}"


def test_type_checking_block_matches_the_lazy_loader():
    """The TYPE_CHECKING block names exactly what ``_LAZY`` loads, from the same modules, and
    each of those modules has the name (a renamed function fails here, not in a user's IDE)."""
    _, typed = _init_imports()
    assert typed == jax_ucp._LAZY
    for name, module in typed.items():
        assert hasattr(importlib.import_module(module), name), (module, name)
    assert sorted(jax_ucp.__all__) == sorted({*jax_ucp.__all__, *jax_ucp._LAZY})


def test_public_exceptions_derive_from_ucp_error():
    """Every public error class is in the ``UCPError`` tree (warnings are ``UserWarning``s)."""
    for name in jax_ucp.__all__:
        value = getattr(jax_ucp, name)
        if isinstance(value, type) and issubclass(value, BaseException):
            if issubclass(value, Warning):
                assert issubclass(value, UserWarning), name
            else:
                assert issubclass(value, jax_ucp.UCPError), name


def test_version_has_one_source():
    """``pyproject.toml`` takes the version from ``jax_ucp/version.py`` (setuptools dynamic)."""
    pyproject = tomllib.loads((ROOT.parent / "pyproject.toml").read_text())
    assert "version" not in pyproject["project"]
    assert "version" in pyproject["project"]["dynamic"]
    attr = pyproject["tool"]["setuptools"]["dynamic"]["version"]["attr"]
    module, _, name = attr.rpartition(".")
    assert getattr(importlib.import_module(module), name) == jax_ucp.__version__


def test_every_exception_class_of_the_package_derives_from_ucp_error():
    """Not only the exported ones: any error jax_ucp raises is caught by ``except UCPError``
    (``format/safetensors._DuplicateKey``, raised inside ``json.loads``, included)."""
    import inspect
    import pkgutil

    outside = []
    for info in pkgutil.walk_packages(jax_ucp.__path__, "jax_ucp."):
        if info.name.endswith("__main__") or ".samples" in info.name:
            continue  # __main__ runs the CLI
        module = importlib.import_module(info.name)
        for value in vars(module).values():
            if (
                inspect.isclass(value)
                and issubclass(value, BaseException)
                and value.__module__ == module.__name__
                and not issubclass(value, (jax_ucp.UCPError, Warning))
            ):
                outside.append(f"{module.__name__}.{value.__qualname__}")
    assert outside == []
