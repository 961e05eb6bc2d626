"""The oracle: what each entry point did with a hostile copy, judged against what it did with
the intact one.

Allowed: the same result, bit for bit; one of the project's errors (``UCPError``) naming a file
or a parameter; ``verify`` reporting the damage; ``fallback=True`` taking an older intact step
with a ``ResumeWarning``; ``optax_from_torch`` building the optimizer without what a lost file
recorded (a schedule, clipping), listed in its ``unrecovered`` and warned; and, in a format
without checksums over tensor bytes, a flipped or swapped payload giving other bytes under the
same names, shapes and dtypes (undetectable by the format: counted apart, never a failure), and
a plan giving the shapes such a format's swapped or flipped metadata says (a plan reads no
tensor bytes; the restore is judged). Everything else is a failure: a different value, a raw
exception, an unnamed error, a file opened outside the input (a link followed out), a write
outside the output, a pickle's payload run, a display carrying live HTML or terminal escapes,
strict-JSON output that is not, and (judged by the parent) a signal or a hang."""

from __future__ import annotations

import os
import re

#: outcome labels that pass
PASS = {
    "unavailable",
    "step-added",
    "same",
    "refused",
    "reported",
    "fell-back",
    "step-gone",
    "undetectable",
    "skipped",
    "said",
    "plan-only",
    "step-renamed",
    "record-consistent",
}

_HTML = re.compile(r"<\s*(script|img|iframe|svg)\b", re.I)
_ESC = re.compile(r"[\x00-\x08\x0b-\x1f\x7f\u202e]")


def names_of(root: str, digest_keys=()) -> set[str]:
    """What an error may name: the input's path, its files' and folders' names, its tensors."""
    out = {root}
    for _dirpath, dirnames, filenames in os.walk(root):
        out.update(dirnames)
        out.update(filenames)
    for k in digest_keys:
        out.update(re.split(r"[/'\[\]]+", str(k)))
    return {n for n in out if len(n) >= 3 and not n.isdigit()}


#: entry points whose result holds a run's settings (what a continuation reads)
SETTINGS_ENTRIES = ("optax", "optax-direct", "convert-settings")


