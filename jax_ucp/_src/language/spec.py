"""Specs: settings, ``ImportRule`` (pattern -> kind), ``RestoreRule`` (pattern -> target, ops) and
``Root`` (where parameters live, so a rule also covers their optimizer moments); first match wins,
patterns are RE2 regexes matched in full against the name relative to its root. Also the spec's dict
form (TOML's)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import PurePath
from typing import TYPE_CHECKING, Any

from jax_ucp._src.errors import LanguageError
from jax_ucp._src.language.kinds import Kind, kind_from_obj
from jax_ucp._src.language.ops import op_from_obj
from jax_ucp._src.language.patterns import MAX_PATTERN_CHARS, compile_pattern
from jax_ucp._src.language.plain_form import plain_fields
from jax_ucp._src.language.settings import canonical, derived, normalize, render


def _active(rules: tuple, settings: Mapping[str, Any]) -> list:
    """(index, rule) of the ``rules`` whose ``when`` the settings meet."""

    def met(name, wanted):
        have = settings.get(canonical(name), settings.get(name))
        return have in wanted if isinstance(wanted, (list, tuple)) else have == wanted

    return [(i, r) for i, r in enumerate(rules) if all(met(*w) for w in r.when.items())]


@dataclass(frozen=True)
class ImportRule:
    """``pattern`` (regex over source names) -> ``kind`` (how its per-rank fragments merge)."""

    pattern: str
    kind: Kind
    required: bool = True  # strict: an error if it matches nothing
    when: Mapping[str, Any] = field(default_factory=dict)  # active only if settings match
    label: str = ""  # for messages; defaults to "import rule #i"
    # patterns the whole name must match too ("A and B": RE2 has no look-ahead)
    also: tuple = ()
    if TYPE_CHECKING:  # compiled by __post_init__
        _regex: Any = field(init=False)
        _also: tuple = field(init=False)

    def __post_init__(self):
        object.__setattr__(
            self, "kind", kind_from_obj(self.kind, where=f"{self.label or self.pattern}: ")
        )
        where = f"{self.label or 'import rule'}: "
        if isinstance(self.also, str) or not isinstance(self.also, (tuple, list)):
            raise LanguageError(f"{where}'also' must be a list of patterns, got {self.also!r}")
        object.__setattr__(self, "also", tuple(self.also))
        object.__setattr__(self, "_regex", compile_pattern(self.pattern, where))
        object.__setattr__(self, "_also", tuple(compile_pattern(p, where) for p in self.also))

    def fullmatch(self, name: str):
        """The full match of ``pattern`` on ``name`` (None unless every ``also`` matches too)."""
        m = self._regex.fullmatch(name)
        if m is None or any(r.fullmatch(name) is None for r in self._also):
            return None
        return m

    def to_dict(self) -> dict:
        """The rule's plain (TOML) form: every field not at its default, the kind's inline."""
        d = plain_fields(self)
        d.update(d.pop("kind"))
        return d


@dataclass(frozen=True)
class RestoreRule:
    """``pattern`` -> ``target`` (relative to the root; None keeps the name) after ``ops``."""

    pattern: str
    target: str | None = None
    ops: tuple = ()
    required: bool = True
    when: Mapping[str, Any] = field(default_factory=dict)
    label: str = ""
    # logical axis names of the restored tensor, for ``restore(mesh=, rules=)``; None: unnamed
    axes: tuple | None = None
    # the axes the source tensor is read as holding ("[E, 2F, H]"), where its writer chose them
    # (a model's fused parameter): a tensor whose last two are of one length cannot show it
    layout: str = ""
    if TYPE_CHECKING:  # compiled by __post_init__
        _regex: Any = field(init=False)

    def __post_init__(self):
        where = f"{self.label or self.pattern}: "
        if self.axes is not None:
            if isinstance(self.axes, str) or not all(
                a is None or (isinstance(a, str) and a) for a in self.axes
            ):
                raise LanguageError(
                    f"{where}axes must be a list of logical axis names, got {self.axes!r}"
                )
            object.__setattr__(self, "axes", tuple(self.axes))
        if self.target is not None and (
            not isinstance(self.target, str) or len(self.target) > MAX_PATTERN_CHARS
        ):
            raise LanguageError(
                f"{where}target must be a template string of at most {MAX_PATTERN_CHARS} "
                f"characters, got {str(self.target)[:60]!r}"
            )
        object.__setattr__(self, "ops", tuple(op_from_obj(o, where=where) for o in self.ops))
        object.__setattr__(self, "_regex", compile_pattern(self.pattern, where))

    def fullmatch(self, name: str):
        """The match of ``pattern`` over the whole of ``name`` (relative to its root), or None."""
        return self._regex.fullmatch(name)

    def to_dict(self) -> dict:
        """The rule's plain (TOML) form: every field not at its default."""
        return plain_fields(self)


