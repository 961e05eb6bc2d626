"""Benchmark: the same save to ``s3://`` with jax_ucp and with Orbax's ``StandardCheckpointer``,
against moto's S3 server started here on 127.0.0.1 (stopped after), beside the same save to a
local directory. Prints each contender's time (median of ``--rounds``) or its error.

    python benchmarks/bench_object_store.py --mib 256 --rounds 3 --json docs/benchmark_object_store.json

moto keeps objects in memory in one Python process, so the S3 figures measure the protocol and
this machine's CPU, not a real object store's bandwidth.
"""

from __future__ import annotations

import argparse
import os
import shutil
import socket
import statistics
import subprocess
import tempfile
import time
import urllib.request

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mib", type=int, default=256, help="total tensor bytes")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json", default=None, help="write the figures here")
    a = ap.parse_args()
    port = _free_port()
    server = subprocess.Popen(
        [shutil.which("moto_server"), "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        for _ in range(200):
            with socket.socket() as s:
                if s.connect_ex(("127.0.0.1", port)) == 0:
                    break
            time.sleep(0.05)
        endpoint = f"http://127.0.0.1:{port}"
        os.environ.update(
            AWS_ACCESS_KEY_ID="bench",
            AWS_SECRET_ACCESS_KEY="bench",
            AWS_REGION="us-east-1",
            AWS_ENDPOINT_URL=endpoint,
        )
        urllib.request.urlopen(urllib.request.Request(f"{endpoint}/bench", method="PUT"))
        run(a.mib, a.rounds, a.json)
    finally:
        server.terminate()
        server.wait(timeout=30)


def run(mib: int, rounds: int, json_path: str | None) -> None:
    import json
    import platform

    import jax
    import numpy as np
    import orbax.checkpoint as ocp
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    import jax_ucp

    mesh = Mesh(np.array(jax.devices()).reshape(2, 4), ("x", "y"))
    n = max(1, mib // 16)  # 16 MiB fp32 tensors
    rng = np.random.default_rng(0)
    tree = {
        f"w{i}": jax.device_put(
            rng.standard_normal((2048, 2048), dtype=np.float32), NamedSharding(mesh, P("x", "y"))
        )
        for i in range(n)
    }
    local = tempfile.mkdtemp(prefix="bench_os_")
    times: dict[str, list[float]] = {}
    errors: dict[str, str] = {}

    def timed(name, fn):
        if name in errors:
            return
        t = time.perf_counter()
        try:
            fn()
        except Exception as e:  # noqa: BLE001 - the point is to show what fails
            errors[name] = f"{type(e).__name__}: {str(e)[:160]}"
            return
        times.setdefault(name, []).append(time.perf_counter() - t)

    def orbax_save(path):
        with ocp.StandardCheckpointer() as ckptr:
            ckptr.save(path, tree)
            ckptr.wait_until_finished()

    # restored onto the transposed mesh: every device reads other slices than were written
    new_mesh = Mesh(np.array(jax.devices()).reshape(4, 2), ("x", "y"))
    target = {
        k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=NamedSharding(new_mesh, P("y", "x")))
        for k, v in tree.items()
    }

    def restore(path):
        jax.block_until_ready(jax_ucp.restore(path, target=target))

    for r in range(rounds):
        timed("jax_ucp -> s3://", lambda: jax_ucp.save(f"s3://bench/ucp-{r}", tree))
        timed("Orbax StandardCheckpointer -> s3://", lambda: orbax_save(f"s3://bench/orbax-{r}"))
        timed("jax_ucp -> local dir", lambda: jax_ucp.save(os.path.join(local, f"u{r}"), tree))
        timed("Orbax -> local dir", lambda: orbax_save(os.path.join(local, f"o{r}")))
        timed("jax_ucp s3:// -> 4x2 mesh", lambda: restore(f"s3://bench/ucp-{r}"))
        timed("jax_ucp local dir -> 4x2 mesh", lambda: restore(os.path.join(local, f"u{r}")))
    shutil.rmtree(local, ignore_errors=True)
    back = jax_ucp.restore("s3://bench/ucp-0")
    exact = all(np.asarray(back[k]).tobytes() == np.asarray(v).tobytes() for k, v in tree.items())
    print(f"{n} x 16 MiB fp32 tensors on a 2x4 mesh, median of {rounds}:")
    names = (
        "jax_ucp -> s3://",
        "Orbax StandardCheckpointer -> s3://",
        "jax_ucp -> local dir",
        "Orbax -> local dir",
        "jax_ucp s3:// -> 4x2 mesh",
        "jax_ucp local dir -> 4x2 mesh",
    )
    for name in names:
        if name in errors:
            print(f"  {name:38} fails: {errors[name]}")
        else:
            print(f"  {name:38} {statistics.median(times[name]):7.2f} s")
    print(f"  jax_ucp's s3:// checkpoint restored bit-exact: {exact}")
    if json_path:
        result = {
            "date": time.strftime("%Y-%m-%d"),
            "machine": f"{platform.machine()}, {os.cpu_count()} cores",
            "tensors": n,
            "tensor_bytes": 2048 * 2048 * 4,
            "rounds": rounds,
            "median_seconds": {k: statistics.median(v) for k, v in times.items()},
            "errors": errors,
            "bit_exact": exact,
        }
        with open(json_path, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
