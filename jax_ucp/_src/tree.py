"""Pytrees ⇄ key paths: flattening what is saved, rebuilding nested dicts/lists on restore."""

from __future__ import annotations

import functools
import importlib
import math
import sys
import warnings
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from jax_ucp._src.errors import CheckpointError, RequestError
from jax_ucp._src.format import keypath as keypath_lib


def _is_leaf(x) -> bool:
    if x is None:
        return True
    return _is_box(x)


def _is_box(x) -> bool:
    """A flax metadata box, asked only once flax.core.meta is imported (importing flax: 0.2 s)."""
    meta = sys.modules.get("flax.core.meta")
    return meta is not None and isinstance(x, meta.AxisMetadata)


def flatten(tree) -> tuple[list[tuple[tuple[str, ...], tuple[str, ...], Any]], Any]:
    """[(key, key_types, leaf)] in flatten order, and the treedef; a bad key is a ``RequestError``."""
    import jax  # here, not at import: inspect reads a tree's classes without JAX

    try:
        leaves, treedef = jax.tree_util.tree_flatten_with_path(tree, is_leaf=_is_leaf)
    except ValueError as e:
        where = _unsortable_dict(tree)
        if where is None:
            raise
        path, types = where
        raise RequestError(
            f"Dict at key path {_path_text(path)} mixes key types {types} (e.g. 1 and '1'); JAX "
            f"sorts a dict's keys and a checkpoint names leaves by them: use keys of one type."
        ) from e
    out = []
    for path, leaf in leaves:
        comps = [keypath_lib.component_of(p) for p in path]
        key = tuple(c[1] for c in comps)
        for component in key:
            if not component.isascii():
                try:
                    component.encode("utf-8")
                except UnicodeEncodeError as e:
                    raise RequestError(
                        f"Key path {_path_text(key)}: component {component!r} is not valid "
                        f"Unicode text ({e.reason} at position {e.start}); a checkpoint stores "
                        f"keys as UTF-8. Rename that key."
                    ) from None
        out.append((key, tuple(c[0] for c in comps), leaf))
    return out, treedef


def _key_of(path) -> tuple[str, ...]:
    """The key (component names) of a JAX key path."""
    return tuple(keypath_lib.component_of(p)[1] for p in path)


def _path_text(path: Sequence[str]) -> str:
    text = "/".join(path) if path else "(the root)"
    return repr(text if len(text) <= 200 else text[:200] + "…")  # repr escapes surrogates


def _unsortable_dict(tree) -> tuple[tuple[str, ...], list[str]] | None:
    """(key path, key type names) of the first dict whose keys cannot be sorted, else None."""
    stack: list[tuple[tuple[str, ...], Any]] = [((), tree)]
    while stack:
        prefix, node = stack.pop()
        if _is_leaf(node):
            continue
        if isinstance(node, dict):
            try:
                sorted(node)
            except TypeError:
                return prefix, sorted({type(k).__name__ for k in node})
            stack.extend((prefix + (str(k),), v) for k, v in node.items())
            continue
        try:
            children = _children(node)
        except ValueError:  # a dict-like node (FrozenDict) whose own keys do not sort
            return prefix, ["mixed"]
        stack.extend((prefix + _key_of(path), child) for path, child in children or ())
    return None


def _children(node) -> list | None:
    """(key path entry, child) of each child of ``node``; None when it is no container."""
    import jax  # here, not at import: inspect reads a tree's classes without JAX

    children = jax.tree_util.tree_flatten_with_path(node, is_leaf=lambda c: c is not node)[0]
    return None if len(children) == 1 and children[0][0] == () else children


def unbox(leaf) -> tuple[Any, tuple | None]:
    """(value, logical axis names) for flax metadata boxes; (leaf, None) otherwise."""
    if _is_box(leaf):
        names = getattr(leaf, "names", None)
        return leaf.unbox(), (tuple(names) if names is not None else None)
    return leaf, None


def rebox(target_leaf, value) -> Any:
    """``value`` in the flax box ``target_leaf`` is, so a restore keeps the target's treedef."""
    if _is_box(target_leaf):
        return target_leaf.replace_boxed(value)
    return value