def judge_entry(
    entry: str, base, got, *, kind, mutation_op: str, names: set[str], alt=None, mutation=None
):
    """(label, detail) for one entry point: ``base``/``got`` are ``("ok", digest, warnings)`` or
    ``("error", class name, message, is_ucp)``; ``alt`` maps older steps to their digests;
    ``mutation`` (``mutations.Mutation``): what was done, for the operators whose answer must
    name it (``record-disagree``: the record edited; ``settings-rewrite``: the setting)."""
    if got[0] == "skipped":
        return "skipped", ""
    if base[0] != "ok":  # the entry cannot read even the intact copy here (e.g. needs torch)
        return "unavailable", f"{base[1]}: {base[2][:200]}"
    record = _edited_record(mutation) if entry in SETTINGS_ENTRIES else None
    if got[0] == "ok" and record is not None and got[1] == base[1]:
        # one record of a fact edited, the others not: a reader that read only the others
        # continues as before, silently; it must refuse, or say it (a new warning naming it)
        said = [w for w in got[2] if w not in base[2] and any(r in w for r in record)]
        if said:
            return "said", f"continued as the other records say, warned: {said[0][:200]}"
        return "disagreement-unseen", f"{mutation.describe()}: continued as intact, nothing said"
    if got[0] == "ok" and mutation_op == "settings-rewrite" and entry.startswith("verify"):
        setting = _setting(mutation)
        value = got[1]
        if isinstance(value, str) and value.startswith("reported") and not _names(value, setting):
            return "unnamed-setting", f"{setting} changed, verify reported {value[:200]!r}"
    if got[0] == "ok":
        value, warnings = got[1], got[2]
        if value == base[1]:
            return "same", ""
        if entry == "verify" or entry == "verify-against":
            if isinstance(value, str) and value.startswith("reported"):
                return "reported", value[:200]
            return "silent-wrong", f"verify said {value!r}, intact said {base[1]!r}"
        older = [s for s, d in (alt or {}).items() if d == value]
        if "fallback" in entry and older and any("ResumeWarning" in w for w in warnings):
            return "fell-back", f"to step {older[0]}"
        if entry == "latest-step-fallback" and value in (alt or {}):
            return "fell-back", f"to step {value}"
        if entry.startswith("latest-step") and mutation_op == "duplicate":
            return "step-added", f"a copied step folder is a step: {value}"
        if entry.startswith("latest-step") and mutation_op == "rename" and value not in (alt or {}):
            # a step folder renamed to another step number is that step, as Orbax's manager
            # lists it (the restores of it are judged apart: an older step's values, or refused)
            return "step-renamed", f"a step folder renamed is the step it names: {value}"
        gone = older or (entry.startswith("latest-step") and value in (alt or {}))
        if gone and mutation_op in ("delete", "rename", "symlink-out", "fifo"):
            return "step-gone", f"{entry} gave step {older[0] if older else value}"
        if mutation_op in ("delete", "rename") and _subset(value, base[1]):
            # the importers' own word for it: "... the weights imported alone" (a lost optimizer)
            said = any("imported alone" in w for w in warnings)
            return "said" if said else "dropped", "went on without what the mutation removed" + (
                ", warned: " if said else ": "
            ) + _diff(base[1], value)
        if entry.startswith("optax") and _said(base[1], value, warnings):
            return "said", f"went on without {value['unrecovered']}, warned"
        new = [w for w in warnings if w not in base[2] and any(n in w for n in names)]
        if entry.startswith("optax") and new and value.get("params") == base[1].get("params"):
            # records that cannot be told edited from chosen (a Trainer's client optimizer)
            return "said", f"continued as the files say, warned: {new[0][:200]}"
        payload = mutation_op in ("flip-data", "flip-meta", "swap")
        if (
            entry == "plan-direct"
            and mutation_op in ("swap", "flip-meta", "record-swap")
            and not kind.checksummed
            and isinstance(value, dict)
            and value.keys() == base[1].keys()
        ):  # a plan reads the metadata alone: what it says changed, the restore judges
            return "plan-only", _diff(base[1], value)
        if payload and not kind.checksummed and _data_only(base[1], value):
            return "undetectable", "tensor bytes differ, names/shapes/dtypes the same"
        if mutation_op == "record-swap" and _data_only(base[1], value):
            # the record and what it lists agree: only a cross-check could tell (counted apart)
            return "record-consistent", "tensor bytes differ, every digest agrees"
        return "silent-wrong", _diff(base[1], value)
    cls, message, is_ucp = got[1], got[2], got[3]
    if mutation_op == "path-form":  # nothing changed but how the path is typed
        return "path-form-refused", f"{cls}: {message[:400]}"
    if cls == "NotStrictJson":
        return "not-strict-json", message[:300]
    if not is_ucp:
        return "raw-exception", f"{cls}: {message[:400]}"
    if not any(n in message for n in names):
        return "unnamed-error", f"{cls}: {message[:400]}"
    if record is not None and not (
        any(r in message for r in record) and _another_file(message, record, names)
    ):  # a refusal of a disagreement names both records (the edited one and another)
        return "unnamed-record", f"{mutation.describe()}: {cls}: {message[:400]}"
    if mutation_op == "settings-rewrite" and not _names(message, _setting(mutation)):
        return "unnamed-setting", f"{_setting(mutation)} changed: {cls}: {message[:400]}"
    return "refused", f"{cls}"


def _edited_record(mutation) -> tuple[str, ...] | None:
    """How an answer may name the record ``record-disagree`` edited: its file's name, or the
    DCP object's (``object: what``); None for any other operator."""
    if mutation is None or mutation.op != "record-disagree":
        return None
    names = [os.path.basename(mutation.target)]
    if ":" in mutation.detail:  # a rank's optimizer object inside a .distcp (its shard aside)
        names.append(mutation.detail.split(":")[0].split("/")[0])
    return tuple(names)


