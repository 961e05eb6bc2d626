"""Compile a spec's restore rules over saved tensors into lazy view plans, every error found at
compile time over placeholder stores that refuse to be read."""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import ml_dtypes  # noqa: F401  (registers bfloat16 & co. with numpy: dtypes given by name)
import numpy as np
import tensorstore as ts

from jax_ucp._src.errors import LanguageError
from jax_ucp._src.language import views
from jax_ucp._src.language.settings import render
from jax_ucp._src.language.spec import Spec, check_strict, describe_rule
from jax_ucp._src.language.toml_io import list_specs, load_spec

Key = tuple
_Targets = dict[Key, tuple["ViewPlan", str]]  # the plans by target key, with what made each


@dataclass(frozen=True)
class TensorInfo:
    """Shape and dtype of a saved tensor: all a plan needs to be compiled and checked."""

    shape: tuple
    dtype: np.dtype

    def __post_init__(self):
        object.__setattr__(self, "shape", tuple(int(s) for s in self.shape))
        object.__setattr__(self, "dtype", np.dtype(self.dtype))


@dataclass(frozen=True)
class ViewPlan:
    """One restored tensor: shape, dtype, the saved keys it reads, ``build(opened)``."""

    shape: tuple
    dtype: np.dtype
    sources: tuple  # saved keys read
    build: Callable[[Mapping[Key, ts.TensorStore]], ts.TensorStore]  # lazy, exact
    rule: str = "identity"  # which rule produced it (for plans / errors)
    ops: tuple = ()  # op names applied, in order
    logical_axes: tuple | None = None  # the rule's ``axes``: names for restore(mesh=, rules=)
    assumed: str = ""  # a layout the rule reads that the source's shape cannot confirm


@dataclass(frozen=True)
class _Node:
    """A view under construction: its sources, how to build it, and the same over placeholders."""

    sources: tuple
    fn: Callable
    view: Any  # the same composition over placeholders: shape/dtype, compile-time checks
    ops: tuple = ()


def _placeholder(key, info) -> ts.TensorStore:
    name = "/".join(key)

    def refuse(domain, array, params):
        raise RuntimeError(f"placeholder for {name} must not be read")

    dt = np.dtype(info.dtype)
    return ts.virtual_chunked(
        refuse, dtype=ts.dtype(dt.name), domain=ts.IndexDomain(shape=list(info.shape))
    )


def _source_node(key, ph) -> _Node:
    def fn(opened, key=key):
        try:
            t = opened[key]
        except KeyError:
            raise LanguageError(f"restore plan: source {'/'.join(key)} was not opened") from None
        return views.as_view(t)

    return _Node((key,), fn, ph)


def _find_root(spec: Spec, key):
    for root in spec.roots:  # a param root matches a prefix, never the whole key
        m = root.match(key)
        if m is not None and not (root.params and m[0] >= len(key)):
            return root, *m
    return None


def _identity(key, info, rule="identity") -> ViewPlan:
    return ViewPlan(
        tuple(info.shape),
        np.dtype(info.dtype),
        (key,),
        lambda opened, key=key: views.as_view(opened[key]),
        rule,
    )


def _tensor_info(x) -> TensorInfo:
    """A TensorInfo from anything with ``shape`` and ``dtype`` (numpy, TensorStore, ...)."""
    if isinstance(x, TensorInfo):
        return x
    dt = x.dtype
    if isinstance(dt, ts.dtype):
        dt = dt.numpy_dtype
    return TensorInfo(tuple(x.shape), np.dtype(dt))


def compile_restore_plan(
    spec: Spec | str, saved: Mapping[Key, Any], *, strict: bool | None = None
) -> dict[Key, ViewPlan]:
    """Target key -> ViewPlan for every saved tensor (uncovered keys pass unless ``strict``).

    Args:
      spec: a ``Spec``, or what ``load_spec`` takes (a shipped spec's name, a file).
      saved: saved key → ``TensorInfo`` (or anything with ``shape`` and ``dtype``).
      strict: refuse uncovered parameters and unmatched required rules (None: the spec's own)."""
    if not isinstance(spec, Spec):
        spec = load_spec(spec)
    rules = spec.active_restore()
    # a spec without restore rules (e.g. import-only) leaves every tensor as it is (roots still move)
    strict = (spec.strict if strict is None else strict) and bool(rules)
    targets: _Targets = {}
    per_rule, uncovered = _assign(spec, rules, saved, targets)
    if strict:
        matched = [i for i in per_rule if per_rule[i]]
        check_strict(spec.name, "restore", ["/".join(u[0]) for u in uncovered], rules, matched)
    for key, info, tprefix, rel in uncovered:
        _put(targets, tprefix + tuple(rel.split("/")), _identity(key, info), "/".join(key))
    for i, r in rules:
        if per_rule[i]:
            _emit_rule(r, i, per_rule[i], spec.env, targets)
    return {k: plan for k, (plan, _) in targets.items()}


