"""What a save refuses before writing anything: leaves it cannot save, a bare leaf."""

from __future__ import annotations

import os

import ml_dtypes
import numpy as np
import pytest

import jax_ucp


def test_unsupported_leaf_and_bare_leaf(tmp_path):
    with pytest.raises(ValueError, match="bare leaf"):
        jax_ucp.save(tmp_path / "x", np.zeros(3))
    with pytest.raises(TypeError, match=r"'a/b'.*set"):
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
