"""Draw the PNG of each benchmark from the JSON it wrote.

The scripts in ``benchmarks/`` write their figures to ``docs/benchmark_<name>.json`` and, apart
from ``bench_save_restore.py``, draw nothing. This module turns each of those JSON files into the
``docs/benchmark_<name>.png`` that docs/BENCHMARKS.md links, plotting the same figures as the
table there (medians, as the benchmarks recorded them; no number here is computed from anything
but the JSON). A JSON file that does not exist is skipped.

  python benchmarks/plot_results.py [--only async_stall|convert_processes|many_tensors|memory|object_store]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOCS = os.path.join(ROOT, "docs")
DPI = 110
FIGSIZE = (8, 4.5)
MiB = 2**20
GiB = 2**30
FAIL_COLOR = "tab:red"


# ---------------------------------------------------------------- helpers


def load(name: str) -> dict | None:
    path = os.path.join(DOCS, f"benchmark_{name}.json")
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return json.load(f)


def run_date(data: dict) -> str:
    if "date_utc" in data:
        return f"{data['date_utc']} UTC"
    return data.get("date", "date unknown")


def grouped_bars(ax, groups, series, fmt, colors=None, label_size=7, centre=True):
    """One bar per series in each group; ``None`` leaves a gap. Returns the bars' x positions.

    ``fmt`` is a %-format or a function of the value for the label above each bar; ``None``
    writes no labels (the caller writes its own with ``label_bars``). ``centre`` puts each
    group's label under the bars it has rather than under all its slots.
    """
    names = list(series)
    width = 0.8 / len(names)
    xs = {}
    for j, name in enumerate(names):
        offset = (j - (len(names) - 1) / 2) * width
        pos = [i + offset for i in range(len(groups))]
        xs[name] = pos
        kept = [(x, v) for x, v in zip(pos, series[name]) if v is not None]
        if not kept:
            continue
        color = colors[name] if colors else None
        bars = ax.bar([x for x, _ in kept], [v for _, v in kept], width, label=name, color=color)
        if fmt is not None:
            labels = [fmt(v) if callable(fmt) else fmt % v for _, v in kept]
            ax.bar_label(bars, labels=labels, fontsize=label_size, padding=2)
    ticks = [group_centre(xs, series, i) if centre else i for i in range(len(groups))]
    ax.set_xticks(ticks, groups, fontsize=8)
    return xs


def group_centre(xs, series, i):
    """The middle of group i's bars, so its label sits under the bars it has."""
    present = [xs[n][i] for n in series if series[n][i] is not None]
    return statistics.mean(present) if present else i


def headroom(ax, factor=1.18):
    """Leave room above the tallest bar for its label."""
    lo, hi = ax.get_ylim()
    if ax.get_yscale() == "log":
        ax.set_ylim(lo, hi * factor**3)
    else:
        ax.set_ylim(lo, hi * factor)


def finish(fig, title: str, png: str) -> None:
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(png, dpi=DPI)
    plt.close(fig)


# ---------------------------------------------------------------- async_stall


