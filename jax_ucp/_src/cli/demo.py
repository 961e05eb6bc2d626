"""The demo: a small model state saved on 8 CPU devices, restored onto two other meshes.

Prints what moved where (saved vs restored PartitionSpecs and per-device shard shapes) and
checks every restored byte against what was saved.
"""

from __future__ import annotations

import os
import tempfile

from jax_ucp._src.cli import layout
from jax_ucp._src.errors import RequestError
from jax_ucp._src.tree import flatten


def _ensure_devices(n: int) -> None:
    # Must happen before JAX initialises its backend (importing jax does not).
    flags = os.environ.get("XLA_FLAGS", "")
    if "xla_force_host_platform_device_count" not in flags:
        os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={n}".strip()
    os.environ.setdefault("JAX_PLATFORMS", "cpu")


def _model_state(mesh):
    import flax.linen as nn
    import jax
    import jax.numpy as jnp
    import optax
    from flax.linen import spmd  # flax.linen re-exports logical_to_mesh_sharding without "as"

    class Block(nn.Module):
        @nn.compact
        def __call__(self, x):
            dense = lambda f, names, name: nn.Dense(
                f,
                name=name,
                kernel_init=nn.with_logical_partitioning(nn.initializers.lecun_normal(), names),
            )
            h = dense(256, ("embed", "mlp"), "up")(x)
            return dense(64, ("mlp", "embed"), "down")(nn.gelu(h)) + x

    class Model(nn.Module):
        @nn.compact
        def __call__(self, tokens):
            emb = nn.unbox(  # the array: flax types self.param as its LogicallyPartitioned box
                self.param(
                    "embedding",
                    nn.with_logical_partitioning(nn.initializers.normal(0.02), ("vocab", "embed")),
                    (512, 64),
                    jnp.bfloat16,
                )
            )
            x = emb[tokens].astype(jnp.float32)
            for i in range(2):
                x = Block(name=f"block_{i}")(x)
            return x @ emb.T.astype(jnp.float32)

    model = Model()
    boxed = model.init(jax.random.key(0), jnp.zeros((2, 8), jnp.int32))
    logical = nn.get_partition_spec(boxed)
    rules = [("vocab", "model"), ("embed", "data"), ("mlp", "model")]
    shardings = spmd.logical_to_mesh_sharding(logical, mesh, rules)
    params = jax.tree.map(lambda x, s: jax.device_put(x, s), nn.unbox(boxed), shardings)
    opt_state = optax.adamw(1e-3).init(params["params"])
    state = {
        "params": params["params"],
        "opt_state": opt_state,
        "step": 1000,
        "data_position": {"epoch": 3, "offset": 12345},
    }
    axes = {
        "params": jax.tree.map(
            tuple, logical["params"], is_leaf=lambda x: isinstance(x, jax.sharding.PartitionSpec)
        )
    }
    return state, axes


def _spec(a) -> str:
    import jax

    s = getattr(a, "sharding", None)
    if isinstance(s, jax.sharding.NamedSharding):
        dims = [("+".join(p) if isinstance(p, tuple) else (p or "·")) for p in s.spec]
        return "(" + ", ".join(dims) + ")" if dims else "replicated"
    if isinstance(s, jax.sharding.SingleDeviceSharding):
        return "1 device"
    return "host numpy"


