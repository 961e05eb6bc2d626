"""The child process: for one input kind, builds the intact copy, runs the entry points on it
(the baseline), then on one hostile copy per mutation index, under memory and file-size bounds
and the file-open spy; prints one JSON line as each mutation starts and one with its verdict,
so the parent can name the mutation a hang or a signal struck.

``python3 -m tests.hostile.child KIND SEED INDICES WORK [--long]`` (the parent runs it)."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import random
import re
import resource
import shutil
import sys
import tempfile
import time
import traceback
import warnings
from typing import Any

from tests.hostile import inputs, mutations, oracle
from tests.hostile.spy import NativeOpens, watch_opens

MEMORY_LIMIT = 6 << 30  # address space: a hostile length that allocates it all fails fast
FILE_LIMIT = 1 << 30  # no write grows a file past this


#: the parent's channel: the real stdout, kept apart from what libraries print (fd 1 goes to
#: stderr in ``main``)
_CHANNEL = sys.stdout


def emit(**record) -> None:
    _CHANNEL.write(json.dumps(record, default=str) + "\n")
    _CHANNEL.flush()


class Child:
    def __init__(self, kind: inputs.Kind, work: str, long: bool):
        self.kind, self.work, self.long = kind, work, long
        self.entries = kind.entries + (kind.long_entries if long else ())
        self.baselines: dict[str, dict] = {}

    # ---- one run of the entry points over the copy at <work>/in/src

    def reset(self, pristine: str) -> None:
        for d in ("in", "outarea", "outside"):
            shutil.rmtree(os.path.join(self.work, d), ignore_errors=True)
        marker = os.path.join(self.work, mutations.PWNED)
        if os.path.exists(marker):
            os.remove(marker)
        os.makedirs(os.path.join(self.work, "outarea"))
        shutil.copytree(pristine, os.path.join(self.work, "in", "src"), symlinks=True)

    def run_entries(self, inp: inputs.Input) -> tuple[dict, list]:
        """Each entry point's outcome, and what the spy saw amiss (reads outside the input and
        writes outside the output, realpaths)."""
        import jax_ucp

        allowed_reads = [os.path.realpath(inp.root), os.path.realpath(os.path.dirname(inp.out))]
        if inp.against:
            allowed_reads.append(os.path.realpath(inp.against))
        work = os.path.realpath(self.work)
        out_area = os.path.realpath(os.path.dirname(inp.out))
        seen: dict[tuple[str, str], None] = {}  # (what in which entry, realpath), in order
        now = [""]

        def note(path, writing: bool) -> None:
            if isinstance(path, int):
                return
            real = os.path.realpath(os.fsdecode(path))
            if writing and _temporary(real) and not _under(real, work):
                return  # a library's temporary file (the harness's own folder is no such)
            if writing and not _under(real, out_area) and not real.startswith("/dev/"):
                seen[(f"write-outside in {now[0]}", real)] = None
            elif (
                not writing
                and _under(real, work)
                and not any(_under(real, a) for a in allowed_reads)
            ):
                seen[(f"read-outside in {now[0]}", real)] = None

        outcomes: dict = {}
        state: dict = {}
        # every file opened in the work folder outside the input and the output, by anyone
        # (TensorStore's native reads too): the allowed folders are not watched
        native = NativeOpens(work, lambda d: any(_under(d, a) for a in allowed_reads))
        for entry in self.entries:
            now[0] = entry
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                try:
                    with watch_opens(note):
                        value = inputs.run_entry(entry, inp, state)
                except inputs.CliFailure as e:
                    if e.raw is not None:
                        outcomes[entry] = ("error", type(e.raw).__name__, str(e.raw), False)
                    else:
                        outcomes[entry] = ("error", "CLI exit", str(e), True)
                except BaseException as e:
                    tb = _where(e)
                    is_ucp = isinstance(e, jax_ucp.UCPError)
                    outcomes[entry] = ("error", type(e).__name__, str(e) + "\n" + tb, is_ucp)
                else:
                    if isinstance(value, str) and value.startswith("skipped"):
                        outcomes[entry] = ("skipped", value)
                    else:
                        kinds = [f"{w.category.__name__}: {str(w.message)[:200]}" for w in caught]
                        outcomes[entry] = ("ok", _plain(value), kinds)
            if "displays" in state:
                outcomes[entry + ":displays"] = state.pop("displays")
            for path in native.drain():
                seen[(f"read-outside in {entry}", os.path.realpath(path))] = None
        native.close()
        return outcomes, list(seen)

    # ---- the intact copy

    def baseline(self, source: str) -> dict:
        if source in self.baselines:
            return self.baselines[source]
        pristine = os.path.join(self.work, "pristine", str(len(self.baselines)))
        inp = inputs.build(source, pristine, self.work)
        self.reset(pristine)
        outcomes, seen = self.run_entries(inputs.upload(inp, "m") if self.kind.remote else inp)
        alt = {}
        for s in inp.steps:  # every step's values, for what a fallback or a gone step returns
            import jax_ucp

            alt[s] = inputs.tree_digest(jax_ucp.restore(inp.path, step=s))
            if s == max(inp.steps):
                alt.pop(s)
        base = {"pristine": pristine, "inp": inp, "outcomes": outcomes, "seen": seen, "alt": alt}
        keys = []
        for o in outcomes.values():
            if isinstance(o, tuple) and o[0] == "ok" and isinstance(o[1], dict):
                keys += list(o[1])
        base["names"] = oracle.names_of(inp.root, keys) | oracle.names_of(pristine)
        self.baselines[source] = base
        return base

    # ---- one mutation

    def run(self, seed: int, index: int) -> dict:
        source = self.kind.sources[index % len(self.kind.sources)]
        base = self.baseline(source)
        findings = [("baseline-" + w, p) for w, p in base.pop("seen", ())]  # said once
        inp: inputs.Input = base["inp"]
        self.reset(base["pristine"])
        rng = random.Random(f"{seed}/{self.kind.name}/{index}")
        outside = os.path.join(self.work, "outside")
        given = os.path.relpath(inp.path, inp.root)
        m = mutations.mutate(inp.root, rng, outside, ops=self.kind.ops, given=given)
        emit(event="mutated", index=index, source=source, mutation=m.describe())
        t0 = time.monotonic()
        form = {"path-form": m.detail, "linked-path-out": m.detail.split(";")[0]}.get(m.op)
        if form is not None:  # the input, its path typed another way (through links)
            with path_in_form(inp, form, self.work) as typed:
                got, seen = self.run_entries(typed)
                here = os.getcwd()
            # a result naming the path names it as typed: the same path, told apart no more
            got = _untyped(got, here, os.path.realpath(inp.path), inp.path)
        else:
            read = inputs.upload(inp, f"m{index}") if self.kind.remote else inp
            got, seen = self.run_entries(read)
        names = base["names"] | oracle.names_of(inp.root) | {f"s3://hostile/m{index}"}
        labels = {}
        for entry in self.entries:
            label, detail = oracle.judge_entry(
                entry,
                base["outcomes"][entry],
                got[entry],
                kind=self.kind,
                mutation_op=m.op,
                names=names,
                alt=base["alt"],
                mutation=m,
            )
            labels[entry] = label
            if label not in oracle.PASS:
                findings.append((f"{label} in {entry}", detail))
            shown = got.get(entry + ":displays")
            if shown:
                hostile = m.op in ("rename", "stray-copy", "json-value")
                for label2, detail2 in oracle.judge_displays(shown, hostile):
                    findings.append((f"{label2} in {entry}", detail2))
        findings += [(w, p) for w, p in seen]
        findings += self.consistency(got, base)
        if os.path.exists(os.path.join(self.work, mutations.PWNED)):
            findings.append(("code-ran", "a hostile pickle's payload ran (PWNED was created)"))
        return {
            "source": source,
            "mutation": m.describe(),
            "op": m.op,
            "labels": labels,
            "findings": findings,
            "seconds": round(time.monotonic() - t0, 3),
        }

    @staticmethod
    def consistency(got: dict, base: dict) -> list[tuple[str, str]]:
        """``latest_step(fallback=True)`` and ``restore(step="latest", fallback=True)`` choose
        the same step (docs/ELASTIC.md calls them the same choice)."""
        a, b = got.get("latest-step-fallback"), got.get("restore-latest-fallback")
        if not (a and b and a[0] == "ok" and b[0] == "ok"):
            return []
        steps = {s: d for s, d in base["alt"].items()}
        newest = base["outcomes"]["latest-step"]
        if newest[0] == "ok":
            steps[newest[1]] = base["outcomes"]["restore-latest"][1]
        chose = [s for s, d in steps.items() if d == b[1]]
        if chose and a[1] in steps and a[1] not in chose:
            return [
                ("resume-disagree", f"latest_step(fallback=True) = {a[1]}, restore chose {chose}")
            ]
        return []


@contextlib.contextmanager
def path_in_form(inp: inputs.Input, form: str, work: str):
    """``inp`` with its path typed as ``form`` (``mutations.PATH_FORMS``), the working directory
    ``<work>/in/link`` (a link to ``<work>/in/cwd``) meanwhile; ``x`` is the path relative to
    ``<work>/in``, ``mnt`` a link to its parent folder, ``x-link`` a link to it."""
    base = os.path.join(work, "in")
    os.makedirs(os.path.join(base, "cwd"), exist_ok=True)
    if not os.path.lexists(os.path.join(base, "link")):
        os.symlink("cwd", os.path.join(base, "link"))
    rel = os.path.relpath(inp.path, base)
    for name, target in (("mnt", os.path.dirname(inp.path)), ("x-link", inp.path)):
        if os.path.lexists(os.path.join(base, name)):
            os.remove(os.path.join(base, name))
        os.symlink(target, os.path.join(base, name))
    typed = {
        "../x": f"../{rel}",
        "./../x/": f"./../{rel}/",
        "../x//": f"../{rel}//",
        "../link/../x": f"../link/../{rel}",
        "/abs/./x/": f"{base}/./{rel}/",
        "mnt/x": f"{base}/mnt/{os.path.basename(inp.path)}",
        "x-link": f"{base}/x-link",
    }[form]
    before = os.getcwd()
    os.chdir(os.path.join(base, "link"))
    try:
        yield dataclasses.replace(inp, path=typed)
    finally:
        os.chdir(before)


_QUOTED = re.compile(r"'([^']+)'|\"([^\"]+)\"")


def _untyped(value: Any, cwd: str, real: str, plain: str) -> Any:
    """``value`` (an outcome, nested) with every string that is a path to ``real`` from ``cwd``
    (whole, or quoted inside a repr) written as ``plain``."""

    def same(text: str) -> bool:
        return "/" in text and os.path.realpath(os.path.join(cwd, text)) == real

    def fix(text: str) -> str:
        if same(text):
            return plain
        return _QUOTED.sub(
            lambda m: m[0][0] + plain + m[0][0] if same(m[1] or m[2]) else m[0], text
        )

    if isinstance(value, str):
        return fix(value)
    if isinstance(value, dict):
        return {k: _untyped(v, cwd, real, plain) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_untyped(v, cwd, real, plain) for v in value)
    return value


def _where(e: BaseException) -> str:
    """Where ``e`` was raised, and the innermost jax_ucp frame it passed (the code to fix)."""
    frames = traceback.extract_tb(e.__traceback__)
    ours = [f for f in frames if f"{os.sep}jax_ucp{os.sep}" in f.filename]
    shown = ([ours[-1]] if ours and ours[-1] is not frames[-1] else []) + frames[-1:]
    return "".join(f"  at {f.filename}:{f.lineno} in {f.name}\n" for f in shown)


_TMP = os.path.realpath(tempfile.gettempdir())  # found once: finding it opens files


def _temporary(path: str) -> bool:
    """A write a library may make in the temporary folder: inside a folder made there, or a
    file named as ``tempfile`` names them. A
    fixed name written straight into it (``/tmp/latest_universal``) is not: on a shared
    ``/tmp`` it races other users and follows whatever link another user planted there."""
    tmp = _TMP
    if not _under(path, tmp) or path == tmp:
        return False
    rel = os.path.relpath(path, tmp)
    return os.sep in rel or re.fullmatch(r"(tmp)?[a-z0-9_]{8}", rel) is not None


def _under(path: str, root: str) -> bool:
    return path == root or path.startswith(root + os.sep)


def _plain(value):
    """JSON-safe (tuples to lists, int keys to str), so the parent compares what it reads."""
    return json.loads(json.dumps(value, default=str))


def main(argv: list[str]) -> None:
    kind, seed, indices, work = argv[0], int(argv[1]), argv[2], argv[3]
    long = "--long" in argv
    global _CHANNEL
    _CHANNEL = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)  # a library printing to stdout (DeepSpeed's logger) cannot break the channel
    shutil.rmtree(work, ignore_errors=True)  # a child restarted after a crash starts clean
    os.makedirs(work)
    resource.setrlimit(resource.RLIMIT_AS, (MEMORY_LIMIT, MEMORY_LIMIT))
    resource.setrlimit(resource.RLIMIT_FSIZE, (FILE_LIMIT, FILE_LIMIT))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    child = Child({**inputs.KINDS, **inputs.CANARIES}[kind], work, long)
    emit(event="ready")
    for i in (int(x) for x in indices.split(",") if x):
        emit(event="start", index=i)
        try:
            result = child.run(seed, i)
        except Exception:  # the harness's own failure (building, mutating): shown, not hidden
            result = {"findings": [("harness-error", traceback.format_exc()[-2000:])]}
        emit(event="done", index=i, **result)


if __name__ == "__main__":
    main(sys.argv[1:])