def specs_naming(keys: Iterable[tuple[str, ...]]) -> list[str]:
    """The shipped specs that name logical axes whose restore rules cover ``keys``, best first
    (the most keys covered, then the fewest required rules matching none; none covering any
    left out): what to restore these tensors with so that ``rules=`` shards them."""
    # one key per name up to its numbers (layer, expert): bounded work for any model
    shapes = {re.sub("[0-9]+", "0", "/".join(map(str, k))): tuple(map(str, k)) for k in keys}
    keys = list(shapes.values())[:1000]
    ranked: dict[str, tuple[int, int]] = {}
    for name in list_specs():
        spec = load_spec(name)
        rules = spec.active_restore()
        if not any(r.axes for _, r in rules):
            continue  # names no axes (an export spec): no advice
        matched = []
        for key in keys:
            found = _find_root(spec, key)
            if found and found[0].params:
                matched.append(_match_rule(rules, "/".join(key[found[1] :])))
        hit = {m[0] for m in matched if m}
        if hit:
            unmet = sum(r.required and i not in hit for i, r in rules)
            ranked[name] = (-len([m for m in matched if m]), unmet)
    return sorted(ranked, key=lambda name: ranked[name])


def _put(targets: _Targets, tkey, plan: ViewPlan, what: str) -> None:
    """``plan`` (made from ``what``) at ``tkey``; a key two tensors map to is an error naming both."""
    tkey = tuple(tkey)
    if tkey in targets:
        raise LanguageError(
            f"restore plan: {what} and {targets[tkey][1]} both map to {'/'.join(tkey)}"
        )
    targets[tkey] = (plan, what)


def _assign(spec: Spec, rules, saved: Mapping[Key, Any], targets: _Targets):
    """Each saved tensor to the first restore rule matching it under its root (others into
    ``targets``); returns the matches by rule and the uncovered tensors."""
    per_rule: dict[int, list] = {i: [] for i, _ in rules}
    uncovered = []
    # Parameters before the optimizer state that mirrors them, so an error names the parameter.
    ordered = sorted(saved.items(), key=lambda kv: str(kv[0][0]) not in ("params", "model_params"))
    for key, info in ordered:
        key = tuple(str(k) for k in key)
        info = _tensor_info(info)
        found = _find_root(spec, key)
        if found is None:
            _put(targets, key, _identity(key, info), "/".join(key))
            continue
        root, n, caps = found
        tprefix = root.target_prefix(key, n, caps, spec.env)
        if not root.params:
            plan = _identity(key, info, f"root {root.source!r}")
            _put(targets, tprefix + key[n:], plan, "/".join(key))
            continue
        rel = "/".join(key[n:])
        matched = _match_rule(rules, rel)
        if matched is None:
            uncovered.append((key, info, tprefix, rel))
            continue
        i, vars_ = matched
        node = _source_node(key, _placeholder(key, info))
        per_rule[i].append((tuple(key[:n]), tprefix, vars_, node, rel))
    return per_rule, uncovered


def _match_rule(rules, rel: str):
    """(index, captured variables) of the first rule ``rel`` matches in full."""
    for i, r in rules:
        m = r.fullmatch(rel)
        if m:
            named = set(m.re.groupindex.values())
            vars_ = {
                str(j): g
                for j, g in enumerate(m.groups(), start=1)
                if g is not None and j not in named
            }
            vars_.update({k: v for k, v in m.groupdict().items() if v is not None})
            return i, vars_
    return None


