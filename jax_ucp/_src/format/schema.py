"""The published JSON Schema of ``ucp.json``, generated from the typed model ``manifest.Manifest``
(``python -m jax_ucp._src.format.schema`` rewrites ``ucp_manifest.v1.schema.json``; a test holds
the checked-in file equal to the generated one)."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import msgspec

from jax_ucp._src.format import manifest

SCHEMA_FILE = Path(__file__).with_name("ucp_manifest.v1.schema.json")

# The value's JSON type by the entry's "type" (the reader checks it too: a Struct has one tag).
VALUE_SCHEMAS: dict[str, dict] = {
    "none": {"type": "null"},
    "bool": {"type": "boolean"},
    "int": {"type": "integer"},
    "float": {"type": "string", "pattern": manifest.FLOAT_HEX_PATTERN},
    "str": {"type": "string"},
}
_SCHEMA_NAMES = {
    "Manifest": "ManifestModel",
    "TensorEntry": "TensorModel",
    "ValueEntry": "ValueModel",
    "SavedSharding": "SavedShardingModel",
}


def json_schema() -> dict:
    """The JSON Schema of ``ucp.json``, generated from ``manifest.Manifest`` (plus the one rule
    a Struct cannot carry: a value entry's ``value`` by its ``type``)."""
    text = msgspec.json.encode(msgspec.json.schema(manifest.Manifest)).decode()
    for name, published in _SCHEMA_NAMES.items():  # the entries' names when it was published
        text = text.replace(f'"{name}"', f'"{published}"').replace(f'/{name}"', f'/{published}"')
    schema = json.loads(text)
    for part in schema["$defs"].values():  # the docstrings, without their indentation
        if "description" in part:
            part["description"] = " ".join(part["description"].split())
    for name, defaults in manifest.DEFAULTS.items():  # what an absent member means, documented
        part = schema["$defs"][_SCHEMA_NAMES.get(name, name)]
        for field, default in defaults.items():
            part["properties"][field]["default"] = default
    value = schema["$defs"]["ValueModel"]
    value["allOf"] = [
        {"if": {"properties": {"type": {"const": t}}}, "then": {"properties": {"value": s}}}
        for t, s in VALUE_SCHEMAS.items()
    ]
    return {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "$id": "jax_ucp/ucp_manifest.v1.schema.json",
        "title": f"jax_ucp manifest (ucp.json), format version {manifest.FORMAT_VERSION}",
        **schema,
    }


def schema_text() -> str:
    """What ``ucp_manifest.v1.schema.json`` holds: indented, what fits on one line on one."""

    def dump(v: Any, indent: str) -> str:
        inner, flat = indent + " ", json.dumps(v, ensure_ascii=False)
        if len(flat) + len(indent) <= 96:
            return flat
        if isinstance(v, dict):
            items = [f"{inner}{json.dumps(k)}: {dump(x, inner)}" for k, x in v.items()]
            return "{\n" + ",\n".join(items) + f"\n{indent}}}"
        if isinstance(v, list) and any(isinstance(x, (dict, list)) for x in v):
            return "[\n" + ",\n".join(inner + dump(x, inner) for x in v) + f"\n{indent}]"
        return json.dumps(v, ensure_ascii=False)

    return dump(json_schema(), "") + "\n"


if __name__ == "__main__":  # regenerates the checked-in schema
    SCHEMA_FILE.write_text(schema_text(), encoding="utf-8")
    sys.stdout.write(f"wrote {SCHEMA_FILE}\n")
