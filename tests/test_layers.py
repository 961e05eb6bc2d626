"""The layering of docs/INTERNAL_CONTRACTS.md, checked on the code: which layer imports which."""

from __future__ import annotations

import ast
import functools
import glob
import os

import pytest

from tests.ucp_testing import REPO

# The layers are the packages and modules of jax_ucp/_src/ (the public modules outside it are
# facades re-exporting from it: test_public_api.py). ``jax_ucp._src.store`` is layer ``store``.
PUBLIC_ROOT = os.path.join(REPO, "jax_ucp")
PACKAGE = os.path.join(PUBLIC_ROOT, "_src")

# layer -> the jax_ucp layers it may import (itself always allowed)
ALLOWED = {
    "format": set(),
    "store": {"format", "multihost"},  # multihost.liveness: a killed saver's lock or leftovers
    "multihost": {"format"},
    "writer": {"format", "store", "multihost"},
    "language": {"format"},  # format.mapped_file: views of mapped files read with pread
    "sharding": {"format"},
    "tree": {"format"},
    # + importers: the "open" stage plans the import of a source convert reads, read in place
    # (restoring.sources.import_open; registry.plan_import only reads, imported where it is
    # called)
    "restoring": {
        "format",
        "store",
        "writer",
        "multihost",
        "language",
        "sharding",
        "tree",
        "importers",
    },
    "saving": {"format", "store", "writer", "multihost", "sharding", "tree"},
    "orbax": {"format", "store", "writer", "multihost", "sharding", "tree", "restoring", "saving"},
    "api": {"format", "store", "tree", "restoring", "saving", "against", "logits", "export_check"},
    # verify(EXPORTED, against=CKPT): the export read by its import, the checkpoint by the spec
    "export_check": {"format", "store", "writer", "restoring", "importers", "exporters", "logits"},
    # torch's file formats, read and written without torch; store: a DCP folder in an object
    # store or a Hub repo read by ranged GETs (store.storage.ranged)
    "torchfiles": {"format", "writer", "store"},
    # store: the local medium's names (Orbax's temporary step mark, store.storage.local)
    "importers": {"format", "store", "writer", "language", "torchfiles"},
    "models": {"language"},
    # models: only when config= is an LMConfig (its config.json written; JAX is loaded already)
    "exporters": {
        "format",
        "store",
        "writer",
        "language",
        "tree",
        "restoring",
        "torchfiles",
        "models",
        "continuation",  # megatron_out: the run record checked as a continuation reads it
    },
    # continuation: a Megatron run's records read at convert as a continuation reads them
    "conversion": {"importers", "writer", "multihost", "orbax", "format", "store", "continuation"},
    # verify(against=, logits=True): the source's logits (transformers) vs TransformerLM's
    "logits": {"format", "restoring", "language", "models"},
    # what a torch run's files say of how it stepped (DeepSpeed's config, Megatron's scheduler)
    "continuation": {"format"},
    "optax_torch": {"format", "store", "language", "restoring", "api", "models", "continuation"},
    "against": {
        "format",
        "store",
        "restoring",
        "torchfiles",
        "importers",  # the import of the source planned again: which tensor is whose
        "writer",  # a planned item's value built when asked (writer.Deferred), as convert does
    },  # verify(against=): the source's own loaders
}
# Modules that load no JAX when imported (JAX only inside a function, where a sharding the caller
# gave means it is loaded): the restore engine and its sources, below the one JAX part of
# restoring (``restoring.requests``), so exports and host-only reads never import it. Checked
# with every jax_ucp module each imports at module level, transitively (``import jax_ucp.
# exporters`` is also run in a fresh process: tests/exporters/test_without_jax.py).
JAX_FREE = {
    "jax_ucp._src.restoring.locate",
    "jax_ucp._src.restoring.steps",
    "jax_ucp._src.restoring.resume",
    "jax_ucp._src.restoring.model",
    "jax_ucp._src.restoring.engine",
    "jax_ucp._src.restoring.sources",
    "jax_ucp._src.restoring.sources.ucp_source",
    "jax_ucp._src.restoring.sources.import_source",
    "jax_ucp._src.restoring.sources.gathered",
    "jax_ucp._src.restoring.sources.import_open",
    "jax_ucp._src.restoring.inspecting",
    "jax_ucp._src.api",  # verify and latest_step: jax-ucp verify starts without JAX
    "jax_ucp._src.tree",
    "jax_ucp.exporters",
}
JAX_PACKAGES = {"jax", "jaxlib", "orbax", "flax", "optax"}
TOP = {"cli", "__init__"}  # may import any layer (the demo is in cli)
# leaf modules any layer may use (facts: a run's facts gathered from every record stating them)
BASE = {"lazy_names", "version", "errors", "options", "bulk", "facts"}