def target_leaves(target, boxed: bool = True) -> tuple[list[tuple[tuple[str, ...], Any]], Callable]:
    """A restore target flattened once: its unboxed leaves by key, and ``rebuild(values)``."""
    import jax  # here, not at import: inspect reads a tree's classes without JAX

    leaves, treedef = flatten(target)
    boxes = [leaf for _, _, leaf in leaves] if boxed else None

    def rebuild(values: list) -> Any:
        if boxes is not None:
            values = [rebox(box, x) for box, x in zip(boxes, values)]
        return jax.tree_util.tree_unflatten(treedef, values)

    return [(key, unbox(leaf)[0]) for key, _, leaf in leaves], rebuild


def _is_variable(x) -> bool:
    return _is_variable_class(type(x))


def _is_variable_class(cls: type) -> bool:
    # As _is_box: a Variable exists only once flax.nnx is imported; importing it to ask cost a
    # first save ~0.5 s (1.74 s vs 0.44 s for 1 GB on 8 CPU devices).
    nnx = sys.modules.get("flax.nnx")
    return nnx is not None and issubclass(cls, nnx.Variable)


# nnx.Variable metadata holding its axis names, by flax release (0.12: out_sharding).
_VARIABLE_AXES_METADATA = ("out_sharding", "sharding_names", "sharding")


def _inside_variables(tree, of: Callable[[Any], Any]) -> dict[tuple[str, ...], Any]:
    """{key inside an ``nnx.Variable`` of ``tree``: ``of(the Variable)``}, where that is not None."""
    import jax  # here, not at import: inspect reads a tree's classes without JAX

    if "flax.nnx" not in sys.modules:
        return {}
    nodes = jax.tree_util.tree_flatten_with_path(
        tree, is_leaf=lambda x: _is_variable(x) or _is_leaf(x)
    )[0]
    out: dict[tuple[str, ...], Any] = {}
    for path, node in nodes:
        found = of(node) if _is_variable(node) else None
        if found is not None:
            for inner, _ in jax.tree_util.tree_flatten_with_path(node)[0]:
                out[_key_of(path) + _key_of(inner)] = found
    return out


def variable_roles(tree) -> dict[tuple[str, ...], str]:
    """{key inside an ``nnx.Variable``: "param" or "opt_state"}, by the Variable's class."""

    def role(node) -> str | None:
        nnx = sys.modules["flax.nnx"]
        if isinstance(node, nnx.Param):
            return "param"
        return "opt_state" if isinstance(node, getattr(nnx, "OptState", ())) else None

    return _inside_variables(tree, role)


def variable_axes(tree) -> dict[tuple[str, ...], tuple]:
    """{key inside an ``nnx.Variable``: its axis names}, where its metadata names them."""

    def axes(node) -> tuple | None:
        metadata = node.get_metadata() if hasattr(node, "get_metadata") else {}
        names = next(
            (metadata[m] for m in _VARIABLE_AXES_METADATA if metadata.get(m) is not None), None
        )
        if names is None or not all(isinstance(n, (str, type(None))) for n in names):
            return None
        return tuple(names)

    return _inside_variables(tree, axes)


def nest(items: Iterable[tuple[Sequence[str], Sequence[str], Any]], *, partial=False) -> Any:
    """Nested dicts from (key, key_types, value); a level of indices 0..n-1 becomes a list."""
    root: dict = {}
    types_at: dict[tuple, set] = {}
    for key, key_types, value in items:
        node = root
        for depth, comp in enumerate(key[:-1]):
            types_at.setdefault(tuple(key[:depth]), set()).add(
                key_types[depth] if depth < len(key_types) else "key"
            )
            node = node.setdefault(comp, {})
        types_at.setdefault(tuple(key[:-1]), set()).add(key_types[-1] if key_types else "key")
        node[key[-1]] = value

    def convert(node, prefix):
        if not isinstance(node, dict):
            return node
        conv = {k: convert(v, prefix + (k,)) for k, v in node.items()}
        if types_at.get(prefix) == {"index"} and sorted(conv, key=int) == [
            str(i) for i in range(len(conv))
        ]:
            return [conv[str(i)] for i in range(len(conv))]
        if partial and types_at.get(prefix) == {"index"}:
            return {int(k): v for k, v in sorted(conv.items(), key=lambda kv: int(kv[0]))}
        return conv

    return convert(root, ())