@dataclass(frozen=True)
class Root:
    """Where parameters live in the saved tree, so one rule covers a parameter and its moments.
    ``source``: a glob of ``/``-separated components (``*`` one, ``**`` any); ``target``: where it
    goes, ``{1}``... the wildcards' matches (None keeps it); ``params=False`` moves keys without
    rules."""

    source: str
    target: str | None = None
    params: bool = True
    if TYPE_CHECKING:  # split by __post_init__
        _parts: tuple[str, ...] = field(init=False)

    def __post_init__(self):
        parts = [p for p in self.source.split("/") if p]
        if not parts:
            raise LanguageError(f"root {self.source!r}: empty")
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
        env = {**settings, **{str(i + 1): c for i, c in enumerate(caps)}}
        return tuple(
            p for p in render(self.target, env, where=f"root {self.source!r}: ").split("/") if p
        )

    def to_dict(self) -> dict:
        """The root's plain (TOML) form: every field not at its default."""
        return plain_fields(self)


DEFAULT_ROOTS: tuple[Root, ...] = (
    Root("params"),
    Root("model_params"),
    Root("opt_state/**/mu"),
    Root("opt_state/**/nu"),
    Root("opt_state/**/master"),
    Root("opt_state/**/trace"),
)


def optax_chain_roots(index: int = 0, params_prefix: str = "params") -> tuple[Root, ...]:
    """Roots moving an import's ``opt_state/{mu,nu,count}`` into ``optax.adam``'s chain state."""
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
    """The import rule that matched a name: its index, its resolved kind and the captures."""

    rule: ImportRule
    index: int
    kind: Kind  # resolved against the settings
    groups: dict


@dataclass(frozen=True)
class Spec:
    """A model's rules in one value (settings, import and restore rules, roots, strictness)."""

    name: str = "spec"
    description: str = ""
    settings: Mapping[str, Any] = field(default_factory=dict)
    imports: tuple = ()
    restore: tuple = ()
    roots: tuple = DEFAULT_ROOTS
    strict: bool = True
    #: an export's spec: the import spec whose names it writes (run as is by an export; a spec
    #: without it is run backwards, ``language.inverse``)
    inverts: str = ""
    #: the Hugging Face ``model_type`` values whose names the spec maps (an export's config.json
    #: is checked against them)
    model_types: tuple = ()

    def __post_init__(self):
        object.__setattr__(self, "settings", normalize(self.settings))
        object.__setattr__(
            self, "imports", _from_dicts(self.imports, import_rule_from_dict, "import rule")
        )
        object.__setattr__(
            self, "restore", _from_dicts(self.restore, restore_rule_from_dict, "restore rule")
        )
        object.__setattr__(self, "roots", _from_dicts(self.roots, root_from_dict, "root"))

    # -- settings
    def with_settings(self, **settings) -> Spec:
        """The same spec with ``settings`` overriding its own."""
        return dataclasses.replace(self, settings={**self.settings, **normalize(settings)})

    @property
    def env(self) -> dict:
        """Settings with derived defaults (num_query_groups, head_dim, padded_vocab_size)."""
        return derived(self.settings)

    def active_imports(self) -> list[tuple[int, ImportRule]]:
        """(index, rule) of every import rule whose ``when`` the settings meet."""
        return _active(self.imports, self.env)

    def active_restore(self) -> list[tuple[int, RestoreRule]]:
        """(index, rule) of every restore rule whose ``when`` the settings meet."""
        return _active(self.restore, self.env)

    # -- import side
    def match(self, name: str) -> ImportMatch | None:
        """The first active import rule matching ``name`` (None if no rule covers it)."""
        env = self.env
        for i, r in self.active_imports():
            m = r.fullmatch(name)
            if m:
                groups = {str(j + 1): g for j, g in enumerate(m.groups())} | m.groupdict()
                loc = {**env, **{k: v for k, v in groups.items() if v is not None}}
                return ImportMatch(r, i, r.kind.resolve(loc, lenient=True), loc)
        return None

    def classify(
        self, names: Iterable[str], *, strict: bool | None = None
    ) -> dict[str, ImportMatch]:
        """Match every name; strict: uncovered names and unmatched required rules are an error."""
        matches = {n: self.match(n) for n in names}
        out = {n: m for n, m in matches.items() if m is not None}
        uncovered = [n for n, m in matches.items() if m is None]
        if self.strict if strict is None else strict:
            used = {m.index for m in out.values()}
            check_strict(self.name, "import", uncovered, self.active_imports(), used)
        return out

    def to_dict(self) -> dict:
        """The dict form (what ``toml_io.spec_to_toml`` writes); see ``spec_to_dict``."""
        return spec_to_dict(self)


