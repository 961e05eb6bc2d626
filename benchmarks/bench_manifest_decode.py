"""Reading a 100 000-tensor ``ucp.json``: this tree's reader against another's, and the typed
model's two contenders (issue 49).

The manifest is the one ``bench_many_tensors.py --manifest N`` reads (MoE-named tensors, each
with its saved sharding on a data=2 x model=4 mesh, a shard digest and the tree), written here
without the arrays: only ``ucp.json`` is read. Each measurement is a fresh process: the time of
``read_manifest_file`` and the process's peak RSS (VmHWM) after it, less the peak after imports.

  python benchmarks/bench_manifest_decode.py [--n 100000] [--rounds 3] [--base DIR]

``--base DIR`` is another checkout's root (e.g. ``git archive main jax_ucp | tar -x -C DIR``);
the two alternate within each round. ``--contenders`` decodes the same text with the msgspec
model and an equivalent pydantic v2 model instead.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import textwrap

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def make(n: int, directory: str) -> str:
    """``directory/ucp.json`` of ``n`` MoE-named tensors (written once; cached)."""
    path = os.path.join(directory, "ucp.json")
    if os.path.exists(path):
        return path
    from bench_many_tensors import moe_names, nested

    from jax_ucp._src import format as fmt

    saved = fmt.SavedSharding.of(("data", "model"), (2, 4), ())
    entries = []
    for name, shape in moe_names(n):
        key = ("params", *name.split("/"))
        entries.append(
            fmt.TensorEntry(
                key=key,
                key_types=("key",) * len(key),
                dir=fmt.array_dir(key),
                shape=shape,
                dtype="float32",
                chunk_shape=shape,
                inner_chunk_shape=shape,
                compression=None,
                checksum="crc32c",
                role="param",
                saved_sharding=saved,
                shard_digests={"c/" + "/".join("0" * len(shape)): "0123abcd"},
            )
        )

    def tree(node) -> dict:
        if not isinstance(node, dict):
            return {"type": "leaf"}
        return {"type": "dict", "children": [[k, "key", tree(v)] for k, v in node.items()]}

    flat = {"params/" + name: None for name, _ in moe_names(n)}
    manifest = fmt.new_manifest(entries, tree=tree(nested(flat)))
    os.makedirs(directory, exist_ok=True)
    with open(path, "w") as f:
        f.write(manifest.dumps())
    return path


_READ = """
import time
def hwm():
    return int(next(l for l in open('/proc/self/status') if l.startswith('VmHWM')).split()[1]) * 1024
from jax_ucp._src.format import manifest
before = hwm()
t0 = time.perf_counter()
m = manifest.read_manifest_file({directory!r})
took = time.perf_counter() - t0
assert len(m.entries) == {n}
import jax_ucp, sys; print(jax_ucp.__file__, file=sys.stderr)
print(took, hwm() - before, hwm())
"""

_CONTENDER = {
    "msgspec": """
from jax_ucp._src.format import manifest
decode = manifest.DECODER.decode
""",
    "pydantic": """
from typing import Annotated, Any, Literal, Union
import pydantic
from pydantic import BaseModel, ConfigDict, Field
from jax_ucp._src.format.dtypes import SUPPORTED
Dim = Annotated[int, Field(ge=0, lt=2**62, strict=True)]
PosDim = Annotated[int, Field(ge=1, lt=2**62, strict=True)]
Dims = Annotated[tuple[Dim, ...], Field(max_length=64)]
PosDims = Annotated[tuple[PosDim, ...], Field(max_length=64)]
KeyType = Literal["key", "index", "attr"]
class M(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)
class Mesh(M):
    axis_names: tuple[str, ...]
    shape: Dims
class Sharding(M):
    mesh: Mesh
    partition_spec: tuple[Union[str, tuple[str, ...], None], ...]
ShardKey = Annotated[str, Field(pattern=r"^c(/[0-9]+)*\\z")]
Digest = Annotated[str, Field(pattern=r"^[0-9a-f]{8}\\z")]
class Tensor(M):
    entry: Literal["tensor"]
    key: Annotated[tuple[str, ...], Field(min_length=1)]
    dir: Annotated[str, Field(pattern=r"^arrays/[A-Za-z0-9_%~.\\-]+\\z")]
    shape: Dims
    dtype: Literal[tuple(SUPPORTED)]
    chunk_shape: PosDims
    inner_chunk_shape: PosDims
    role: Literal["param", "opt_state", "other"]
    key_types: tuple[KeyType, ...] = None
    compression: Literal["zstd", None] = None
    checksum: Literal["crc32c", None] = None
    sub_role: str | None = None
    logical_axes: tuple[str | None, ...] | None = None
    saved_sharding: Sharding | None = None
    provenance: dict[str, Any] | None = None
    shard_digests: dict[ShardKey, Digest] | None = None
    frozen: bool = False
    tied_to: str | None = None