def _layer_of(path: str) -> str:
    rel = os.path.relpath(path, PACKAGE)
    first = rel.split(os.sep)[0]
    return first[: -len(".py")] if first.endswith(".py") else first


def _internal(dotted: str) -> list[str]:
    """``jax_ucp._src.a.b`` -> ``["jax_ucp", "a", "b"]``: the module path inside the layers."""
    parts = dotted.split(".")
    return [parts[0], *parts[2:]] if parts[1:2] == ["_src"] else parts


@functools.cache
def _tree(path: str) -> ast.Module:
    """The parsed module, once per test module's run (the checks only read it)."""
    with open(path, encoding="utf-8") as f:
        return ast.parse(f.read(), path)


#: id(tree) -> (the tree, its nodes in ``ast.walk``'s order, {types: those of them})
_WALKS: dict[int, tuple[ast.AST, tuple[ast.AST, ...], dict[tuple[type, ...], list[ast.AST]]]] = {}


def _walk(tree: ast.AST, *types: type[ast.AST]) -> tuple[ast.AST, ...] | list[ast.AST]:
    """``ast.walk(tree)``'s nodes, in its order, those of ``types`` only when given: each tree
    walked once (a walk in Python, node by node, is most of what these checks cost; every check
    walks every module)."""
    got = _WALKS.get(id(tree))
    if got is None or got[0] is not tree:
        got = _WALKS[id(tree)] = (tree, tuple(ast.walk(tree)), {})
    if not types:
        return got[1]
    if types not in got[2]:
        got[2][types] = [n for n in got[1] if isinstance(n, types)]
    return got[2][types]


@pytest.fixture(scope="module", autouse=True)
def _free_the_trees():
    """The parsed trees and their walks (millions of objects) go at the module's end: kept, they
    would slow every full garbage collection of the rest of the xdist worker's tests."""
    yield
    _tree.cache_clear()
    _WALKS.clear()


def _imports(path: str):
    """(imported jax_ucp layer, imported names) of every import in the module, nested included."""
    for node in _walk(_tree(path), ast.Import, ast.ImportFrom):
        if isinstance(node, ast.Import):
            for alias in node.names:
                parts = _internal(alias.name)
                if parts[0] == "jax_ucp" and len(parts) > 1:
                    yield parts[1], [], node.lineno
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            parts = _internal(node.module)
            if parts[0] != "jax_ucp":
                continue
            names = [a.name for a in node.names]
            if len(parts) == 1:  # from jax_ucp._src import writer, format as fmt
                for name in names:
                    yield name, [], node.lineno
            else:
                yield parts[1], names if len(parts) > 2 else [], node.lineno


def _modules():
    for dirpath, _, filenames in os.walk(PACKAGE):
        for name in filenames:
            if name.endswith(".py"):
                yield os.path.join(dirpath, name)


def test_the_layers_import_no_public_module():
    """Code under ``_src`` imports ``_src``: the public modules are the facades over it, so a
    facade can change (or go) without touching the layers. The command line, a client of the
    public API, may use the package root (``jax_ucp.inspect``, ...)."""
    wrong = []
    for path in _modules():
        root_ok = _layer_of(path) in TOP
        for node in _walk(_tree(path), ast.Import, ast.ImportFrom):
            names = (
                [node.module or ""]
                if isinstance(node, ast.ImportFrom) and node.level == 0
                else [a.name for a in node.names]
                if isinstance(node, ast.Import)
                else []
            )
            for name in names:
                parts = name.split(".")
                if parts == ["jax_ucp"] and root_ok:
                    continue
                if parts[0] == "jax_ucp" and parts[1:2] != ["_src"]:
                    wrong.append(f"{os.path.relpath(path, REPO)}:{node.lineno}: imports {name}")
    assert not wrong, "\n".join(wrong)