def describe_rule(rule, index: int, side: str) -> str:
    """``import rule #3 (label) pattern '...'``: how messages name a rule.

    Args:
        rule: an import or restore rule
        index: its position in the spec (0-based; shown 1-based)
        side: ``import`` or ``restore``"""
    label = f" ({rule.label})" if rule.label else ""
    return f"{side} rule #{index + 1}{label} pattern {rule.pattern!r}"


def check_strict(
    spec_name: str, side: str, uncovered: Sequence[str], rules, matched: Iterable[int]
) -> None:
    """A strict spec: a ``LanguageError`` naming every uncovered tensor and unmatched required rule.

    Args:
        spec_name: the spec, as named in the error.
        side: ``"import"`` or ``"restore"``.
        uncovered: the tensors no rule covers.
        rules: (index, rule) pairs of the spec's rules on this side.
        matched: the indices of the rules that matched a tensor."""
    problems = []
    if uncovered:
        problems.append(
            f"{len(uncovered)} tensor(s) covered by no {side} rule: "
            + ", ".join(uncovered[:20])
            + (" ..." if len(uncovered) > 20 else "")
        )
    matched = set(matched)
    problems += [
        f"{describe_rule(r, i, side)} matched no tensor"
        for i, r in rules
        if r.required and i not in matched
    ]
    if problems:
        raise LanguageError(f"spec {spec_name!r}: " + "; ".join(problems))


def _from_dicts(items, from_dict: Callable[[Mapping, str], Any], what: str) -> tuple:
    """Rules / roots as objects: mappings (the dict form) are parsed, numbered from 1 in errors."""
    return tuple(
        from_dict(item, f"{what} #{i + 1}") if isinstance(item, Mapping) else item
        for i, item in enumerate(items)
    )


def _prefixed(error: LanguageError, where: str) -> LanguageError:
    message = str(error)
    return LanguageError(message if message.startswith(where) else f"{where}: {message}")


_IMPORT_KEYS = {"pattern", "required", "when", "label", "also"}


def import_rule_from_dict(obj: Mapping, where: str) -> ImportRule:
    """An ``ImportRule`` from its dict form; errors start with ``where``."""
    if "pattern" not in obj:
        raise LanguageError(f"{where}: missing 'pattern'")
    if "kind" not in obj:
        raise LanguageError(f"{where} ({obj['pattern']!r}): missing 'kind'")
    kind = {k: v for k, v in obj.items() if k not in _IMPORT_KEYS}
    try:
        kind = kind_from_obj(kind, where=f"{where}: ")
        return ImportRule(**_rule_fields(obj, _IMPORT_KEYS), kind=kind)
    except LanguageError as e:
        raise _prefixed(e, where) from None


def _rule_fields(obj: Mapping, keys: set[str]) -> dict[str, Any]:
    """The dict form's ``keys`` as the rule's fields: ``required`` a bool, ``when`` a dict."""
    rule = {k: v for k, v in obj.items() if k in keys}
    return rule | {"required": bool(obj.get("required", True)), "when": dict(obj.get("when", {}))}


_RESTORE_KEYS = {"pattern", "target", "ops", "required", "when", "label", "axes", "layout"}


