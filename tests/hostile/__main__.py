"""The long run, and the replay of one mutation.

    python3 -m tests.hostile --seed 1 --count 200            # every kind, 200 mutations each
    python3 -m tests.hostile --seed 1 --count 50 --kind verl --kind ucp
    python3 -m tests.hostile --kind ucp --seed 1 --index 17  # replay one, print all it did

Prints, per input kind, how many mutations it tried, what the entry points did with them
(same / refused / reported / undetectable / ...) and every failure with its reproducer;
``--json FILE`` writes every result."""

from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import sys
import time

from tests.hostile.inputs import KINDS
from tests.hostile.runner import run_kind


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python3 -m tests.hostile", description=__doc__)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--count", type=int, default=20, help="mutations per kind")
    ap.add_argument("--start", type=int, default=0, help="first mutation index")
    ap.add_argument("--kind", action="append", choices=sorted(KINDS), help="default: all")
    ap.add_argument("--index", type=int, action="append", help="replay these indices only")
    ap.add_argument("--short", action="store_true", help="the CI slice's entry points only")
    ap.add_argument("--json", dest="json_out", help="write every result to this file")
    ap.add_argument("--python", default=sys.executable, help="the children's interpreter")
    args = ap.parse_args(argv)
    kinds = args.kind or sorted(KINDS)
    indices = args.index or list(range(args.start, args.start + args.count))
    failures = 0
    everything = []
    for kind in kinds:
        t0 = time.monotonic()
        results = run_kind(kind, args.seed, indices, long=not args.short, python=args.python)
        everything += results
        outcomes = collections.Counter(label for r in results for label in r.labels.values())
        bad = [r for r in results if r.failed]
        failures += len(bad)
        print(
            f"{kind}: {len(results)} mutations in {time.monotonic() - t0:.0f} s, "
            f"{len(bad)} failing; entry outcomes {dict(sorted(outcomes.items()))}",
            flush=True,
        )
        for r in bad:
            print(r.report(), flush=True)
        if args.index:
            for r in results:
                print(json.dumps(dataclasses.asdict(r), indent=1, default=str))
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump([dataclasses.asdict(r) for r in everything], f, indent=1, default=str)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
