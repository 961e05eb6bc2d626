"""How a restore reads an inner chunk cut between devices (issue 69, item 2): (a) ``preadv`` into
the reader thread's reused scratch buffer, crc32c over it, a numpy copy into each device's rows
(``ShardReader._read_part`` today) against (b) ``preadv`` with one iovec per (row, device)
segment straight into the device buffers (at most ``IOV_MAX`` per call), crc32c carried over the
segments in file order. Chunks of 256 full rows of 4096 float32 (4 MiB, ``bench_scale``'s
single-device layout), read from the page cache, cut over 2 or 4 devices along the columns.
Prints wall and process CPU (user + sys) per GB, alternating, with the load average.

    python benchmarks/bench_cut_chunks.py --rounds 3
"""

from __future__ import annotations

import argparse
import os
import resource
import tempfile
import time

import crc32c
import numpy as np

ROWS, COLS, CHUNKS = 256, 4096, 64  # 64 chunks of 4 MiB: 256 MiB
CHUNK = ROWS * COLS * 4


def scratch_copy(fd: int, devices: int) -> list[np.ndarray]:
    outs = [np.empty((ROWS * CHUNKS, COLS // devices), np.float32) for _ in range(devices)]
    w, buf = COLS // devices, np.empty((ROWS, COLS), np.float32)
    view = memoryview(buf.reshape(-1).view(np.uint8))
    for k in range(CHUNKS):
        os.preadv(fd, [view], k * CHUNK)
        crc32c.crc32c(view)
        for d, out in enumerate(outs):
            out[k * ROWS : (k + 1) * ROWS] = buf[:, d * w : (d + 1) * w]
    return outs


def iovecs(fd: int, devices: int) -> list[np.ndarray]:
    outs = [np.empty((ROWS * CHUNKS, COLS // devices), np.float32) for _ in range(devices)]
    w, most = (COLS // devices) * 4, os.sysconf("SC_IOV_MAX")
    views = [memoryview(o.reshape(-1).view(np.uint8)) for o in outs]
    for k in range(CHUNKS):
        at = k * ROWS * w
        segs = [v[at + r * w : at + (r + 1) * w] for r in range(ROWS) for v in views]
        for s in range(0, len(segs), most):
            os.preadv(fd, segs[s : s + most], k * CHUNK + s * w)
        crc = 0
        for seg in segs:
            crc = crc32c.crc32c(seg, crc)
    return outs


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    with tempfile.NamedTemporaryFile(dir=os.environ.get("TMPDIR", "/tmp")) as f:
        f.write(np.random.default_rng(0).integers(0, 255, CHUNK * CHUNKS, np.uint8).tobytes())
        f.flush()
        fd = os.open(f.name, os.O_RDONLY)
        scale = 1e9 / (CHUNK * CHUNKS)
        for r in range(args.rounds):
            for name, fn in [("scratch + copy", scratch_copy), ("iovec per segment", iovecs)]:
                for devices in (2, 4):
                    u, t = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
                    fn(fd, devices)
                    wall, e = time.perf_counter() - t, resource.getrusage(resource.RUSAGE_SELF)
                    cpu = e.ru_utime + e.ru_stime - u.ru_utime - u.ru_stime
                    print(
                        f"round {r} {name:18s} {devices} devices: {wall * scale:.3f} s/GB wall, "
                        f"{cpu * scale:.3f} CPU-s/GB (sys {(e.ru_stime - u.ru_stime) * scale:.3f}),"
                        f" load {os.getloadavg()[0]:.1f}"
                    )
        os.close(fd)


if __name__ == "__main__":
    main()