def _is_axes(x) -> bool:
    return x is None or (isinstance(x, tuple) and all(isinstance(n, (str, type(None))) for n in x))


def flatten_axes(logical_axes) -> dict[tuple[str, ...], tuple | None]:
    """A pytree of logical axis-name tuples (or PartitionSpecs of names) → {key: names}."""
    import jax  # here, not at import: inspect reads a tree's classes without JAX

    leaves, _ = jax.tree_util.tree_flatten_with_path(logical_axes, is_leaf=_is_axes)
    return {_key_of(path): None if names is None else tuple(names) for path, names in leaves}


# --- container types: recorded at save, rebuilt on restore without a target ----------------------
# A manifest is untrusted: its class names are looked up in ``allowed_classes()``, never imported
# or resolved by attribute; anything else comes back a dict of its fields.

# Public optax modules whose NamedTuples (optimizer states) are rebuilt.
_OPTAX_MODULES = (
    "optax",
    "optax.contrib",
    "optax.schedules",
    "optax.transforms",
    "optax.tree_utils",
)
# Other container classes rebuilt from the dict of their children: (module, attribute).
_DICT_CLASSES = (("flax.core", "FrozenDict"), ("flax.nnx", "State"))
# The module whose public nnx.Variable subclasses (flax's own) are rebuilt from their value.
_VARIABLE_MODULE = "flax.nnx"
_PACKAGES = ("optax", "flax")

