"""Reading torch files a user hands over, bounded in total and safe against files that change
underneath (issue 30, round 3): a zip of many deflated members, each under the per-member cap,
is bounded by what the pickle declares and by one total for the archive (peak memory measured
in a subprocess, by the process itself); a file truncated between planning and reading is an
error naming it, never SIGBUS. Every hostile file is built here, without torch.
"""

from __future__ import annotations

import json
import os
import shutil
import struct
import subprocess
import sys
import zlib

import pytest

from jax_ucp.importers.torch.unpickler import MAX_INFLATED_TOTAL, TorchFileError, load_torch_file
from tests.importers.torch.test_unpickler import D, prog, tensor
from tests.ucp_testing import REPO

pytestmark = pytest.mark.timeout(180)

MIB = 1 << 20


def _deflated_zeros(size: int) -> tuple[bytes, int]:
    """A raw deflate stream of ``size`` zero bytes and their CRC-32, built in 1 MiB steps."""
    assert size % MIB == 0
    z = zlib.compressobj(9, zlib.DEFLATED, -zlib.MAX_WBITS)
    block = bytes(MIB)
    out, crc = [], 0
    for _ in range(size // MIB):
        out.append(z.compress(block))
        crc = zlib.crc32(block, crc)
    out.append(z.flush())
    return b"".join(out), crc


def _zip(path, members: list[tuple[str, bytes, int, int, int]]) -> str:
    """A zip written byte by byte: ``(name, data, method, crc, uncompressed size)`` per member,
    so one compressed stream serves many members (zipfile would compress each again)."""
    central, offset = [], 0
    with open(path, "wb") as f:
        for name, data, method, crc, size in members:
            n = name.encode()
            header = struct.pack(
                "<IHHHHHIIIHH", 0x04034B50, 20, 0, method, 0, 0x21, crc, len(data), size, len(n), 0
            )
            f.write(header + n + data)
            central.append(
                struct.pack(
                    "<IHHHHHHIIIHHHHHII",
                    0x02014B50,
                    20,
                    20,
                    0,
                    method,
                    0,
                    0x21,
                    crc,
                    len(data),
                    size,
                    len(n),
                    0,
                    0,
                    0,
                    0,
                    0,
                    offset,
                )  # fmt: skip
                + n
            )
            offset += len(header) + len(n) + len(data)
        directory = b"".join(central)
        f.write(directory)
        f.write(
            struct.pack(
                "<IHHHHIIH", 0x06054B50, 0, 0, len(members), len(members), len(directory), offset, 0
            )
        )
    return str(path)


def _stored(name: str, data: bytes) -> tuple[str, bytes, int, int, int]:
    return name, data, 0, zlib.crc32(data), len(data)


def _bomb(path, members: int, member_bytes: int, declared: int) -> str:
    """``members`` deflated members of ``member_bytes`` zeros each (one 255 MiB stream is
    ~250 KB), the pickle a dict of uint8 tensors each declaring ``declared`` bytes."""
    data, crc = _deflated_zeros(member_bytes)
    body = b"}" + b"".join(
        D(f"t{i}") + tensor("ByteStorage", str(i), declared, 0, (declared,), (1,)) + b"s"
        for i in range(members)
    )
    return _zip(
        path,
        [
            _stored("archive/data.pkl", prog(body)),
            _stored("archive/byteorder", b"little"),
            *[(f"archive/data/{i}", data, 8, crc, member_bytes) for i in range(members)],
            _stored("archive/version", b"3\n"),
        ],
    )


_CONVERT_AND_MEASURE = """
import json, sys
import jax_ucp
try:
    jax_ucp.convert(sys.argv[1], sys.argv[2])
    error = None
except jax_ucp.UCPError as e:
    error = str(e)
# VmHWM, not ru_maxrss: the latter keeps the high-water mark of the process that forked this
# one (a pytest worker that ran other tests), VmHWM is this program's own memory since exec.
hwm = [l for l in open("/proc/self/status") if l.startswith("VmHWM:")][0]
print(json.dumps({"error": error, "peak": int(hwm.split()[1]) * 1024}))
"""


def _convert_in_subprocess(src, dst) -> dict:
    done = subprocess.run(
        [sys.executable, "-c", _CONVERT_AND_MEASURE, str(src), str(dst)],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": REPO},
        timeout=170,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_sixteen_deflated_members_each_under_the_cap_stay_bounded_in_total(tmp_path):
    """16 deflated members of 255 MiB of zeros (each under the 256 MiB per-member cap; 4 GiB in
    all from a ~4 MB file) declared as 16 tensors: refused once the archive's inflated total
    would pass MAX_INFLATED_TOTAL, with the process's own peak RSS far below what it declares
    (it reached 4.6 GB before)."""
    src = _bomb(tmp_path / "bomb.pt", 16, 255 * MIB, 255 * MIB)
    assert os.path.getsize(src) < 8 * MIB
    result = _convert_in_subprocess(src, tmp_path / "out")
    assert result["error"] is not None, "the bomb converted"
    assert "bomb.pt" in result["error"]
    assert f"more than the {MAX_INFLATED_TOTAL} bytes inflated in total" in result["error"]
    assert result["peak"] < 1 << 30, result
    assert not (tmp_path / "out").exists()


def test_deflated_member_larger_than_its_storage_is_refused_before_inflating(tmp_path):
    """The pickle declares 16 bytes per storage, each member inflates to 255 MiB: refused by what
    the pickle declares, before any member is inflated (peak memory: the interpreter's)."""
    src = _bomb(tmp_path / "small_storages.pt", 16, 255 * MIB, 16)
    result = _convert_in_subprocess(src, tmp_path / "out")
    assert "small_storages.pt" in (result["error"] or "")
    assert "declares 267386880 bytes, but the pickle's storage needs 16" in result["error"]
    assert result["peak"] < 1 << 30, result


def test_deflated_members_within_the_total_read_exactly(tmp_path):
    """Legitimate compressed archives under the total still load, byte for byte, and a CRC
    check of every member keeps nothing inflated."""
    src = _bomb(tmp_path / "ok.pt", 3, 4 * MIB, 4 * MIB)
    loaded = load_torch_file(src, verify_crc=True)
    assert sorted(loaded) == ["t0", "t1", "t2"]
    assert all(v.shape == (4 * MIB,) and not v.any() for v in loaded.values())


def test_verify_crc_of_deflated_members_keeps_nothing(tmp_path):
    """verify_crc inflates an unreferenced deflated member only to check it: 2 x 255 MiB pass
    the check without counting against the archive's total (nothing is kept)."""
    from jax_ucp.importers.torch.unpickler import TorchArchive

    src = _bomb(tmp_path / "unreferenced.pt", 2, 255 * MIB, 0)
    arch = TorchArchive(src)
    try:
        arch.verify_crc()
        assert arch._inflated == 0
    finally:
        arch.close()
    with pytest.raises(TorchFileError, match="but the pickle's storage needs 0"):
        load_torch_file(src)


# --------------------------------------------------------------------------- files that shrink

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


@pytest.mark.parametrize("kind", ["pt", "distcp"])
def test_a_file_truncated_after_it_was_mapped_is_an_error_naming_it(tmp_path, kind):
    """A ``.pt`` truncated between planning and reading (every tensor already a view of its
    mapping), a ``.distcp`` truncated right after a chunk's range was mapped: an error naming
    the file, nothing written — not SIGBUS (exit -7, no message, as when the mapping is
    touched). Deterministic: the file shrinks at a hook, not in a race."""
    if kind == "pt":
        src = tmp_path / "model.pt"
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