#: how a refusal sets one record against another inside one file (common.pt's args, its
#: scheduler and its groups; recipe_state.pt's progress against the optimizer's step)
_AGAINST = ("disagree", " but ", " is not ", " not the ", " differ")


def _another_file(message: str, record: tuple[str, ...], names: set[str]) -> bool:
    """``message`` names a file or object of the input besides the record edited (the record
    it disagrees with), or sets two records of one file against each other, their values
    stated."""
    files = {n for n in names if "." in n and not n.startswith("/")}
    others = [n for n in files if n not in record and not any(n in r for r in record)]
    against = any(w in message for w in _AGAINST) or message.count(" = ") >= 2
    return any(n in message for n in others) or against


def _names(text: str, setting: str) -> bool:
    """``text`` names the ``setting`` (the certificate's absence by its own words)."""
    text = " ".join(text.split())  # a terminal's line breaks
    certificate = setting == "source.certificate" and "no certificate recorded" in text
    return setting in text or certificate


def _setting(mutation) -> str:
    """The setting ``settings-rewrite`` changed, as ``verify --against`` names it: the field
    of ``ucp.json``'s ``source`` it sits in (``source.optimizer``...)."""
    return ".".join(mutation.detail.split(" ")[0].split(".")[:2])


def _said(base, value, warnings) -> bool:
    """An optimizer built without more than the intact copy's (``unrecovered`` grew: a lost
    file recorded it), the params the same, and a warning saying it."""
    if not (isinstance(base, dict) and isinstance(value, dict)):
        return False
    before, after = base.get("unrecovered") or [], value.get("unrecovered") or []
    grew = set(after) > set(before)
    return grew and value.get("params") == base.get("params") and bool(warnings)


def _data_only(a, b) -> bool:
    """Two digests with the same tensors (names, shapes, dtypes) and values."""
    if not (isinstance(a, dict) and isinstance(b, dict)) or a.keys() != b.keys():
        return False
    for k in a:
        x, y = a[k], b[k]
        if isinstance(x, dict):
            if not _data_only(x, y):
                return False
        elif isinstance(x, list) and isinstance(y, list) and x[:1] == y[:1] == ["tensor"]:
            if x[:3] != y[:3]:
                return False
        elif x != y:
            return False
    return True


def _subset(small, big) -> bool:
    """``small`` is ``big`` with entries left out, the rest identical."""
    return (
        isinstance(small, dict)
        and isinstance(big, dict)
        and small.keys() < big.keys()
        and all(big[k] == v for k, v in small.items())
    )


def _diff(a, b) -> str:
    if isinstance(a, dict) and isinstance(b, dict):
        gone = sorted(set(a) - set(b))[:5]
        new = sorted(set(b) - set(a))[:5]
        changed = sorted(k for k in set(a) & set(b) if a[k] != b[k])[:5]
        return f"different value: missing {gone}, extra {new}, changed {changed}"
    return f"different value: {str(b)[:200]!r} instead of {str(a)[:200]!r}"


def judge_displays(shown: dict, hostile_names: bool) -> list[tuple[str, str]]:
    """A Markdown or pretty display carrying live HTML or terminal control characters from a
    name the input chose (HTML displays must escape; text ones must not pass escapes)."""
    out = []
    if not hostile_names:
        return out
    for where, text in shown.items():
        live = _HTML.search(text)
        if where in ("_repr_markdown_", "_repr_html_") and live:
            out.append(("display-unsafe", f"{where} carries live HTML: {live[0]!r}"))
        if where in ("_repr_pretty_", "str", "repr") and _ESC.search(text.replace("\n", "")):
            out.append(("display-unsafe", f"{where} passes a control character through"))
    return out