def test_lower_layers_never_import_higher_ones():
    wrong = []
    for path in _modules():
        layer = _layer_of(path)
        if layer in TOP:
            continue
        for imported, _, line in _imports(path):
            if imported in BASE or imported == layer:
                continue
            if imported not in ALLOWED[layer]:
                wrong.append(f"{os.path.relpath(path, REPO)}:{line}: {layer} imports {imported}")
    assert not wrong, "\n".join(wrong)


def test_no_private_names_across_modules():
    wrong = []
    for path in _modules():
        for _, names, line in _imports(path):
            private = [n for n in names if n.startswith("_") and not n.startswith("__")]
            if private:
                wrong.append(f"{os.path.relpath(path, REPO)}:{line}: imports {private}")
    assert not wrong, "\n".join(wrong)


def test_every_module_has_a_layer():
    """A new package or top-level module is placed in ALLOWED (or TOP), not skipped unchecked."""
    layers = {_layer_of(path) for path in _modules()}
    assert layers - set(ALLOWED) - TOP - BASE == set()


def test_the_layers_form_no_cycle():
    """``ALLOWED`` is a partial order: no layer may reach itself through the layers it imports."""

    def reach(layer: str, seen: frozenset[str]) -> None:
        for lower in ALLOWED.get(layer, ()):
            assert lower not in seen, f"cycle: {' -> '.join([*seen, lower])}"
            reach(lower, seen | {lower})

    for layer in ALLOWED:
        reach(layer, frozenset({layer}))


def test_the_actual_imports_form_no_cycle():
    """No circle between jax_ucp's top-level packages and modules, ``cli`` and ``__init__``
    included (the layer table above does not check those), as found in the code itself."""
    graph: dict[str, set[str]] = {}
    for path in _modules():
        layer = _layer_of(path)
        if layer == "__init__":
            continue  # the package root re-exports everything; it is imported by nothing below
        graph.setdefault(layer, set()).update(
            imported for imported, _, _ in _imports(path) if imported != layer
        )
    done: set[str] = set()

    def visit(node: str, path: tuple[str, ...]) -> None:
        if node in path:
            raise AssertionError(f"import cycle: {' -> '.join([*path, node])}")
        if node in done:
            return
        for nxt in sorted(graph.get(node, ())):
            visit(nxt, (*path, node))
        done.add(node)

    for node in sorted(graph):
        visit(node, ())


def _imported_modules(path: str):
    """(line, dotted module) of every absolute import in the module, ``from a import b`` also
    as ``a.b`` (b may be a module)."""
    for node in _walk(_tree(path), ast.Import, ast.ImportFrom):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            yield node.lineno, node.module
            for a in node.names:
                yield node.lineno, f"{node.module}.{a.name}"
        elif isinstance(node, ast.Import):
            for a in node.names:
                yield node.lineno, a.name


def _imported_formats(path: str, formats: set[str]):
    """(line, format) of every import of a format package under ``importers/``."""
    for line, module in _imported_modules(path):
        parts = _internal(module)
        if parts[:2] == ["jax_ucp", "importers"] and len(parts) > 2 and parts[2] in formats:
            yield line, parts[2]


def _importer_formats(root: str) -> set[str]:
    return {d for d in os.listdir(root) if os.path.isdir(os.path.join(root, d))} - {"__pycache__"}


