"""The DCP chunk-coverage check (``dcp.check_coverage``, shared by the Megatron
torch_dist and plain torch DCP importers): exact, and O(n log n) in the chunk count.

Before, overlaps were found by comparing every chunk with every later one: a ``.metadata``
declaring one tensor in 10**5 tiny chunks took minutes (measured: 227 s) before any error.
Each chunk set here is built by the test; its verdict is compared with a brute-force count of
how many chunks hold each element."""

from __future__ import annotations

import itertools
import os
import re
import shutil

import numpy as np
import pytest

import jax_ucp
from jax_ucp._src.torchfiles import dcp
from jax_ucp._src.torchfiles.dcp import DcpChunk, DcpTensor
from jax_ucp.errors import SourceError
from tests.importers.megatron.test_dcp import read_layout, write_layout
from tests.ucp_testing import (
    FIXTURES,
    assert_bit_exact,
    assert_convert_refused,
    assert_destination_untouched,
    copy_fixture,
    move_out,
    python_lines,
    restored_params,
)


def _tensor(shape, boxes, name="w") -> DcpTensor:
    """``boxes`` [(offsets, sizes)] as chunks of a float32 tensor, each with its own 4 bytes
    per element in one file."""
    chunks, at = [], 0
    for offsets, sizes in boxes:
        length = 4 * int(np.prod(sizes, dtype=np.int64))
        chunks.append(DcpChunk(tuple(offsets), tuple(sizes), "__0_0.distcp", at, length))
        at += length
    return DcpTensor(name, tuple(shape), np.dtype(np.float32), tuple(chunks))


def _counts(shape, boxes) -> np.ndarray:
    count = np.zeros(shape, np.int64)
    for offsets, sizes in boxes:
        count[tuple(slice(o, o + s) for o, s in zip(offsets, sizes))] += 1
    return count


def _grid(shape, rng) -> list:
    """A random tiling: each dimension cut at random points, every cell one chunk; some cells
    cut again along their last dimension (megatron's flattened ranges are split like that)."""
    cuts = [
        sorted({0, g, *rng.integers(1, g, size=rng.integers(0, 3)).tolist()}) if g > 1 else [0, g]
        for g in shape
    ]
    boxes = []
    for cell in itertools.product(*[list(itertools.pairwise(c)) for c in cuts]):
        lo, hi = [a for a, _ in cell], [b for _, b in cell]
        if hi[-1] - lo[-1] > 1 and rng.random() < 0.5:
            mid = int(rng.integers(lo[-1] + 1, hi[-1]))
            boxes.append((lo, [b - a for a, b in zip(lo, hi[:-1] + [mid])]))
            lo = lo[:-1] + [mid]
        boxes.append((lo, [b - a for a, b in zip(lo, hi)]))
    return boxes


