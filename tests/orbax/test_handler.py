"""UCPSave / UCPRestore: fields checked when constructed, with messages naming the field and the
value; args passed as the item are refused, not wrapped."""

from __future__ import annotations

import numpy as np
import pytest

import jax_ucp


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"compression": "gzip"}, "UCPSave.compression: expected None or 'zstd', got 'gzip'."),
        (
            {"compression": "zstd", "compression_level": 30},
            "UCPSave.compression_level: expected an int in -131072..22 (zstd's levels), got 30.",
        ),
        (
            {"inner_chunk_bytes": 0},
            "UCPSave.inner_chunk_bytes: must be a positive number of bytes, got 0.",
        ),
        ({"checksum": "md5"}, "UCPSave.checksum: expected 'crc32c' or None, got 'md5'."),
        ({"source": "me"}, "UCPSave.source: expected None or a dict (a JSON object), got str."),
    ],
)
def test_ucpsave_fields_are_checked_when_constructed(kwargs, message):
    with pytest.raises(jax_ucp.UCPError, match="^" + _re(message) + "$"):
        jax_ucp.UCPSave({"w": np.ones(2)}, **kwargs)


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"mesh": "data=2"}, "UCPRestore.mesh: expected a jax.sharding.Mesh, got str."),
        (
            {"rules": [("embed", "data"), "mlp"]},
            "UCPRestore.rules: expected (logical_name, mesh_axes) pairs, e.g. "
            "[('embed', 'data'), ('mlp', 'model')], got 'mlp'.",
        ),
        (
            {"casting": "lossless"},
            "UCPRestore.casting: expected one of 'no', 'equiv', 'safe', 'same_kind', "
            "'unsafe', got 'lossless'.",
        ),
        (
            {"select": 3},
            "UCPRestore.select: expected a regex string or a predicate on the name, got int.",
        ),
        (
            {"memory_budget": -1},
            "UCPRestore.memory_budget: must be a positive number of bytes, got -1.",
        ),
        ({"strict": "no"}, "UCPRestore.strict: expected True or False, got 'no'."),
    ],
)
def test_ucprestore_fields_are_checked_when_constructed(kwargs, message):
    with pytest.raises(jax_ucp.UCPError, match="^" + _re(message) + "$"):
        jax_ucp.UCPRestore(**kwargs)


@pytest.mark.timeout(120)
def test_args_passed_as_the_item_are_refused_not_wrapped(tmp_path):
    jax_ucp.save(tmp_path / "c", {"w": np.ones(2, np.float32)})
    handler = jax_ucp.UCPCheckpointHandler()
    with pytest.raises(jax_ucp.UCPError, match=r"^UCPRestore\.target: got a UCPRestore, which"):
        handler.restore(tmp_path / "c", jax_ucp.UCPRestore())
    with pytest.raises(jax_ucp.UCPError, match=r"^UCPSave\.item: got a UCPSave, which is"):
        jax_ucp.UCPSave(jax_ucp.UCPSave({"w": np.ones(2)}))
    with pytest.raises(jax_ucp.UCPError, match=r"restore args.*UCPSave.*expected jax_ucp"):
        handler.restore(tmp_path / "c", args=jax_ucp.UCPSave({"w": np.ones(2)}))
    restored = handler.restore(tmp_path / "c", args=jax_ucp.UCPRestore())
    assert restored["w"].tolist() == [1.0, 1.0]


def _re(text: str) -> str:
    import re

    return re.escape(text)