def test_importers_never_import_each_other():
    """One package per format under ``importers/``: a format's modules import the shared
    importer modules beside the packages (``importers.plan``, ``importers.safetensors_weights``)
    and what lies below (torch's file formats are ``torchfiles``), never another format's
    package. A source two formats share is handed over by ``importers.registry``."""
    root = os.path.join(PACKAGE, "importers")
    formats = _importer_formats(root)
    wrong = []
    for fmt in sorted(formats):
        for dirpath, _, filenames in os.walk(os.path.join(root, fmt)):
            for name in filenames:
                if name.endswith(".py"):
                    path = os.path.join(dirpath, name)
                    for line, other in _imported_formats(path, formats):
                        if other != fmt:
                            rel = os.path.relpath(path, REPO)
                            wrong.append(f"{rel}:{line}: {fmt} imports {other}")
    assert not wrong, "\n".join(sorted(set(wrong)))


def _module_file(name: str) -> str | None:
    """The file of jax_ucp module ``name`` (a package's ``__init__.py``), None if it is none."""
    parts = name.split(".")
    if parts[0] != "jax_ucp":
        return None
    base = os.path.join(REPO, *parts)
    for path in (base + ".py", os.path.join(base, "__init__.py")):
        if os.path.isfile(path):
            return path
    return None


def _load_time_imports(path: str):
    """The absolute module names ``path`` imports when it is imported: its statements outside
    functions and ``if TYPE_CHECKING:`` blocks (a ``from m import n`` names ``m.n`` too)."""
    body = _tree(path).body
    stack = list(body)
    while stack:
        node = stack.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            stack.extend(node.orelse)
            continue
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            yield node.module
            if node.module.split(".")[0] == "jax_ucp":
                yield from (f"{node.module}.{alias.name}" for alias in node.names)
        else:
            stack.extend(c for c in ast.iter_child_nodes(node) if isinstance(c, ast.stmt))


def test_the_engine_and_its_sources_import_no_jax():
    """Each ``JAX_FREE`` module, and every jax_ucp module importing it runs (parent packages
    included), imports no JAX package at module level."""
    wrong = []
    for start in sorted(JAX_FREE):
        chain: dict[str, str | None] = {start: None}  # module -> the module that imported it
        todo = [start]
        while todo:
            name = todo.pop()
            parts = name.split(".")
            parents = [".".join(parts[:i]) for i in range(1, len(parts))]
            for module in [*parents, name]:
                path = _module_file(module)
                if path is None:
                    continue
                for imported in _load_time_imports(path):
                    if imported.split(".")[0] in JAX_PACKAGES:
                        via, seen = [module], module
                        while chain.get(seen):
                            seen = chain[seen]
                            via.append(seen)
                        wrong.append(f"{start}: {' <- '.join(via)} imports {imported}")
                    elif imported not in chain and _module_file(imported) is not None:
                        chain[imported] = module
                        todo.append(imported)
    assert not wrong, "\n".join(wrong)


# restoring/reader.py held six jobs in 1,232 lines (issue 39); its stages stay modules of their
# own size. plan and replicated are whole subjects of their own.
LARGE_RESTORING = {"plan.py", "replicated.py"}
MAX_LINES = 450


def test_the_restoring_modules_stay_small():
    folder = os.path.join(PACKAGE, "restoring")
    large = []
    for path in sorted(glob.glob(os.path.join(folder, "**", "*.py"), recursive=True)):
        if os.path.basename(path) not in LARGE_RESTORING:
            with open(path, encoding="utf-8") as f:
                lines = sum(1 for _ in f)
            if lines > MAX_LINES:
                large.append(f"restoring/{os.path.relpath(path, folder)}: {lines} lines")
    assert not large, "\n".join(large)


def test_the_shared_importer_modules_import_no_format():
    """The modules beside the format packages (``importers.plan``, ...) are what the formats
    share, so they import none of them: only the registry (and the package root) composes the
    formats."""
    root = os.path.join(PACKAGE, "importers")
    formats = _importer_formats(root)
    shared = [n for n in os.listdir(root) if n.endswith(".py")]
    assert "plan.py" in shared and "registry.py" in shared
    wrong = [
        f"importers/{name}:{line}: imports {other}"
        for name in sorted(set(shared) - {"registry.py", "__init__.py"})
        for line, other in _imported_formats(os.path.join(root, name), formats)
    ]
    assert not wrong, "\n".join(wrong)