@pytest.mark.timeout(60)
def test_coverage_verdict_matches_a_brute_force_count():
    """Random tilings of 1-, 2- and 3-D tensors pass; each one changed (a chunk moved, grown,
    shrunk, dropped or doubled) fails exactly when some element is then in no chunk or in
    several, and the error names such an element (and, for an overlap, two chunks that both
    hold it)."""
    rng = np.random.default_rng(7)
    checked = {"ok": 0, "overlap": 0, "gap": 0}
    for trial in range(300):
        shape = [int(g) for g in rng.integers(1, 7, size=1 + trial % 3)]
        boxes = _grid(shape, rng)
        dcp.check_coverage(_tensor(shape, boxes), "m")
        checked["ok"] += 1
        i = int(rng.integers(len(boxes)))
        offsets, sizes = (list(x) for x in boxes[i])
        how = trial % 5
        k = int(rng.integers(len(shape)))
        if how == 0:  # moved within the shape
            offsets[k] = int(rng.integers(0, shape[k] - sizes[k] + 1))
        elif how == 1 and offsets[k] + sizes[k] < shape[k]:  # grown
            sizes[k] += 1
        elif how == 2 and sizes[k] > 1:  # shrunk
            sizes[k] -= 1
        changed = [b for j, b in enumerate(boxes) if j != i]
        if how == 3:  # dropped
            pass
        elif how == 4:  # doubled
            changed += [boxes[i], boxes[i]]
        else:
            changed.append((offsets, sizes))
        count = _counts(shape, changed)
        t = _tensor(shape, changed)
        if np.all(count == 1):
            dcp.check_coverage(t, "m")
            continue
        with pytest.raises(SourceError) as error:
            dcp.check_coverage(t, "m")
        message = str(error.value)
        if "overlapping shards" in message:
            checked["overlap"] += 1
            element = [
                int(v) for v in message.split("both hold element [")[1].split("]")[0].split(",")
            ]
            assert count[tuple(element)] >= 2, message
        else:
            checked["gap"] += 1
            assert "incomplete shard coverage" in message, message
            if "is in no chunk" in message:
                element = [int(v) for v in message.split("element [")[1].split("]")[0].split(",")]
                assert count[tuple(element)] == 0, message
    assert min(checked.values()) > 30, checked