#: ``allowed_classes`` for optax 0.2.8 / flax 0.12, judged without importing them (and JAX: 1-4 s);
#: tests/test_tree.py checks it against the installed packages.
KNOWN_CLASSES: dict[str, dict[str, tuple[str, ...] | str]] = {
    "optax": {
        "AddNoiseState": ("count", "rng_key"),
        "ApplyEvery": ("count", "grad_acc"),
        "ApplyIfFiniteState": ("notfinite_count", "last_finite", "total_notfinite", "inner_state"),
        "COCOBState": ("init_particles", "cumulative_gradients", "scale", "subgradients", "reward"),
        "ConditionallyMaskState": ("step", "inner_state"),
        "ConditionallyTransformState": ("inner_state", "step"),
        "DAdaptAdamWState": (
            "exp_avg",
            "exp_avg_sq",
            "grad_sum",
            "estim_lr",
            "numerator_weighted",
            "count",
        ),
        "DifferentiallyPrivateAggregateState": ("rng_key",),
        "DoGState": ("is_init_step", "init_params", "max_dist", "sum_sq_norm_grads"),
        "DoWGState": ("init_params", "weighted_sq_norm_grads", "estim_sq_dist"),
        "EmaState": ("count", "ema"),
        "EmptyState": (),
        "FactoredState": ("count", "v_row", "v_col", "v"),
        "GaLoreDimensionNumbers": ("reduction_axis", "output_axis"),
        "GaLoreState": ("count", "base_optimizer_state", "projector"),
        "GradientTransformation": ("init", "update"),
        "GradientTransformationExtraArgs": ("init", "update"),
        "HutchinsonState": ("key",),
        "InjectHyperparamsState": ("count", "hyperparams", "inner_state"),
        "InjectStatefulHyperparamsState": (
            "count",
            "hyperparams",
            "hyperparams_states",
            "inner_state",
        ),
        "LookaheadParams": ("fast", "slow"),
        "LookaheadState": ("fast_state", "steps_since_sync"),
        "MadgradState": ("count", "grad_sum_sq", "s", "x0"),
        "MaskedNode": (),
        "MaskedState": ("inner_state",),
        "MechanicState": ("base_optimizer_state", "count", "r", "m", "v", "s", "x0"),
        "MomoAdamState": ("exp_avg", "exp_avg_sq", "barf", "gamma", "lb", "count"),
        "MomoState": ("exp_avg", "barf", "gamma", "lb", "count"),
        "MonitorState": ("measurements", "measure_states"),
        "MultiStepsState": (
            "mini_step",
            "gradient_step",
            "inner_opt_state",
            "acc_grads",
            "skip_state",
        ),
        "MuonDimensionNumbers": ("reduction_axis", "output_axis"),
        "MuonState": ("count", "mu", "ns_coeffs"),
        "PartitionState": ("inner_states",),
        "ProdigyState": (
            "exp_avg",
            "exp_avg_sq",
            "grad_sum",
            "params0",
            "estim_lr",
            "numerator_weighted",
            "count",
        ),
        "ReduceLROnPlateauState": (
            "scale",
            "best_value",
            "plateau_count",
            "cooldown_count",
            "count",
            "avg_value",
        ),
        "SAMState": ("steps_since_sync", "opt_state", "adv_state", "cache"),
        "ScaleByAdaDeltaState": ("e_g", "e_x"),
        "ScaleByAdamState": ("count", "mu", "nu"),
        "ScaleByAdanState": ("m", "v", "n", "g", "t"),
        "ScaleByAdemamixState": ("count", "count_m2", "m1", "m2", "nu"),
        "ScaleByAmsgradState": ("count", "mu", "nu", "nu_max"),
        "ScaleByBacktrackingLinesearchState": ("learning_rate", "value", "grad", "info"),
        "ScaleByBeliefState": ("count", "mu", "nu"),
        "ScaleByLBFGSState": (
            "count",
            "params",
            "updates",
            "diff_params_memory",
            "diff_updates_memory",
            "weights_memory",
        ),
        "ScaleByLionState": ("count", "mu"),
        "ScaleByNovogradState": ("count", "mu", "nu"),
        "ScaleByRStdDevState": ("mu", "nu"),
        "ScaleByRmsState": ("nu",),
        "ScaleByRpropState": ("step_sizes", "prev_updates"),
        "ScaleByRssState": ("sum_of_squares",),
        "ScaleBySM3State": ("mu", "nu"),
        "ScaleByScheduleState": ("count",),
        "ScaleBySimplifiedAdEMAMixState": ("t", "m", "n"),
        "ScaleByZoomLinesearchState": ("learning_rate", "value", "grad", "info"),
        "ScheduleFreeState": (
            "b1",
            "weight_sum",
            "step_count",
            "max_lr",
            "base_optimizer_state",
            "z",
        ),
        "SnapshotState": ("measurement",),
        "SophiaState": ("count", "mu", "nu", "hessian_fn_state"),
        "SplitRealAndImaginaryState": ("inner_state",),
        "TraceState": ("trace",),
        "ZeroNansState": ("found_nan",),
        "ZoomLinesearchInfo": ("num_linesearch_steps", "decrease_error", "curvature_error"),
    },
    "flax": {
        "BatchStat": "variable",
        "Cache": "variable",
        "FrozenDict": "dict",
        "Intermediate": "variable",
        "LoRAParam": "variable",
        "OptArray": "variable",
        "OptState": "variable",
        "OptVariable": "variable",
        "Param": "variable",
        "Perturbation": "variable",
        "RngCount": "variable",
        "RngKey": "variable",
        "RngState": "variable",
        "State": "dict",
        "Variable": "variable",
    },
}


def class_name(cls: type) -> str:
    """How ``describe_structure`` names a class in the manifest."""
    return f"{cls.__module__}:{cls.__qualname__}"


def _classes_in(module_name: str, keep: Callable[[type], bool]) -> dict[str, type]:
    """The classes of ``module_name`` (its own package's, not imported ones) that ``keep``."""
    try:
        module = importlib.import_module(module_name)
    except ImportError:  # pragma: no cover - an optax or flax without that module
        return {}
    package = module_name.split(".")[0]
    found = (getattr(module, attr, None) for attr in dir(module))
    return {
        class_name(obj): obj
        for obj in found
        if isinstance(obj, type) and obj.__module__.split(".")[0] == package and keep(obj)
    }


def _is_named_tuple(cls: type) -> bool:
    return issubclass(cls, tuple) and isinstance(getattr(cls, "_fields", None), tuple)


@functools.cache
def _allowed_in(package: str) -> dict[str, type]:
    """The allow-list's classes of one package, from our own list of modules, never a manifest's."""
    if package == "optax":
        return {k: v for m in _OPTAX_MODULES for k, v in _classes_in(m, _is_named_tuple).items()}
    table: dict[str, type] = {}
    for module_name, attr in _DICT_CLASSES:
        table.update(_classes_in(module_name, lambda cls, attr=attr: cls.__name__ == attr))
    return {**table, **_classes_in(_VARIABLE_MODULE, _is_variable_class)}