# Orbax is an integration, not the engine: the save, the restore and the multi-process commit
# run without it (issue 39); only these import the ``orbax`` package.
ORBAX_USERS = ("orbax/", "importers/orbax/", "exporters/orbax_out.py")


def test_orbax_is_imported_only_by_the_orbax_integrations():
    wrong = []
    for path in _modules():
        rel = os.path.relpath(path, PACKAGE).replace(os.sep, "/")
        if rel.startswith(ORBAX_USERS):
            continue
        for line, module in _imported_modules(path):
            if module.split(".")[0] == "orbax":
                wrong.append(f"jax_ucp/{rel}:{line}: imports {module}")
    assert not wrong, "\n".join(sorted(set(wrong)))


def _private_parts(dotted: str) -> list[str]:
    """The underscore segments of a jax_ucp path, but the ``_src`` package right below the root:
    tests of internals import ``jax_ucp._src.<module>`` as JAX's own tests import ``jax._src``."""
    parts = dotted.split(".")
    return [
        p
        for i, p in enumerate(parts)
        if p.startswith("_") and not p.startswith("__") and not (i == 1 and p == "_src")
    ]


def _private_reaches(path: str):
    """(line, what) for each underscore name of jax_ucp a test file imports, reads as an
    attribute of something it imported from jax_ucp, or monkeypatches by name (the ``_src``
    package itself excepted: ``_private_parts``)."""
    tree = _tree(path)
    bound = set()  # names bound to jax_ucp modules, classes or functions
    for node in _walk(tree, ast.Import, ast.ImportFrom):
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "jax_ucp":
            for a in node.names:
                if _private_parts(f"{node.module}.{a.name}"):
                    yield node.lineno, f"from {node.module} import {a.name}"
                bound.add(a.asname or a.name)
        elif isinstance(node, ast.Import):
            for a in node.names:
                if a.name.split(".")[0] == "jax_ucp":
                    if _private_parts(a.name):
                        yield node.lineno, f"import {a.name}"
                    bound.add(a.asname or "jax_ucp")
    for node in _walk(tree, ast.Attribute, ast.Call):
        if isinstance(node, ast.Attribute) and node.attr.startswith("_"):
            chain, base = [node.attr], node.value
            while isinstance(base, ast.Attribute):
                chain.append(base.attr)
                base = base.value
            if isinstance(base, ast.Name) and base.id in bound:
                dotted = ".".join([base.id, *reversed(chain)])
                if base.id != "jax_ucp":  # a name imported from jax_ucp: all of it is its own
                    dotted = "jax_ucp.x." + dotted
                if _private_parts(dotted)[-1:] == [node.attr]:
                    yield node.lineno, ast.unparse(node)
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr in ("setattr", "delattr")
            and node.args
        ):
            target = node.args[0]
            while isinstance(target, ast.Attribute):
                target = target.value
            name = node.args[1] if len(node.args) > 1 else None
            if isinstance(target, ast.Name) and target.id in bound:
                if isinstance(name, ast.Constant) and _private_parts(f"jax_ucp.x.{name.value}"):
                    yield node.lineno, ast.unparse(node)
            elif (
                isinstance(target, ast.Constant)
                and isinstance(target.value, str)
                and target.value.split(".")[0] == "jax_ucp"
                and _private_parts(target.value)
            ):
                yield node.lineno, ast.unparse(node)


def test_the_private_reach_rule_allows_src_but_no_underscore_name_beyond_it(tmp_path):
    """The rule above on its own: ``jax_ucp._src.<module>`` is a module a test may import, an
    underscore name in or below it is not."""
    probe = tmp_path / "probe.py"
    probe.write_text(
        "import jax_ucp\n"
        "import jax_ucp._src.writer.commit as commit\n"
        "from jax_ucp._src.format import dtypes\n"
        "from jax_ucp._src.format.dtypes import _private_a\n"
        "import jax_ucp._src._private_b\n"
        "jax_ucp._src.format.dtypes.dtype_name\n"
        "jax_ucp._src.format._private_c\n"
        "dtypes._private_d\n"
        "monkeypatch.setattr('jax_ucp._src.writer.commit.os', 1)\n"
        "monkeypatch.setattr('jax_ucp._src.writer.commit._private_e', 1)\n"
        "monkeypatch.setattr(commit, '_private_f', 1)\n"
    )
    found = [what for _, what in _private_reaches(str(probe))]
    assert len(found) == 6 and all(f"_private_{c}" in " ".join(found) for c in "abcdef"), found


