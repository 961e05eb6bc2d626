"""The walk of one parameter through jax_ucp: ``restore(path, mesh=, rules=, target=)`` of a
one-tensor checkpoint onto a 2x2 mesh (the target's leaf sharded over it), traced, as the sequence of jax_ucp modules control is in.

    python3 tools/restore_walk.py [--show] [--calls | --all] [--depth N] [--import SRC]

A module is *entered* when one of its functions is called from another module's frame (a
module calling its own helpers, comprehensions included, stays where it is); a *stay* is a run
of consecutive entries into one module; a *return* is a stay in a module already left before.
Counted are the entries into the rooms of the restore pipeline (``PIPELINE``: api, tree,
restoring/, sharding/), lower layers and other libraries being transparent (a callback jax
hands back into jax_ucp enters its module). ``--calls`` counts every call, a module's calls of
its own functions too; ``--all`` counts every module of jax_ucp and every event, returns into a
caller's frame too. Only the main thread's Python frames count. Imports and first-call caches
are kept out by a first, untraced restore. The issue (#39) asks for at most 6 returns.

``--import SRC`` walks ``convert``'s planning of the checkpoint ``SRC`` instead
(``importers.registry.plan_import`` with the importer detection finds given: its ``plan``
and the accounting; the items are not read), every jax_ucp module a room (``--depth 2``: the registry and what it
calls; issue #49 compares the torch family's walk with DeepSpeed's).
"""

from __future__ import annotations

import os
import sys

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=4")

import argparse
import tempfile
from collections import Counter

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

import jax_ucp

# the rooms a parameter walks through on its way out; lower layers (format, store, the option
# and error leaves) are transparent, as third-party code is
PIPELINE = ("_src/api.py", "_src/tree.py", "_src/restoring/", "_src/sharding/")
PACKAGE = os.path.dirname(os.path.abspath(jax_ucp.__file__))


def _module(frame) -> str | None:
    path = frame.f_code.co_filename
    if not path.startswith(PACKAGE + os.sep):
        return None
    return os.path.relpath(path, PACKAGE)


def _depth(frame) -> int:
    """How many jax_ucp frames are on the stack, ``frame`` included."""
    n = 0
    while frame is not None:
        n += _module(frame) is not None
        frame = frame.f_back
    return n


def walk(
    restore,
    depth: int,
    calls: bool,
    rooms: tuple[str, ...],
    names: bool = False,
    entries: bool = True,
) -> list[str]:
    """The modules control is in while ``restore()`` runs, each event's (calls, and returns
    unless ``calls``; with ``entries`` only calls from another module), counting only jax_ucp
    frames at most ``depth`` deep (1: ``restore`` itself) in modules whose path starts with one
    of ``rooms`` (all if empty); ``names``: each event as ``module:function``."""
    seen: list[str] = []

    def profile(frame, event, arg):
        if event == "return" and not calls:
            frame = frame.f_back
        elif event != "call":
            return
        if frame is None or (where := _module(frame)) is None:
            return
        if entries and event == "call" and frame.f_back and _module(frame.f_back) == where:
            return  # a module calling its own function: not entered
        if (rooms and not where.startswith(rooms)) or _depth(frame) > depth:
            return
        seen.append(f"{where}:{frame.f_code.co_name}" if names else where)

    sys.setprofile(profile)
    try:
        restore()
    finally:
        sys.setprofile(None)
    return seen


def stays(events: list[str]) -> list[str]:
    """Consecutive events in one module merged into one stay (``module:function`` events give
    each stay's functions)."""
    out: list[str] = []
    for event in events:
        module, _, function = event.partition(":")
        if out and out[-1].partition(" ")[0] == module:
            if function and function not in out[-1].split(" ")[1:]:
                out[-1] += " " + function
        else:
            out.append(f"{module} {function}".strip())
    return out


def returns(path: list[str]) -> int:
    """Stays in a module already left before."""
    left, count = set(), 0
    for i, m in enumerate(path):
        if m in left:
            count += 1
        if i:
            left.add(path[i - 1])
    return count


def measure(
    depth: int = 99, *, calls: bool = False, every_module: bool = False, names: bool = False
) -> list[str]:
    """The stays of the restore this tool walks (entries unless ``calls``; the pipeline's
    rooms unless ``every_module``, then every event)."""
    devices = np.array(jax.devices()[:4]).reshape(2, 2)
    mesh = Mesh(devices, ("data", "model"))
    rules = [("embed", "data"), ("mlp", "model")]
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "ckpt")
        w = np.arange(32, dtype=np.float32).reshape(8, 4)
        jax_ucp.save(path, {"w": w}, logical_axes={"w": ("embed", "mlp")})
        placed = NamedSharding(mesh, PartitionSpec("data", "model"))
        target = {"w": jax.ShapeDtypeStruct((8, 4), np.float32, sharding=placed)}

        def restore():
            out = jax_ucp.restore(path, mesh=mesh, rules=rules, target=target)
            assert out["w"].sharding == placed and np.array_equal(np.asarray(out["w"]), w)

        restore()  # imports and caches, untraced
        rooms = () if every_module else PIPELINE
        return stays(walk(restore, depth, not every_module, rooms, names, entries=not calls))


def measure_import(src: str, depth: int = 99, *, calls: bool = False, names: bool = False):
    """The stays of ``plan_import(src)`` (the planning ``convert`` does), every module a room."""
    from jax_ucp._src.importers import registry

    name = registry.importer_for(src).name  # the layout's importer: planned without detection

    def plan():
        registry.plan_import(src, format=name)

    plan()  # imports and caches, untraced
    return stays(walk(plan, depth, calls, (), names, entries=not calls))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--show", action="store_true", help="print the stays in order")
    parser.add_argument(
        "--depth", type=int, default=99, help="count frames at most this deep (1: restore)"
    )
    parser.add_argument(
        "--calls",
        action="store_true",
        help="every call, a module's calls of its own functions too, not only entries",
    )
    parser.add_argument(
        "--all",
        action="store_true",
        help="every event (returns into callers too) in every jax_ucp module, not the pipeline's "
        "calls",
    )
    parser.add_argument(
        "--import",
        dest="source",
        metavar="SRC",
        help="walk convert's planning of the checkpoint SRC instead of a restore",
    )
    args = parser.parse_args()
    show = args.show
    if args.source:
        path_ = measure_import(args.source, args.depth, calls=args.calls, names=show)
    else:
        path_ = measure(args.depth, calls=args.calls or args.all, every_module=args.all, names=show)
    if show:
        for m in path_:
            print(m)
    path_ = [m.partition(" ")[0] for m in path_]
    entered = Counter(path_)
    most = ", ".join(f"{m} {n}" for m, n in entered.most_common(4))
    counted = "calls" if args.calls or args.all else "entries"
    print(
        f"{len(path_)} stays, {returns(path_)} returns to a module already left, counting "
        f"{counted} ({most})"
    )


if __name__ == "__main__":
    main()