def allowed_classes() -> dict[str, type]:
    """Manifest class name → class, for every container a restore rebuilds."""
    return {k: v for package in _PACKAGES for k, v in _allowed_in(package).items()}


@functools.cache
def _by_qualname(package: str) -> dict[str, type | None]:
    """qualname → class of one package where unique: optax moves classes between private modules."""
    out: dict[str, type | None] = {}
    for cls in _allowed_in(package).values():
        key = cls.__qualname__
        out[key] = None if key in out and out[key] is not cls else cls
    return out


def _package_of(name: object) -> str | None:
    if not isinstance(name, str):
        return None
    package = name.partition(":")[0].split(".")[0]
    return package if package in _PACKAGES else None


def allowed_class(name: object) -> type | None:
    """The allow-listed class ``"<module>:<qualname>"`` names, or one optax has since moved."""
    package = _package_of(name)
    if package is None:
        return None
    assert isinstance(name, str)
    cls = _allowed_in(package).get(name)
    if cls is not None:
        return cls
    return _by_qualname(package).get(name.partition(":")[2])


def class_kind(name: object, live: bool) -> tuple[str, tuple[str, ...] | None] | None:
    """("namedtuple", fields) | ("dict", None) | ("variable", None) for an allow-listed class name,
    else None."""
    package = _package_of(name)
    if package is None:
        return None
    assert isinstance(name, str)
    if not live:
        known = KNOWN_CLASSES[package].get(name.partition(":")[2])
        if known is None:
            return None
        return ("namedtuple", known) if isinstance(known, tuple) else (known, None)
    cls = allowed_class(name)
    if cls is None:
        return None
    if issubclass(cls, tuple):
        return "namedtuple", tuple(getattr(cls, "_fields", ()))
    return ("variable" if _is_variable_class(cls) else "dict"), None


_PLAIN_KINDS = {dict: "dict", list: "list", tuple: "tuple"}


def describe_structure(tree) -> dict:
    """The container structure of ``tree`` as JSON: node types, classes, child names."""

    def node(x) -> dict:
        children = None if _is_leaf(x) else _children(x)
        if children is None:
            return {"type": "leaf"}
        kids = []
        for path, child in children:
            key_type, name = keypath_lib.component_of(path[0])
            if key_type == "key" and type(getattr(path[0], "key", None)) is int:
                key_type = "index"
            kids.append([name, key_type, node(child)])
        kind = _PLAIN_KINDS.get(type(x))
        if kind is not None:
            return {"type": kind, "children": kids}
        kind = "namedtuple" if isinstance(x, tuple) and hasattr(type(x), "_fields") else "object"
        out = {"type": kind, "children": kids, "class": class_name(type(x))}
        if _is_variable(x):
            out["metadata"] = _variable_metadata(x)
        return out

    return node(tree)


# nnx.Variable metadata a restore leaves to flax (set by the Variable itself; flax refuses to
# change them on an existing Variable).
_RESERVED_METADATA = frozenset(("hijax", "ref", "eager_sharding"))


def _json_scalar(v) -> bool:
    if isinstance(v, float):
        return math.isfinite(v)  # ucp.json is strict JSON
    return isinstance(v, (type(None), str, bool, int))


def _variable_metadata(variable) -> dict:
    """An ``nnx.Variable``'s metadata that JSON holds, so a restore without a target gives it back."""
    metadata = variable.get_metadata() if hasattr(variable, "get_metadata") else {}
    out = {}
    for name, v in metadata.items():
        if name in _RESERVED_METADATA or not isinstance(name, str):
            continue
        if isinstance(v, tuple):
            v = list(v)
        if _json_scalar(v) or (isinstance(v, list) and all(map(_json_scalar, v))):
            out[name] = v
    return out


_MISSING = object()


