"""``sharding.assemble``: the host buffers a restore reads into."""

from __future__ import annotations

import sys

import numpy as np
import pytest

from jax_ucp._src.sharding.assemble import aligned_empty


def _vm_flags(address: int) -> list[str]:
    """The ``VmFlags`` of the mapping of this process holding ``address``."""
    inside = False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                start, stop = (int(x, 16) for x in head.split("-"))
                inside = start <= address < stop
            elif inside and head == "VmFlags:":
                return line.split()[1:]
    raise AssertionError(f"no mapping holds {address:#x}")


def _numpy_advises_huge_pages() -> bool:
    try:
        from numpy._core.multiarray import _get_madvise_hugepage
    except ImportError:  # numpy < 2
        from numpy.core.multiarray import _get_madvise_hugepage
    return bool(_get_madvise_hugepage())


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc/self/smaps is Linux's")
def test_large_buffer_not_advised_huge_pages():
    # numpy madvises huge pages on its buffers of 4 MiB and up; with THP defrag=madvise a fault
    # there may compact memory first: a restore's fresh buffers keep the system's own policy
    if not _numpy_advises_huge_pages():
        pytest.skip("this numpy does not advise huge pages")
    out = aligned_empty((3, 1 << 20), np.float32)  # 12 MiB
    out[...] = 1.5
    middle = out.ctypes.data + out.nbytes // 2  # numpy advises from the first 2 MiB boundary
    assert "hg" not in _vm_flags(middle)
    assert out.ctypes.data % 64 == 0 and out.flags.c_contiguous and out.flags.writeable
    assert out.shape == (3, 1 << 20) and out.dtype == np.float32
    assert float(out[2, -1]) == 1.5


@pytest.mark.parametrize("shape", [(0,), (5, 3), (1 << 20, 2), (2, 3, 1 << 18)])
@pytest.mark.parametrize("dtype", [np.float32, np.uint8, np.float64])
def test_aligned_shapes_and_dtypes(shape, dtype):
    out = aligned_empty(shape, dtype)
    assert out.shape == shape and out.dtype == dtype
    assert out.flags.c_contiguous and out.flags.writeable
    assert out.size == 0 or out.ctypes.data % 64 == 0
    out[...] = 7
    assert out.size == 0 or int(out.reshape(-1)[-1]) == 7