def plot_async_stall(data: dict, png: str) -> None:
    med = statistics.median
    stall = {k: med(v) for k, v in data["stall_s"].items()}
    whole = {k: med(v) for k, v in data["whole_save_s"].items()}
    copy = med(data["copy_s"]["private copy (np.array)"])
    names = list(stall) + ["private host copy (np.array)"]
    palette = ["tab:blue", "tab:cyan", "tab:green", "tab:orange"][: len(stall)] + ["tab:gray"]
    colors = dict(zip(names, palette))
    fig, (left, right) = plt.subplots(1, 2, figsize=FIGSIZE, width_ratios=(3, 2))

    stall_vals = list(stall.values()) + [copy]
    bars = left.bar(range(len(names)), stall_vals, 0.6, color=[colors[n] for n in names])
    left.bar_label(
        bars, labels=[f"{v:.3f} s\n{v / copy:.2f}× copy" for v in stall_vals], fontsize=8
    )
    left.set_xticks(range(len(names)), [n.replace(" (", "\n(") for n in names], fontsize=8)
    left.set_ylabel("stall: until save() returns, s (median)")
    left.set_title("time training is blocked", fontsize=9)
    headroom(left, 1.25)

    bars = right.bar(range(len(whole)), list(whole.values()), 0.6, color=palette[: len(whole)])
    right.bar_label(bars, fmt="%.2f s", fontsize=8)
    right.set_xticks(range(len(whole)), [n.replace(" ", "\n", 1) for n in whole], fontsize=8)
    right.set_ylabel("whole save (until written), s (median)")
    right.set_title("whole async save", fontsize=9)
    headroom(right)

    rounds = len(next(iter(data["stall_s"].values())))
    finish(
        fig,
        f"Async save stall: {data['bytes'] / GiB:.2f} GiB on a 2×4 mesh, "
        f"CheckpointManager.save(), medians of {rounds} — {run_date(data)}",
        png,
    )


# ---------------------------------------------------------------- convert_processes

FORMAT_NAMES = {
    "deepspeed": "DeepSpeed ZeRO-2",
    "megatron": "megatron-core\ndp_reshardable",
    "safetensors": "Hugging Face\nsafetensors",
}


def plot_convert_processes(data: dict, png: str) -> None:
    results = data["results"]
    dates = data.get("dates", {})
    groups = [
        f"{FORMAT_NAMES.get(r['format'], r['format'])}, {dates.get(r['format'], data['date'])}"
        for r in results
    ]
    converters = []
    for r in results:
        converters += [c for c in r["medians"] if c not in converters]
    palette = ["tab:blue", "tab:cyan", "tab:purple", "tab:orange", "tab:green", "tab:red"]
    colors = dict(zip(converters, palette))

    def column(key, scale=1.0):
        return {
            c: [r["medians"][c][key] / scale if c in r["medians"] else None for r in results]
            for c in converters
        }

    fig, (top, bottom) = plt.subplots(2, 1, figsize=(8, 6.5), sharex=True)
    durable = column("durable_s")
    one = converters[0]

    labels = {
        c: [
            None if v is None else f"{v:.2f} s\n{durable[one][i] / v:.2f}×"
            for i, v in enumerate(durable[c])
        ]
        for c in converters
    }
    grouped_bars(top, groups, durable, None, colors)
    label_bars(top, durable, labels)
    top.set_ylabel("durable s\n(exit + sync, median)")
    top.set_title(f"durable time; second line: time of “{one}” ÷ this time", fontsize=9)
    headroom(top, 1.3)
    top.legend(fontsize=7, loc="upper right")

    total = column("peak_rss_anon_total", MiB)
    xs = grouped_bars(bottom, groups, total, "%.0f MiB", colors)
    bottom.set_yscale("log")
    bottom.set_ylabel("peak RssAnon, MiB (log)\nbar: all processes")
    bottom.set_title("memory; black mark: the largest single process", fontsize=9)
    largest = column("peak_rss_anon_process", MiB)
    for c in converters:
        for x, v, t in zip(xs[c], largest[c], total[c]):
            if v is None:
                continue
            bottom.scatter([x], [v], marker="_", s=250, color="black", zorder=3)
            if round(v) != round(t):
                bottom.text(x, v * 0.85, f"{v:.0f}", ha="center", va="top", fontsize=7)
    headroom(bottom, 1.3)
    bottom.tick_params(axis="x", labelbottom=True)

    finish(
        fig,
        f"Checkpoint conversion across processes ({data.get('cpus', '?')} CPUs, one host): "
        f"jax-ucp convert --processes N vs ds_to_universal — {data['date']}",
        png,
    )