@pytest.mark.timeout(300)
def test_hundred_thousand_tiny_chunks_are_checked_in_n_log_n():
    """One [1000, 100] tensor declared as 10**5 one-element chunks: a tiling, accepted; the same
    with the last chunk moved onto the first, refused naming both chunks and the element (the
    pairwise check took 227 s on this input). The work is bounded by a count, not seconds: on
    2 * 10**4 chunks the check runs under 30 lines of Python per chunk (measured: 21), where a
    pairwise check runs one per pair (2 * 10**8)."""
    n = 100_000
    boxes = [((i // 100, i % 100), (1, 1)) for i in range(n)]
    dcp.check_coverage(_tensor((n // 100, 100), boxes), "m")
    boxes[-1] = ((0, 0), (1, 1))
    with pytest.raises(
        SourceError,
        match=r"tensor 'w': overlapping shards: \[0, 0\]\+\[1, 1\] in __0_0\.distcp and "
        r"\[0, 0\]\+\[1, 1\] in __0_0\.distcp both hold element \[0, 0\] \(m\)",
    ):
        dcp.check_coverage(_tensor((n // 100, 100), boxes), "m")
    small = boxes[: n // 5]
    result, lines = python_lines(dcp.check_coverage, _tensor((n // 500, 100), small), "m")
    assert result is None, result
    assert lines < 30 * len(small), lines


@pytest.mark.timeout(30)
def test_gap_and_overlap_with_the_right_element_count_are_found():
    """Element counts that add up are not enough: chunks of rows 0-2 and of row 2 of a 4-row
    tensor overlap on row 2 and leave row 3 out (8 of 8 elements); chunks of rows 1-3 and of
    row 3 leave row 0 out, which the error names."""
    with pytest.raises(SourceError, match=r"overlapping shards: \[0, 0\]\+\[3, 2\] .* \[2, 0\]\+"):
        dcp.check_coverage(_tensor((4, 2), [((0, 0), (3, 2)), ((2, 0), (1, 2))]), "m")
    with pytest.raises(
        SourceError,
        match=r"8 of 8 elements of shape \[4, 2\] .*; element \[0, 0\] is in no chunk",
    ):
        dcp.check_coverage(_tensor((4, 2), [((1, 0), (3, 2)), ((3, 0), (1, 2))]), "m")


@pytest.mark.timeout(30)
def test_chunks_split_along_too_many_dimensions_are_refused():
    """The check's work is chunks x 2**(dimensions they split): a tensor of 2**12 chunks split
    along 12 dimensions is refused by name before any large allocation."""
    shape = [2] * 12
    boxes = [(list(corner), [1] * 12) for corner in itertools.product((0, 1), repeat=12)]
    with pytest.raises(
        SourceError,
        match=r"'w' in m: 4096 chunks split along 12 dimensions:.*\(16781312 corners, at most 2581110\)",
    ):
        dcp.check_coverage(_tensor(shape, boxes), "m")


# Nothing outside the checkpoint is read, and no tensor borrows another's bytes.


@pytest.mark.timeout(120)
def test_dcp_storage_file_linked_outside_is_refused(tmp_path):
    """The issue's reproduction: ``__1_0.distcp`` a symlink to a file outside the checkpoint
    folder. Before, ``convert`` succeeded and read the outside bytes."""
    src = copy_fixture(tmp_path, "torch/fsdp2_fp32", name="fsdp2_fp32")
    move_out(src / "__1_0.distcp", tmp_path / "elsewhere")
    dst = tmp_path / "out"
    assert_convert_refused(
        src,
        dst,
        r"fsdp2_fp32/\.metadata:.*'__1_0\.distcp' resolves to \S+/elsewhere/__1_0\.distcp, outside",
    )


@pytest.mark.timeout(120)
def test_dcp_storage_file_linked_inside_reads_exactly(tmp_path):
    src = copy_fixture(tmp_path, "torch/fsdp2_fp32", name="fsdp2_fp32")
    want = restored_params(
        jax_ucp.convert(os.path.join(FIXTURES, "torch/fsdp2_fp32"), tmp_path / "ref")
    )
    (src / "blobs").mkdir()
    shutil.move(src / "__1_0.distcp", src / "blobs" / "rank1")
    (src / "__1_0.distcp").symlink_to("blobs/rank1")
    got = restored_params(jax_ucp.convert(src, tmp_path / "out"))
    assert sorted(got) == sorted(want)
    for name in want:
        assert_bit_exact(got[name], want[name], name)


def _same_shape_pair(tensors: dict) -> tuple[str, str]:
    """Two weight tensors of one shape and dtype (the borrower reads as the lender)."""
    seen: dict = {}
    for name, t in sorted(tensors.items()):
        if not name.startswith("model.") or not t["chunks"]:
            continue
        key = (tuple(t["shape"]), str(t["dtype"]), len(t["chunks"]))
        if key in seen:
            return seen[key], name
        seen[key] = name
    raise AssertionError("the fixture has no two tensors of one shape")


@pytest.mark.timeout(120)
def test_dcp_tensor_pointing_at_another_tensors_bytes_is_refused(tmp_path):
    """Tensor b's storage entries set to a's file/offset/length: before, ``convert`` succeeded
    and b restored with a's values. Now an error naming both tensors and the file."""
    src = copy_fixture(tmp_path, "torch/fsdp2_fp32", name="fsdp2_fp32")
    tensors, objects = read_layout(src)
    a, b = _same_shape_pair(tensors)
    for ca, cb in zip(tensors[a]["chunks"], tensors[b]["chunks"]):
        cb.update(file=ca["file"], offset=ca["offset"], length=ca["length"])
    write_layout(src, tensors, objects)
    dst = tmp_path / "out"
    with pytest.raises(
        jax_ucp.UCPError,
        match=rf"\.metadata: tensor '({a}|{b})' \(chunk at offsets \[\d+(, \d+)*\]\) and "
        rf"tensor '({a}|{b})' \(chunk at offsets .*\) share bytes \[\d+, \d+\) of storage file "
        r"__\d_0\.distcp",
    ) as e:
        jax_ucp.convert(src, dst)
    assert a in str(e.value) and b in str(e.value)
    assert_destination_untouched(dst)


@pytest.mark.timeout(120)
def test_dcp_entries_overlapping_in_part_across_tensors_are_refused(tmp_path):
    """An entry lying inside a longer one of another tensor (not equal to it) is found too;
    adjacent entries, and equal ranges of two files, are fine."""
    from jax_ucp._src.torchfiles.dcp import DcpChunk, DcpTensor, check_disjoint

    f32 = np.dtype(np.float32)
    tensors = {
        "a": DcpTensor("a", (100,), f32, (DcpChunk((0,), (100,), "__0_0.distcp", 0, 400),)),
        "c": DcpTensor("c", (2,), f32, (DcpChunk((0,), (2,), "__0_0.distcp", 8, 8),)),
        "d": DcpTensor("d", (2,), f32, (DcpChunk((0,), (2,), "__1_0.distcp", 8, 8),)),
    }
    with pytest.raises(SourceError, match=r"tensor 'a' .* and tensor 'c' .* share bytes \[8, 16\)"):
        check_disjoint(tensors, {}, "m")
    tensors["c"] = DcpTensor("c", (2,), f32, (DcpChunk((0,), (2,), "__0_0.distcp", 400, 8),))
    check_disjoint(tensors, {}, "m")  # adjacent, and equal ranges in two files: fine


@pytest.mark.timeout(60)
def test_dcp_disjoint_verdict_matches_a_brute_force_pairwise_check():
    """Random storage entries (tensors' chunks and objects over 3 files, some empty): an error
    exactly when some two entries share a byte, naming two entries that do."""
    from jax_ucp._src.torchfiles.dcp import DcpChunk, DcpObject, DcpTensor, check_disjoint

    rng = np.random.default_rng(3)
    f32 = np.dtype(np.float32)
    verdicts = set()
    for _ in range(400):
        spans = [
            (f"__{rng.integers(3)}_0.distcp", int(rng.integers(0, 60)), int(rng.integers(0, 8)))
            for _ in range(int(rng.integers(2, 9)))
        ]
        tensors, objects = {}, {}
        for k, (file, offset, length) in enumerate(spans):
            if k % 3 == 2:
                objects[f"o{k}"] = DcpObject(f"o{k}", file, offset, length)
            else:
                chunk = DcpChunk((k,), (1,), file, offset, length)
                tensors[f"t{k}"] = DcpTensor(f"t{k}", (len(spans),), f32, (chunk,))
        shared = {
            (a, b)
            for a in range(len(spans))
            for b in range(len(spans))
            if a < b
            and spans[a][0] == spans[b][0]
            and max(spans[a][1], spans[b][1])
            < min(spans[a][1] + spans[a][2], spans[b][1] + spans[b][2])
        }
        try:
            check_disjoint(tensors, objects, "m")
        except SourceError as e:
            named = {int(n[1:]) for n in re.findall(r"'([ot]\d+)'", str(e))}
            assert any(set(pair) == named for pair in shared), (spans, str(e))
            verdicts.add("shared")
        else:
            assert not shared, spans
            verdicts.add("disjoint")
    assert verdicts == {"shared", "disjoint"}


@pytest.mark.timeout(60)
def test_region_reads_equal_slices_of_the_whole_tensor(tmp_path, monkeypatch):
    """``DcpCheckpoint.region_jobs`` (a direct restore's reads of a torch_dist tensor, no row
    built first) fills random boxes, several at once, as slices of the tensor do: chunks of a
    random tiling, raw bytes and ``torch.save`` archives alternating, read in slabs of a few
    bytes (``READ_PIECE`` lowered to 16) so slabs start inside rows and inside chunks."""
    from jax_ucp._src.torchfiles import torch_zip

    monkeypatch.setattr(dcp, "READ_PIECE", 16)
    rng = np.random.default_rng(3)
    for shape in [(5, 7, 6), (9, 11), (13,)]:
        whole = np.arange(np.prod(shape), dtype=np.float32).reshape(shape)
        chunks = []
        with open(tmp_path / "__0_0.distcp", "wb") as f:
            for i, (offsets, sizes) in enumerate(_grid(shape, rng)):
                part = whole[tuple(slice(o, o + s) for o, s in zip(offsets, sizes))]
                at = f.tell()
                if i % 2:
                    length = torch_zip.write_torch_save(f, array=np.ascontiguousarray(part))
                else:
                    length = f.write(part.tobytes())
                chunks.append(DcpChunk(tuple(offsets), tuple(sizes), "__0_0.distcp", at, length))
        t = DcpTensor("w", shape, np.dtype(np.float32), tuple(chunks))
        ck = dcp.DcpCheckpoint(dcp.folder(tmp_path), {"w": t}, {})
        for _ in range(20):
            dests = []
            for _ in range(int(rng.integers(1, 4))):
                lows = [int(rng.integers(0, n)) for n in shape]
                region = [(a, int(rng.integers(a + 1, n + 1))) for a, n in zip(lows, shape)]
                dests.append((tuple(region), np.full([b - a for a, b in region], -1, np.float32)))
            for job in ck.region_jobs("w", dests):
                job()
            for region, out in dests:
                np.testing.assert_array_equal(out, whole[tuple(slice(a, b) for a, b in region)])


def test_tensors_read_by_a_reader_replace_the_files_within_its_block_only():
    """``dcp.tensors_read_by`` (verify's hook for torch's own ``dcp.load``): within it every
    tensor read, whole or by rows, is the reader's; after it, the files' bytes again."""
    ckpt = dcp.open_dcp(os.path.join(FIXTURES, "torch", "fsdp2_fp32"))
    name, t = next((n, t) for n, t in sorted(ckpt.tensors.items()) if len(t.shape) == 2)
    files = ckpt.read(name)
    asked = []

    def reader(path, tensor, start, stop):
        asked.append((path, tensor, start, stop))
        return files[start:stop] + 1

    with dcp.tensors_read_by(reader):
        np.testing.assert_array_equal(ckpt.read(name), files + 1)
        np.testing.assert_array_equal(ckpt.read_rows(name, 1, 2), files[1:2] + 1)
    assert asked == [(str(ckpt.path), name, 0, t.shape[0]), (str(ckpt.path), name, 1, 2)]
    np.testing.assert_array_equal(ckpt.read(name), files)


def test_region_reads_of_a_whole_archive_chunk_check_its_crc_without_a_copy(tmp_path, monkeypatch):
    """A ``torch.save`` chunk a direct restore cuts between devices is read slab by slab
    straight into them (never whole, then copied) and its zip CRC-32 checked over its bytes in
    file order: one flipped byte in its last slab is an error naming the chunk's file."""
    from jax_ucp._src.torchfiles import torch_zip

    monkeypatch.setattr(dcp, "READ_PIECE", 16)
    monkeypatch.setattr(dcp, "SMALL", 0)  # (so small a chunk is otherwise read whole)
    whole = np.arange(48, dtype=np.float32).reshape(6, 8)
    with open(tmp_path / "__0_0.distcp", "wb") as f:
        length = torch_zip.write_torch_save(f, array=whole)
    chunk = DcpChunk((0, 0), (6, 8), "__0_0.distcp", 0, length)
    ck = dcp.DcpCheckpoint(
        dcp.folder(tmp_path), {"w": DcpTensor("w", (6, 8), whole.dtype, (chunk,))}, {}
    )
    monkeypatch.setattr(ck, "read_chunk", None)  # the whole chunk is never read

    def read() -> np.ndarray:
        dests = [(((0, 6), (a, a + 4)), np.full((6, 4), -1, np.float32)) for a in (0, 4)]
        for job in ck.region_jobs("w", dests):
            job()
        return np.concatenate([out for _, out in dests], axis=1)

    np.testing.assert_array_equal(read(), whole)
    data = bytearray((tmp_path / "__0_0.distcp").read_bytes())
    data[data.find(whole.tobytes()) + 4 * 45] ^= 0xFF
    (tmp_path / "__0_0.distcp").write_bytes(bytes(data))
    with pytest.raises(SourceError, match=r"'w'.*__0_0\.distcp.*CRC-32 mismatch"):
        read()
