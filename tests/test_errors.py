"""The public exceptions are one small tree under ``UCPError``, grouped by what the user does
about the error (``jax_ucp/errors.py``), each raised under its own name: no module binds an
error class under another name (``DcpError = SourceError`` made ``except DcpError`` catch every
importer's refusals)."""

from __future__ import annotations

import importlib
import inspect
import pkgutil

import pytest

import jax_ucp
from jax_ucp import errors

BUILTINS = (ValueError, TypeError, KeyError, RuntimeError, OSError, FileNotFoundError)
BUILTINS += (FileExistsError,)

# The tree: each class and its parent in it (the builtins it also is, after the comma).
TREE: dict[str, tuple[str | None, tuple[type, ...]]] = {
    "UCPError": (None, ()),
    "RequestError": ("UCPError", (ValueError,)),
    "UnsupportedError": ("RequestError", (ValueError, TypeError)),
    "ShardingMismatchError": ("RequestError", (ValueError,)),
    "AmbiguousAdamStateError": ("RequestError", (ValueError,)),
    "SourceError": ("UCPError", (ValueError,)),
    "SourceNotFoundError": ("SourceError", (ValueError, FileNotFoundError)),
    "TorchFileError": ("SourceError", (ValueError,)),
    "UnsafePickleError": ("TorchFileError", (ValueError,)),
    "MegatronImportError": ("SourceError", (ValueError,)),
    "CheckpointError": ("UCPError", (ValueError,)),
    "FileReadError": ("UCPError", (OSError,)),
    "UnsafeFileError": ("UCPError", (OSError,)),
    "OutsideCheckpointError": ("UnsafeFileError", (ValueError, OSError)),
    "SaveConflictError": ("UCPError", (OSError,)),
    "NotReplaceableError": ("SaveConflictError", (OSError, FileExistsError)),
    "CheckpointReplacedError": ("SaveConflictError", (OSError,)),
    "MultiProcessError": ("UCPError", (RuntimeError,)),
    "SharedWriteError": ("MultiProcessError", (RuntimeError,)),
    "ProcessLostError": ("SharedWriteError", (RuntimeError,)),
    "ReplicatedReadError": ("MultiProcessError", (RuntimeError,)),
    "LanguageError": ("UCPError", (ValueError,)),
    "SpecError": ("LanguageError", (ValueError,)),
    "StrictnessError": ("LanguageError", (ValueError,)),
    "MergeError": ("LanguageError", (ValueError,)),
    "TransformError": ("LanguageError", (ValueError,)),
    "NotFoundError": ("UCPError", (KeyError,)),
    "SetupError": ("UCPError", (RuntimeError,)),
}


def _builtins(cls: type) -> set[type]:
    """The builtin exception classes (of ``BUILTINS``) ``cls`` derives from."""
    return {b for b in BUILTINS if issubclass(cls, b)}


def _instance(cls: type) -> BaseException:
    return cls("a/file", "refused") if issubclass(cls, errors.TorchFileError) else cls("refused")


def test_the_tree_is_pinned():
    """The real classes are exactly ``TREE``, each under its parent and every builtin it lists."""
    for name, (parent, bases) in TREE.items():
        cls = getattr(errors, name)
        assert cls.__name__ == name and cls.__module__ == "jax_ucp.errors"
        if parent is not None:
            ucp_bases = [b for b in cls.__bases__ if issubclass(b, errors.UCPError)]
            assert ucp_bases == [getattr(errors, parent)], name
        assert _builtins(cls) == {b for b in BUILTINS if any(issubclass(o, b) for o in bases)}
    groups = [n for n, (parent, _) in TREE.items() if parent == "UCPError"]
    assert len(groups) == 10, groups


def test_every_exception_class_of_the_package_is_in_the_tree():
    """No module defines a class of its own: one the tree lacks fails here, on purpose."""
    found: dict[str, set[str]] = {}
    for info in pkgutil.walk_packages(jax_ucp.__path__, "jax_ucp."):
        if info.name.endswith("__main__") or ".samples" in info.name:
            continue
        module = importlib.import_module(info.name)
        for attr, value in vars(module).items():
            if (
                inspect.isclass(value)
                and issubclass(value, BaseException)
                and not issubclass(value, Warning)
                and value.__module__.startswith("jax_ucp")
            ):
                found.setdefault(value.__qualname__, set()).add(f"{info.name}.{attr}")
    assert set(found) == set(TREE), sorted(set(found) ^ set(TREE))


def test_no_module_binds_an_error_class_under_another_name():
    """Every error class a jax_ucp module holds at module level is bound under its own name
    (imported from ``jax_ucp.errors``), never as an alias such as ``DcpError = SourceError``."""
    aliases = []
    for info in pkgutil.walk_packages(jax_ucp.__path__, "jax_ucp."):
        if info.name.endswith("__main__") or ".samples" in info.name:
            continue
        module = importlib.import_module(info.name)
        for attr, value in vars(module).items():
            if inspect.isclass(value) and issubclass(value, errors.UCPError):
                if attr != value.__name__:
                    aliases.append(f"{info.name}.{attr} = {value.__name__}")
    assert not aliases, aliases


def test_a_torch_file_error_keeps_its_path():
    error = errors.UnsafePickleError("/x/model.pt", "global os.system is not allowed")
    assert error.path == "/x/model.pt"
    assert str(error) == "/x/model.pt: global os.system is not allowed"
    assert isinstance(error, jax_ucp.SourceError)


def test_not_found_error_reads_as_its_message():
    assert str(errors.NotFoundError("no sample named 'x'")) == "no sample named 'x'"


def test_a_duplicate_json_key_is_a_safetensors_error_naming_the_file():
    """The duplicate-key hook raises the public class itself (no private exception escapes)."""
    from jax_ucp.format import safetensors

    with pytest.raises(errors.SourceError, match=r"^f\.json: names 'a' twice"):
        safetensors.strict_json('{"b": {"a": 1, "a": 2}}', "f.json")
    assert safetensors.strict_json('{"a": {"a": 1}}', "f.json") == {"a": {"a": 1}}
