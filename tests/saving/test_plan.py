"""What a save refuses before writing anything: leaves it cannot save, a bare leaf."""

from __future__ import annotations

import os
import re

import ml_dtypes
import numpy as np
import pytest

import jax_ucp


def test_unsupported_leaf_and_bare_leaf(tmp_path):
    with pytest.raises(ValueError, match="bare leaf"):
        jax_ucp.save(tmp_path / "x", np.zeros(3))
    with pytest.raises(jax_ucp.RequestError, match=r"'a/b'.*set"):
        jax_ucp.save(tmp_path / "y", {"a": {"b": {1, 2}}})
    assert not os.path.exists(tmp_path / "x") and not os.path.exists(tmp_path / "y")


# --- save: what may not be written, what must not be lost -------------------------------------------
@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    "tree, message",
    [
        ({"s": "\ud800"}, r"Leaf 's': value: not encodable as UTF-8"),
        ({"big": 10**5000}, r"Leaf 'big': an int of more than 64 digits"),
        ({"obj": object()}, r"Leaf 'obj': cannot save a builtins\.object"),
        ({"q": np.zeros(3, ml_dtypes.uint4)}, r"dtype uint4 is not supported"),
    ],
    ids=["lone surrogate", "5000-digit int", "object", "uint4"],
)
def test_unsavable_leaves_are_clear_errors_and_nothing_is_left(tmp_path, tree, message):
    with pytest.raises((jax_ucp.UCPError, TypeError), match=message):
        jax_ucp.save(tmp_path / "c", tree)
    assert os.listdir(tmp_path) == []


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    "tree,match",
    [
        ({"a": {"\ud800": np.ones(2)}}, r"Key path 'a/\\ud800': component '\\ud800' is not valid"),
        ({"p": {1: np.ones(2), "1": np.ones(2)}}, r"Dict at key path 'p' mixes key types"),
        ({1: np.ones(2), "b": np.ones(2)}, r"Dict at key path '\(the root\)' mixes key types"),
    ],
    ids=["lone-surrogate", "int-and-str-1", "int-and-str-b"],
)
def test_save_names_a_key_path_it_cannot_write(tmp_path, tree, match):
    jax_ucp.save(tmp_path / "c", {"old": np.arange(3)})
    with pytest.raises(jax_ucp.UCPError, match=match):
        jax_ucp.save(tmp_path / "c", tree, force=True)
    with pytest.raises(ValueError, match=match):  # RequestError is a ValueError too
        jax_ucp.save(tmp_path / "new", tree)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c"]  # nothing written or left
    assert list(jax_ucp.restore(tmp_path / "c")) == ["old"]


@pytest.mark.timeout(60)
def test_save_of_a_deleted_or_donated_array_names_it_before_writing(tmp_path):
    import jax
    import jax.numpy as jnp

    deleted = jnp.ones(4)
    deleted.delete()
    donated = jnp.ones((2, 3))
    jax.jit(lambda a: a + 1, donate_argnums=0)(donated)
    for key, leaf in (("x", deleted), ("y", donated)):
        if not leaf.is_deleted():  # pragma: no cover - a backend without donation
            continue
        shape = tuple(leaf.shape)
        with pytest.raises(
            jax_ucp.UCPError,
            match=rf"Leaf 'state/{key}': the jax.Array \(shape {re.escape(str(shape))}, float32\) "
            r"has been deleted or donated",
        ):
            jax_ucp.save(tmp_path / "c", {"state": {"w": np.ones(2), key: leaf}})
        assert not (tmp_path / "c").exists() and list(tmp_path.iterdir()) == []
    assert donated.is_deleted() and deleted.is_deleted()
