"""Checks ``bench_plan_scale.py``'s replay of a restore's reads against the real reader.

A small real checkpoint (three float32 tensors saved from ``fsdp=4 × tensor=2`` on 8 CPU
devices, with 16 KiB and 4 MiB inner chunks) is (1) restored whole onto three meshes by
``jax_ucp.restore`` and (2) read in sub-regions, as one process of many would, by
``store.shard_reader.ShardReader``; every shard-file open, pread and byte is counted (the
reader's ``files.open_regular`` and ``_preadv_exact`` wrapped) and compared with
``bench_plan_scale.reads_of``. Exits non-zero on a difference.

    python benchmarks/check_plan_replay.py
"""

from __future__ import annotations

import contextlib
import os
import shutil
import sys
import tempfile

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

import bench_plan_scale as bench  # noqa: E402
import jax  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import jax_ucp  # noqa: E402
from jax_ucp._src import format as fmt  # noqa: E402
from jax_ucp._src.format import files  # noqa: E402
from jax_ucp._src.store import shard_reader  # noqa: E402

RULES = (("embed", "fsdp"), ("mlp", "tensor"))


@contextlib.contextmanager
def counted():
    """Counts shard-file opens, preads and bytes pread while inside."""
    counts = {"opens": 0, "requests": 0, "bytes": 0}
    real_open, real_preadv = files.open_regular, shard_reader._preadv_exact

    def open_regular(path, *args, **kwargs):
        counts["opens"] += 1
        return real_open(path, *args, **kwargs)

    def preadv(fd, buffers, offset, path):
        counts["requests"] += 1
        counts["bytes"] += sum(memoryview(b).nbytes for b in buffers)
        return real_preadv(fd, buffers, offset, path)

    files.open_regular, shard_reader._preadv_exact = open_regular, preadv
    try:
        yield counts
    finally:
        files.open_regular, shard_reader._preadv_exact = real_open, real_preadv


def main() -> int:
    devices = np.array(jax.devices())
    save_mesh = Mesh(devices.reshape(4, 2), ("fsdp", "tensor"))
    rng = np.random.default_rng(0)

    def put(shape, spec):
        return jax.device_put(
            rng.standard_normal(shape, dtype=np.float32), NamedSharding(save_mesh, spec)
        )

    tree = {
        "params": {
            "w": put((256, 512), P("fsdp", "tensor")),
            "o": put((512, 256), P("tensor", "fsdp")),
            "n": put((256,), P("fsdp")),
        }
    }
    logical = {"params": {"w": ("embed", "mlp"), "o": ("mlp", "embed"), "n": ("embed",)}}
    tmp = tempfile.mkdtemp(prefix="ucp_replay_check_")
    failures = 0
    try:
        for inner in (16 << 10, 4 << 20):
            path = os.path.join(tmp, f"inner{inner}")
            jax_ucp.save(path, tree, logical_axes=logical, inner_chunk_bytes=inner)
            manifest = fmt.read_manifest_file(path)
            for axes in ((("fsdp", 8), ("tensor", 1)), (("fsdp", 2), ("tensor", 4))):
                mesh = Mesh(devices.reshape([s for _, s in axes]), tuple(a for a, _ in axes))
                with counted() as real:
                    out = jax.block_until_ready(jax_ucp.restore(path, mesh=mesh, rules=RULES))
                for k, v in tree["params"].items():
                    assert np.array_equal(np.asarray(out["params"][k]), np.asarray(v))
                real["opens"] -= 1  # ucp.json, counted apart (metadata) by the replay
                result = jax_ucp.plan(path, mesh=bench.abstract_mesh(axes), rules=RULES)
                zarr = {e.key: 0 for e in manifest.tensors}
                (row,) = bench.replay(manifest, result, axes, 1, [0], zarr, 0)
                failures += report(f"restore, inner {inner}, {axes}", real, row)
            for e in manifest.tensors:
                full = [tuple((0, n) for n in e.shape)]
                cases = [
                    [tuple((0, max(1, n // 16)) for n in e.shape)],
                    [((16, 32), *full[0][1:])],
                    [((0, 16), *full[0][1:]), ((32, 48), *full[0][1:])],
                ]
                for regions in cases:
                    layout = bench.entry_layout(e)
                    reader = shard_reader.ShardReader(
                        os.path.join(path, e.dir),
                        layout,
                        np.dtype(e.dtype),
                        digests=e.shard_digests,
                        root=path,
                    )
                    dests = [(r, np.empty(tuple(b - a for a, b in r), np.float32)) for r in regions]
                    with counted() as real:
                        reader.read_into(dests).result()
                    failures += report(
                        f"regions {regions} of {e.name}, inner {inner}",
                        real,
                        bench.reads_of(e, regions),
                    )
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print("replay matches the reader" if not failures else f"{failures} differences")
    return 1 if failures else 0


def report(what: str, real: dict, replayed: dict) -> int:
    same = all(real[k] == replayed[k] for k in real)
    shown = {k: replayed[k] for k in real}
    print(f"{'ok  ' if same else 'DIFF'} {what}: reader {real}, replay {shown}")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