def rebuild_structure(
    description: dict,
    value_at: Any,
    prefix: tuple = (),
    *,
    partial: bool = False,
    axes_at: Callable[[tuple], tuple | None] | None = None,
) -> Any:
    """The tree ``describe_structure`` described, each leaf ``value_at(key)`` (``_MISSING`` when not
    restored): containers that lose children become dicts, empty subtrees of a selection disappear,
    a leafless node comes back only beside siblings restored whole.

    Args:
        description: what ``describe_structure`` recorded.
        value_at: the value of a leaf, by key (``_MISSING`` when not restored).
        prefix: the key of ``description``'s node.
        partial: a selection: only containers of restored leaves.
        axes_at: the recorded logical axes of a leaf, by key: an ``nnx.Variable`` comes back
            with them as its ``out_sharding`` (None: without)."""
    for _, notice in class_notices(description):  # never silently a dict: the nodes named
        warnings.warn(notice, UserWarning, stacklevel=2)
    return _rebuild(description, value_at, prefix, partial, axes_at)[0]


class _Leafless:
    """A child without leaves (``EmptyState()``, ``{}``) whose place a selection decides."""

    def __init__(self, description: dict):
        self.description = description


def _has_leaves(description: dict) -> bool:
    if description["type"] == "leaf":
        return True
    return any(_has_leaves(child) for _, _, child in description["children"])


def _rebuild(
    description: dict, value_at: Any, prefix: tuple, partial: bool, axes_at=None
) -> tuple[Any, bool]:
    """(the rebuilt node or ``_MISSING``, whether every leaf under it was restored)."""
    if description["type"] == "leaf":
        value = value_at(prefix)
        return value, value is not _MISSING
    slots: list = []  # (key, value) per child in order; leafless ones decided below
    whole = True
    for name, key_type, child in description["children"]:
        key = _child_key(name, key_type)
        if partial and not _has_leaves(child):
            slots.append((key, _Leafless(child)))
            continue
        value, child_whole = _rebuild(child, value_at, prefix + (name,), partial, axes_at)
        whole = whole and child_whole
        slots.append((key, value))
    restored = [(k, v) for k, v in slots if not isinstance(v, _Leafless) and v is not _MISSING]
    if partial:
        if not restored:
            return _MISSING, False
        if whole:  # every leaf below was restored: its leafless parts belong to it too
            restored = [
                (k, _rebuild(v.description, value_at, prefix, False, axes_at)[0])
                if isinstance(v, _Leafless)
                else (k, v)
                for k, v in slots
            ]
    elif not restored and description["children"]:
        return _MISSING, False  # nothing of this subtree was restored
    if len(restored) < len(description["children"]):
        return dict(restored), False  # part of a container (a selection): positions stay ints
    kind, values = description["type"], [v for _, v in restored]
    if kind in ("list", "tuple"):
        return (list if kind == "list" else tuple)(values), whole
    if kind == "dict":
        return dict(restored), whole  # an int key (key type "index") stays an int
    rebuilt_as = _node_kind(description)  # None: a class outside the allow-list
    fields = {str(k): v for k, v in restored}
    if rebuilt_as is None:
        return fields, whole  # its fields, by name
    cls = allowed_class(description["class"])
    assert cls is not None
    if rebuilt_as == "namedtuple":
        return cls(*values), whole
    if rebuilt_as == "variable":
        names = None if axes_at is None else axes_at(prefix + ("value",))
        return _variable(cls, fields["value"], description.get("metadata"), names), whole
    return cls(dict(restored)), whole  # FrozenDict, State


def _child_key(name: str, key_type: str):
    """A child's key in its rebuilt container: an int for a position or an integer dict key."""
    if key_type == "index":
        try:
            number = int(name)
        except ValueError:  # an untrusted manifest's "index" that is no number: a name
            return name
        if str(number) == name:  # "01" or " 1" stay names: two children never share a key
            return number
    return name


def _variable(cls: type, value: Any, metadata: dict | None, names: tuple | None) -> Any:
    """An ``nnx.Variable`` of class ``cls`` holding ``value`` with the recorded metadata."""
    variable = cls(value)
    if metadata is None and names is not None and any(n is not None for n in names):
        metadata = {_VARIABLE_AXES_METADATA[0]: names}
    kept = {
        str(k): tuple(v) if isinstance(v, list) else v
        for k, v in (metadata or {}).items()
        if k not in _RESERVED_METADATA
    }
    if kept:
        variable.set_metadata(**kept)
    return variable


