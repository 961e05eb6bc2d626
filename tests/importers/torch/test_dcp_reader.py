"""The DCP chunk-coverage check (``dcp_reader.check_coverage``, shared by the Megatron
torch_dist and plain torch DCP importers): exact, and O(n log n) in the chunk count.

Before, overlaps were found by comparing every chunk with every later one: a ``.metadata``
declaring one tensor in 10**5 tiny chunks took minutes (measured: 227 s) before any error.
Each chunk set here is built by the test; its verdict is compared with a brute-force count of
how many chunks hold each element."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from jax_ucp.importers.torch import dcp_reader
from jax_ucp.importers.torch.dcp_reader import DcpChunk, DcpError, DcpTensor


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
    for cell in itertools.product(*[list(zip(c, c[1:])) for c in cuts]):
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
        dcp_reader.check_coverage(_tensor(shape, boxes), "m")
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
            dcp_reader.check_coverage(t, "m")
            continue
        with pytest.raises(DcpError) as error:
            dcp_reader.check_coverage(t, "m")
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


@pytest.mark.timeout(30)
def test_hundred_thousand_tiny_chunks_are_checked_in_n_log_n():
    """One [1000, 100] tensor declared as 10**5 one-element chunks: a tiling, accepted; the same
    with the last chunk moved onto the first, refused naming both chunks and the element (the
    pairwise check took 227 s on this input; the test's timeout is 30 s)."""
    n = 100_000
    boxes = [((i // 100, i % 100), (1, 1)) for i in range(n)]
    dcp_reader.check_coverage(_tensor((n // 100, 100), boxes), "m")
    boxes[-1] = ((0, 0), (1, 1))
    with pytest.raises(
        DcpError,
        match=r"tensor 'w': overlapping shards: \[0, 0\]\+\[1, 1\] in __0_0\.distcp and "
        r"\[0, 0\]\+\[1, 1\] in __0_0\.distcp both hold element \[0, 0\] \(m\)",
    ):
        dcp_reader.check_coverage(_tensor((n // 100, 100), boxes), "m")


@pytest.mark.timeout(30)
def test_gap_and_overlap_with_the_right_element_count_are_found():
    """Element counts that add up are not enough: chunks of rows 0-2 and of row 2 of a 4-row
    tensor overlap on row 2 and leave row 3 out (8 of 8 elements); chunks of rows 1-3 and of
    row 3 leave row 0 out, which the error names."""
    with pytest.raises(DcpError, match=r"overlapping shards: \[0, 0\]\+\[3, 2\] .* \[2, 0\]\+"):
        dcp_reader.check_coverage(_tensor((4, 2), [((0, 0), (3, 2)), ((2, 0), (1, 2))]), "m")
    with pytest.raises(
        DcpError,
        match=r"incomplete shard coverage: chunks hold 8 of 8 elements of shape \[4, 2\] "
        r".*; element \[0, 0\] is in no chunk",
    ):
        dcp_reader.check_coverage(_tensor((4, 2), [((1, 0), (3, 2)), ((3, 0), (1, 2))]), "m")


@pytest.mark.timeout(30)
def test_chunks_split_along_too_many_dimensions_are_refused():
    """The check's work is chunks x 2**(dimensions they split): a tensor of 2**12 chunks split
    along 12 dimensions is refused by name before any large allocation."""
    shape = [2] * 12
    boxes = [(list(corner), [1] * 12) for corner in itertools.product((0, 1), repeat=12)]
    with pytest.raises(
        DcpError,
        match=r"tensor 'w' in m: 4096 chunks split along 12 dimensions: too many to check that "
        r"they tile the tensor \(16781312 corners, at most 2581110\)",
    ):
        dcp_reader.check_coverage(_tensor(shape, boxes), "m")