def _emit_rule(r, i, entries, env0, targets: _Targets) -> None:
    """Applies rule ``r``'s ops to the tensors it matched and puts each result at its target."""
    what = describe_rule(r, i, "restore")
    square = {}  # a source whose last two axes are of one length: its layout is taken on trust
    for inst, _, _, node, rel in entries if r.layout else ():
        shape = tuple(node.view.shape)
        if len(shape) >= 2 and shape[-1] == shape[-2]:
            square[node.sources[0]] = (
                f"{'/'.join(inst)}/{rel} {list(shape)}: its last two axes are of one length, "
                f"so its shape cannot tell {r.layout} from its transpose; read as {r.layout} "
                f"({what})"
            )
    for op in r.ops:
        entries = _apply_op(op, entries, env0, what)
    for inst, tprefix, vars_, node, rel in entries:
        env = {**env0, **vars_}
        try:
            tgt = rel if r.target is None else render(r.target, env, where=f"{what}: ")
        except LanguageError as e:
            raise type(e)(f"{what}: target {r.target!r} for {'/'.join(inst)}/{rel}: {e}") from None
        tkey = tprefix + tuple(p for p in tgt.split("/") if p)
        v = node.view
        if r.axes is not None and len(r.axes) != len(v.shape):
            raise LanguageError(
                f"{what}: axes {list(r.axes)} name {len(r.axes)} dimensions, but "
                f"{'/'.join(inst)}/{rel} restores with shape {tuple(v.shape)}"
            )
        plan = ViewPlan(
            tuple(v.shape),
            np.dtype(v.dtype.numpy_dtype),
            node.sources,
            node.fn,
            what,
            node.ops,
            r.axes,
            "; ".join(dict.fromkeys(square[s] for s in node.sources if s in square)),
        )
        _put(targets, tkey, plan, f"{'/'.join(inst)}/{rel} ({what})")


def _apply_op(op, entries, env0, what):
    """Run one op over the entries (inst, tprefix, vars, node, rel)."""
    out = []
    if op.arity == "map":
        for inst, tp, vars_, node, rel in entries:
            env = {**env0, **vars_}
            view = _with_context(lambda n=node, e=env: op.apply(n.view, e), op, what, inst, rel)
            fn = lambda opened, node=node, env=env: op.apply(node.fn(opened), env)
            out.append((inst, tp, vars_, _Node(node.sources, fn, view, node.ops + (op.op,)), rel))
        return out
    if op.arity == "fanout":
        for inst, tp, vars_, node, rel in entries:
            if getattr(op, "if_unbound", False) and op.var in vars_:
                out.append((inst, tp, vars_, node, rel))
                continue
            env = {**env0, **vars_}
            labels = _with_context(lambda n=node, e=env: op.labels(n.view, e), op, what, inst, rel)
            for j, lab in enumerate(labels):
                view = _with_context(
                    lambda n=node, e=env, j=j: op.part(n.view, e, j), op, what, inst, rel
                )
                fn = lambda opened, node=node, env=env, j=j: op.part(node.fn(opened), env, j)
                part = _Node(node.sources, fn, view, node.ops + (f"{op.op}[{lab}]",))
                out.append((inst, tp, {**vars_, op.var: lab}, part, f"{rel}[{op.var}={lab}]"))
        return out
    # fan-in
    groups: dict = {}
    for inst, tp, vars_, node, rel in entries:
        if op.over not in vars_:
            raise LanguageError(
                f"{what}: op {op.op!r} combines over {op.over!r}, but {'/'.join(inst)}/"
                f"{rel} has no such variable (have: {', '.join(sorted(vars_)) or 'none'}); "
                f"name a regex group (?P<{op.over}>...)"
            )
        rest = tuple(sorted((k, v) for k, v in vars_.items() if k != op.over))
        groups.setdefault((inst, tp, rest), []).append((vars_[op.over], node, rel))
    for (inst, tp, rest), items in groups.items():
        by = {}
        for lab, node, rel in items:
            if lab in by:
                raise LanguageError(
                    f"{what}: {'/'.join(inst)}: {rel} and {by[lab][1]} both have {op.over}={lab}"
                )
            by[lab] = (node, rel)
        env = {**env0, **dict(rest)}
        first_rel = items[0][2]
        at = f"{what} at {'/'.join(inst)}/{first_rel}"
        order = _with_context(
            lambda by=by, e=env, at=at: op.order(list(by), e, at), op, what, inst, first_rel
        )
        nodes = [by[lab][0] for lab in order]
        view = _with_context(
            lambda ns=nodes, e=env: op.combine([n.view for n in ns], e), op, what, inst, first_rel
        )
        fn = lambda opened, nodes=nodes, env=env: op.combine([n.fn(opened) for n in nodes], env)
        sources = tuple(s for n in nodes for s in n.sources)
        rel = f"{op.op}({', '.join(by[lab][1] for lab in order[:3])}{', ...' if len(order) > 3 else ''})"
        out.append((inst, tp, dict(rest), _Node(sources, fn, view, nodes[0].ops + (op.op,)), rel))
    return out


