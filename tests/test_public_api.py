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


def _lazy_table() -> dict[str, str]:
    """The ``_LAZY`` table of ``jax_ucp/__init__.py`` (name -> module), read from the source."""
    tree = ast.parse((ROOT / "__init__.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and [ast.unparse(t) for t in node.targets] == ["_LAZY"]:
            return ast.literal_eval(node.value)
    raise AssertionError("jax_ucp/__init__.py has no _LAZY table")


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
    lazy = _lazy_table()
    assert typed == lazy
    for name, module in typed.items():
        assert hasattr(importlib.import_module(module), name), (module, name)
        assert getattr(jax_ucp, name) is getattr(importlib.import_module(module), name)
    assert sorted(jax_ucp.__all__) == sorted({*jax_ucp.__all__, *lazy})


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
    (one raised inside ``json.loads``'s hook included)."""
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


# What each subpackage exports (its ``__all__``): the names users or other layers import from
# it. A change here is a change of the package's surface, made on purpose.
SURFACE: dict[str, set[str]] = {
    "jax_ucp.cli": {"app", "main"},
    "jax_ucp.format": {
        "ARRAYS_DIR",
        "Entry",
        "FORMAT_VERSION",
        "MANIFEST_FILE",
        "MAX_MANIFEST_BYTES",
        "MAX_TREE_DEPTH",
        "Manifest",
        "SavedSharding",
        "TensorEntry",
        "UCPError",
        "ValueEntry",
        "array_dir",
        "check_tree_depth",
        "dtype_name",
        "encode_key",
        "key_to_str",
        "new_manifest",
        "read_manifest_file",
        "role_of",
        "to_numpy_dtype",
    },
    "jax_ucp.importers": {"plan_import"},
    "jax_ucp.importers.deepspeed": {
        "DS_CLASSES",
        "DeepSpeedCheckpoint",
        "DeepSpeedOptions",
        "MegatronDeepSpeedCheckpoint",
        "detect",
        "is_deepspeed_checkpoint",
        "open_deepspeed_checkpoint",
        "plan",
        "plan_deepspeed",
    },
    "jax_ucp.importers.megatron": {
        "MegatronImportError",
        "MegatronOptions",
        "detect",
        "detect_megatron",
        "plan",
        "plan_megatron",
    },
    "jax_ucp.importers.orbax": {"OrbaxOptions", "detect", "plan", "plan_orbax"},
    "jax_ucp.importers.safetensors": {"detect", "plan"},
    "jax_ucp.importers.torch": {"TorchOptions", "detect", "plan"},
    "jax_ucp.importers.verl": {"VerlOptions", "detect", "plan"},
    "jax_ucp.language": {
        "Averaged",
        "DEFAULT_ROOTS",
        "Expert",
        "ImportMatch",
        "ImportRule",
        "KINDS",
        "Kind",
        "OPS",
        "Op",
        "Partitioned",
        "PipelineTied",
        "QKV",
        "Replicated",
        "RestoreRule",
        "Root",
        "Spec",
        "SubParams",
        "SwiGLU",
        "TensorInfo",
        "ViewPlan",
        "Vocab",
        "apply_restore_plan",
        "apply_spec_to_tree",
        "compile_restore_plan",
        "describe_plan",
        "dump_spec",
        "expert_global_index",
        "flatten_nested",
        "head_split",
        "kind_from_obj",
        "list_specs",
        "load_spec",
        "merge",
        "op_from_obj",
        "optax_chain_roots",
        "padded_vocab_size",
        "saved_infos",
        "spec_from_dict",
        "spec_from_toml",
        "spec_to_dict",
        "spec_to_toml",
        "split",
        "split_parts",
        "unflatten_nested",
    },
    "jax_ucp.models": {"LMConfig", "TransformerLM", "from_megatron", "shipped_spec_for"},
    "jax_ucp.multihost": set(),
    "jax_ucp.orbax": set(),
    "jax_ucp.restoring": set(),
    "jax_ucp.samples": {"NAMES", "path", "reference", "settings"},
    "jax_ucp.saving": set(),
    "jax_ucp.sharding": {
        "PendingArray",
        "ReplicationWarning",
        "check_divisible",
        "check_names",
        "check_rules",
        "describe",
        "host_memory_limit",
        "replicated_unasked",
        "replication_warning",
        "sharding_for",
        "unmatched_rules",
        "unmatched_rules_message",
    },
    "jax_ucp.store": {
        "ArrayLayout",
        "DEFAULT_INNER_CHUNK_BYTES",
        "InFlightBytes",
        "array_config",
        "bytes_read",
        "create",
        "inner_chunk_shape",
        "is_url",
        "kvstore_config",
        "kvstore_driver",
        "open_array",
        "outer_chunk_shape",
        "read_manifest",
        "write_manifest",
    },
    "jax_ucp.torchfiles": {"dcp_reader", "dtypes", "sharded", "unpickler"},
    "jax_ucp.writer": {
        "DEFAULT_MEMORY_BUDGET",
        "Deferred",
        "mapped_deferred",
        "HostItem",
        "PipelinedWriter",
        "PreparedTensor",
        "SaveOptions",
        "array_layout",
        "memory_budget",
        "memory_budget_scope",
        "prepare_host_tensor",
        "remove_abandoned",
        "tensor_entry",
        "unpooled_empty",
        "value_entry",
        "with_digests",
        "with_progress",
        "write_host_checkpoint",
        "write_shared_checkpoint",
        "write_stream",
        "write_tensor",
    },
}
# handler/ keeps the old module names Orbax records (aliases, no surface of its own); exporters/
# pins its own ``__all__`` (its options are being split per format).
UNPINNED = {"jax_ucp.handler", "jax_ucp.exporters"}


def _subpackages():
    import pkgutil

    for info in pkgutil.walk_packages(jax_ucp.__path__, "jax_ucp."):
        if info.ispkg:
            yield info.name, importlib.import_module(info.name)


def test_every_subpackage_surface_is_pinned():
    found = {name: set(getattr(module, "__all__", [])) for name, module in _subpackages()}
    assert set(found) - UNPINNED == set(SURFACE), "a new subpackage: pin its __all__ in SURFACE"
    for name, names in SURFACE.items():
        assert found[name] == names, (name, found[name] ^ names)


def test_exported_names_resolve():
    for name, module in _subpackages():
        for attribute in getattr(module, "__all__", []):
            assert hasattr(module, attribute), (name, attribute)


def test_functions_and_classes_of_an_init_are_exported_or_private():
    """A function or class written in a subpackage's ``__init__`` is in its ``__all__`` or has a
    ``_`` name: an internal helper does not look public."""
    import inspect

    loose = []
    for name, module in _subpackages():
        if name in UNPINNED:
            continue
        for attribute, value in vars(module).items():
            if (
                (inspect.isfunction(value) or inspect.isclass(value))
                and value.__module__ == name
                and not attribute.startswith("_")
                and attribute not in module.__all__
            ):
                loose.append(f"{name}.{attribute}")
    assert loose == []
