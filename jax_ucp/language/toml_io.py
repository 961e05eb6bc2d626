"""The TOML file form of a spec: TOML text <-> the spec's dict form (``spec.spec_from_dict`` /
``spec.spec_to_dict``, where validation lives; errors here add the rule's line), and the shipped
specs (``specs/*.toml``) found by name with ``load_spec``.

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
from jax_ucp.language.spec import Spec, spec_from_dict, spec_to_dict

SPECS_DIR = Path(__file__).parent / "specs"


def _table_lines(text: str, table: str) -> list[int]:
    """The line number of each ``[[table]]`` header, in order."""
    header = re.compile(r"^\s*\[\[\s*" + re.escape(table) + r"\s*\]\]")
    return [i + 1 for i, line in enumerate(text.splitlines()) if header.match(line)]


def spec_from_toml(text: str, *, source: str = "<spec>", settings: Mapping | None = None) -> Spec:
    """A spec from TOML text; ``settings`` override its ``[settings]``. Errors name ``source``
    and the line of the offending ``[[import]]``/``[[restore]]``/``[[roots]]`` table."""
    try:
        d = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise SpecError(f"{source}: invalid TOML: {e}") from None
    lines = {table: _table_lines(text, table) for table in ("import", "restore", "roots")}
    return spec_from_dict(d, source=source, settings=settings, table_lines=lines)


# ---------------------------------------------------------------------------------- dumping


def _toml_string(s: str) -> str:
    """A TOML literal string when ``s`` allows one (regexes stay readable), else a basic one."""
    if "'" not in s and "\n" not in s and all(c >= " " or c == "\t" for c in s):
        return f"'{s}'"
    out = s.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n").replace("\t", "\\t")
    out = "".join(c if c >= " " else f"\\u{ord(c):04x}" for c in out)
    return f'"{out}"'


def _toml_key(k: str) -> str:
    return k if re.fullmatch(r"[A-Za-z0-9_-]+", k) else _toml_string(k)


def _toml_value(v: Any) -> str:
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
        return _toml_string(v)
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    if isinstance(v, Mapping):
        return (
            "{" + ", ".join(f"{_toml_key(str(k))} = {_toml_value(x)}" for k, x in v.items()) + "}"
        )
    if v is None:
        raise SpecError("TOML cannot hold None; leave the key out")
    raise SpecError(f"cannot write {type(v).__name__} {v!r} to TOML")


def spec_to_toml(spec: Spec) -> str:
    """TOML text of ``spec`` (its dict form); ``spec_from_toml`` gives the spec back."""
    d = spec_to_dict(spec)
    lines = []
    for k in ("name", "description", "strict"):
        if k in d:
            lines.append(f"{k} = {_toml_value(d[k])}")
    if "settings" in d:
        lines += ["", "[settings]"] + [
            f"{_toml_key(k)} = {_toml_value(v)}" for k, v in d["settings"].items()
        ]
    for table in ("roots", "import", "restore"):
        for item in d.get(table, []):
            lines += ["", f"[[{table}]]"]
            for k, v in item.items():
                if v is None:
                    continue
                lines.append(f"{_toml_key(k)} = {_toml_value(v)}")
    return "\n".join(lines) + "\n"


def dump_spec(spec: Spec, path: str | os.PathLike) -> None:
    """Write ``spec`` to a TOML file."""
    Path(path).write_text(spec_to_toml(spec))


# ---------------------------------------------------------------------------------- shipped


def list_specs() -> list[str]:
    """Names of the shipped specs (``specs/*.toml``)."""
    return sorted(path.stem for path in SPECS_DIR.glob("*.toml"))


def load_spec(name_or_path: str | os.PathLike | Spec, **settings) -> Spec:
    """A shipped spec by name (see ``list_specs()``) or a TOML file, with settings overridden
    by keyword arguments (e.g. ``load_spec("llama", num_layers=2, vocab_size=1000)``)."""
    if isinstance(name_or_path, Spec):
        return name_or_path.with_settings(**settings) if settings else name_or_path
    path = Path(name_or_path)
    if not path.is_file():
        shipped = SPECS_DIR / f"{str(name_or_path).replace('-', '_')}.toml"
        if shipped.is_file():
            path = shipped
        elif path.suffix == ".toml" or os.sep in str(name_or_path):
            raise SpecError(f"spec file {str(name_or_path)!r} not found")
        else:
            raise SpecError(
                f"unknown spec {str(name_or_path)!r}: not a file and not a shipped spec "
                f"(shipped: {', '.join(list_specs()) or 'none'})"
            )
    return spec_from_toml(path.read_text(), source=str(path), settings=settings)
