"""format.mapped_file: views of a file read with pread, and a file that shrinks under them."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import zlib

import pytest

from jax_ucp.errors import CheckpointError
from tests.ucp_testing import REPO

_TRUNCATED_WHILE_READ = """
import json, os, sys
import numpy as np
import jax_ucp
from jax_ucp._src.torchfiles import torch_zip
from jax_ucp._src.torchfiles import dcp as torch_dcp
from jax_ucp._src.torchfiles import torch_zip

kind, src, dst = sys.argv[1:]
shrunk = []

def shrink(path, size):
    if not shrunk:  # once: the first file mapped, right after it was mapped
        os.truncate(path, size)
        shrunk.append(os.path.basename(path))

if kind == "pt":
    arrays = [np.arange(1 << 20, dtype=np.float32) + i for i in range(3)]
    slots = {f"w{i}": torch_zip.TensorSlot(i, a.shape, a.dtype) for i, a in enumerate(arrays)}
    torch_zip.save_file(src, slots, arrays)
    real = torch_zip.load_torch_file

    def load(path, *args, **kwargs):  # planned (every tensor a view of the mapping), then shrunk
        out = real(path, *args, **kwargs)
        file = os.path.join(path[0].root, path[1]) if isinstance(path, tuple) else os.fspath(path)
        shrink(file, os.path.getsize(file) // 2)
        return out

    torch_zip.load_torch_file = load
elif kind == "safetensors":
    from safetensors.numpy import save_file
    from jax_ucp._src.format import safetensors as safetensors_format

    save_file({f"w{i}": np.arange(1 << 20, dtype=np.float32) + i for i in range(3)}, src)
    real = safetensors_format.SafetensorsFile.read_from

    def read_from(path, *args, **kwargs):  # header parsed through the map, then shrunk
        out = real(path, *args, **kwargs)
        shrink(os.fspath(path), os.path.getsize(path) // 2)
        return out

    safetensors_format.SafetensorsFile.read_from = read_from
else:
    real = torch_dcp._file_range

    def file_range(reader, offset, *args):  # read, then cut where the range starts
        out = real(reader, offset, *args)
        shrink(reader.shown, offset)
        return out

    torch_dcp._file_range = file_range
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


_RANK_FILE_TRUNCATED = """
import json, os, shutil, sys
import jax_ucp
from jax_ucp._src.torchfiles import torch_zip

real = torch_zip.TorchArchive.load
case = {}

def archive_load(self, *args, **kwargs):  # unpickled: its tensors are views of the mapping
    out = real(self, *args, **kwargs)
    path = str(self.path)
    if os.path.basename(path).startswith(case["prefix"]):
        case["loads"].append(path)
        if case["loads"].count(path) == case["nth"] and not case["shrunk"]:
            os.truncate(path, os.path.getsize(path) // 2)  # its last load, then cut
            case["shrunk"].append(os.path.basename(path))
    return out

torch_zip.TorchArchive.load = archive_load
for fixture, prefix, nth, budget, src, dst in json.loads(sys.argv[1]):
    shutil.copytree(fixture, src)
    case.update(prefix=prefix, nth=nth, loads=[], shrunk=[])
    try:
        jax_ucp.convert(src, dst, **({"memory_budget": budget} if budget else {}))
        error = None
    except jax_ucp.UCPError as e:
        error = str(e)
    print("CASE " + json.dumps({"error": error, "shrunk": case["shrunk"]}), flush=True)
"""

#: (fixture, rank file name prefix, its load followed by the cut, memory budget): DeepSpeed
#: ZeRO-1/2 (the fp32 master checked against the module), ZeRO-3 (pieces joined), the module
#: file, Megatron-DeepSpeed TP merges, AutoTP's affine map, MoE at ZeRO-0; Megatron legacy TP
#: merges built whole and in row slabs (a budget below every tensor), pipeline-tied copies,
#: distrib_optim.pt's flat buffers.
_RANK_FILES = [
    ("deepspeed/z2_bf16_dp2/ckpt", "bf16_zero_pp_rank_0", 1, ""),
    ("deepspeed/z3_bf16_dp2/ckpt", "bf16_zero_pp_rank_0", 1, ""),
    ("deepspeed/z1_fp32_dp2/ckpt", "mp_rank_00_model", 1, ""),
    ("deepspeed/megatron_ds_tp2_dp2_z1_bf16_synthetic/ckpt", "bf16_zero_pp_rank_0", 1, ""),
    ("deepspeed/autotp_tp2_dp2_z2_bf16/ckpt", "mp_rank_00_model", 1, ""),
    ("deepspeed/moe_ep2_z0_fp32/ckpt", "mp_rank_00_model", 1, ""),
    ("deepspeed/autotp_tp2_dp2_z2_bf16/universal", "fp32", 1, ""),
    ("megatron/legacy_llama_tp2_synthetic", "model_optim_rng", 2, ""),
    ("megatron/legacy_llama_tp2_synthetic", "model_optim_rng", 2, "2KiB"),
    ("megatron/legacy_gpt_tp2pp2_synthetic", "model_optim_rng", 2, ""),
    ("megatron/legacy_gpt_distopt_pp2dp2_synthetic", "distrib_optim", 2, ""),
]


@pytest.mark.timeout(300)
def test_rank_files_truncated_once_unpickled_are_errors_naming_them(tmp_path):
    """A DeepSpeed or Megatron legacy rank file truncated once it was unpickled for the import
    (every tensor a view of its mapping; the importers slice, join, merge, compare and cast
    them): an error naming the file, nothing written — not SIGBUS (exit -7, no message), and
    not the zeros a mapping shows past a file's new end within its last page (a Megatron TP
    merge read them and called the ranks disagreeing). One process for every case."""
    cases = [
        (
            os.path.join(REPO, "tests", "fixtures", fx),
            prefix,
            nth,
            budget,
            str(tmp_path / f"src{i}"),
            str(tmp_path / f"out{i}"),
        )
        for i, (fx, prefix, nth, budget) in enumerate(_RANK_FILES)
    ]
    done = subprocess.run(
        [sys.executable, "-c", _RANK_FILE_TRUNCATED, json.dumps(cases)],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": REPO},
        timeout=290,
    )
    assert done.returncode == 0, (done.returncode, done.stderr[-3000:])
    results = [json.loads(x[5:]) for x in done.stdout.splitlines() if x.startswith("CASE ")]
    assert len(results) == len(cases)
    for (fx, prefix, _, _budget), result in zip(_RANK_FILES, results):
        (shrunk,) = result["shrunk"]
        assert shrunk.startswith(prefix), (fx, result)
        assert result["error"] is not None, f"{fx}: converted from a truncated {shrunk}"
        assert shrunk in result["error"] and "truncated" in result["error"], (fx, result)
    for i in range(len(cases)):
        assert not (tmp_path / f"out{i}").exists()
    assert sorted(os.listdir(tmp_path)) == sorted(f"src{i}" for i in range(len(cases)))


@pytest.mark.timeout(180)
def test_mapped_file_reads_views_with_pread_exactly(tmp_path):
    """read_out / copy_into / crc32 / read_bytes give what touching the mapping would: C-order,
    transposed, reversed and byte-swapped views; after the file shrinks, an error naming it."""
    import numpy as np

    from jax_ucp._src.format import mapped_file

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
        cast = np.empty(view.shape, np.float64)  # another dtype: read and cast piece by piece
        mapped_file.copy_into(cast, view)
        assert np.array_equal(cast, np.array(view).astype(np.float64))
    assert mapped_file.crc32(flat) == zlib.crc32(values.tobytes())
    assert mapped_file.read_bytes(mm, 0, 4) == b"head"
    assert mapped_file.read_out(values) is values  # not mapped: passed through
    os.truncate(path, 1000)
    with pytest.raises(CheckpointError, match=r"data\.bin: .*is 1000 now"):
        mapped_file.read_out(flat)
    with pytest.raises(CheckpointError, match=r"data\.bin"):
        mapped_file.crc32(flat)
    assert np.array_equal(mapped_file.read_out(flat[:10]), values[:10])  # still inside


def test_check_before_read_runs_once_before_the_first_read_of_its_range(tmp_path):
    """A range's check (a zip member's CRC-32) runs before its first byte is read, once; a range
    never read is never checked; a failing check fails every read of its range, not others."""
    import numpy as np

    from jax_ucp._src.format import mapped_file

    path = tmp_path / "data.bin"
    path.write_bytes(bytes(range(256)) * 16)  # 4096 bytes
    mm = mapped_file.map_file(str(path))
    arr = np.frombuffer(mm, np.uint8)
    calls = []

    def ok(name):
        return lambda m: calls.append((name, mapped_file.read_bytes(m, 0, 1)))  # reads itself

    def bad(m):
        calls.append(("bad", b""))
        raise CheckpointError("bad range")

    mapped_file.check_before_read(mm, 100, 100, ok("a"))  # [100, 200)
    mapped_file.check_before_read(mm, 1000, 24, bad)  # [1000, 1024)
    mapped_file.check_before_read(mm, 2000, 1000, ok("c"))  # [2000, 3000): never read
    assert np.array_equal(mapped_file.read_out(arr[:100]), arr[:100].copy()) and calls == []
    assert mapped_file.read_bytes(mm, 150, 2) == bytes([150, 151])
    assert calls == [("a", b"\x00")]
    mapped_file.read_out(arr[100:200])
    mapped_file.copy_into(np.empty(50, np.uint8), arr[120:170])
    assert calls == [("a", b"\x00")]  # once
    for _ in range(2):
        with pytest.raises(CheckpointError, match="bad range"):
            mapped_file.read_out(arr[990:1010])
    with pytest.raises(CheckpointError, match="bad range"):
        mapped_file.crc32(arr[1023:])
    assert [c for c, _ in calls] == ["a", "bad", "bad", "bad"]
    assert mapped_file.read_bytes(mm, 1024, 4) == bytes([0, 1, 2, 3])  # just past it
    assert "c" not in [c for c, _ in calls]
    with pytest.raises(CheckpointError, match="bad range"):
        mapped_file.check_pending(mm)  # all of them now: the bad one fails again
    assert "c" not in [c for c, _ in calls]  # sorted by offset: [1000, ...) failed first
    mapped_file.check_pending(mm, 1500)
    assert calls[-1] == ("c", b"\x00")


def test_copy_into_casts_a_mapped_tensor_piece_by_piece_exactly(tmp_path, monkeypatch):
    """A cast (fp32 master -> bf16 weight) read a piece at a time, the last piece short: the
    values of a cast of the whole, bit for bit; a file shrunk meanwhile is an error naming it."""
    import ml_dtypes
    import numpy as np

    from jax_ucp._src.format import mapped_file

    monkeypatch.setattr(mapped_file, "PIECE", 64)  # 16 float32 a piece: 63 pieces, the last short
    values = np.random.default_rng(0).standard_normal(1000).astype(">f4")
    values[[3, 500]] = np.nan, np.inf
    path = tmp_path / "data.bin"
    path.write_bytes(b"head" + values.tobytes())
    mm = mapped_file.map_file(str(path))
    flat = np.frombuffer(mm, ">f4", count=1000, offset=4).reshape(10, 100)
    out = np.empty((10, 100), ml_dtypes.bfloat16)
    mapped_file.copy_into(out, flat)
    want = values.astype(np.float32).astype(ml_dtypes.bfloat16).reshape(10, 100)
    assert np.array_equal(out.view(np.uint16), want.view(np.uint16))
    os.truncate(path, 2000)
    with pytest.raises(CheckpointError, match=r"data\.bin: .*is 2000 now"):
        mapped_file.copy_into(out, flat)
