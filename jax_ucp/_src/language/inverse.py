"""A spec's restore rules run backwards, so an export writes the names a user imported with: each
rule's target becomes the pattern, its pattern the target, its ops reversed and each replaced by
its exact inverse (transpose, merge_qkv / split_qkv, concat / split, stack / unstack, rope_half
both ways, merge_dims given its sizes). A rule that cannot be run backwards (an op that loses
data, a pattern that is not literal text around its groups) makes the inversion refuse, naming
the rule."""

from __future__ import annotations

import dataclasses
import re

from jax_ucp._src.errors import LanguageError
from jax_ucp._src.language import ops as O
from jax_ucp._src.language.spec import RestoreRule, Root, Spec, describe_rule

_FIELD = re.compile(r"\{([^{}]*)\}")
_QKV_FIELDS = ("axis", "parts", "interleaved", "num_heads", "num_kv_heads", "head_dim")


def invert_op(op: O.Op) -> O.Op | None:
    """The op undoing ``op`` exactly, or None when it has none (a slice, a pad, a reshape)."""
    if isinstance(op, O.Transpose):
        perm = op.perm
        if perm is None:
            return op
        if not all(isinstance(p, int) for p in perm):
            return None
        return O.Transpose(tuple(sorted(range(len(perm)), key=lambda i: perm[i])))
    if isinstance(op, (O.MergeQKV, O.SplitQKV)):
        same = {f: getattr(op, f) for f in _QKV_FIELDS}
        if isinstance(op, O.MergeQKV):
            return O.SplitQKV(var=op.over, **same)
        return O.MergeQKV(over=op.var, **same)
    if isinstance(op, O.Concat):  # parts of equal size (gate / up)
        return O.Split(axis=op.axis, parts=op.parts, var=op.over)
    if isinstance(op, O.Split) and op.sizes is None:
        return O.Concat(over=op.var, axis=op.axis, parts=op.parts)
    if isinstance(op, O.Stack):
        return O.Unstack(axis=op.axis, var=op.over)
    if isinstance(op, O.Unstack) and not op.if_unbound:
        return O.Stack(over=op.var, axis=op.axis)
    if isinstance(op, O.RopeHalf):
        return dataclasses.replace(op, inverse=not op.inverse)
    if isinstance(op, O.SplitDim):
        return O.MergeDims(axis=op.axis)
    if isinstance(op, O.MergeDims) and op.sizes:  # the sizes it merged, given
        return O.SplitDim(axis=op.axis, sizes=op.sizes)
    if isinstance(op, O.GroupStages):
        return O.UngroupStages(axis=op.axis)
    return None


def _pattern_parts(pattern: str) -> list[tuple] | None:
    """``pattern`` as ("lit", text) and ("var", name, body) pieces: literal text around capturing
    groups (no quantifier on a group, no nested capture); None for any other regex."""
    out: list = []
    i, number = 0, 0
    while i < len(pattern):
        c = pattern[i]
        if c == "\\" and i + 1 < len(pattern) and not pattern[i + 1].isalnum():
            out.append(("lit", pattern[i + 1]))
            i += 2
        elif c == "(":
            depth, j = 1, i + 1
            while j < len(pattern) and depth:
                depth += {"(": 1, ")": -1}.get(pattern[j], 0)
                j += 2 if pattern[j] == "\\" else 1
            if depth or (j < len(pattern) and pattern[j] in "?*+{"):
                return None
            inner = pattern[i + 1 : j - 1]
            number += 1
            m = re.fullmatch(r"\?P<(\w+)>(.*)", inner, re.S)
            name, body = (m.group(1), m.group(2)) if m else (str(number), inner)
            if (inner.startswith("?") and not m) or re.search(r"\((?!\?:)", body):
                return None
            out.append(("var", name, body))
            i = j
        elif c in ".[]{}|?*+^$)\\":
            return None
        else:
            out.append(("lit", c))
            i += 1
    return out


def _var(name: str) -> str:
    """A variable as a regex group name (a numbered group ``{1}`` becomes ``_1``)."""
    return name if name.isidentifier() else f"_{name}"


def invert_rule(rule: RestoreRule, index: int) -> RestoreRule:
    """The rule mapping ``rule``'s targets back to its sources, or a ``LanguageError`` naming it."""
    what = describe_rule(rule, index, "restore")

    def refuse(why: str) -> LanguageError:
        return LanguageError(f"{what} cannot be run backwards for an export: {why}")

    parts = _pattern_parts(rule.pattern)
    if parts is None:
        raise refuse("its pattern is not literal text around capturing groups")
    inverse_ops = []
    for op in reversed(rule.ops):
        back = invert_op(op)
        if back is None:
            raise refuse(f"op {op.op!r} has no exact inverse")
        inverse_ops.append(back)
    # the variables the inverse pattern captures: the fields of the target, each matched as the
    # original captured it, or as the op that made it (unstack: an index, a split: its parts)
    made = {}
    for op in rule.ops:
        if isinstance(op, O.Unstack):
            made[op.var] = "[0-9]+"
        elif isinstance(op, O.FanOut):
            made[op.var] = "|".join(re.escape(p) for p in op.parts)
    bodies = {p[1]: p[2] for p in parts if p[0] == "var"}
    target = rule.target
    if target is None:  # the name kept: the pattern is its own target
        target = "".join(f"{{{p[1]}}}" if p[0] == "var" else p[1] for p in parts)
    pieces, seen = [], set()
    for k, text in enumerate(_FIELD.split(target.replace("{{", "\0").replace("}}", "\1"))):
        if k % 2 == 0:
            pieces.append(re.escape(text.replace("\0", "{").replace("\1", "}")))
            continue
        name = text.strip()
        body = bodies.get(name, made.get(name))
        if body is None or name in seen:
            raise refuse(f"target field {{{name}}} is no variable of the pattern, or repeats")
        seen.add(name)
        pieces.append(f"(?P<{_var(name)}>{body})")
    consumed = {op.over for op in rule.ops if isinstance(op, O.FanIn)}
    lost = sorted(set(bodies) - seen - consumed)
    if lost:
        raise refuse(f"the target keeps no trace of the pattern's group(s) {lost}")
    template = "".join(
        p[1].replace("{", "{{").replace("}", "}}") if p[0] == "lit" else f"{{{_var(p[1])}}}"
        for p in parts
    )
    return RestoreRule(
        pattern="".join(pieces),
        target=template,
        ops=tuple(inverse_ops),
        required=rule.required,
        when=rule.when,
        label=f"back: {rule.label or rule.pattern}",
    )


def invert_spec(spec: Spec) -> Spec:
    """``spec`` run backwards: every restore rule inverted (``invert_rule``), the roots kept where
    the restore put them; the import rules dropped (an export reads a JAX checkpoint)."""
    roots: list[Root] = []
    for root in spec.roots:
        if root.params:
            source = root.source if root.target is None else _FIELD.sub("*", root.target)
            if all(r.source != source for r in roots):
                roots.append(Root(source))
    return dataclasses.replace(
        spec,
        name=f"{spec.name} (backwards)",
        imports=(),
        restore=tuple(invert_rule(r, i) for i, r in enumerate(spec.restore)),
        roots=tuple(roots),
        inverts=spec.name,
    )


def export_spec(spec: Spec) -> Spec:
    """What an export runs: a spec written for exports (``inverts`` set) as it is, any other
    (an import's) backwards."""
    return spec if spec.inverts else invert_spec(spec)
