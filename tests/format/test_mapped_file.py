"""format.mapped_file: views of a file read with pread, and a file that shrinks under them."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import zlib

import pytest

from tests.ucp_testing import REPO

_TRUNCATED_WHILE_READ = """
import json, os, sys
import numpy as np
import jax_ucp
from jax_ucp.exporters import torch_out
from jax_ucp.importers.torch import dcp_reader
from jax_ucp.importers.torch import unpickler as torch_pickle

kind, src, dst = sys.argv[1:]
shrunk = []

def shrink(path, size):
    if not shrunk:  # once: the first file mapped, right after it was mapped
        os.truncate(path, size)
        shrunk.append(os.path.basename(path))

if kind == "pt":
    arrays = [np.arange(1 << 20, dtype=np.float32) + i for i in range(3)]
    slots = {f"w{i}": torch_out.TensorSlot(i, a.shape, a.dtype) for i, a in enumerate(arrays)}
    torch_out.save_file(src, slots, arrays)
    real = torch_pickle.load_torch_file

    def load(path, *args, **kwargs):  # planned (every tensor a view of the mapping), then shrunk
        out = real(path, *args, **kwargs)
        shrink(os.fspath(path), os.path.getsize(path) // 2)
        return out

    torch_pickle.load_torch_file = load
elif kind == "safetensors":
    from safetensors.numpy import save_file
    from jax_ucp.format import safetensors as safetensors_format

    save_file({f"w{i}": np.arange(1 << 20, dtype=np.float32) + i for i in range(3)}, src)
    real = safetensors_format.SafetensorsFile.__init__

    def init(self, path, *args):  # header parsed, every tensor a view of the mapping, shrunk
        real(self, path, *args)
        shrink(os.fspath(path), os.path.getsize(path) // 2)

    safetensors_format.SafetensorsFile.__init__ = init
else:
    real = dcp_reader._file_range

    def file_range(path, offset, *args):  # mapped, then cut where the range starts
        out = real(path, offset, *args)
        shrink(str(path), offset)
        return out

    dcp_reader._file_range = file_range
try:
    jax_ucp.convert(src, dst)
    error = None
except jax_ucp.UCPError as e:
    error = str(e)
print(json.dumps({"error": error, "shrunk": shrunk}))
"""


@pytest.mark.timeout(180)
@pytest.mark.parametrize("kind", ["pt", "distcp", "safetensors"])
def test_a_file_truncated_after_it_was_mapped_is_an_error_naming_it(tmp_path, kind):
    """A ``.pt`` truncated between planning and reading (every tensor already a view of its
    mapping), a ``.distcp`` truncated right after a chunk's range was mapped, a
    ``.safetensors`` truncated once its header was parsed: an error naming
    the file, nothing written — not SIGBUS (exit -7, no message, as when the mapping is
    touched). Deterministic: the file shrinks at a hook, not in a race."""
    if kind == "pt":
        src = tmp_path / "model.pt"
    elif kind == "safetensors":
        src = tmp_path / "model.safetensors"
    else:
        src = tmp_path / "dcp"
        shutil.copytree(os.path.join(REPO, "tests", "fixtures", "torch", "fsdp2_fp32"), src)
    done = subprocess.run(
        [sys.executable, "-c", _TRUNCATED_WHILE_READ, kind, str(src), str(tmp_path / "out")],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": REPO},
        timeout=170,
    )
    assert done.returncode == 0, (done.returncode, done.stderr[-3000:])
    result = json.loads(done.stdout.strip().splitlines()[-1])
    (shrunk,) = result["shrunk"]
    assert result["error"] is not None, "converted from a truncated file"
    assert shrunk in result["error"] and "truncated" in result["error"], result["error"]
    assert not (tmp_path / "out").exists()
    assert sorted(os.listdir(tmp_path)) == sorted([src.name])  # no temporaries left


@pytest.mark.timeout(180)
def test_mapped_file_reads_views_with_pread_exactly(tmp_path):
    """read_out / copy_into / crc32 / read_bytes give what touching the mapping would: C-order,
    transposed, reversed and byte-swapped views; after the file shrinks, an error naming it."""
    import numpy as np

    from jax_ucp.format import mapped_file

    path = tmp_path / "data.bin"
    values = np.arange(4096, dtype=">f4")
    path.write_bytes(b"head" + values.tobytes())
    mm = mapped_file.map_file(str(path))
    flat = np.frombuffer(mm, ">f4", count=4096, offset=4)
    views = [flat, flat.reshape(64, 64).T, flat[::-3], flat.reshape(64, 64)[3:9, ::-2]]
    for view in views:
        out = mapped_file.read_out(view)
        assert mapped_file.mapped_at(out) is None and out.dtype == view.dtype
        assert np.array_equal(out, np.array(view))  # np.array: touching the intact mapping
        region = np.empty(view.shape, view.dtype)
        mapped_file.copy_into(region, view)
        assert np.array_equal(region, np.array(view))
    assert mapped_file.crc32(flat) == zlib.crc32(values.tobytes())
    assert mapped_file.read_bytes(mm, 0, 4) == b"head"
    assert mapped_file.read_out(values) is values  # not mapped: passed through
    os.truncate(path, 1000)
    with pytest.raises(mapped_file.FileShrankError, match=r"data\.bin: .*is 1000 now"):
        mapped_file.read_out(flat)
    with pytest.raises(mapped_file.FileShrankError, match=r"data\.bin"):
        mapped_file.crc32(flat)
    assert np.array_equal(mapped_file.read_out(flat[:10]), values[:10])  # still inside