def label_bars(ax, series, labels, size=7):
    """Write ``labels[name][i]`` above bar i of each series (as placed by grouped_bars)."""
    names = list(series)
    width = 0.8 / len(names)
    for j, name in enumerate(names):
        for i, (v, text) in enumerate(zip(series[name], labels[name])):
            if v is None or text is None:
                continue
            x = i + (j - (len(names) - 1) / 2) * width
            ax.annotate(
                text,
                (x, v),
                xytext=(0, 2),
                textcoords="offset points",
                ha="center",
                va="bottom",
                fontsize=size,
            )


# ---------------------------------------------------------------- many_tensors


def plot_many_tensors(data: dict, png: str) -> None:
    trees = data["results"]
    contenders = list(next(iter(trees.values()))["contenders"])
    base = contenders[0]
    colors = dict(zip(contenders, ["tab:blue", "tab:orange", "tab:green"]))
    groups = [f"{name}\n({t['tensors']:,} tensors)" for name, t in trees.items()]
    fig, axes = plt.subplots(1, 2, figsize=FIGSIZE)
    for ax, op in zip(axes, ("save", "restore")):
        key = f"{op}_ms_per_tensor"
        series = {c: [t["contenders"][c][key] for t in trees.values()] for c in contenders}
        labels = {
            c: [
                f"{v:.2f}" if c == base else f"{v:.2f}\n{v / b:.2f}×"
                for v, b in zip(series[c], series[base])
            ]
            for c in contenders
        }
        grouped_bars(ax, groups, series, None, colors)
        label_bars(ax, series, labels, size=6.5)
        ax.set_ylabel(f"{op} ms per tensor (median)")
        ax.set_title(f"{op}; under each Orbax value: ÷ {base}", fontsize=9)
        headroom(ax, 1.15)
    axes[0].legend(fontsize=7, loc="upper left")
    rounds = len(next(iter(trees.values()))["contenders"][base]["all_save_s"])
    finish(
        fig,
        f"Many tensors: float32, one CPU device per leaf, medians of {rounds} — {run_date(data)}",
        png,
    )


# ---------------------------------------------------------------- memory


def plot_memory(data: dict, png: str) -> None:
    rows = data["results"]
    contenders = list(dict.fromkeys(r["contender"] for r in rows))
    by = {(r["contender"], r["direction"]): r for r in rows}
    directions = ("save", "restore")
    colors = {"save": "tab:blue", "restore": "tab:orange"}
    groups = [c.replace(" ", "\n", 1) for c in contenders]
    fig, (left, right) = plt.subplots(1, 2, figsize=FIGSIZE, width_ratios=(3, 2))

    peak = {
        d: [by[c, d]["RssAnon_peak_increase"] / GiB if (c, d) in by else None for c in contenders]
        for d in directions
    }
    grouped_bars(left, groups, peak, "+%.2f", colors)
    arrays = {by[c, "restore"]["array_bytes"] for c in contenders if (c, "restore") in by}
    for nbytes in arrays:
        left.axhline(
            nbytes / GiB,
            ls="--",
            color="gray",
            lw=1,
            label=f"restored arrays themselves ({nbytes / GiB:.2f} GiB)",
        )
    left.set_ylabel("peak RssAnon increase, GiB")
    left.set_title("host memory (above the line: held beyond the arrays)", fontsize=9)
    headroom(left, 1.15)
    left.legend(fontsize=7, loc="upper left")

    secs = {
        d: [by[c, d]["seconds"] if (c, d) in by else None for c in contenders] for d in directions
    }
    grouped_bars(right, groups, secs, "%.1f", colors)
    right.set_ylabel("seconds")
    right.set_title("time of each operation", fontsize=9)
    headroom(right, 1.1)

    finish(
        fig,
        "Host memory: save on 2×4, restore onto 4×2, "
        f"{arrays.pop() / GiB:.0f} GiB float32, one fresh process each — {run_date(data)}",
        png,
    )


# ---------------------------------------------------------------- object_store


