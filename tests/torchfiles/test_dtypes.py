"""torchfiles.dtypes: one table of torch's dtypes both ways, so what the writers pickle is what
the reader maps back, and the names are torch's own."""

from __future__ import annotations

import numpy as np
import pytest

from jax_ucp._src.torchfiles import torch_zip
from jax_ucp._src.torchfiles.dtypes import BY_NAME, STORAGES, TORCH_DTYPES
from jax_ucp._src.torchfiles.torch_zip import load_torch_file


def test_the_written_names_read_back_to_the_same_dtype():
    for dtype, (name, storage) in TORCH_DTYPES.items():
        assert BY_NAME[name] == dtype, name
        assert STORAGES[storage] == name, storage
    assert STORAGES["UntypedStorage"] == "uint8"


@pytest.mark.parametrize("dtype", list(TORCH_DTYPES), ids=str)
def test_a_tensor_written_by_torch_out_is_read_back_bit_exact(tmp_path, dtype):
    raw = np.arange(6 * dtype.itemsize, dtype=np.uint8) % (2 if dtype == np.bool_ else 251)
    array = raw.view(dtype).reshape(2, 3)
    path = str(tmp_path / "t.pt")
    torch_zip.save_file(path, {"t": torch_zip.TensorSlot(0, array.shape, dtype)}, [array])
    got = load_torch_file(path)["t"]
    assert got.dtype == dtype and got.shape == array.shape
    assert got.tobytes() == array.tobytes()


@pytest.mark.torch
def test_the_names_are_torchs():
    torch = pytest.importorskip("torch")
    for name in BY_NAME:
        assert isinstance(getattr(torch, name), torch.dtype), name
    for storage, name in STORAGES.items():
        if storage != "UntypedStorage":
            assert getattr(torch, storage).dtype == getattr(torch, name), storage
    for name, dtype in BY_NAME.items():  # aliases name the same dtype as the canonical name
        canonical = next(n for n, d in BY_NAME.items() if d == dtype)
        assert getattr(torch, name) == getattr(torch, canonical), name
