"""Restore straight from every real fixture the importers are tested on (``restoring.
import_source``): the tree equals convert + restore of the same source with the same options,
value for value, on the host and on a mesh; the import's records come back as convert writes
them; nothing is written. Torch-free: the project's own readers."""

from __future__ import annotations

import glob
import os
import warnings

import jax
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding

import jax_ucp
from jax_ucp._src.format import to_numpy_dtype
from jax_ucp._src.importers.megatron import legacy as megatron_legacy
from jax_ucp._src.importers.plan import ImportOptions
from jax_ucp._src.restoring import import_source
from tests.ucp_testing import REPO

FIXTURES = os.path.join(REPO, "tests", "fixtures")


def _fixtures():
    """The sources of tests/importers/test_accounting.py's fixtures (the committed ones)."""
    out = sorted(glob.glob(os.path.join(FIXTURES, "deepspeed", "*", "ckpt")))
    out += sorted(glob.glob(os.path.join(FIXTURES, "hf_trainer", "*", "checkpoint-*")))
    out += sorted(
        os.path.dirname(p)
        for pattern in (".metadata", megatron_legacy.TRACKER_FILE)
        for p in glob.glob(os.path.join(FIXTURES, "megatron", "**", pattern), recursive=True)
    )
    out += sorted(
        os.path.dirname(p)
        for p in glob.glob(os.path.join(FIXTURES, "megatron_bridge", "*", "latest_*.pt"))
    )
    out += [
        p
        for p in sorted(glob.glob(os.path.join(FIXTURES, "torch", "*")))
        if not p.endswith((".npz", ".json"))
    ]
    out += sorted(glob.glob(os.path.join(FIXTURES, "accelerate", "*[!z]")))
    out += sorted(
        p for p in glob.glob(os.path.join(FIXTURES, "verl", "*")) if not p.endswith(".npz")
    )
    out += [os.path.join(FIXTURES, "olmo_core", "olmo_fp32")]
    return [pytest.param(p, id=os.path.relpath(p, FIXTURES)) for p in out if os.path.isdir(p) or os.path.isfile(p)]


def _equal(a, b, path="") -> None:
    """The same tree: containers, keys, leaf types, dtypes, shapes, values (NaN equal NaN)."""
    assert type(a) is type(b), (path, type(a), type(b))
    if isinstance(a, dict):
        assert list(a) == list(b), path
        for k in a:
            _equal(a[k], b[k], f"{path}/{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            _equal(x, y, f"{path}/{i}")
    elif isinstance(a, (np.ndarray, jax.Array)):
        assert (a.dtype, a.shape) == (b.dtype, b.shape), path
        if isinstance(a, jax.Array):
            assert a.sharding == b.sharding, path
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=path)
    else:
        assert a == b, path


def _both(src, tmp_path, **options):
    """(convert + restore, the direct restore) of ``src``, or the error both give."""
    importing = options.pop("importing", None)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            ckpt = jax_ucp.convert(src, str(tmp_path / "ucp"), importing=importing)
    except jax_ucp.UCPError as e:  # refused by the import: the direct restore refuses alike
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with pytest.raises(type(e)) as direct:
                jax_ucp.restore(src, importing=importing or ImportOptions(), **options)
        assert str(direct.value) == str(e)
        return None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        converted = jax_ucp.restore(ckpt, **options)
        direct = jax_ucp.restore(src, importing=importing or ImportOptions(), **options)
    return converted, direct, ckpt


def _files(root) -> dict[str, float]:
    return {
        os.path.join(d, f): os.stat(os.path.join(d, f)).st_mtime
        for d, _, fs in os.walk(root)
        for f in fs
    }


@pytest.mark.timeout(120)
@pytest.mark.parametrize("src", _fixtures())
def test_a_direct_restore_equals_convert_then_restore(tmp_path, src):
    before = _files(src)
    got = _both(src, tmp_path)
    assert _files(src) == before  # nothing written beside the source
    if got is None:
        return
    converted, direct, ckpt = got
    _equal(converted, direct)
    assert list(tmp_path.iterdir()) == [tmp_path / "ucp"]  # no scratch copy anywhere else
    # the records as convert writes them in the manifest
    manifest = jax_ucp.inspect(ckpt)
    found = import_source.import_format(src, ImportOptions())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with import_source.opened_import(src, found) as opened:
            assert opened.source == manifest.source
            assert opened.saved == {e.key: (e.shape, to_numpy_dtype(e.dtype)) for e in manifest.tensors}
