"""ucp.json is untrusted input: every malformed or hostile manifest is an error naming the field."""

from __future__ import annotations

import json

import pytest

import jax_ucp
from jax_ucp import format as fmt


def test_corrupt_manifest(ckpt):
    (ckpt / "ucp.json").write_text('{"format": "jax_ucp", "version": 1, "entries": [')
    with pytest.raises(fmt.ManifestError, match=r"ucp\.json: corrupt manifest"):
        jax_ucp.restore(ckpt)


def test_newer_format_version(ckpt):
    d = json.loads((ckpt / "ucp.json").read_text())
    d["version"] = 99
    (ckpt / "ucp.json").write_text(json.dumps(d))
    with pytest.raises(fmt.ManifestError, match="version 99 is newer"):
        jax_ucp.inspect(ckpt)
