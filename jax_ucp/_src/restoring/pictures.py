"""Pictures of where a restore puts things, computed from the plan alone (no array allocated,
no device needed: an ``AbstractMesh`` will do) — ``jax.debug.visualize_array_sharding``'s idea
before the array exists.

* :func:`device_slices` / :func:`slice_map` — which device holds which rows and columns of one
  tensor on a mesh, replicated slices marked; text always, a matplotlib figure on request.
* :func:`bytes_chart` — bytes per device of a whole :class:`~jax_ucp._src.restoring.plan.RestorePlan`
  with the replicated bytes stacked in another colour, beside another plan (e.g. the saved
  mesh's) when given.

matplotlib is only imported by the figure functions (the ``notebook`` extra); everything else
is plain text.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from typing import Any

from jax_ucp._src.format.sizes import format_size

__all__ = ["bytes_by_device", "bytes_chart", "device_slices", "slice_map"]


def _axes(entry: Any) -> tuple[str, ...]:
    if entry is None:
        return ()
    return tuple(entry) if isinstance(entry, tuple | list) else (entry,)


def device_slices(
    shape: Sequence[int], spec: Sequence[Any] | None, mesh_axes: Sequence[tuple[str, int]]
) -> dict[int, tuple[tuple[int, int], ...]]:
    """Device index (row-major over the mesh) → the ``(start, stop)`` of each dimension it
    holds, for a ``NamedSharding(mesh, P(*spec))`` of a tensor of ``shape`` (``spec`` None: on
    host, one "device" 0 holding everything).

    Args:
        shape: the tensor's global shape.
        spec: its PartitionSpec entries (None, an axis name, or a tuple of names), per dim.
        mesh_axes: ``[(axis name, size), ...]`` of the mesh, in order.
    """
    names = [n for n, _ in mesh_axes]
    sizes = [int(s) for _, s in mesh_axes]
    spec = list(spec or ()) + [None] * (len(shape) - len(spec or ()))
    out = {}
    for device, coords in enumerate(itertools.product(*(range(s) for s in sizes))):
        where = dict(zip(names, coords))
        dims = []
        for n, entry in zip(shape, spec):
            parts, index = 1, 0
            for axis in _axes(entry):  # the first axis is the major one, as in JAX
                index = index * sizes[names.index(axis)] + where[axis]
                parts *= sizes[names.index(axis)]
            step = math.ceil(n / parts) if parts else n
            dims.append((min(n, index * step), min(n, (index + 1) * step)))
        out[device] = tuple(dims)
    return out


def _held(slices: dict[int, tuple]) -> dict[tuple, list[int]]:
    held: dict[tuple, list[int]] = {}
    for device, s in slices.items():
        held.setdefault(s, []).append(device)
    return held


def slice_map(
    shape: Sequence[int],
    spec: Sequence[Any] | None,
    mesh_axes: Sequence[tuple[str, int]],
    *,
    name: str = "tensor",
    figure: bool = False,
):
    """Which device holds which slice of a tensor: a text table (one line per distinct slice,
    its devices, "replicated" when every device holds it whole), or with ``figure=True`` a
    matplotlib figure of the tensor's first two dimensions cut into the slices, each labelled
    with its devices.

    Args:
        shape: the tensor's global shape.
        spec: its PartitionSpec entries.
        mesh_axes: ``[(axis name, size), ...]`` of the mesh.
        name: the tensor's name, for the title.
        figure: draw a matplotlib figure instead of returning text.
    """
    slices = device_slices(shape, spec, mesh_axes)
    held = _held(slices)
    mesh_text = " × ".join(f"{n}={s}" for n, s in mesh_axes)
    whole = tuple((0, n) for n in shape)
    title = f"{name} {list(shape)} as P{tuple(spec or ())} on {mesh_text}"
    if not figure:
        lines = [title]
        for s, devices in sorted(held.items()):
            what = "whole (replicated)" if s == whole else " × ".join(f"{a}:{b}" for a, b in s)
            lines.append(f"  {what:<30} devices {_ranges(devices)}")
        return "\n".join(lines)
    import matplotlib.pyplot as plt
    from matplotlib.patches import Rectangle

    fig, ax = plt.subplots(figsize=(5, 4))
    rows = shape[0] if shape else 1
    cols = shape[1] if len(shape) > 1 else 1
    colours = plt.get_cmap("tab20")
    for i, (s, devices) in enumerate(sorted(held.items())):
        (r0, r1) = s[0] if s else (0, 1)
        (c0, c1) = s[1] if len(s) > 1 else (0, 1)
        ax.add_patch(
            Rectangle((c0, r0), c1 - c0, r1 - r0, facecolor=colours(i % 20), edgecolor="black")
        )
        label = "all devices" if s == whole and len(devices) > 1 else f"dev {_ranges(devices)}"
        ax.text((c0 + c1) / 2, (r0 + r1) / 2, label, ha="center", va="center", fontsize=8)
    ax.set_xlim(0, cols)
    ax.set_ylim(rows, 0)
    ax.set_xlabel("columns" if len(shape) > 1 else "")
    ax.set_ylabel("rows")
    ax.set_title(title, fontsize=9)
    return fig


def bytes_by_device(plan) -> tuple[int, int, int]:
    """(devices, sharded bytes per device, replicated bytes per device) of a restore plan: every
    ``NamedSharding`` gives each device an equal share, so one number each says it."""
    devices = len(plan.device_bytes)
    replicated = sum(t.bytes_per_device or 0 for t in plan.tensors if t.replicated)
    sharded = sum(t.bytes_per_device or 0 for t in plan.tensors if not t.replicated)
    return devices, sharded, replicated


def bytes_chart(plans: dict[str, Any], *, figure: bool = False):
    """Bytes per device of each plan (``{"saved fsdp=2 × tp=4": plan, "4 devices": plan}``),
    the replicated bytes stacked apart: text, or with ``figure=True`` a matplotlib bar chart
    with one group of bars per plan.

    Args:
        plans: label → ``RestorePlan``.
        figure: draw a matplotlib figure instead of returning text.
    """
    rows = {label: bytes_by_device(plan) for label, plan in plans.items()}
    if not figure:
        lines = []
        for label, (n, sharded, replicated) in rows.items():
            lines.append(
                f"{label}: {n} devices × ({format_size(sharded)} sharded + "
                f"{format_size(replicated)} replicated) = {format_size(sharded + replicated)} "
                f"each"
            )
        return "\n".join(lines)
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3.5))
    x, ticks, labels = 0, [], []
    for label, (n, sharded, replicated) in rows.items():
        xs = list(range(x, x + n))
        ax.bar(xs, [sharded / 1024] * n, color="tab:blue", label="sharded" if x == 0 else None)
        ax.bar(
            xs,
            [replicated / 1024] * n,
            bottom=[sharded / 1024] * n,
            color="tab:orange",
            label="replicated" if x == 0 else None,
        )
        ticks.append(x + (n - 1) / 2)
        labels.append(label)
        x += n + 1
    ax.set_xticks(ticks, labels, fontsize=8)
    ax.set_ylabel("KiB per device")
    ax.set_title("bytes each device holds (one bar per device)", fontsize=9)
    ax.legend()
    return fig


def _ranges(devices: list[int]) -> str:
    """``[0, 1, 2, 5]`` as ``0-2, 5``."""
    out, start = [], None
    for i, d in enumerate(devices):
        if start is None:
            start = d
        if i + 1 == len(devices) or devices[i + 1] != d + 1:
            out.append(str(start) if start == d else f"{start}-{d}")
            start = None
    return ", ".join(out)
