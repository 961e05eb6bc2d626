"""The plain file form of a spec (TOML): load (tomllib, validated, errors name the rule and its
line) and dump; ``load_spec`` finds shipped specs by name.

    name = "my-model"
    strict = true
    [settings]
    num_layers = 2
    [[roots]]                      # optional; default: params, model_params, opt_state/**/{mu,nu}
    source = "opt_state/mu"
    target = "opt_state/0/mu"
    [[import]]
    pattern = 'decoder\\.layers\\.\\d+\\.self_attention\\.linear_qkv\\.weight'
    kind = "qkv"
    [[restore]]
    pattern = 'decoder\\.layers\\.(\\d+)\\.self_attention\\.linear_qkv\\.weight'
    target = "layers_{1}/attn/qkv/kernel"
    ops = ["transpose"]
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import tomllib

from jax_ucp.language.errors import SpecError
from jax_ucp.language.spec import (
    DEFAULT_ROOTS,
    Root,
    Spec,
    _import_rule_from_obj,
    _restore_rule_from_obj,
)

SPECS_DIR = Path(__file__).parent / "specs"
_TOP = {"name", "description", "strict", "settings", "roots", "import", "restore"}


def _header_lines(text: str, table: str) -> list[int]:
    pat = re.compile(r"^\s*\[\[\s*" + re.escape(table) + r"\s*\]\]")
    return [i + 1 for i, line in enumerate(text.splitlines()) if pat.match(line)]


def spec_from_dict(
    d: Mapping, *, source: str = "<spec>", text: str | None = None, settings: Mapping | None = None
) -> Spec:
    extra = set(d) - _TOP
    if extra:
        raise SpecError(
            f"{source}: unknown top-level key(s) {sorted(extra)} (known: {', '.join(sorted(_TOP))})"
        )
    lines = {t: _header_lines(text, t) if text else [] for t in ("import", "restore", "roots")}

    def where(table, i, what):
        ln = lines[table][i] if i < len(lines[table]) else None
        return f"{source}{f' line {ln}' if ln else ''}: {what} #{i + 1}"

    def table_list(name):
        v = d.get(name, [])
        if not isinstance(v, list) or not all(isinstance(x, Mapping) for x in v):
            raise SpecError(f"{source}: '{name}' must be an array of tables ([[{name}]])")
        return v

    imports = [
        _import_rule_from_obj(r, where("import", i, "import rule"))
        for i, r in enumerate(table_list("import"))
    ]
    restore = [
        _restore_rule_from_obj(r, where("restore", i, "restore rule"))
        for i, r in enumerate(table_list("restore"))
    ]
    roots = []
    for i, r in enumerate(table_list("roots")):
        bad = set(r) - {"source", "target", "params"}
        if bad or "source" not in r:
            raise SpecError(
                f"{where('roots', i, 'root')}: needs 'source' (and optional 'target', "
                f"'params'); unknown {sorted(bad)}"
            )
        roots.append(
            Root(source=r["source"], target=r.get("target"), params=bool(r.get("params", True)))
        )
    s = dict(d.get("settings", {}))
    if not isinstance(d.get("settings", {}), Mapping):
        raise SpecError(f"{source}: [settings] must be a table")
    s.update(settings or {})
    strict = d.get("strict", True)
    if not isinstance(strict, bool):
        raise SpecError(f"{source}: strict must be true or false")
    return Spec(
        name=str(d.get("name", Path(source).stem if source != "<spec>" else "spec")),
        description=str(d.get("description", "")),
        settings=s,
        imports=tuple(imports),
        restore=tuple(restore),
        roots=tuple(roots) if roots else DEFAULT_ROOTS,
        strict=strict,
    )


def spec_from_toml(text: str, *, source: str = "<spec>", settings: Mapping | None = None) -> Spec:
    try:
        d = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise SpecError(f"{source}: invalid TOML: {e}") from None
    return spec_from_dict(d, source=source, text=text, settings=settings)


def spec_to_dict(spec: Spec) -> dict:
    d: dict = {"name": spec.name}
    if spec.description:
        d["description"] = spec.description
    d["strict"] = spec.strict
    if spec.settings:
        d["settings"] = dict(spec.settings)
    if tuple(spec.roots) != DEFAULT_ROOTS:
        d["roots"] = [r.to_dict() for r in spec.roots]
    if spec.imports:
        d["import"] = [r.to_dict() for r in spec.imports]
    if spec.restore:
        d["restore"] = [r.to_dict() for r in spec.restore]
    return d


# ---------------------------------------------------------------------------------- dumping


def _str(s: str) -> str:
    if "'" not in s and "\n" not in s and all(c >= " " or c == "\t" for c in s):
        return f"'{s}'"
    out = s.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n").replace("\t", "\\t")
    out = "".join(c if c >= " " else f"\\u{ord(c):04x}" for c in out)
    return f'"{out}"'


def _key(k: str) -> str:
    return k if re.fullmatch(r"[A-Za-z0-9_-]+", k) else _str(k)


def _val(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int):
        return str(v)
    if isinstance(v, float):
        if math.isnan(v):
            return "nan"
        if math.isinf(v):
            return "inf" if v > 0 else "-inf"
        return repr(v)
    if isinstance(v, str):
        return _str(v)
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(_val(x) for x in v) + "]"
    if isinstance(v, Mapping):
        return "{" + ", ".join(f"{_key(str(k))} = {_val(x)}" for k, x in v.items()) + "}"
    if v is None:
        raise SpecError("TOML cannot hold None; leave the key out")
    raise SpecError(f"cannot write {type(v).__name__} {v!r} to TOML")


def spec_to_toml(spec: Spec) -> str:
    d = spec_to_dict(spec)
    lines = []
    for k in ("name", "description", "strict"):
        if k in d:
            lines.append(f"{k} = {_val(d[k])}")
    if "settings" in d:
        lines += ["", "[settings]"] + [f"{_key(k)} = {_val(v)}" for k, v in d["settings"].items()]
    for table in ("roots", "import", "restore"):
        for item in d.get(table, []):
            lines += ["", f"[[{table}]]"]
            for k, v in item.items():
                if v is None:
                    continue
                lines.append(f"{_key(k)} = {_val(v)}")
    return "\n".join(lines) + "\n"


def dump_spec(spec: Spec, path: str | os.PathLike) -> None:
    Path(path).write_text(spec_to_toml(spec))


# ---------------------------------------------------------------------------------- shipped


def list_specs() -> list[str]:
    return sorted(p.stem for p in SPECS_DIR.glob("*.toml"))


def load_spec(name_or_path: str | os.PathLike | Spec, **settings) -> Spec:
    """A shipped spec by name (see ``list_specs()``) or a TOML file, with settings overridden
    by keyword arguments (e.g. ``load_spec("llama", num_layers=2, vocab_size=1000)``)."""
    if isinstance(name_or_path, Spec):
        return name_or_path.with_settings(**settings) if settings else name_or_path
    p = Path(name_or_path)
    if not p.is_file():
        cand = SPECS_DIR / f"{str(name_or_path).replace('-', '_')}.toml"
        if cand.is_file():
            p = cand
        elif p.suffix == ".toml" or os.sep in str(name_or_path):
            raise SpecError(f"spec file {str(name_or_path)!r} not found")
        else:
            raise SpecError(
                f"unknown spec {str(name_or_path)!r}: not a file and not a shipped spec "
                f"(shipped: {', '.join(list_specs()) or 'none'})"
            )
    return spec_from_toml(p.read_text(), source=str(p), settings=settings)