def test_tests_reach_no_private_name_of_jax_ucp():
    """Tests go through the public surface (a module's non-underscore names): a unit worth a
    test of its own gets a public name in its module, so a refactoring of internals never
    breaks a test that pinned them."""
    wrong = []
    for dirpath, _, filenames in os.walk(os.path.join(REPO, "tests")):
        for name in filenames:
            if name.endswith(".py"):
                path = os.path.join(dirpath, name)
                for line, what in _private_reaches(path):
                    wrong.append(f"{os.path.relpath(path, REPO)}:{line}: {what}")
    assert not wrong, "\n".join(wrong)


# The storage media (``store/storage/``) are the only code that renames a checkpoint into place or
# writes objects of a prefix itself (issue 49): a new backend is a new module there, and nothing
# above it commits on its own.
STORAGE = ("store/storage/",)
RENAMES = {("os", "rename"), ("os", "replace"), ("os", "renames"), ("shutil", "move")}
OBJECT_CLIENTS = {"object_store"}  # the object-store client
OBJECT_WRITES = {"write", "create", "delete", "delete_names"}
KVSTORE_READERS = {
    "restoring/sources/ucp_source.py",  # opens a prefix to read its shards' digests
}


def _storage_escapes(rel: str, tree: ast.AST):
    for node in _walk(tree, ast.ImportFrom, ast.Attribute, ast.Call):
        if (
            isinstance(node, ast.ImportFrom)
            and (node.module or "").split(".")[-1] in OBJECT_CLIENTS
        ):
            for alias in node.names:
                if alias.name in OBJECT_WRITES:
                    yield node.lineno, f"imports the object-store write {alias.name}"
        if (
            isinstance(node, ast.Attribute)
            and node.attr == "KvStore"
            and rel not in KVSTORE_READERS
        ):
            yield node.lineno, "opens a TensorStore KvStore"
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
            continue
        func, owner = node.func, node.func.value
        owner_name = owner.attr if isinstance(owner, ast.Attribute) else getattr(owner, "id", "")
        if (owner_name, func.attr) in RENAMES or (
            func.attr in OBJECT_WRITES and owner_name in OBJECT_CLIENTS
        ):
            yield node.lineno, f"{owner_name}.{func.attr}"
        elif func.attr in ("rename", "replace") and len(node.args) == 1 and not node.keywords:
            yield node.lineno, f"Path.{func.attr}"  # pathlib's rename / replace take one target


def test_renames_and_object_writes_stay_in_the_storage_modules():
    wrong = []
    for path in _modules():
        rel = os.path.relpath(path, PACKAGE).replace(os.sep, "/")
        if rel.startswith(STORAGE):
            continue
        tree = _tree(path)
        wrong += [
            f"jax_ucp/_src/{rel}:{line}: {what}" for line, what in _storage_escapes(rel, tree)
        ]
    assert not wrong, "\n".join(sorted(wrong))


def test_the_medium_is_asked_only_inside_the_storage_modules():
    """Whether a path is an object store is its ``Storage``'s to answer (``local``,
    ``identity()``, its requests), chosen once and handed down (issue 58): no ``.renames`` (how
    a medium commits) nor ``"://"`` sniffed anywhere above ``store/storage/``."""
    wrong = []
    for path in _modules():
        rel = os.path.relpath(path, PACKAGE).replace(os.sep, "/")
        with open(path, encoding="utf-8") as f:
            lines = [] if rel.startswith(STORAGE) else list(enumerate(f, 1))
        forks = (".renames", '"://"', "'://'")
        wrong += [f"jax_ucp/_src/{rel}:{n}" for n, s in lines if any(k in s for k in forks)]
    assert not wrong, "\n".join(wrong)


