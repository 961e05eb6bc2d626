"""Specs: ordered rules over parameter names (first match wins), roots, settings, strictness.

A ``Spec`` holds
- ``settings``: model hyper-parameters (see ``settings``) that parametrise kinds and ops;
- ``imports``: ``ImportRule(pattern -> kind)``, how each source parameter is spread over
  TP/PP/EP fragments (used by importers through ``Spec.match`` / ``Spec.classify``);
- ``restore``: ``RestoreRule(pattern -> target, ops)``, how saved UCP tensors map into the JAX
  tree at restore (compiled into lazy views by ``plan.compile_restore_plan``);
- ``roots``: where parameters live in the saved tree. Rules are written once, relative to a
  root; every tensor under every *param root* (``params``, ``model_params``, the optimizer moments
  ``opt_state/**/mu``, ``opt_state/**/nu``, ...) gets the same rule, so a rule written for a
  parameter applies to its optimizer moments automatically.

Patterns are Python regexes matched in full (``re.fullmatch``) against the parameter's name
relative to its root: the single key component for flat imports (``decoder.layers.0.mlp.
linear_fc1.weight``), or the components joined with ``/`` for nested trees
(``layers/attn/qkv/kernel``).
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from jax_ucp.language.errors import SpecError, StrictnessError
from jax_ucp.language.kinds import Kind, kind_from_obj
from jax_ucp.language.ops import op_from_obj
from jax_ucp.language.settings import canonical, derived, normalize, render

Key = tuple


def _compile(pattern: str, where: str) -> re.Pattern:
    try:
        return re.compile(pattern)
    except re.error as e:
        raise SpecError(f"{where}bad regex {pattern!r}: {e}") from None


def _when_ok(when: Mapping[str, Any], settings: Mapping[str, Any]) -> bool:
    for k, v in when.items():
        have = settings.get(canonical(k), settings.get(k))
        if isinstance(v, (list, tuple)):
            if have not in v:
                return False
        elif have != v:
            return False
    return True


def _with_rule_options(d: dict, rule) -> dict:
    """The options import and restore rules share, written only when not the default."""
    if not rule.required:
        d["required"] = False
    if rule.when:
        d["when"] = dict(rule.when)
    if rule.label:
        d["label"] = rule.label
    return d


@dataclass(frozen=True)
class ImportRule:
    """``pattern`` (regex over source parameter names) -> ``kind`` (how fragments merge)."""

    pattern: str
    kind: Kind
    required: bool = True  # strict: an error if it matches nothing
    when: Mapping[str, Any] = field(default_factory=dict)  # active only if settings match
    label: str = ""  # for messages; defaults to "import rule #i"

    def __post_init__(self):
        object.__setattr__(
            self, "kind", kind_from_obj(self.kind, where=f"{self.label or self.pattern}: ")
        )
        object.__setattr__(self, "_re", _compile(self.pattern, f"{self.label or 'import rule'}: "))

    def to_dict(self) -> dict:
        return _with_rule_options({"pattern": self.pattern, **self.kind.to_dict()}, self)


@dataclass(frozen=True)
class RestoreRule:
    """``pattern`` -> ``target`` (a template over regex groups, op variables and settings, relative
    to the root; None keeps the name) after running ``ops`` (see ``ops``)."""

    pattern: str
    target: str | None = None
    ops: tuple = ()
    required: bool = True
    when: Mapping[str, Any] = field(default_factory=dict)
    label: str = ""

    def __post_init__(self):
        where = f"{self.label or self.pattern}: "
        object.__setattr__(self, "ops", tuple(op_from_obj(o, where=where) for o in self.ops))
        object.__setattr__(self, "_re", _compile(self.pattern, where))

    def to_dict(self) -> dict:
        d: dict = {"pattern": self.pattern}
        if self.target is not None:
            d["target"] = self.target
        if self.ops:
            d["ops"] = [o.to_dict() for o in self.ops]
        return _with_rule_options(d, self)


@dataclass(frozen=True)
class Root:
    """Where parameters live in the saved tree.

    ``source`` is a glob over key components separated by ``/``: ``*`` is one component, ``**``
    any number (e.g. ``opt_state/**/mu`` matches ("opt_state","mu") and ("opt_state","0","mu")).
    ``target`` is where that prefix goes in the restored tree: a template where ``{1}``, ``{2}``...
    are the wildcards' matches (``**`` as a ``/``-joined path) and ``{name}`` are settings;
    None keeps the prefix. ``params=False`` moves keys without applying rules (e.g. the step
    count: ``opt_state/count`` -> ``opt_state/0/count``)."""

    source: str
    target: str | None = None
    params: bool = True

    def __post_init__(self):
        parts = [p for p in self.source.split("/") if p]
        if not parts:
            raise SpecError(f"root {self.source!r}: empty")
        object.__setattr__(self, "_parts", tuple(parts))

    def match(self, key: Sequence[str]) -> tuple[int, list[str]] | None:
        """(length of the shortest matching prefix, wildcard captures) or None."""
        parts = self._parts

        def rec(i, j, caps):
            if i == len(parts):
                return j, caps
            p = parts[i]
            if p == "**":
                for k in range(j, len(key) + 1):
                    r = rec(i + 1, k, caps + ["/".join(key[j:k])])
                    if r:
                        return r
                return None
            if j >= len(key):
                return None
            if p == "*":
                return rec(i + 1, j + 1, caps + [key[j]])
            return rec(i + 1, j + 1, caps) if key[j] == p else None

        return rec(0, 0, [])

    def target_prefix(
        self, key: Sequence[str], n: int, caps: list[str], settings: Mapping[str, Any]
    ) -> tuple[str, ...]:
        if self.target is None:
            return tuple(key[:n])
        env = dict(settings)
        env.update({str(i + 1): c for i, c in enumerate(caps)})
        return tuple(
            p for p in render(self.target, env, where=f"root {self.source!r}: ").split("/") if p
        )

    def to_dict(self) -> dict:
        d: dict = {"source": self.source}
        if self.target is not None:
            d["target"] = self.target
        if not self.params:
            d["params"] = False
        return d


DEFAULT_ROOTS: tuple[Root, ...] = (
    Root("params"),
    Root("model_params"),
    Root("opt_state/**/mu"),
    Root("opt_state/**/nu"),
    Root("opt_state/**/master"),
    Root("opt_state/**/trace"),
)


def optax_chain_roots(index: int = 0, params_prefix: str = "params") -> tuple[Root, ...]:
    """Roots for an imported checkpoint (``opt_state/{mu,nu,count}``) restored into the optax state
    of ``optax.adam``/``optax.adamw`` (a chain: ``opt_state/<index>/{mu,nu,count}``)."""
    return (
        Root("params", params_prefix),
        Root("model_params"),
        Root("opt_state/mu", f"opt_state/{index}/mu"),
        Root("opt_state/nu", f"opt_state/{index}/nu"),
        Root("opt_state/count", f"opt_state/{index}/count", params=False),
        Root("opt_state/**/mu"),
        Root("opt_state/**/nu"),
    )


@dataclass(frozen=True)
class ImportMatch:
    rule: ImportRule
    index: int
    kind: Kind  # resolved against the settings
    groups: dict


@dataclass(frozen=True)
class Spec:
    name: str = "spec"
    description: str = ""
    settings: Mapping[str, Any] = field(default_factory=dict)
    imports: tuple = ()
    restore: tuple = ()
    roots: tuple = DEFAULT_ROOTS
    strict: bool = True

    def __post_init__(self):
        object.__setattr__(self, "settings", normalize(self.settings))
        object.__setattr__(
            self, "imports", _rules(self.imports, _import_rule_from_obj, "import rule")
        )
        object.__setattr__(
            self, "restore", _rules(self.restore, _restore_rule_from_obj, "restore rule")
        )
        object.__setattr__(
            self, "roots", tuple(Root(**r) if isinstance(r, Mapping) else r for r in self.roots)
        )

    # -- settings
    def with_settings(self, **settings) -> Spec:
        s = dict(self.settings)
        s.update(normalize(settings))
        return dataclasses.replace(self, settings=s)

    @property
    def env(self) -> dict:
        """Settings with derived defaults (num_query_groups, head_dim, padded_vocab_size)."""
        return derived(self.settings)

    def active_imports(self) -> list[tuple[int, ImportRule]]:
        env = self.env
        return [(i, r) for i, r in enumerate(self.imports) if _when_ok(r.when, env)]

    def active_restore(self) -> list[tuple[int, RestoreRule]]:
        env = self.env
        return [(i, r) for i, r in enumerate(self.restore) if _when_ok(r.when, env)]

    # -- import side
    def match(self, name: str) -> ImportMatch | None:
        """The first active import rule matching ``name`` (None if no rule covers it)."""
        env = self.env
        for i, r in self.active_imports():
            m = r._re.fullmatch(name)
            if m:
                loc = dict(env)
                loc.update({str(j + 1): g for j, g in enumerate(m.groups()) if g is not None})
                loc.update({k: v for k, v in m.groupdict().items() if v is not None})
                return ImportMatch(r, i, r.kind.resolve(loc, lenient=True), loc)
        return None

    def classify(
        self, names: Iterable[str], *, strict: bool | None = None
    ) -> dict[str, ImportMatch]:
        """Match every name; strict (default: the spec's) -> an error naming each uncovered name and
        each required rule that matched nothing."""
        strict = self.strict if strict is None else strict
        out, uncovered, used = {}, [], set()
        for n in names:
            m = self.match(n)
            if m is None:
                uncovered.append(n)
            else:
                out[n] = m
                used.add(m.index)
        if strict:
            problems = []
            if uncovered:
                problems.append(
                    f"{len(uncovered)} tensor(s) covered by no import rule: "
                    + ", ".join(uncovered[:20])
                    + (" ..." if len(uncovered) > 20 else "")
                )
            for i, r in self.active_imports():
                if r.required and i not in used:
                    problems.append(f"{describe_rule(r, i, 'import')} matched no tensor")
            if problems:
                raise StrictnessError(f"spec {self.name!r}: " + "; ".join(problems))
        return out

    def to_dict(self) -> dict:
        from jax_ucp.language.toml_io import spec_to_dict

        return spec_to_dict(self)


def describe_rule(rule, index: int, side: str) -> str:
    lab = f" ({rule.label})" if rule.label else ""
    return f"{side} rule #{index + 1}{lab} pattern {rule.pattern!r}"


_IMPORT_KEYS = {"pattern", "required", "when", "label"}


def _rules(rules, from_obj, what: str) -> tuple:
    """Rules as objects: plain mappings (TOML/dict form) are parsed, numbered from 1 in errors."""
    return tuple(
        from_obj(r, f"{what} #{i + 1}") if isinstance(r, Mapping) else r
        for i, r in enumerate(rules)
    )


def _import_rule_from_obj(obj: Mapping, where: str) -> ImportRule:
    if "pattern" not in obj:
        raise SpecError(f"{where}: missing 'pattern'")
    if "kind" not in obj:
        raise SpecError(f"{where} ({obj['pattern']!r}): missing 'kind'")
    kind = {k: v for k, v in obj.items() if k not in _IMPORT_KEYS}
    try:
        return ImportRule(
            pattern=obj["pattern"],
            kind=kind_from_obj(kind, where=f"{where}: "),
            required=bool(obj.get("required", True)),
            when=dict(obj.get("when", {})),
            label=obj.get("label", ""),
        )
    except SpecError as e:
        msg = str(e)
        raise SpecError(msg if msg.startswith(where) else f"{where}: {msg}") from None


_RESTORE_KEYS = {"pattern", "target", "ops", "required", "when", "label"}


def _restore_rule_from_obj(obj: Mapping, where: str) -> RestoreRule:
    if "pattern" not in obj:
        raise SpecError(f"{where}: missing 'pattern'")
    extra = set(obj) - _RESTORE_KEYS
    if extra:
        raise SpecError(
            f"{where} ({obj['pattern']!r}): unknown key(s) {sorted(extra)} "
            f"(known: {', '.join(sorted(_RESTORE_KEYS))})"
        )
    ops = obj.get("ops", ())
    if isinstance(ops, (str, Mapping)):
        ops = [ops]
    try:
        return RestoreRule(
            pattern=obj["pattern"],
            target=obj.get("target"),
            ops=tuple(op_from_obj(o, where=f"{where} op #{j + 1}: ") for j, o in enumerate(ops)),
            required=bool(obj.get("required", True)),
            when=dict(obj.get("when", {})),
            label=obj.get("label", ""),
        )
    except SpecError as e:
        msg = str(e)
        raise SpecError(msg if msg.startswith(where) else f"{where}: {msg}") from None