def run(directory: str | None = None, console=None) -> bool:
    """Runs the demo; returns True when every restored tensor is bit-exact.

    Without ``directory`` it works in a temporary directory that it removes afterwards.
    """
    if directory is None:
        with tempfile.TemporaryDirectory(prefix="jax_ucp_demo_") as tmp:
            return run(tmp, console)
    _ensure_devices(8)
    import jax
    import numpy as np
    from jax.sharding import Mesh
    from rich.console import Console
    from rich.markup import escape

    import jax_ucp

    console = console or Console()
    if jax.device_count() < 8:
        raise RequestError(
            f"the demo needs 8 devices, JAX has {jax.device_count()} "
            f"(set XLA_FLAGS=--xla_force_host_platform_device_count=8 before JAX starts)"
        )
    devices = np.array(jax.devices()[:8])
    mesh8 = Mesh(devices.reshape(2, 4), ("data", "model"))
    state, axes = _model_state(mesh8)
    path = os.path.join(directory, "checkpoint")
    jax_ucp.save(path, state, logical_axes=axes, force=True)
    m = jax_ucp.inspect(path)
    console.print(
        f"[bold]Saved[/bold] {len(m.tensors)} tensors, {m.nbytes / 2**20:.1f} MiB, from an "
        f"8-device mesh (data=2, model=4) to [cyan]{escape(path)}[/cyan]"
    )

    # Target A: 4 devices, other axis names → logical rules map the recorded axis names.
    mesh4 = Mesh(devices[:4].reshape(2, 2), ("fsdp", "tp"))
    rules = [("vocab", "tp"), ("embed", "fsdp"), ("mlp", "tp")]
    a = jax_ucp.restore(path, mesh=mesh4, rules=rules)
    # Target B: 2 devices, same axis names → saved PartitionSpecs reused where they divide.
    mesh2 = Mesh(devices[6:8].reshape(1, 2), ("data", "model"))
    b = jax_ucp.restore(path, mesh=mesh2)
    plain = jax_ucp.restore(path)

    rows, values, specs, all_ok = _compare(state, a, b, plain)
    _report(console, rows, values, specs)
    console.print(
        "[bold green]All tensors restored bit-exact.[/bold green]"
        if all_ok
        else "[bold red]Mismatch![/bold red]"
    )
    return all_ok


def _compare(state, a, b, plain):
    """Each saved leaf against its three restores, byte for byte: (table rows of the params and
    of any mismatch, the scalar values, {key: the three specs} of the arrays, all equal)."""
    import numpy as np

    def flat(tree):
        return {key: leaf for key, _, leaf in flatten(tree)[0]}

    fa, fb, fp = flat(a), flat(b), flat(plain)
    rows, values, specs, all_ok = [], [], {}, True
    for key, x in flat(state).items():
        ra, rb, rp = fa.get(key), fb.get(key), fp.get(key)
        if not hasattr(x, "shape"):
            ok = ra == x and rb == x and rp == x
            values.append(f"{'/'.join(key)}={x!r}{'' if ok else ' ✗'}")
            all_ok &= bool(ok)
            continue
        want = np.asarray(x)
        ok = all(
            r is not None
            and np.asarray(r).dtype == want.dtype
            and np.asarray(r).tobytes() == want.tobytes()
            for r in (ra, rb, rp)
        )
        all_ok &= ok
        specs[key] = (_spec(x), _spec(ra), _spec(rb))
        if key[0] == "params":
            shape = "x".join(map(str, x.shape)) or "()"
            dtype = {"bfloat16": "bf16", "float32": "f32", "int32": "i32"}.get(str(x.dtype))
            rows.append(("/".join(key[1:]), f"{shape} {dtype or x.dtype}", *specs[key], ok))
        elif not ok:
            rows.append(("/".join(key), str(x.shape), *specs[key], ok))
    return rows, values, specs, all_ok


def _report(console, rows, values, specs) -> None:
    """The three layouts' table, and one line for what it leaves out (optimizer moments, whether
    they follow their parameter's specs, and the scalars); the table is the CLI's (names
    wrapped at ``/`` to fit the terminal)."""
    console.print(
        "Restored onto two other meshes and as host numpy, each byte checked:\n"
        "  saved: 8 devices, mesh (data 2, model 4)\n"
        "  A: 4 devices (fsdp 2, tp 2), logical rules vocab→tp, embed→fsdp, mlp→tp\n"
        "  B: 2 devices (data 1, model 2), mesh= alone: saved specs kept where they fit",
        highlight=False,
    )
    header = ["params", "shape", "saved", "A", "B", "ok"]
    cells = [[*row[:5], "✓" if row[5] else "✗"] for row in rows]
    console.print(layout.table(header, cells, width=console.width), highlight=False)
    moments = [k for k in specs if k[0] == "opt_state" and k[2] in ("mu", "nu")]
    followed = [k for k in moments if specs[k] == specs.get(("params", *k[3:]))]
    rest = len(specs) - len(rows) - len(moments)
    console.print(
        f"not listed: opt_state, {len(moments)} Adam moments ("
        + (
            "each with its parameter's specs in all three layouts"
            if followed == moments
            else f"{len(moments) - len(followed)} with other specs than their parameter"
        )
        + f") and {rest} other tensor(s), all ✓; values {', '.join(values)}",
        highlight=False,
    )


if __name__ == "__main__":
    raise SystemExit(0 if run() else 1)