def test_the_storage_rule_sees_a_rename_and_an_object_write():
    code = (
        "import os, pathlib\n"
        "from jax_ucp._src.store.storage import object_store\n"
        "from jax_ucp._src.store.storage.object_store import create\n"
        "os.rename(a, b)\n"
        "pathlib.Path(a).rename(b)\n"
        "object_store.write(url, 'ucp.json', data)\n"
        "ts.KvStore.open(spec)\n"
        "s.replace('a', 'b')\n"  # str.replace: not a rename
    )
    found = [what for _, what in _storage_escapes("writer/x.py", ast.parse(code))]
    assert sorted(found) == sorted(
        [
            "imports the object-store write create",
            "os.rename",
            "Path.rename",
            "object_store.write",
            "opens a TensorStore KvStore",
        ]
    )


# --------------------------------------------------------------------------- format knowledge

#: The string literals naming an importer's format or layout that a module outside
#: ``importers/`` may hold, each for a reason that is not a format's knowledge (issue 58: what a
#: format is, reads and records, and how ``verify --against`` reads it, is in ``importers/``).
FORMAT_NAMES_ALLOWED = {
    # Python packages: the extra a missing loader's package names; OLMo-core's pickled module
    "against.py": {"deepspeed", "torch", "olmo_core", "torch_dist", "fsdp_dtensor"},
    "options.py": {"orbax"},  # a module name: Orbax's frames skipped to find the user's line
    # torch's module name in the pickles of torch's file formats
    "torchfiles/pickle_format.py": {"torch"},
    "torchfiles/torch_zip.py": {"torch"},
    "torchfiles/dcp.py": {"torch"},
    # the exporters' own output formats (an exporter is its format's module, as an importer is)
    "exporters/engine.py": {"safetensors", "orbax", "megatron"},
    "exporters/options.py": {"safetensors", "orbax", "megatron"},
    "exporters/megatron_out.py": {"torch_dist", "torch"},  # megatron-core's own format names
    "cli/commands.py": {"safetensors"},  # export --to's default: an exporter's name
    # the records a run is continued from (continuation imports format alone): the DeepSpeed
    # config in source.optimizer, the framework of a Megatron import
    "continuation/deepspeed.py": {"deepspeed"},
    "continuation/megatron.py": {"megatron"},
    "format/manifest.py": {"torch"},  # the display's name of an import recording no framework
    # the restore's open stage, which moves 2 and 3 of issue 58 rewrite (safetensors read in
    # place, a torch DCP folder in an object store)
    "restoring/sources/import_open.py": {"safetensors", "torch_dcp"},
}


def _format_names(rel: str, tree: ast.AST, names: set[str]) -> list[str]:
    """Where module ``rel`` holds a string literal of ``names`` its allow-list does not."""
    names = names - FORMAT_NAMES_ALLOWED.get(rel, set())
    return [
        f"jax_ucp/_src/{rel}:{node.lineno}: {node.value!r}"
        for node in _walk(tree, ast.Constant)
        if isinstance(node.value, str) and node.value in names
    ]


def test_format_names_stay_in_the_importers():
    """No module outside ``importers/`` names an importer's format or layout in a string literal
    (``registry.IMPORTERS``' names, ``FORMATS``, the provenance formats of ``AGAINST``), but for
    ``FORMAT_NAMES_ALLOWED``'s reasons: it asks the registry (issue 58)."""
    from jax_ucp._src.importers import registry

    names = {*registry.IMPORTERS, *registry.FORMATS, *registry.AGAINST}
    wrong = []
    for path in _modules():
        rel = os.path.relpath(path, PACKAGE).replace(os.sep, "/")
        if not rel.startswith("importers/"):
            wrong += _format_names(rel, _tree(path), names)
    assert not wrong, "\n".join(wrong)


def test_the_format_names_rule_sees_a_format_name():
    code = 'x.get("verl")\nfmt == "torch"\nsaid = "verl\'s ranks"\n'
    found = _format_names("against.py", ast.parse(code), {"verl", "torch"})
    assert found == ["jax_ucp/_src/against.py:1: 'verl'"]  # torch: a package against.py names
    assert len(_format_names("writer/x.py", ast.parse(code), {"verl", "torch"})) == 2
