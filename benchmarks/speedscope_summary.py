"""Where the time goes in a py-spy speedscope profile: per thread group, top frames.

  python benchmarks/speedscope_summary.py PROFILE.json [--top 15] [--json OUT.json]

Threads are grouped by name (MainThread, ucp-read_*, ucp-write_*, asyncio_*, unnamed native
threads: XLA / TensorStore); per group it prints the sampled seconds, then the frames holding the
most samples inclusively (Python functions as ``name (file:line)``, native ones by symbol).
Samples of threads parked in a queue, lock or condition wait are counted as idle and left out
(py-spy's own idle detection misses some of them with ``--native``); samples waiting for the GIL
are counted as busy but reported separately ("GIL wait").
"""

from __future__ import annotations

import argparse
import collections
import json
import re


def group_of(thread_name: str) -> str:
    m = re.search(r'"([^"]*)"', thread_name)
    name = m.group(1) if m else ""
    if not name:
        return "native (XLA/TensorStore pools)"
    return re.sub(r"_\d+$", "_*", name)


IDLE = (
    "_queue_SimpleQueue_get",
    "PyThread_acquire_lock_timed",
    "pthread_cond_wait",
    "pthread_cond_timedwait",
    "FutexWaiter",
    "epoll_wait",
    "Condition.wait",
    "Event.wait",
    "BlockingCounter::Wait",
)
GIL = ("take_gil", "PyEval_RestoreThread", "PyEval_AcquireThread", "PyGILState_Ensure")


def label(frame: dict) -> str:
    name = frame.get("name", "?")
    file = (frame.get("file") or "").rsplit("/", 1)[-1]
    if file.endswith(".py"):
        return f"{name} ({file}:{frame.get('line', '')})"
    return name[:100]


def summarise(path: str, top: int) -> dict:
    with open(path) as f:
        d = json.load(f)
    frames = d["shared"]["frames"]
    groups: dict[str, dict] = {}
    for p in d["profiles"]:
        g = groups.setdefault(
            group_of(p.get("name", "")),
            {
                "seconds": 0.0,
                "idle": 0.0,
                "gil": 0.0,
                "inclusive": collections.Counter(),
                "self": collections.Counter(),
            },
        )
        for stack, w in zip(p["samples"], p["weights"]):
            names = [label(frames[i]) for i in stack]
            if any(x.startswith(IDLE) for x in names[-6:]):
                g["idle"] += w
                continue
            g["seconds"] += w
            if any(x.startswith(GIL) for x in names[-6:]):
                g["gil"] += w
            for n in set(names):
                g["inclusive"][n] += w
            if names:
                g["self"][names[-1]] += w
    out = {}
    for name, g in sorted(groups.items(), key=lambda kv: -kv[1]["seconds"]):
        total = g["seconds"] or 1.0
        out[name] = {
            "busy_seconds": round(g["seconds"], 3),
            "idle_seconds": round(g["idle"], 3),
            "gil_wait_seconds": round(g["gil"], 3),
            "inclusive": [(k, round(v / total, 3)) for k, v in g["inclusive"].most_common(top)],
            "self": [(k, round(v / total, 3)) for k, v in g["self"].most_common(top)],
        }
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("profile")
    ap.add_argument("--top", type=int, default=15)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    out = summarise(args.profile, args.top)
    for name, g in out.items():
        if g["busy_seconds"] < 0.05:
            continue
        print(
            f"== {name}: {g['busy_seconds']:.2f} s busy (of which GIL wait "
            f"{g['gil_wait_seconds']:.2f} s), {g['idle_seconds']:.2f} s idle"
        )
        print("   inclusive:")
        for k, v in g["inclusive"]:
            print(f"     {v * 100:5.1f}%  {k}")
        print("   self:")
        for k, v in g["self"][: max(5, args.top // 2)]:
            print(f"     {v * 100:5.1f}%  {k}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
