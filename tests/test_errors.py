"""The public exceptions are one small tree under ``UCPError``, grouped by what the user does
about the error (``jax_ucp/_src/errors.py``), each with one builtin besides and raised under its own
name: no module binds an error class under another name (``DcpError = SourceError`` made
``except DcpError`` catch every importer's refusals)."""

from __future__ import annotations

import importlib
import inspect
import pkgutil

import pytest

import jax_ucp
from jax_ucp import errors

BUILTINS = (ValueError, TypeError, KeyError, RuntimeError, OSError)

# The public tree: each class and the one builtin it also is.
TREE: dict[str, type | None] = {
    "UCPError": None,
    "RequestError": ValueError,
    "SourceError": ValueError,
    "CheckpointError": ValueError,
    "UnsafeFileError": OSError,
    "SaveConflictError": OSError,
    "MultiProcessError": RuntimeError,
    "LanguageError": ValueError,
}
# Distinctions only jax_ucp's own code catches: subclasses in the layer that raises them, not
# exported (a caller catches their public parent).
INTERNAL = {
    "TorchFileError": ("jax_ucp._src.torchfiles.allow_list", "SourceError"),
    "MegatronImportError": ("jax_ucp._src.importers.megatron.common", "SourceError"),
    "ProcessLostError": ("jax_ucp._src.multihost.agreement", "MultiProcessError"),
    "ShardLayoutError": ("jax_ucp._src.torchfiles.sharded", "SourceError"),
    "MissingExtraError": ("jax_ucp._src.against", "SourceError"),
    "HubDeadlineError": ("jax_ucp._src.store.storage.hub", "SourceError"),
    "RangeError": ("jax_ucp._src.store.storage.ranged", "SourceError"),
}


def _builtins(cls: type) -> set[type]:
    """The builtin exception classes (of ``BUILTINS``) ``cls`` derives from."""
    return {b for b in BUILTINS if issubclass(cls, b)}


def test_the_tree_is_pinned():
    """The public classes are exactly ``TREE``, each directly under ``UCPError`` with one builtin,
    all exported from ``jax_ucp``."""
    public = {n for n, v in vars(errors).items() if inspect.isclass(v) and issubclass(v, Exception)}
    assert public - {"ResumeWarning", "OptimizerOrderWarning"} == set(TREE)
    for name, builtin in TREE.items():
        cls = getattr(errors, name)
        assert cls.__name__ == name and getattr(jax_ucp, name) is cls
        assert name in jax_ucp.__all__
        if builtin is not None:
            assert cls.__bases__ == (errors.UCPError, builtin), name
            assert _builtins(cls) == _builtins(builtin), name


def _classes():
    """(qualified name, class) of every exception class a jax_ucp module defines."""
    for info in pkgutil.walk_packages(jax_ucp.__path__, "jax_ucp."):
        if info.name.endswith("__main__") or ".samples" in info.name:
            continue
        module = importlib.import_module(info.name)
        for value in vars(module).values():
            if (
                inspect.isclass(value)
                and issubclass(value, BaseException)
                and not issubclass(value, Warning)
                and value.__module__ == info.name
            ):
                yield value.__name__, value


def test_every_exception_class_of_the_package_is_public_or_a_known_internal_one():
    """No module defines an error class of its own beyond ``INTERNAL``, each a subclass of one
    public class and no other builtin: one more fails here, on purpose."""
    found = dict(_classes())
    assert set(found) == set(TREE) | set(INTERNAL), sorted(set(found) ^ {*TREE, *INTERNAL})
    for name, (module, parent) in INTERNAL.items():
        cls = found[name]
        assert cls.__module__ == module and cls.__bases__ == (getattr(errors, parent),)
        assert not hasattr(jax_ucp, name)


def test_no_module_binds_an_error_class_under_another_name():
    """Every error class a jax_ucp module holds at module level is bound under its own name
    (imported from ``jax_ucp.errors``), never as an alias such as ``DcpError = SourceError``."""
    aliases = []
    for info in pkgutil.walk_packages(jax_ucp.__path__, "jax_ucp."):
        if info.name.endswith("__main__") or ".samples" in info.name:
            continue
        module = importlib.import_module(info.name)
        for attr, value in vars(module).items():
            if (
                inspect.isclass(value)
                and issubclass(value, errors.UCPError)
                and attr != value.__name__
            ):
                aliases.append(f"{info.name}.{attr} = {value.__name__}")
    assert not aliases, aliases


def test_a_torch_file_error_keeps_its_path():
    from jax_ucp._src.torchfiles.allow_list import TorchFileError

    error = TorchFileError("/x/model.pt", "global os.system is not allowed")
    assert error.path == "/x/model.pt"
    assert str(error) == "/x/model.pt: global os.system is not allowed"
    assert isinstance(error, jax_ucp.SourceError)


def test_a_duplicate_json_key_is_a_safetensors_error_naming_the_file():
    """The duplicate-key hook raises the public class itself (no private exception escapes)."""
    from jax_ucp._src.format import safetensors

    with pytest.raises(errors.SourceError, match=r"^f\.json: names 'a' twice"):
        safetensors.strict_json('{"b": {"a": 1, "a": 2}}', "f.json")
    assert safetensors.strict_json('{"a": {"a": 1}}', "f.json") == {"a": {"a": 1}}
