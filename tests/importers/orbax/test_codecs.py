"""An Orbax array's codecs are data (issue 56): one word changed in its ``.zarray`` /
``zarr.json`` (Fortran order, a big-endian dtype, a ``transpose`` codec, a
big-endian ``bytes`` codec) made TensorStore read the same bytes as a transposed, byte-swapped or
re-scaled tensor, every checksum intact, and the import wrote it. Only the codecs Orbax writes are
decoded; the rest is refused naming the file, the array and the codec."""

from __future__ import annotations

import json
import os
import re

import numpy as np
import orbax.checkpoint as ocp
import pytest

import jax_ucp
from jax_ucp.errors import SourceError

pytestmark = pytest.mark.timeout(120)
W = np.arange(4 * 6, dtype=np.float32).reshape(4, 6)


def _orbax(path, zarr3: bool) -> str:
    handler = ocp.PyTreeCheckpointHandler(use_ocdbt=False, use_zarr3=zarr3)
    with ocp.Checkpointer(handler) as c:
        c.save(os.fspath(path), args=ocp.args.PyTreeSave({"params": {"w": W}}))
    return os.fspath(path)


def _inner(z: dict) -> list:
    codecs = z["codecs"]
    return (
        codecs[0]["configuration"]["codecs"] if codecs[0]["name"] == "sharding_indexed" else codecs
    )


V2 = {
    "Fortran order": (lambda z: z.update(order="F"), "order 'F' (not C)"),
    "big-endian dtype": (lambda z: z.update(dtype=">f4"), "big-endian dtype '>f4'"),
}
V3 = {
    "a transpose codec": (
        lambda z: _inner(z).insert(0, {"name": "transpose", "configuration": {"order": [1, 0]}}),
        "codec 'transpose'",
    ),
    "big-endian bytes": (
        lambda z: _inner(z)[0].setdefault("configuration", {}).update(endian="big"),
        "codec bytes with endian 'big'",
    ),
}


@pytest.mark.parametrize("case", sorted(V2) + sorted(V3))
def test_an_edited_orbax_codec_is_refused(tmp_path, case):
    zarr3 = case in V3
    edit, named = (V3 if zarr3 else V2)[case]
    src = _orbax(tmp_path / "orb", zarr3)
    np.testing.assert_array_equal(jax_ucp.restore(src)["params"]["w"], W)
    meta = os.path.join(src, "params.w", "zarr.json" if zarr3 else ".zarray")
    z = json.loads(open(meta).read())
    edit(z)
    open(meta, "w").write(json.dumps(z))
    with pytest.raises(SourceError, match=rf"array .params\.w.: {re.escape(named)}"):
        jax_ucp.convert(src, tmp_path / "out")
    with pytest.raises(SourceError, match=r"would read the stored bytes as other values"):
        jax_ucp.restore(src)
    assert not (tmp_path / "out").exists()