def object_store_key(key: str) -> tuple[str, str]:
    """Split a bench_object_store.py key into (contender, operation).

    'jax_ucp -> s3://' is a save to s3://; 'jax_ucp s3:// -> 4x2 mesh' a restore from s3://.
    """
    left, dest = key.split(" -> ", 1)
    words = left.split()
    rest = " ".join(words[1:])
    if "://" in rest or rest.endswith("dir"):
        return words[0], f"restore {rest}\n→ {dest}"
    return (left if words[0].lower() == "orbax" else words[0]), f"save\n→ {dest}"


def plot_object_store(data: dict, png: str) -> None:
    measured = {object_store_key(k): v for k, v in data["median_seconds"].items()}
    failed = {object_store_key(k): v for k, v in data.get("errors", {}).items()}
    ops, contenders = [], []
    for c, op in list(measured) + list(failed):
        ops += [op] if op not in ops else []
        contenders += [c] if c not in contenders else []
    # Orbax is named both "Orbax" and "Orbax StandardCheckpointer": one series.
    canon = {
        c: max((d for d in contenders if d.split()[0] == c.split()[0]), key=len) for c in contenders
    }
    names = list(dict.fromkeys(canon[c] for c in contenders))
    names.sort(key=lambda n: n.split()[0].lower() != "jax_ucp")
    colors = dict(zip(names, ["tab:blue", "tab:orange", "tab:green"]))
    series = {n: [None] * len(ops) for n in names}
    for (c, op), v in measured.items():
        series[canon[c]][ops.index(op)] = v

    fig, ax = plt.subplots(figsize=FIGSIZE)
    xs = grouped_bars(ax, ops, series, "%.2f s", colors, label_size=8, centre=False)
    headroom(ax, 1.1)
    top = ax.get_ylim()[1]
    for (c, op), err in failed.items():
        x = xs[canon[c]][ops.index(op)]
        ax.scatter([x], [top * 0.03], marker="x", s=80, color=FAIL_COLOR, zorder=3)
        ax.text(
            x,
            top * 0.08,
            "fails:\n" + err.split(":")[0],  # the exception's type; its message is in the JSON
            ha="center",
            va="bottom",
            fontsize=7,
            color=FAIL_COLOR,
        )
    for n in names:
        for i, v in enumerate(series[n]):
            if v is None and not any(canon[c] == n and op == ops[i] for c, op in failed):
                ax.text(xs[n][i], top * 0.02, "not run", ha="center", fontsize=7, color="gray")
    ax.set_xlim(-0.6, len(ops) - 0.4)
    ax.set_ylabel("seconds (median)")
    ax.legend(fontsize=8, loc="upper right")
    exact = {True: "s3:// restore bit-exact", False: "s3:// restore NOT bit-exact"}
    finish(
        fig,
        f"Object stores: {data['tensors']} × {data['tensor_bytes'] / MiB:.0f} MiB fp32 saved on "
        f"2×4 to s3:// (local moto server) and to a local dir, restored onto 4×2\n"
        f"medians of {data['rounds']}; {exact.get(data.get('bit_exact'), '')} — {run_date(data)}, "
        f"{data.get('machine', '')}",
        png,
    )


# ---------------------------------------------------------------- main

PLOTS = {
    "async_stall": plot_async_stall,
    "convert_processes": plot_convert_processes,
    "many_tensors": plot_many_tensors,
    "memory": plot_memory,
    "object_store": plot_object_store,
}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", choices=sorted(PLOTS), help="draw this benchmark's PNG only")
    args = ap.parse_args()
    for name, plot in PLOTS.items():
        if args.only and name != args.only:
            continue
        data = load(name)
        if data is None:
            print(f"skip {name}: no docs/benchmark_{name}.json")
            continue
        png = os.path.join(DOCS, f"benchmark_{name}.png")
        plot(data, png)
        print(f"wrote {os.path.relpath(png, ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
