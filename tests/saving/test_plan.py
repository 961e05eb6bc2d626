"""What a save refuses before writing anything: leaves it cannot save, a bare leaf."""

from __future__ import annotations

import os

import numpy as np
import pytest

import jax_ucp


def test_unsupported_leaf_and_bare_leaf(tmp_path):
    with pytest.raises(ValueError, match="bare leaf"):
        jax_ucp.save(tmp_path / "x", np.zeros(3))
    with pytest.raises(TypeError, match=r"'a/b'.*set"):
        jax_ucp.save(tmp_path / "y", {"a": {"b": {1, 2}}})
    assert not os.path.exists(tmp_path / "x") and not os.path.exists(tmp_path / "y")
