"""Pictures of where a restore puts things, computed from the plan alone (no array allocated,
no device needed: an ``AbstractMesh`` will do) — ``jax.debug.visualize_array_sharding``'s idea
before the array exists.

* :func:`device_slices` / :func:`slice_map` — which device holds which rows and columns of one
  tensor on a mesh, replicated slices marked; text always, a matplotlib figure on request.
* :func:`bytes_chart` — bytes per device of a whole :class:`~jax_ucp._src.restoring.plan.RestorePlan`
  with the replicated bytes stacked in another colour, beside another plan (e.g. the saved
  mesh's) when given.

matplotlib is only imported by the figure functions (the ``notebook`` extra); everything else
is plain text. A figure's cost is bounded: past :data:`FIGURE_SLICES` slices a tensor's slices
are coloured in one mesh, unlabelled, and past :data:`FIGURE_BARS` devices a plan's devices are
one bar (every device of a plan holds the same bytes); the figure says so in its title.
"""

from __future__ import annotations

import itertools
import math
import operator
from collections.abc import Sequence
from typing import Any

from jax_ucp._src.errors import RequestError
from jax_ucp._src.format.sizes import format_size
from jax_ucp._src.sharding.mesh_layout import axes_of

__all__ = ["bytes_by_device", "bytes_chart", "device_slices", "slice_map"]

#: slices a figure draws and labels one by one; past it they are one coloured mesh
FIGURE_SLICES = 64
#: devices a chart draws one bar each for; past it a plan's devices are one bar
FIGURE_BARS = 64


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
    shape, spec, names, sizes = _checked(shape, spec, mesh_axes)
    out = {}
    for device, coords in enumerate(itertools.product(*(range(s) for s in sizes))):
        where = dict(zip(names, coords))
        dims = []
        for n, entry in zip(shape, spec):
            parts, index = 1, 0
            for axis in axes_of(entry):  # the first axis is the major one, as in JAX
                index = index * sizes[names.index(axis)] + where[axis]
                parts *= sizes[names.index(axis)]
            step = math.ceil(n / parts) if parts else n
            dims.append((min(n, index * step), min(n, (index + 1) * step)))
        out[device] = tuple(dims)
    return out


def _whole(n: Any) -> int | None:
    """``n`` as an int when it is a whole number (a numpy integer too), not a bool; else None."""
    if isinstance(n, bool):
        return None
    try:
        return operator.index(n)
    except TypeError:
        return None


def _checked(shape, spec, mesh_axes) -> tuple[tuple[int, ...], list, list[str], list[int]]:
    """``shape``, ``spec`` padded with None to its length, the mesh's axis names and sizes; a
    negative or non-integer dimension, an axis of size < 1, two axes of one name, a spec longer
    than the shape, naming an axis the mesh lacks or one axis twice is a ``RequestError`` (a
    picture of what no restore can do would be a wrong picture)."""
    dims: list[int] = []
    for i, given in enumerate(shape):
        n = _whole(given)
        if n is None or n < 0:
            raise RequestError(
                f"shape {list(shape)}: dimension {i} is {given!r}; a dimension is a whole "
                f"number >= 0"
            )
        dims.append(n)
    names, sizes = [], []
    for name, size in mesh_axes:
        n = _whole(size)
        if n is None or n < 1:
            raise RequestError(f"mesh axis {name!r} has size {size!r}; a mesh axis has >= 1 device")
        if name in names:
            raise RequestError(f"mesh axis {name!r} is named twice in {list(mesh_axes)}")
        names.append(name)
        sizes.append(n)
    entries = list(spec or ())
    if len(entries) > len(dims):
        raise RequestError(
            f"spec P{tuple(entries)} has {len(entries)} entries for a tensor of "
            f"{len(dims)} dimensions {list(dims)}"
        )
    used: set[str] = set()
    for entry in entries:
        for axis in axes_of(entry):
            if axis not in names:
                mesh = " × ".join(f"{a}={n}" for a, n in zip(names, sizes)) or "no axes"
                raise RequestError(
                    f"spec P{tuple(entries)} names mesh axis {axis!r}, which the mesh "
                    f"({mesh}) lacks"
                )
            if axis in used:
                raise RequestError(f"spec P{tuple(entries)} uses mesh axis {axis!r} twice")
            used.add(axis)
    return tuple(dims), entries + [None] * (len(dims) - len(entries)), names, sizes


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
    shape = tuple(int(n) for n in shape)
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
    if len(held) > FIGURE_SLICES:  # one mesh of coloured cells, not an artist per slice
        _slice_mesh(ax, sorted(held), colours)
        title += f"\n{len(held)} slices: coloured, labelled only up to {FIGURE_SLICES}"
    else:
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


def _slice_mesh(ax, slices: list[tuple], colours) -> None:
    """``slices`` (their first two dimensions) as one ``pcolormesh``: a cell per distinct
    (rows, columns) block, coloured by the first slice covering it."""
    import numpy as np

    def span(s, d):
        return s[d] if len(s) > d else (0, 1)

    edges = [sorted({e for s in slices for e in span(s, d)}) for d in (0, 1)]
    edges = [ed if len(ed) > 1 else [ed[0], ed[0] + 1] for ed in edges]  # a dimension of size 0
    at = [{e: i for i, e in enumerate(ed)} for ed in edges]
    colour = np.full((len(edges[0]) - 1, len(edges[1]) - 1), np.nan)
    for i, s in reversed(list(enumerate(slices))):  # the first slice's colour wins
        (r0, r1), (c0, c1) = span(s, 0), span(s, 1)
        colour[at[0][r0] : at[0][r1], at[1][c0] : at[1][c1]] = i % 20
    lines = "black" if colour.size <= 1024 else "face"  # past that, edges would hide the cells
    ax.pcolormesh(edges[1], edges[0], colour, cmap=colours, vmin=0, vmax=20, edgecolors=lines)


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
    grouped = any(n > FIGURE_BARS for n, _, _ in rows.values())
    for label, (n, sharded, replicated) in rows.items():
        if n > FIGURE_BARS:  # every device holds the same bytes: one bar says it
            label, n = f"{label}\n(one bar: each of {n} devices)", 1
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
    per = f"one bar per device, up to {FIGURE_BARS} a plan" if grouped else "one bar per device"
    ax.set_title(f"bytes each device holds ({per})", fontsize=9)
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