def _node_kind(description: dict, live: bool = True) -> str | None:
    """How a "namedtuple"/"object" node is rebuilt: "namedtuple", "variable", "dict"; None: a dict."""
    found = class_kind(description.get("class"), live)
    if found is None:
        return None
    kind, fields = found
    names = tuple(name for name, _, _ in description["children"])
    if (description["type"] == "namedtuple") != (kind == "namedtuple"):
        return None
    if kind == "namedtuple" and fields != names:
        return None
    if kind == "variable" and names != ("value",):
        return None
    return kind


def class_notices(description: dict | None) -> list[tuple[str, str]]:
    """[(tree node, notice)]: one notice naming the nodes a restore without a target gives as dicts."""
    found: list[tuple[str, str, str]] = []  # (node path, class, why)
    stack: list[tuple[tuple[str, ...], dict, bool]] = (
        [((), description, False)] if description is not None else []
    )
    while stack:
        prefix, node, in_state = stack.pop()
        if node["type"] == "leaf":
            continue
        kind = None
        if node["type"] in ("namedtuple", "object"):
            name = node.get("class")
            live = _package_of(name) in sys.modules
            kind = _node_kind(node, live)
            _refuse_foreign_variable(prefix, node, kind, in_state)
            if kind is None:
                why = (
                    "is not in the allow-list of container classes"
                    if class_kind(name, live) is None
                    else "is allow-listed but its fields are not "
                    + _short_text(tuple(name for name, _, _ in node["children"]))
                )
                found.append(("/".join(prefix) or "the root", _short_text(name), why))
        state = kind == "dict" and str(node.get("class")).startswith(_VARIABLE_MODULE)
        for name, _, child in reversed(node["children"]):
            stack.append((prefix + (name,), child, state))
    if not found:
        return []
    where = found[0][0]
    if len(found) == 1:
        _, cls, why = found[0]
        return [
            (
                where,
                f"Tree node {where!r}: class {cls} {why}; a restore without a target gives it "
                f"back as a dict of its fields.",
            )
        ]
    by_class: dict[tuple[str, str], list[str]] = {}
    for path, cls, why in found:
        by_class.setdefault((cls, why), []).append(path)
    parts = [
        f"class {cls} {why} ({len(paths)}: {', '.join(map(repr, paths[:2]))}"
        f"{', …' if len(paths) > 2 else ''})"
        for (cls, why), paths in list(by_class.items())[:4]
    ]
    more = f"; and {len(by_class) - 4} more classes" if len(by_class) > 4 else ""
    return [
        (
            where,
            f"{len(found)} tree nodes come back as dicts of their fields from a restore without "
            f"a target: {'; '.join(parts)}{more}.",
        )
    ]


def _refuse_foreign_variable(prefix: tuple, node: dict, kind: str | None, in_state: bool) -> None:
    """A node recorded as an ``nnx.Variable`` (its metadata, or the lone ``value`` attribute
    of a node in an ``nnx.State``) whose class no Variable can have (not "module:qualname", or
    of Python's standard library: ``os:system``) is refused, never handed back as a plain
    container in the Variable's place; a user's own Variable subclass stays a notice."""
    shaped = in_state and [c[:2] for c in node["children"]] == [["value", "attr"]]
    if kind == "variable" or not ("metadata" in node or shaped):
        return
    name = node.get("class")
    module = name.partition(":")[0].split(".")[0] if isinstance(name, str) else ""
    if ":" in str(name) and module not in sys.stdlib_module_names and module != "builtins":
        return
    where = "/".join(prefix) or "the root"
    raise CheckpointError(
        f"ucp.json: tree node {where!r} is recorded as an nnx.Variable "
        f"({'its metadata' if 'metadata' in node else 'a value in an nnx.State'}) of class "
        f"{_short_text(name)}, which no Variable can be (Python's standard library, or not "
        f"'module:qualname'); refusing the checkpoint rather than restoring it as a dict."
    )


def _short_text(text, limit: int = 120) -> str:
    text = repr(text)
    return text if len(text) <= limit else text[:limit] + "…"


def missing() -> Any:
    """The marker ``value_at`` returns for a leaf that is not restored."""
    return _MISSING