class Value(M):
    entry: Literal["value"]
    key: tuple[str, ...]
    type: Literal["none", "bool", "int", "float", "str"]
    value: Any
    key_types: tuple[KeyType, ...] = None
    role: Literal["param", "opt_state", "other"] = "other"
    sub_role: str | None = None
class Node(M):
    type: Literal["leaf", "dict", "list", "tuple", "namedtuple", "object"]
    children: list[tuple[str, KeyType, "Node"]] | None = None
    class_: str | None = Field(None, alias="class")
class KvStore(M):
    driver: str
class Manifest(M):
    format: Literal["jax_ucp"]
    version: Annotated[int, Field(ge=1, le=1)]
    save_id: str
    kvstore: KvStore
    entries: list[Annotated[Union[Tensor, Value], Field(discriminator="entry")]]
    created_by: str = ""
    created_at: float = 0.0
    source: dict[str, Any] = {}
    tree: Node | None = None
decode = Manifest.model_validate_json
""",
}

_DECODE = """
import time
def hwm():
    return int(next(l for l in open('/proc/self/status') if l.startswith('VmHWM')).split()[1]) * 1024
{setup}
text = open({path!r}).read()
before = hwm()
t0 = time.perf_counter()
m = decode(text)
took = time.perf_counter() - t0
assert len(m.entries) == {n}
import jax_ucp, sys; print(jax_ucp.__file__, file=sys.stderr)
print(took, hwm() - before, hwm())
"""


def run(code: str, root: str) -> tuple[float, int, int]:
    """(seconds, peak RSS growth, peak RSS) printed by ``code`` in a fresh process."""
    env = {**os.environ, "PYTHONPATH": root, "JAX_PLATFORMS": "cpu"}
    out = subprocess.run(
        [sys.executable, "-c", code],
        env=env,
        cwd=root,
        capture_output=True,
        text=True,
        check=False,
    )
    if out.returncode:
        raise RuntimeError(out.stderr[-3000:])
    took, grew, peak = out.stdout.split()
    return float(took), int(grew), int(peak)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=100_000)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--dir", default="/tmp/ucp_manifest_decode")
    ap.add_argument("--base", help="another checkout's root, read alternately with this one")
    ap.add_argument("--contenders", action="store_true", help="msgspec vs pydantic")
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args()
    directory = os.path.join(args.dir, f"n{args.n}")
    path = make(args.n, directory)
    print(f"{path}: {os.path.getsize(path) / 1e6:.1f} MB, {args.n} tensors", flush=True)
    if args.contenders:
        runs = {
            name: textwrap.dedent(_DECODE).format(setup=setup, path=path, n=args.n)
            for name, setup in _CONTENDER.items()
        }
        roots = dict.fromkeys(runs, ROOT)
    else:
        code = textwrap.dedent(_READ).format(directory=directory, n=args.n)
        runs, roots = {"this tree": code}, {"this tree": ROOT}
        if args.base:
            runs["base"], roots["base"] = code, os.path.abspath(args.base)
    results: dict[str, list] = {name: [] for name in runs}
    loads = [os.getloadavg()[0]]
    for r in range(args.rounds):
        for name, code in runs.items():  # alternating within each round
            results[name].append(run(code, roots[name]))
            took, grew, peak = results[name][-1]
            load = os.getloadavg()[0]
            loads.append(load)
            print(
                f"  round {r} {name:10s} {took:6.2f} s  +{grew / 2**20:5.0f} MiB "
                f"(peak {peak / 2**20:5.0f} MiB)  load {load:.2f}",
                flush=True,
            )
    print(f"\n{'':10s} {'s (median)':>10s} {'+MiB (median)':>14s}")
    for name, rs in results.items():
        med_t = statistics.median(r[0] for r in rs)
        med_m = statistics.median(r[1] for r in rs)
        print(f"{name:10s} {med_t:10.2f} {med_m / 2**20:14.0f}")
    print(f"(load average {min(loads):.2f}..{max(loads):.2f}, {os.cpu_count()} CPUs)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"loads": loads, "results": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