def _with_context(thunk, op, what, inst, rel):
    """Run ``thunk``; a transform error names the rule, the op and the tensor."""
    try:
        return thunk()
    except (ValueError, IndexError) as e:
        raise LanguageError(f"{what}, op {op.op!r} on {'/'.join(inst)}/{rel}: {e}") from None


def saved_infos(tree_or_arrays: Mapping) -> dict[Key, TensorInfo]:
    """Flat {key tuple: TensorInfo} from a nested dict of arrays (tests, in-memory use)."""
    leaves = _flat(tree_or_arrays, into_sequences=True)
    return {k: _tensor_info(x if hasattr(x, "dtype") else np.asarray(x)) for k, x in leaves.items()}


def flatten_nested(tree: Mapping) -> dict[Key, Any]:
    """A nested dict -> {key tuple: leaf} (the inverse of ``unflatten_nested``)."""
    return _flat(tree, into_sequences=False)


def _flat(tree, into_sequences: bool, prefix: Key = ()) -> dict[Key, Any]:
    """{key tuple: leaf} of nested mappings (and lists/tuples if ``into_sequences``)."""
    if isinstance(tree, Mapping):
        items = tree.items()
    elif into_sequences and isinstance(tree, (list, tuple)) and not hasattr(tree, "shape"):
        items = enumerate(tree)
    else:
        return {prefix: tree}
    return {k: v for i, x in items for k, v in _flat(x, into_sequences, (*prefix, str(i))).items()}


def unflatten_nested(flat: Mapping[Key, Any]) -> dict:
    """{key tuple: leaf} -> a nested dict (the inverse of ``flatten_nested``)."""
    out: dict = {}
    for key, v in flat.items():
        d = out
        for k in key[:-1]:
            d = d.setdefault(k, {})
        d[key[-1]] = v
    return out


def apply_restore_plan(
    plan: Mapping[Key, ViewPlan], arrays: Mapping[Key, Any], *, read: bool = True
) -> dict[Key, Any]:
    """Build every view over in-memory ``arrays`` (tests, small trees), read unless ``read=False``.

    Args:
        plan: target key -> view plan.
        arrays: saved key -> array (numpy or TensorStore).
        read: read the views to numpy."""
    opened = {k: views.as_view(v) for k, v in arrays.items()}
    built = {k: p.build(opened) for k, p in plan.items()}
    return {k: t.read().result() for k, t in built.items()} if read else built


def apply_spec_to_tree(spec: Spec | str, tree: Mapping, *, strict: bool | None = None) -> dict:
    """A spec's restore rules applied to an in-memory nested dict of arrays, read into numpy.

    Args:
        spec: the spec (a ``Spec``, shipped name or file).
        tree: a nested dict of arrays.
        strict: override the spec's ``strict``."""
    plan = compile_restore_plan(spec, saved_infos(tree), strict=strict)
    return unflatten_nested(apply_restore_plan(plan, flatten_nested(tree)))


def describe_plan(plan: Mapping[Key, ViewPlan]) -> list[str]:
    """One line per target: target <- sources via ops (rule)."""
    lines = []
    for k, p in sorted(plan.items()):
        src = ", ".join("/".join(s) for s in p.sources[:3]) + (" ..." if len(p.sources) > 3 else "")
        ops = " -> ".join(p.ops) if p.ops else "as is"
        lines.append(f"{'/'.join(k)} {list(p.shape)} {p.dtype} <- {src} [{ops}] ({p.rule})")
    return lines
