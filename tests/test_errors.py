"""The public exceptions are one small tree under ``UCPError``, grouped by what the user does
about the error (``jax_ucp/errors.py``); the classes each module used to define are aliases of
their group, still importable where they were and still every builtin they were."""

from __future__ import annotations

import importlib
import inspect
import pkgutil

import pytest

import jax_ucp
from jax_ucp import errors

# Every exception class jax_ucp defined before the tree (main at 5a4c77b), with the builtins it
# derived from: ``except <builtin>`` and ``except <old name>`` must keep catching what they did.
OLD: list[tuple[str, str, tuple[type, ...]]] = [
    ("jax_ucp.conversion", "DestinationError", (ValueError,)),
    ("jax_ucp.errors", "CheckpointError", (ValueError,)),  # was restoring.reader's (split)
    ("jax_ucp.errors", "CheckpointReplacedError", (OSError,)),
    ("jax_ucp.errors", "ExportError", (ValueError,)),
    ("jax_ucp.errors", "NotFoundError", (KeyError,)),
    ("jax_ucp.errors", "RequestError", (ValueError,)),
    ("jax_ucp.errors", "SetupError", (RuntimeError,)),
    ("jax_ucp.errors", "UCPError", ()),
    ("jax_ucp.errors", "UnsupportedError", (ValueError, TypeError)),
    ("jax_ucp.format.files", "OutsideCheckpointError", (ValueError, OSError)),
    ("jax_ucp.format.files", "UnsafeFileError", (OSError,)),
    ("jax_ucp.format.manifest", "ManifestError", (ValueError,)),
    ("jax_ucp.format.mapped_file", "FileShrankError", (OSError,)),
    ("jax_ucp.format.safetensors", "SafetensorsError", (ValueError,)),
    ("jax_ucp.format.sizes", "SizeError", (ValueError,)),
    ("jax_ucp.importers.deepspeed.files", "DeepSpeedImportError", (ValueError,)),
    ("jax_ucp.importers.megatron.bridge", "MegatronBridgeError", (ValueError,)),
    ("jax_ucp.importers.megatron.common", "MegatronImportError", (ValueError,)),
    ("jax_ucp.importers.megatron.legacy", "LegacyError", (ValueError,)),
    ("jax_ucp.importers.orbax", "OrbaxImportError", (ValueError,)),
    ("jax_ucp.importers.orbax.zstd_rows", "ZstdChunkError", (ValueError,)),
    ("jax_ucp.importers.plan", "UnaccountedTensorsError", (ValueError,)),
    ("jax_ucp.importers.registry", "SourceFormatError", (ValueError,)),
    ("jax_ucp.importers.registry", "SourceNotFoundError", (ValueError, FileNotFoundError)),
    ("jax_ucp.torchfiles.dcp_reader", "DcpError", (ValueError,)),
    ("jax_ucp.importers.torch.optimizer", "TorchImportError", (ValueError,)),
    ("jax_ucp.torchfiles.unpickler", "TorchFileError", (ValueError,)),
    ("jax_ucp.torchfiles.unpickler", "UnsafePickleError", (ValueError,)),
    ("jax_ucp.language.errors", "LanguageError", (ValueError,)),
    ("jax_ucp.language.errors", "MergeError", (ValueError,)),
    ("jax_ucp.language.errors", "SpecError", (ValueError,)),
    ("jax_ucp.language.errors", "StrictnessError", (ValueError,)),
    ("jax_ucp.language.errors", "TransformError", (ValueError,)),
    ("jax_ucp.multihost.agreement", "ProcessLostError", (RuntimeError,)),
    ("jax_ucp.multihost.agreement", "SharedWriteError", (RuntimeError,)),
    ("jax_ucp.restoring.adam_state", "AmbiguousAdamStateError", (ValueError,)),
    ("jax_ucp.restoring.options", "ArgsError", (ValueError,)),
    ("jax_ucp.restoring.replicated", "ReplicatedReadError", (RuntimeError,)),
    ("jax_ucp.sharding.mesh_layout", "ShardingMismatchError", (ValueError,)),
    ("jax_ucp.store.location", "ObjectStoreError", (ValueError,)),
    ("jax_ucp.store.safetensors_file", "SafetensorsReadError", (OSError,)),
    ("jax_ucp.store.shard_file", "ShardReadError", (OSError,)),
    ("jax_ucp.tree", "TreeError", (ValueError,)),
    ("jax_ucp.writer.commit", "NotReplaceableError", (OSError, FileExistsError)),
    ("jax_ucp.writer.commit", "SaveConflictError", (OSError,)),
]
BUILTINS = (ValueError, TypeError, KeyError, RuntimeError, OSError, FileNotFoundError)
BUILTINS += (FileExistsError,)

# The tree: each class and its parent in it (the builtins it also is, after the comma).
TREE: dict[str, tuple[str | None, tuple[type, ...]]] = {
    "UCPError": (None, ()),
    "RequestError": ("UCPError", (ValueError,)),
    "UnsupportedError": ("RequestError", (ValueError, TypeError)),
    "ShardingMismatchError": ("RequestError", (ValueError,)),
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


@pytest.mark.parametrize("module, name, bases", OLD, ids=[f"{m}.{n}" for m, n, _ in OLD])
def test_an_old_name_still_catches_what_it_did(module, name, bases):
    """Importable where it was, a ``UCPError``, and an instance of every builtin it was and no
    other (a new builtin base would change what an ``except OSError`` somewhere catches)."""
    cls = getattr(importlib.import_module(module), name)
    error = _instance(cls)
    assert isinstance(error, jax_ucp.UCPError)
    for base in bases:
        assert isinstance(error, base), (name, base)
    assert _builtins(cls) == {b for b in BUILTINS if any(issubclass(o, b) for o in bases)}, name
    with pytest.raises(cls):  # what raising the group's class looks like to an old except
        raise error


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


def test_old_names_are_aliases_of_their_group():
    """A module's name for its errors is its group, not a class of its own (``DcpError`` is
    ``SourceError``), so ``except SourceError`` catches every importer's refusals."""
    from jax_ucp.format import manifest, safetensors, sizes
    from jax_ucp.importers import registry
    from jax_ucp.multihost import agreement
    from jax_ucp.restoring import replicated
    from jax_ucp.store import shard_file
    from jax_ucp.torchfiles import dcp_reader
    from jax_ucp.writer import commit

    assert dcp_reader.DcpError is safetensors.SafetensorsError is errors.SourceError
    assert registry.SourceFormatError is errors.SourceError
    assert manifest.ManifestError is jax_ucp.CheckpointError
    assert sizes.SizeError is jax_ucp.ExportError is jax_ucp.RequestError
    assert shard_file.ShardReadError is jax_ucp.FileReadError
    assert issubclass(agreement.ProcessLostError, agreement.SharedWriteError)
    assert issubclass(agreement.SharedWriteError, jax_ucp.MultiProcessError)
    assert issubclass(replicated.ReplicatedReadError, jax_ucp.MultiProcessError)
    assert commit.SaveConflictError is jax_ucp.SaveConflictError
    assert issubclass(commit.NotReplaceableError, jax_ucp.SaveConflictError)
    assert issubclass(jax_ucp.CheckpointReplacedError, jax_ucp.SaveConflictError)


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

    with pytest.raises(safetensors.SafetensorsError, match=r"^f\.json: names 'a' twice"):
        safetensors.strict_json('{"b": {"a": 1, "a": 2}}', "f.json")
    assert safetensors.strict_json('{"a": {"a": 1}}', "f.json") == {"a": {"a": 1}}