def restore_rule_from_dict(obj: Mapping, where: str) -> RestoreRule:
    """A ``RestoreRule`` from its dict form; errors start with ``where``."""
    if "pattern" not in obj:
        raise LanguageError(f"{where}: missing 'pattern'")
    extra = set(obj) - _RESTORE_KEYS
    if extra:
        raise LanguageError(
            f"{where} ({obj['pattern']!r}): unknown key(s) {sorted(extra)} "
            f"(known: {', '.join(sorted(_RESTORE_KEYS))})"
        )
    ops = obj.get("ops", ())
    if isinstance(ops, (str, Mapping)):
        ops = [ops]
    try:
        ops = tuple(op_from_obj(o, where=f"{where} op #{j + 1}: ") for j, o in enumerate(ops))
        return RestoreRule(**{**_rule_fields(obj, _RESTORE_KEYS), "ops": ops})
    except LanguageError as e:
        raise _prefixed(e, where) from None


_ROOT_KEYS = {"source", "target", "params"}


def root_from_dict(obj: Mapping, where: str) -> Root:
    """A ``Root`` from its dict form: ``source``, optional ``target`` and ``params``."""
    unknown = set(obj) - _ROOT_KEYS
    if unknown or "source" not in obj:
        raise LanguageError(
            f"{where}: needs 'source' (and optional 'target', 'params'); unknown {sorted(unknown)}"
        )
    return Root(**{**obj, "params": bool(obj.get("params", True))})


_TOP_LEVEL_KEYS = {
    "name",
    "description",
    "strict",
    "settings",
    "roots",
    "import",
    "restore",
    "inverts",
    "model_types",
}
_TABLES = {"import": "import rule", "restore": "restore rule", "roots": "root"}


def spec_from_dict(
    d: Mapping,
    *,
    source: str = "<spec>",
    settings: Mapping | None = None,
    table_lines: Mapping[str, Sequence[int]] | None = None,
) -> Spec:
    """A ``Spec`` from its dict form; errors name ``source``, the table and its line.

    Args:
        d: the spec's dict form
        source: the file it came from, for messages
        settings: overrides of the dict's ``[settings]``
        table_lines: table name -> the line of each of its entries, for messages"""
    extra = set(d) - _TOP_LEVEL_KEYS
    if extra:
        raise LanguageError(
            f"{source}: unknown top-level key(s) {sorted(extra)} "
            f"(known: {', '.join(sorted(_TOP_LEVEL_KEYS))})"
        )
    table_lines = table_lines or {}

    def parsed(table, from_dict):
        items = d.get(table, [])
        if not isinstance(items, list) or not all(isinstance(x, Mapping) for x in items):
            raise LanguageError(f"{source}: '{table}' must be an array of tables ([[{table}]])")
        lines = table_lines.get(table, ())
        out = []
        for i, item in enumerate(items):
            line = f" line {lines[i]}" if i < len(lines) else ""
            out.append(from_dict(item, f"{source}{line}: {_TABLES[table]} #{i + 1}"))
        return tuple(out)

    imports = parsed("import", import_rule_from_dict)
    restore = parsed("restore", restore_rule_from_dict)
    roots = parsed("roots", root_from_dict)
    if not isinstance(d.get("settings", {}), Mapping):
        raise LanguageError(f"{source}: [settings] must be a table")
    merged_settings = {**d.get("settings", {}), **(settings or {})}
    strict = d.get("strict", True)
    if not isinstance(strict, bool):
        raise LanguageError(f"{source}: strict must be true or false")
    return Spec(
        name=str(d.get("name", PurePath(source).stem if source != "<spec>" else "spec")),
        description=str(d.get("description", "")),
        settings=merged_settings,
        imports=imports,
        restore=restore,
        roots=roots or DEFAULT_ROOTS,
        strict=strict,
        inverts=str(d.get("inverts", "")),
        model_types=tuple(str(t) for t in d.get("model_types", ())),
    )


def spec_to_dict(spec: Spec) -> dict:
    """The dict form of ``spec`` (defaults left out): ``spec_from_dict`` gives it back."""
    d: dict = {"name": spec.name}
    if spec.description:
        d["description"] = spec.description
    d["strict"] = spec.strict
    if spec.inverts:
        d["inverts"] = spec.inverts
    if spec.model_types:
        d["model_types"] = list(spec.model_types)
    if spec.settings:
        d["settings"] = dict(spec.settings)
    if tuple(spec.roots) != DEFAULT_ROOTS:
        d["roots"] = [r.to_dict() for r in spec.roots]
    if spec.imports:
        d["import"] = [r.to_dict() for r in spec.imports]
    if spec.restore:
        d["restore"] = [r.to_dict() for r in spec.restore]
    return d
