"""Benchmark: the same save to ``s3://`` with jax_ucp and with Orbax's ``StandardCheckpointer``,
against moto's S3 server started here on 127.0.0.1 (stopped after), beside the same save to a
local directory. Prints each contender's time (median of ``--rounds``) or its error.

    python benchmarks/bench_object_store.py --mib 256 --rounds 3 --json docs/benchmark_object_store.json

moto keeps objects in memory in one Python process, so the S3 figures measure the protocol and
this machine's CPU, not a real object store's bandwidth. ``--latency-ms 30`` puts a proxy in front
of it that holds every response that long (a real store's time to first byte), which is what
requests issued one after another pay for. The restores from ``s3://`` (onto the transposed mesh,
``select=`` half the tensors, the same one by TensorStore with the digest sweep it had before,
and a torch DCP folder of the same tensors restored directly) alternate with bare loops fetching
the same objects (whole, one GET each, all at once; for the DCP object also by ranged GETs as
``ranged.fetch_ranges`` issues them), and both restores as one process of two sees them (its
devices hold the first half of every tensor's rows) beside loops fetching just that share, with the bytes and HTTP requests each fetched, and the CPU
seconds (user + system) this process, moto's and the proxy's spent during each: moto and the
proxy run on the same cores as the client. ``--pin`` puts moto and the proxy on the first core
and this process on the others (``os.sched_setaffinity``), so that they do not compete.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_for_port(port: int) -> None:
    for _ in range(200):
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.05)


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds process ``pid`` (every thread) has spent so far."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def delay_proxy(listen: int, target: int, seconds: float) -> None:
    """A TCP proxy on 127.0.0.1 that holds the first bytes of each response ``seconds``: a
    request's time to first byte, whatever its size (bodies then flow at full speed)."""
    import asyncio

    async def handle(client_reader, client_writer):
        server_reader, server_writer = await asyncio.open_connection("127.0.0.1", target)
        asked = asyncio.Event()  # the client sent bytes the server has not answered yet

        async def upstream():
            while data := await client_reader.read(1 << 16):
                asked.set()
                server_writer.write(data)
                await server_writer.drain()
            server_writer.close()

        async def downstream():
            while data := await server_reader.read(1 << 16):
                if asked.is_set():
                    asked.clear()
                    await asyncio.sleep(seconds)
                client_writer.write(data)
                await client_writer.drain()
            client_writer.close()

        with contextlib.suppress(OSError):
            await asyncio.gather(upstream(), downstream())

    async def serve():
        server = await asyncio.start_server(handle, "127.0.0.1", listen)
        async with server:
            await server.serve_forever()

    asyncio.run(serve())


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mib", type=int, default=256, help="total tensor bytes")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json", default=None, help="write the figures here")
    ap.add_argument("--latency-ms", type=float, default=0, help="added to every S3 request")
    ap.add_argument(
        "--only",
        default="",
        help="run only the contenders whose name this regex finds (the save to s3:// runs anyway)",
    )
    ap.add_argument(
        "--pin",
        action="store_true",
        help="moto and the proxy on the first core, this process on the others",
    )
    ap.add_argument(
        "--proxy", nargs=3, metavar=("LISTEN", "TARGET", "SECONDS"), help=argparse.SUPPRESS
    )
    a = ap.parse_args()
    if a.proxy:
        return delay_proxy(int(a.proxy[0]), int(a.proxy[1]), float(a.proxy[2]))
    cores = sorted(os.sched_getaffinity(0))
    if a.pin and len(cores) < 2:
        ap.error(f"--pin needs 2 cores, this process may run on {cores}")
    server_cores = cores[:1] if a.pin else cores
    if a.pin:  # before any thread starts: they inherit it
        os.sched_setaffinity(0, cores[1:])
    port = _free_port()
    server = subprocess.Popen(
        [shutil.which("moto_server"), "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    os.sched_setaffinity(server.pid, server_cores)
    servers = {"moto": server.pid}
    proxy = None
    try:
        _wait_for_port(port)
        endpoint = f"http://127.0.0.1:{port}"
        os.environ.update(
            AWS_ACCESS_KEY_ID="bench",
            AWS_SECRET_ACCESS_KEY="bench",
            AWS_REGION="us-east-1",
            AWS_ENDPOINT_URL=endpoint,
        )
        urllib.request.urlopen(urllib.request.Request(f"{endpoint}/bench", method="PUT"))
        if a.latency_ms:
            proxy_port = _free_port()
            cmd = [sys.executable, __file__, "--proxy", str(proxy_port), str(port)]
            proxy = subprocess.Popen([*cmd, str(a.latency_ms / 1000)])
            os.sched_setaffinity(proxy.pid, server_cores)
            servers["proxy"] = proxy.pid
            _wait_for_port(proxy_port)
            os.environ["AWS_ENDPOINT_URL"] = f"http://127.0.0.1:{proxy_port}"
        run(a.mib, a.rounds, a.json, a.latency_ms, servers, a.pin, a.only)
    finally:
        if proxy is not None:
            proxy.terminate()
        server.terminate()
        server.wait(timeout=30)


def run(
    mib: int,
    rounds: int,
    json_path: str | None,
    latency_ms: float = 0,
    servers: dict[str, int] | None = None,
    pinned: bool = False,
    only: str = "",
) -> None:
    import json
    import platform
    import re

    import jax
    import numpy as np
    import orbax.checkpoint as ocp
    import tensorstore as ts
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    import jax_ucp
    from jax_ucp._src.restoring.sources import ucp_source
    from jax_ucp._src.store import storage as jax_ucp_storage
    from jax_ucp._src.store.storage import object_store, ranged
    from jax_ucp._src.torchfiles import dcp

    def s3_counters() -> tuple[float, float]:
        """(bytes read from s3, HTTP requests started) by TensorStore in this process so far
        (a ``ts.Batch`` of ranges of one object is one request each: measured)."""
        got = {"/tensorstore/kvstore/s3/bytes_read": 0.0, "/tensorstore/http/request_started": 0.0}
        for m in ts.experimental_collect_matching_metrics("/tensorstore/"):
            if m["name"] in got:
                got[m["name"]] += sum(v.get("value", 0) for v in m.get("values", []))
        return tuple(got.values())

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
        if name in errors or (name != "jax_ucp -> s3://" and not re.search(only, name)):
            return
        t = time.perf_counter()
        try:
            fn()
        except Exception as e:  # the point is to show what fails
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

    def restore(path, **kw):
        jax.block_until_ready(jax_ucp.restore(path, target=target, **kw))

    def direct(path):  # an import's tensors are its params
        jax.block_until_ready(jax_ucp.restore(path, target={"params": target}))

    def restore_by_tensorstore(path):
        """The restore as before issue 69's round 9: TensorStore reads every array, each shard
        object's digest checked first in a sweep of its own (``verify_shard_objects``)."""
        real = ucp_source.CheckpointSource._objects_read
        ucp_source.CheckpointSource._objects_read = lambda self, found: False
        try:
            restore(path)
        finally:
            ucp_source.CheckpointSource._objects_read = real

    half = "w(" + "|".join(str(i) for i in range(n // 2 or 1)) + ")"  # select=: half the tensors

    def restore_half(path):
        jax.block_until_ready(jax_ucp.restore(path, select=half))

    from jax._src import sharding as jax_sharding

    @contextlib.contextmanager
    def one_process_of_two():
        """The restore as process 0 of a 2-process job sees it, simulated in this one: its
        addressable devices are those holding the first half of each tensor's rows (the
        others are process 1's), and its arrays are the shards it read (a list per tensor)."""
        real_map, real_make = (
            jax_sharding._addressable_devices_indices_map,
            jax.make_array_from_single_device_arrays,
        )

        def share(sharding, shape):
            every = real_map(sharding, shape)
            return {d: i for d, i in every.items() if not shape or (i[0].start or 0) == 0}

        jax_sharding._addressable_devices_indices_map = share
        jax.make_array_from_single_device_arrays = lambda shape, sharding, singles: singles
        try:
            yield
        finally:
            jax_sharding._addressable_devices_indices_map = real_map
            jax.make_array_from_single_device_arrays = real_make

    def share_restore(path):
        with one_process_of_two():
            restore(path)

    def share_direct(path):
        with one_process_of_two():
            direct(path)

    def bare_loop(path, names=None, keep=None):
        """Every object of the checkpoint (or those of tensors ``names``) fetched whole, one GET
        each, all in flight at once through TensorStore's s3 driver (its request concurrency
        the restore's): what the restore's reads cost with nothing else done."""
        kv = ts.KvStore.open(jax_ucp_storage.storage_for(path).kvstore()).result()
        keys = [k.decode() for k in kv.list().result()]
        if names is not None:
            keys = [k for k in keys if not k.startswith("arrays/") or k.split("/")[1] in names]
        if keep is not None:
            keys = [k for k in keys if keep(k)]
        for got in [kv.read(k) for k in keys]:
            got.result()

    def ranged_loop(path, sizes, ranges=None):
        """Every object ``sizes`` names (name -> bytes) fetched by ranged GETs of
        ``ranged.PIECE`` bytes, at most ``ranged.IN_FLIGHT`` bytes in flight
        (``ranged.fetch_ranges``, what a direct restore's reads go through), nothing else done:
        moto reads a whole object for every ranged GET, so whole-object GETs are no bound for
        reads by ranges of one large object. ``ranges`` (name -> [(start, stop)]): those bytes
        alone."""
        storage = jax_ucp_storage.storage_for(path)
        for name, size in sizes.items():
            kv, key = ranged.opened(storage, name)
            wanted = ranges[name] if ranges is not None else [(0, size)]
            ranged.fetch_ranges(kv, key, wanted, lambda at, n, got: None)

    fetched: dict[str, list[tuple[float, float]]] = {}
    load = [os.getloadavg()[0]]  # at the start and after each round
    servers = servers or {}
    cpu: dict[str, list[dict[str, float]]] = {}  # per contender and round: who spent what

    def cpu_now() -> dict[str, float]:
        return {"client": time.process_time()} | {k: cpu_seconds(p) for k, p in servers.items()}

    def counted(name, fn, needed):
        """``fn`` timed, the s3 bytes and GETs it fetched (TensorStore's counters) per byte of
        the slices it needed, and the CPU seconds this process and each server spent."""
        before, was = s3_counters(), cpu_now()
        timed(name, fn)
        after, now = s3_counters(), cpu_now()
        if name not in times:
            return
        got = after[0] - before[0], after[1] - before[1]
        fetched.setdefault(name, []).append((got[0] / needed, got[1]))
        cpu.setdefault(name, []).append({k: now[k] - was[k] for k in now})

    dcp_url = "s3://bench/dcp"
    # the same tensors as a torch DCP folder (one .distcp, as one rank's dcp.save writes),
    # restored straight from s3:// (a "direct restore")
    folder = os.path.join(local, "dcp")
    os.makedirs(folder)
    items = [dcp.DcpItem(k, (k,), (2048, 2048), np.dtype(np.float32)) for k in tree]
    dcp.write_dcp(folder, items, (np.asarray(v) for v in tree.values()), save_id="bench")
    dcp_sizes = {name: os.path.getsize(os.path.join(folder, name)) for name in os.listdir(folder)}
    for name in dcp_sizes:
        with open(os.path.join(folder, name), "rb") as f:
            object_store.write(dcp_url, name, f.read())
    # process 0's share of the DCP object: the first half of each tensor's rows (row-major)
    opened_dcp = dcp.open_dcp(folder)
    dcp_share: dict[str, list[tuple[int, int]]] = {}
    for t in opened_dcp.tensors.values():
        for c in t.chunks:
            row = c.byte_length // c.sizes[0]
            low, high = max(0, c.offsets[0]), min(t.shape[0] // 2, c.offsets[0] + c.sizes[0])
            if low < high:
                at = c.byte_offset + (low - c.offsets[0]) * row
                dcp_share.setdefault(c.file, []).append((at, at + (high - low) * row))
    for r in range(rounds):
        timed("jax_ucp -> s3://", lambda: jax_ucp.save(f"s3://bench/ucp-{r}", tree))
        timed("Orbax StandardCheckpointer -> s3://", lambda: orbax_save(f"s3://bench/orbax-{r}"))
        timed("jax_ucp -> local dir", lambda: jax_ucp.save(os.path.join(local, f"u{r}"), tree))
        timed("Orbax -> local dir", lambda: orbax_save(os.path.join(local, f"o{r}")))
        whole, part = n * 2048 * 2048 * 4, (n // 2 or 1) * 2048 * 2048 * 4
        names = [f"w{i}" for i in range(n // 2 or 1)]
        dcp_half = (dcp_url, {k: dcp_sizes[k] for k in dcp_share}, dcp_share)

        def first(key):  # metadata, and the chunks of each tensor's first half of rows
            return not key.startswith("arrays/") or "/c/" not in key or "/c/0/" in key

        url = f"s3://bench/ucp-{r}"
        for name, fn, needed in [
            ("jax_ucp s3:// -> 4x2 mesh", lambda: restore(url), whole),
            ("bare GET loop, every object", lambda: bare_loop(url), whole),
            ("same, TensorStore reads + digest sweep", lambda: restore_by_tensorstore(url), whole),
            ("direct restore, DCP s3:// -> 4x2 mesh", lambda: direct(dcp_url), whole),
            ("bare GET loop, the DCP objects", lambda: bare_loop(dcp_url), whole),
            ("ranged GET loop, the DCP objects", lambda: ranged_loop(dcp_url, dcp_sizes), whole),
            ("jax_ucp s3:// select= half -> host", lambda: restore_half(url), part),
            ("bare GET loop, half the tensors", lambda: bare_loop(url, names), part),
            ("one process of 2: s3:// -> its rows", lambda: share_restore(url), whole // 2),
            (
                "bare GET loop, that process's chunks",
                lambda: bare_loop(url, keep=first),
                whole // 2,
            ),
            ("one process of 2: direct DCP -> rows", lambda: share_direct(dcp_url), whole // 2),
            ("ranged GET loop, that process's rows", lambda: ranged_loop(*dcp_half), whole // 2),
        ][:: 1 if r % 2 == 0 else -1]:
            counted(name, fn, needed)
        timed("jax_ucp local dir -> 4x2 mesh", lambda: restore(os.path.join(local, f"u{r}")))
        load.append(os.getloadavg()[0])
    shutil.rmtree(local, ignore_errors=True)
    back = jax_ucp.restore("s3://bench/ucp-0")
    exact = all(np.asarray(back[k]).tobytes() == np.asarray(v).tobytes() for k, v in tree.items())
    added = f", {latency_ms:g} ms added to every S3 request" if latency_ms else ""
    added += ", moto and the proxy pinned to a core of their own" if pinned else ""
    print(f"{n} x 16 MiB fp32 tensors on a 2x4 mesh, median of {rounds}{added}:")
    print(
        f"  load (1 min) at the start and after each round: {', '.join(f'{x:.1f}' for x in load)}"
    )
    names = (
        "jax_ucp -> s3://",
        "Orbax StandardCheckpointer -> s3://",
        "jax_ucp -> local dir",
        "Orbax -> local dir",
        "jax_ucp s3:// -> 4x2 mesh",
        "jax_ucp local dir -> 4x2 mesh",
    )
    for name in names:
        if name not in times and name not in errors:
            continue
        if name in errors:
            print(f"  {name:38} fails: {errors[name]}")
        else:
            print(f"  {name:38} {statistics.median(times[name]):7.2f} s")
    print(f"  jax_ucp's s3:// checkpoint restored bit-exact: {exact}")
    for name in sorted(set(errors) - set(names)):
        print(f"  {name:38} fails: {errors[name]}")
    ratio, shown = {}, set()
    for name, loop in [
        ("jax_ucp s3:// -> 4x2 mesh", "bare GET loop, every object"),
        ("same, TensorStore reads + digest sweep", "bare GET loop, every object"),
        ("direct restore, DCP s3:// -> 4x2 mesh", "bare GET loop, the DCP objects"),
        ("direct restore, DCP s3:// -> 4x2 mesh", "ranged GET loop, the DCP objects"),
        ("jax_ucp s3:// select= half -> host", "bare GET loop, half the tensors"),
        ("one process of 2: s3:// -> its rows", "bare GET loop, that process's chunks"),
        ("one process of 2: direct DCP -> rows", "ranged GET loop, that process's rows"),
    ]:
        for k in (name, loop):
            if k in times and k not in shown:
                shown.add(k)
                per = statistics.median(f for f, _ in fetched[k])
                gets = statistics.median(g for _, g in fetched[k])
                spent = ", ".join(
                    f"{who} {statistics.median(c[who] for c in cpu[k]):.2f}" for who in cpu[k][0]
                )
                print(
                    f"  {k:38} {statistics.median(times[k]):7.2f} s, fetched {per:.4f}x the "
                    f"slices needed in {gets:.0f} HTTP requests; CPU s: {spent}"
                )
        if name in times and loop in times:
            ratio[f"{name} / {loop}"] = r = statistics.median(times[loop]) / statistics.median(
                times[name]
            )
            print(f"  {name}: {100 * r:.0f} % of the speed of the {loop}")
    if json_path:
        result = {
            "date": time.strftime("%Y-%m-%d"),
            "machine": f"{platform.machine()}, {os.cpu_count()} cores",
            "tensors": n,
            "tensor_bytes": 2048 * 2048 * 4,
            "rounds": rounds,
            "latency_ms": latency_ms,
            "median_seconds": {k: statistics.median(v) for k, v in times.items()},
            "errors": errors,
            "bit_exact": exact,
            "fetched_per_needed_and_requests": fetched,
            "cpu_seconds": cpu,
            "pinned": pinned,
            "load_at_start_and_each_round": load,
            "speed_vs_bare_loop": ratio,
        }
        with open(json_path, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
