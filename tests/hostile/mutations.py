"""The seeded mutation engine: one hostile change to a copy of an input folder, chosen by a
``random.Random`` alone, so (input kind, seed, index) names the same mutation on every run.

A mutation is what a careless or hostile hand does to a checkpoint: bytes flipped in data and in
metadata, a file cut short or deleted, a file or zip member duplicated, two files of one size
swapped (ranks, steps, tensors of equal shape), a name made odd (non-ASCII digits, leading zeros,
huge numbers, control characters, HTML), a file or folder replaced by a link out of the input, a
FIFO, a JSON value made special (NaN, 1e999, deep nesting, a key twice), a pickle made hostile
(GLOBAL os.system + REDUCE, a huge BINUNICODE length, memo abuse, deep nesting, another storage
type). Each returns a ``Mutation`` whose ``describe()`` is the reproducer's text."""

from __future__ import annotations

import dataclasses
import io
import json
import os
import random
import re
import shutil
import zipfile

#: the marker file a hostile pickle's payload would create if it ever ran
PWNED = "PWNED"

_DIGITS = {
    "arabic-indic digits": "٠١٢٣٤٥٦٧٨٩",
    "fullwidth digits": "０１２３４５６７８９",
    "superscript digits": "⁰¹²³⁴⁵⁶⁷⁸⁹",
}
_NUMBER = re.compile(r"[0-9]+")


@dataclasses.dataclass
class Mutation:
    """What was done, to which path (relative to the input's root), and how."""

    op: str
    target: str
    detail: str = ""

    def describe(self) -> str:
        return f"{self.op} {self.target!r}" + (f": {self.detail}" if self.detail else "")


class Context:
    """The input's tree as the mutations see it: regular files and real folders (links are left
    as they are), in sorted order, so a seed picks the same target on every machine."""

    def __init__(self, root: str, rng: random.Random, outside: str, given: str = "."):
        self.root, self.rng, self.outside = root, rng, outside
        self.given = given  # the path the entry points are given (relative): the user's own
        self.files: list[str] = []
        self.dirs: list[str] = []
        for dirpath, dirnames, filenames in os.walk(root):
            dirnames.sort()
            for d in dirnames:
                p = os.path.join(dirpath, d)
                if not os.path.islink(p):
                    self.dirs.append(os.path.relpath(p, root))
            for f in sorted(filenames):
                p = os.path.join(dirpath, f)
                if os.path.isfile(p) and not os.path.islink(p):
                    self.files.append(os.path.relpath(p, root))

    def path(self, rel: str) -> str:
        return os.path.join(self.root, rel)

    def size(self, rel: str) -> int:
        return os.path.getsize(self.path(rel))

    def read(self, rel: str) -> bytes:
        with open(self.path(rel), "rb") as f:
            return f.read()

    def write(self, rel: str, data: bytes) -> None:
        with open(self.path(rel), "wb") as f:
            f.write(data)

    def json_files(self) -> list[str]:
        out = []
        for rel in self.files:
            if self.size(rel) > 4 << 20:
                continue
            head = self.read(rel)[:1].strip()
            if rel.endswith(".json") or head in (b"{", b"["):
                try:
                    json.loads(self.read(rel))
                except ValueError:
                    continue
                out.append(rel)
        return out

    def zip_files(self) -> list[str]:
        return [r for r in self.files if zipfile.is_zipfile(self.path(r))]

    def pickles(self) -> list[tuple[str, str | None]]:
        """(file, zip member or None) of every pickle: raw pickle files (protocol >= 2) and the
        ``.pkl`` members of torch zip archives."""
        out: list[tuple[str, str | None]] = []
        for rel in self.files:
            if zipfile.is_zipfile(self.path(rel)):
                with zipfile.ZipFile(self.path(rel)) as z:
                    out += [(rel, m) for m in z.namelist() if m.endswith(".pkl")]
            elif self.read(rel)[:1] == b"\x80":
                out.append((rel, None))
        return out

    def small_files(self) -> list[str]:
        """Metadata: what is not bulk tensor data (small files, records, pickles, trackers)."""
        return [r for r in self.files if self.size(r) <= 16 << 10 or r.endswith((".json", ".pkl"))]


# ------------------------------------------------------------------ zip members


def zip_members(data: bytes) -> list[tuple[zipfile.ZipInfo, bytes]]:
    with zipfile.ZipFile(io.BytesIO(data)) as z:
        return [(i, z.read(i)) for i in z.infolist()]


def zip_write(members: list[tuple[zipfile.ZipInfo, bytes]]) -> bytes:
    """A zip of ``members`` in order (stored, as torch writes them), duplicates kept."""
    buf = io.BytesIO()
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "Duplicate name": the duplicate is the point
        with zipfile.ZipFile(buf, "w", zipfile.ZIP_STORED) as z:
            for info, payload in members:
                z.writestr(info.filename, payload)
    return buf.getvalue()


# ------------------------------------------------------------------ the operators


def _flip(data: bytearray, rng: random.Random, n: int, lo: int = 0) -> str:
    spots = []
    for _ in range(n):
        at = rng.randrange(lo, len(data))
        x = rng.randrange(1, 256)
        data[at] ^= x
        spots.append(f"{at}^{x:#04x}")
    return "bytes " + ",".join(spots)


def flip_data(c: Context) -> Mutation | None:
    big = [r for r in c.files if c.size(r) > 0]
    if not big:
        return None
    rel = c.rng.choices(big, weights=[c.size(r) for r in big])[0]
    data = bytearray(c.read(rel))
    # past the header when there is one (the payload is what a flipped disk sector hits)
    detail = _flip(data, c.rng, c.rng.choice([1, 1, 3]), lo=min(len(data) - 1, len(data) // 4))
    c.write(rel, bytes(data))
    return Mutation("flip-data", rel, detail)


def flip_meta(c: Context) -> Mutation | None:
    small = [r for r in c.small_files() if c.size(r) > 0]
    if not small:
        return None
    rel = c.rng.choice(small)
    data = bytearray(c.read(rel))
    detail = _flip(data, c.rng, 1)
    c.write(rel, bytes(data))
    return Mutation("flip-meta", rel, detail)


def truncate(c: Context) -> Mutation | None:
    sized = [r for r in c.files if c.size(r) > 1]
    if not sized:
        return None
    rel = c.rng.choice(sized)
    n = c.size(rel)
    at = c.rng.choice([0, 1, n // 2, n - 1, c.rng.randrange(n)])
    os.truncate(c.path(rel), at)
    return Mutation("truncate", rel, f"to {at} of {n} bytes")


def delete(c: Context) -> Mutation | None:
    choices = c.files + c.dirs
    if not choices:
        return None
    rel = c.rng.choice(choices)
    if os.path.isdir(c.path(rel)):
        shutil.rmtree(c.path(rel))
    else:
        os.remove(c.path(rel))
    return Mutation("delete", rel)


def _other_number(name: str, rng: random.Random) -> str | None:
    nums = list(_NUMBER.finditer(name))
    if not nums:
        return None
    m = rng.choice(nums)
    new = str(int(m.group()) + rng.choice([1, 2, 100]))
    return name[: m.start()] + new.zfill(len(m.group())) + name[m.end() :]


def duplicate(c: Context) -> Mutation | None:
    """A file or folder copied to a sibling whose number differs (an extra rank, step, shard)
    or, without a number, to ``name.1``."""
    choices = c.files + c.dirs
    if not choices:
        return None
    rel = c.rng.choice(choices)
    head, name = os.path.split(rel)
    new = _other_number(name, c.rng) or name + ".1"
    dst = os.path.join(head, new)
    if os.path.lexists(c.path(dst)):
        return None
    _copy(c.path(rel), c.path(dst))
    return Mutation("duplicate", rel, f"as {dst!r}")


def _copy(src: str, dst: str) -> None:
    if os.path.isdir(src):
        shutil.copytree(src, dst, symlinks=True)
    else:
        shutil.copy2(src, dst)


def _tree_sig(path: str) -> tuple:
    out = []
    for dirpath, dirnames, filenames in os.walk(path):
        dirnames.sort()
        for f in sorted(filenames):
            p = os.path.join(dirpath, f)
            out.append((os.path.relpath(p, path), os.path.getsize(p)))
    return tuple(out)


def swap(c: Context) -> Mutation | None:
    """Two files of one size and different bytes (or two folders of one layout) trade places:
    rank files, step folders, the arrays of two tensors of equal shape."""
    by_size: dict[tuple, list[str]] = {}
    for rel in c.files:
        if c.size(rel) > 0:
            by_size.setdefault(("f", c.size(rel)), []).append(rel)
    for rel in c.dirs:
        sig = _tree_sig(c.path(rel))
        if sig:
            by_size.setdefault(("d", sig), []).append(rel)
    pairs = []
    for group in by_size.values():
        for i, a in enumerate(group):
            for b in group[i + 1 :]:
                if not (b.startswith(a + os.sep) or a.startswith(b + os.sep)):
                    pairs.append((a, b))
    pairs = [(a, b) for a, b in pairs if _differ(c, a, b)]
    if not pairs:
        return None
    a, b = c.rng.choice(pairs)
    tmp = c.path(a) + ".swap-tmp"
    os.rename(c.path(a), tmp)
    os.rename(c.path(b), c.path(a))
    os.rename(tmp, c.path(b))
    return Mutation("swap", a, f"with {b!r}")


def _differ(c: Context, a: str, b: str) -> bool:
    pa, pb = c.path(a), c.path(b)
    if os.path.isfile(pa):
        return c.read(a) != c.read(b)
    for rel, _ in _tree_sig(pa):
        with open(os.path.join(pa, rel), "rb") as f, open(os.path.join(pb, rel), "rb") as g:
            if f.read() != g.read():
                return True
    return False


def odd_name(name: str, rng: random.Random) -> tuple[str, str] | None:
    """``name`` made odd, and how."""
    ways = ["control characters", "html", "trailing space", "newline"]
    if _NUMBER.search(name):
        ways += [*_DIGITS, "leading zeros", "huge number"]
    way = rng.choice(ways)
    if way in _DIGITS:
        table = str.maketrans("0123456789", _DIGITS[way])
        m = rng.choice(list(_NUMBER.finditer(name)))
        return name[: m.start()] + m.group().translate(table) + name[m.end() :], way
    if way == "leading zeros":
        return _NUMBER.sub(lambda m: "0" * rng.randint(1, 3) + m.group(), name, count=1), way
    if way == "huge number":
        return _NUMBER.sub("9" * rng.choice([20, 400]), name, count=1), way
    if way == "control characters":
        return name + rng.choice(["\x1b[2J\x1b[31m", "\r", "\x07\x08", "\u202e"]), way
    if way == "html":
        return name + rng.choice(
            ["<img src=x onerror=alert(1)>", "<script>alert(1)<", "&amp;"]
        ), way
    if way == "newline":
        return name + "\nfake line", way
    return name + " ", way


def rename(c: Context, keep: bool = False) -> Mutation | None:
    """A file or folder renamed to an odd name (``keep``: a copy under the odd name beside it,
    a stray that might be taken for it)."""
    choices = c.files + c.dirs
    numbered = [r for r in choices if _NUMBER.search(os.path.basename(r))]
    if not choices:
        return None
    rel = c.rng.choice(numbered if numbered and c.rng.random() < 0.7 else choices)
    head, name = os.path.split(rel)
    odd = odd_name(name, c.rng)
    if odd is None:
        return None
    new, way = odd
    dst = os.path.join(head, new)
    if len(new.encode()) > 255 or os.path.lexists(c.path(dst)):
        return None
    if keep:
        _copy(c.path(rel), c.path(dst))
    else:
        os.rename(c.path(rel), c.path(dst))
    return Mutation("stray-copy" if keep else "rename", rel, f"{way}: as {dst!r}")


def symlink_out(c: Context) -> Mutation | None:
    """A file or folder moved out of the input (same bytes) and linked back in place, by an
    absolute or a relative link."""
    choices = [r for r in c.files + c.dirs if r != c.given]  # a link the user hands us: theirs
    if not choices:
        return None
    rel = c.rng.choice(choices)
    return Mutation("symlink-out", rel, f"{_link_out(c, rel)} link to a copy outside the input")


def _away(c: Context, rel: str) -> str:
    """A new path under ``c.outside`` for ``rel``."""
    os.makedirs(c.outside, exist_ok=True)
    return os.path.join(c.outside, f"{len(os.listdir(c.outside))}-{os.path.basename(rel)}")


def _link_out(c: Context, rel: str) -> str:
    """``rel`` moved out of the input and linked back by an absolute or relative link (which)."""
    away = _away(c, rel)
    shutil.move(c.path(rel), away)
    how = c.rng.choice(["absolute", "relative"])
    link = away if how == "absolute" else os.path.relpath(away, os.path.dirname(c.path(rel)))
    os.symlink(link, c.path(rel))
    return how


def fifo(c: Context) -> Mutation | None:
    if not c.files:
        return None
    rel = c.rng.choice(c.files)
    os.remove(c.path(rel))
    os.mkfifo(c.path(rel))
    return Mutation("fifo", rel, "replaced by a FIFO (a read blocks)")


# ---- JSON

_SPECIALS = ["NaN", "Infinity", "-Infinity", "1e999", "-1", "0", "18446744073709551617", "null",
             "true", '""', '"../../../etc/passwd"', '"<script>alert(1)</script>"', "[]", "{}",
             '"\\u0661\\u0662"', "1.5", '"\\u001b[2J"']  # fmt: skip


def _json_nodes(x, path=()):
    yield path, x
    if isinstance(x, dict):
        for k, v in x.items():
            yield from _json_nodes(v, (*path, k))
    elif isinstance(x, list):
        for i, v in enumerate(x):
            yield from _json_nodes(v, (*path, i))


def _dump(x, at: tuple, text: str) -> str:
    """``x`` as JSON text with the node at ``at`` written as the raw ``text``."""
    if not at:
        return text
    head, rest = at[0], at[1:]
    if isinstance(x, dict):
        parts = [
            json.dumps(k) + ": " + (_dump(v, rest, text) if k == head else json.dumps(v))
            for k, v in x.items()
        ]
        return "{" + ", ".join(parts) + "}"
    parts = [(_dump(v, rest, text) if i == head else json.dumps(v)) for i, v in enumerate(x)]
    return "[" + ", ".join(parts) + "]"


def json_value(c: Context) -> Mutation | None:
    """A JSON record's value (a leaf or a whole object) replaced by a special one: NaN,
    Infinity, 1e999, huge integers, wrong types, hostile strings, deep nesting."""
    files = c.json_files()
    if not files:
        return None
    rel = c.rng.choice(files)
    doc = json.loads(c.read(rel))
    nodes = [p for p, _ in _json_nodes(doc) if p]
    if not nodes:
        return None
    at = c.rng.choice(nodes)
    roll = c.rng.random()
    if roll < 0.15:
        depth = c.rng.choice([2000, 100000])
        text, what = "[" * depth + "]" * depth, f"nesting {depth} deep"
    else:
        text = c.rng.choice(_SPECIALS)
        what = text
    c.write(rel, _dump(doc, at, text).encode())
    return Mutation("json-value", rel, f"{'/'.join(map(str, at))} = {what}")


def json_duplicate_key(c: Context) -> Mutation | None:
    """An object of a JSON record given one of its keys twice, the second with another value
    (parsers disagree about which wins)."""
    files = c.json_files()
    cands = []
    for rel in files:
        doc = json.loads(c.read(rel))
        cands += [(rel, p) for p, v in _json_nodes(doc) if isinstance(v, dict) and v]
    if not cands:
        return None
    rel, at = c.rng.choice(cands)
    doc = json.loads(c.read(rel))
    node = doc
    for k in at:
        node = node[k]
    key = c.rng.choice(list(node))
    other = c.rng.choice(['"other"', "7", "null", "[]"])
    inner = json.dumps(node)[:-1] + ", " + json.dumps(key) + ": " + other + "}"
    c.write(rel, _dump(doc, at, inner).encode())
    return Mutation("json-duplicate-key", rel, f"{'/'.join(map(str, at)) or '.'}[{key!r}] twice")


# ---- zip archives


def zip_duplicate_member(c: Context) -> Mutation | None:
    """A member of a zip (a torch archive's storage or pickle) present twice, the second copy
    with a flipped byte: which one a reader takes decides the values."""
    zips = c.zip_files()
    if not zips:
        return None
    rel = c.rng.choice(zips)
    members = zip_members(c.read(rel))
    i = c.rng.randrange(len(members))
    info, payload = members[i]
    second = bytearray(payload)
    if second:
        second[c.rng.randrange(len(second))] ^= 0x41
    members.insert(i + 1, (info, bytes(second)))
    c.write(rel, zip_write(members))
    return Mutation("zip-duplicate-member", rel, f"{info.filename!r} twice (second differs)")


# ---- pickles


def _hostile_pickle(rng: random.Random, original: bytes, marker: str) -> tuple[bytes, str]:
    way = rng.choice(
        ["os.system", "os.system prefixed", "builtins.eval", "huge BINUNICODE", "huge BINBYTES8",
         "memo get undefined", "memo put huge", "deep nesting", "storage type", "truncated STOP"]
    )  # fmt: skip
    cmd = f"touch {marker}".encode()
    system = b"cos\nsystem\n(V" + cmd + b"\ntR"
    if way == "os.system":
        return b"\x80\x02" + system + b".", way
    if way == "os.system prefixed":
        return b"\x80\x02" + system + b"0" + original, way
    if way == "builtins.eval":
        return b"\x80\x02cbuiltins\neval\n(V__import__('os').system('" + cmd + b"')\ntR.", way
    if way == "huge BINUNICODE":
        return b"\x80\x02X\xff\xff\xff\x7f" + b"a" * 32 + b".", way
    if way == "huge BINBYTES8":
        return b"\x80\x04\x8e" + (1 << 62).to_bytes(8, "little") + b"a" * 32 + b".", way
    if way == "memo get undefined":
        return b"\x80\x02]q\x00h\x07.", way
    if way == "memo put huge":
        return b"\x80\x02]r\xff\xff\xff\x7fj\xff\xff\xff\x7f.", way
    if way == "deep nesting":
        n = 200000
        return b"\x80\x02" + b"]" * n + b"a" * (n - 1) + b".", way
    if way == "storage type":
        kinds = [b"FloatStorage", b"HalfStorage", b"BFloat16Storage", b"IntStorage",
                 b"LongStorage", b"DoubleStorage", b"ByteStorage"]  # fmt: skip
        present = [k for k in kinds if b"\n" + k + b"\n" in original]
        if present:
            old = rng.choice(present)
            new = rng.choice([k for k in kinds if k != old])
            out = original.replace(b"\n" + old + b"\n", b"\n" + new + b"\n")
            return out, f"storage type {old.decode()} -> {new.decode()}"
        way = "truncated STOP"
    return original.rstrip(b".")[:-1] if len(original) > 2 else b"\x80", way


def pickle_hostile(c: Context) -> Mutation | None:
    """A pickle (a raw one, or a torch archive's ``data.pkl``) replaced or edited with hostile
    opcodes; a payload that ran would create the marker file ``PWNED`` in the work folder."""
    pickles = c.pickles()
    if not pickles:
        return None
    rel, member = c.rng.choice(pickles)
    marker = os.path.join(os.path.dirname(c.outside), PWNED)
    if member is None:
        new, way = _hostile_pickle(c.rng, c.read(rel), marker)
        c.write(rel, new)
        return Mutation("pickle-hostile", rel, way)
    members = zip_members(c.read(rel))
    for i, (info, payload) in enumerate(members):
        if info.filename == member:
            new, way = _hostile_pickle(c.rng, payload, marker)
            members[i] = (info, new)
    c.write(rel, zip_write(members))
    return Mutation("pickle-hostile", f"{rel}::{member}", way)


# ---- semantic operators: a change of meaning, every byte checksum intact


def _v3_codecs(z: dict) -> list | None:
    """The array-to-bytes chain of a zarr v3 ``zarr.json`` (inside its sharding codec)."""
    codecs = z.get("codecs")
    if not isinstance(codecs, list) or not codecs:
        return None
    first = codecs[0] if isinstance(codecs[0], dict) else {}
    if first.get("name") == "sharding_indexed":
        inner = (first.get("configuration") or {}).get("codecs")
        return inner if isinstance(inner, list) else None
    return codecs


def zarr_codec(c: Context) -> Mutation | None:
    """One word of an array's zarr metadata changed so that the same bytes read as another
    tensor with every checksum intact: the ``bytes`` codec made big-endian, a ``transpose``
    added, two codecs swapped, ``.``-separated chunk keys, another fill value (zarr v3); Fortran
    order or a big-endian dtype (zarr v2 ``.zarray``)."""
    metas = [r for r in c.files if os.path.basename(r) in ("zarr.json", ".zarray")]
    metas = [r for r in metas if c.size(r) <= 16 << 10]
    if not metas:
        return None
    rel = c.rng.choice(metas)
    try:
        z = json.loads(c.read(rel))
    except ValueError:
        return None
    if not isinstance(z, dict):
        return None
    if rel.endswith(".zarray"):
        dtype = z.get("dtype")
        ways = ["order F"] + (["big-endian dtype"] if str(dtype)[:1] == "<" else [])
        way = c.rng.choice(ways)
        if way == "order F":
            z["order"] = "F"
        else:
            z["dtype"] = ">" + str(dtype)[1:]
    else:
        chain = _v3_codecs(z)
        if chain is None:
            return None
        shape = z.get("shape") or []
        ways = ["bytes big-endian", "chunk keys '.'", "fill value 1"]
        ways += ["transpose added"] if len(shape) >= 2 else []
        ways += ["codecs swapped"] if len(chain) >= 3 else []
        way = c.rng.choice(ways)
        if way == "bytes big-endian":
            chain[0] = {"name": "bytes", "configuration": {"endian": "big"}}
        elif way == "chunk keys '.'":
            z["chunk_key_encoding"] = {"name": "default", "configuration": {"separator": "."}}
        elif way == "fill value 1":
            z["fill_value"] = True if z.get("data_type") == "bool" else 1
        elif way == "transpose added":
            order = list(range(len(shape)))[::-1]
            chain.insert(0, {"name": "transpose", "configuration": {"order": order}})
        else:
            chain[1], chain[2] = chain[2], chain[1]
    c.write(rel, json.dumps(z).encode())
    return Mutation("zarr-codec", rel, way)


def record_swap(c: Context) -> Mutation | None:
    """A consistent swap in a record and what it lists, so that every digest still matches and
    only a cross-check can tell: two tensors of one shape and dtype trade their ``ucp.json``
    entries' folders and shard digests (each name then reads the other's data); two files listed
    in a record of digests (megatron's ``integrity.json``) trade places and digests."""
    cands: list[tuple[str, tuple, str, str]] = []
    for rel in c.json_files():
        doc = json.loads(c.read(rel))
        if os.path.basename(rel) == "ucp.json" and isinstance(doc, dict):
            tensors = [
                e for e in doc.get("entries") or [] if isinstance(e, dict) and "shard_digests" in e
            ]
            for i, a in enumerate(tensors):
                for b in tensors[i + 1 :]:
                    if (a.get("shape"), a.get("dtype")) == (b.get("shape"), b.get("dtype")):
                        cands.append((rel, ("entries",), str(a.get("dir")), str(b.get("dir"))))
            continue
        folder = os.path.dirname(rel)
        for at, node in _json_nodes(doc):
            if isinstance(node, dict):
                listed = sorted(k for k in node if os.path.join(folder, k) in c.files)
                cands += [(rel, at, a, b) for i, a in enumerate(listed) for b in listed[i + 1 :]]
    if not cands:
        return None
    rel, at, a, b = c.rng.choice(cands)
    doc = json.loads(c.read(rel))
    if at == ("entries",):
        ea, eb = (e for e in doc["entries"] if isinstance(e, dict) and e.get("dir") in (a, b))
        for field in ("dir", "shard_digests"):
            ea[field], eb[field] = eb[field], ea[field]
        detail = f"entries of {a!r} and {b!r}: folders and shard digests traded"
    else:
        node = doc
        for k in at:
            node = node[k]
        node[a], node[b] = node[b], node[a]
        folder = os.path.dirname(rel)
        pa, pb = c.path(os.path.join(folder, a)), c.path(os.path.join(folder, b))
        os.rename(pa, pa + ".swap-tmp")
        os.rename(pb, pa)
        os.rename(pa + ".swap-tmp", pb)
        detail = f"{a!r} and {b!r} traded places and their entries in {'/'.join(map(str, at))}"
    c.write(rel, json.dumps(doc, indent=1).encode())
    return Mutation("record-swap", rel, detail)


def array_out(c: Context) -> Mutation | None:
    """An array TensorStore reads found outside the input, same bytes: its folder or one chunk
    file moved out and linked back, or (``ucp.json``) its entry's folder named through ``..``
    to a copy outside. Any read of it is a read outside (``spy.native_opens`` sees TensorStore's)."""
    metas = [r for r in c.files if os.path.basename(r) in ("zarr.json", ".zarray")]
    arrays = sorted({os.path.dirname(r) for r in metas} - {"", c.given})
    if not arrays:
        return None
    arr = c.rng.choice(arrays)
    chunks = [r for r in c.files if r.startswith(arr + os.sep) and r not in metas]
    ways = ["folder linked out"] + ["chunk linked out"] * bool(chunks)
    ways += ["'..' in ucp.json's dir"] if "ucp.json" in c.files else []
    way = c.rng.choice(ways)
    if way == "'..' in ucp.json's dir":
        away = _away(c, arr)
        shutil.copytree(c.path(arr), away)
        doc = json.loads(c.read("ucp.json"))
        for e in doc.get("entries") or []:
            if isinstance(e, dict) and e.get("dir") == arr:
                e["dir"] = os.path.relpath(away, c.root)
        c.write("ucp.json", json.dumps(doc, indent=1).encode())
        return Mutation("array-out", arr, f"{way}: {os.path.relpath(away, c.root)!r}")
    rel = arr if way == "folder linked out" else c.rng.choice(chunks)
    return Mutation("array-out", rel, f"{way} ({_link_out(c, rel)} link)")


def _record_edits(c: Context) -> list[tuple[str, str, object]]:
    """(file, what, change) of every one-record edit of a run's settings this copy allows: one
    copy of DeepSpeed's config (the clipping, a scheduler parameter, the optimizer), one rank's
    ``clip_grad`` or betas; a Trainer's ``initial_lr``, ``base_lrs``, schedule kind or a logged
    learning rate; a Megatron rank file's (or common state's) args.lr, scheduler position,
    iteration or betas; torchtune's progress; a verl rank's betas. Each copy states a fact
    other records of the save state too."""
    from tests import torch_edit

    edits: list[tuple[str, str, object]] = []
    for rel in c.files:
        name = os.path.basename(rel)
        if name == "trainer_state.json":
            logged = [
                h for h in json.loads(c.read(rel)).get("log_history", []) if "learning_rate" in h
            ]
            if logged:
                edits.append((rel, "a logged learning_rate doubled", None))
            continue
        if not name.endswith((".pt", ".bin")):
            continue
        try:
            with zipfile.ZipFile(c.path(rel)) as z:
                pkl = [n for n in z.namelist() if n.endswith("data.pkl")]
                tree = torch_edit.loads(z.read(pkl[0])) if pkl else None
        except Exception:  # not a torch zip, or a pickle the tree reader does not take
            continue
        state = getattr(tree, "state", None)
        if isinstance(state, dict) and "lr_scheduler_type" in state:
            edits.append((rel, "lr_scheduler_type -> cosine", _schedule_kind))
        if not isinstance(tree, dict):
            continue
        config = tree.get("ds_config")
        if isinstance(config, dict):
            edits.append((rel, "ds_config.gradient_clipping changed", _clipping))
            if isinstance((config.get("scheduler") or {}).get("params"), dict):
                edits.append((rel, "a ds_config scheduler parameter tripled", _scheduler))
            if isinstance(config.get("optimizer"), dict):
                edits.append((rel, "ds_config optimizer -> Adam, adam_w_mode false", _adam))
        inner = tree.get("optimizer_state_dict")
        if isinstance(inner, dict) and "clip_grad" in inner:
            edits.append((rel, "clip_grad changed", _clip_grad))
        if isinstance(inner, dict) and _groups(inner):
            edits.append((rel, "param_groups[0].betas[0] lowered by 0.1", _betas))
        if isinstance(tree.get("param_groups"), list):
            edits.append((rel, "param_groups' initial_lr and lr doubled", _doubled))
        if isinstance(tree.get("base_lrs"), list):
            edits.append((rel, "base_lrs doubled", _base_lrs))
        alone = name == "optimizer.bin"  # Accelerate's: no other record of its betas
        if isinstance(tree.get("param_groups"), list) and tree["param_groups"] and not alone:
            edits.append((rel, "param_groups' betas[0] lowered by 0.1", _top_betas))
        edits += [(rel, what, change) for what, change in _megatron_edits(tree)]
        if isinstance(tree.get("epochs_run"), int):  # torchtune's recipe_state.pt
            edits.append((rel, "max_steps_per_epoch lowered, total_epochs 0", _tune_progress))
    for rel, name in _rank_objects(c):  # torch_dist dp_reshardable: a rank's optimizer object
        for what, change in _RANK_EDITS.items():
            edits.append((rel, f"{name}: {what}", (name, change)))
    return edits


_RANK_OBJECT = re.compile(
    r"(chained_[0-9]+\.)?optimizer\.distributed\.dp_group_idx_[0-9]+\.optimizer/"
)


def _rank_objects(c: Context) -> list[tuple[str, str]]:
    """(``.metadata``, object) of each rank's optimizer object in a torch DCP folder (megatron-
    core's dp_reshardable and dp_zero_gather_scatter keep the param groups there)."""
    from tests import torch_edit

    found = []
    for rel in c.files:
        if os.path.basename(rel) == ".metadata":
            names = torch_edit.dcp_objects(os.path.dirname(c.path(rel)))
            rank = re.compile(
                r"(chained_[0-9]+\.)?optimizer\.distributed\.dp_group_idx_[0-9]+\.optimizer/"
            )
            found += [(rel, n) for n in names if rank.match(n)]
    return found


def _each_group(change):
    def edit(tree) -> None:
        for group in tree[0]["param_groups"]:
            change(group)

    return edit


#: one record of a rank object's param groups changed: each is stated by common.pt too
_RANK_EDITS = {
    "param_groups' betas[0] lowered by 0.1": lambda t: _lowered(t[0]["param_groups"]),
    "param_groups' lr doubled": _each_group(lambda g: g.update(lr=2 * g["lr"])),
    "param_groups' eps x 10": _each_group(lambda g: g.update(eps=10 * g["eps"])),
    "param_groups' max_lr doubled": _each_group(lambda g: g.update(max_lr=2 * g["max_lr"])),
    "param_groups' weight_decay + 0.01": _each_group(
        lambda g: g.update(weight_decay=g["weight_decay"] + 0.01)
    ),
    "param_groups' step + 1": _each_group(lambda g: g.update(step=g["step"] + 1)),
}


def _megatron_edits(tree: dict) -> list[tuple[str, object]]:
    """One Megatron rank file's (or common state's) records of the run: its args' lr, its
    scheduler's position, its iteration, its param groups' betas."""
    out: list[tuple[str, object]] = []
    if isinstance(getattr(tree.get("args"), "state", None), dict) and "lr" in tree["args"].state:
        out.append(("args.lr doubled", _args_lr))
    if isinstance(tree.get("opt_param_scheduler"), dict):
        out.append(("opt_param_scheduler.num_steps + 1", _num_steps))
    if isinstance(tree.get("iteration"), int):
        out.append(("iteration + 1", _iteration))
    inner = (tree.get("optimizer") or {}) if isinstance(tree.get("optimizer"), dict) else {}
    if isinstance(inner.get("optimizer"), dict) and inner["optimizer"].get("param_groups"):
        out.append(("the optimizer's param_groups' betas[0] lowered by 0.1", _megatron_betas))
    return out


def _args_lr(t) -> None:
    t["args"].state["lr"] = 2 * t["args"].state["lr"] or 1e-3


def _num_steps(t) -> None:
    t["opt_param_scheduler"]["num_steps"] = t["opt_param_scheduler"].get("num_steps", 0) + 1


def _iteration(t) -> None:
    t["iteration"] += 1


def _lowered(groups: list) -> None:
    for group in groups:
        if isinstance(group, dict) and isinstance(group.get("betas"), tuple | list):
            b1, b2 = group["betas"]
            group["betas"] = (round(b1 - 0.1, 6), b2)


def _top_betas(t) -> None:
    _lowered(t["param_groups"])


def _megatron_betas(t) -> None:
    _lowered(t["optimizer"]["optimizer"]["param_groups"])


def _tune_progress(t) -> None:
    if isinstance(t.get("max_steps_per_epoch"), int) and t["max_steps_per_epoch"] > 1:
        t["max_steps_per_epoch"] -= 1
    else:
        t["total_epochs"] = 0


def _groups(inner: dict) -> list:
    for key in ("base_optimizer_state", "optimizer_state_dict"):
        groups = (
            (inner.get(key) or {}).get("param_groups") if isinstance(inner.get(key), dict) else None
        )
        if isinstance(groups, list) and groups and isinstance(groups[0], dict):
            return groups
    return []


def _other(value) -> float:
    return 0.0 if value else 1.0


def _clipping(t) -> None:
    t["ds_config"]["gradient_clipping"] = _other(t["ds_config"].get("gradient_clipping", 0.0))


def _clip_grad(t) -> None:
    t["optimizer_state_dict"]["clip_grad"] = _other(t["optimizer_state_dict"]["clip_grad"])


def _scheduler(t) -> None:
    params = t["ds_config"]["scheduler"]["params"]
    key = sorted(k for k, v in params.items() if type(v) in (int, float))[0]
    params[key] = params[key] * 3 if params[key] else 1


def _adam(t) -> None:
    made = t["ds_config"]["optimizer"]
    made["type"] = "Adam"
    made.setdefault("params", {})["adam_w_mode"] = False


def _betas(t) -> None:
    group = _groups(t["optimizer_state_dict"])[0]
    b1, b2 = group["betas"]
    group["betas"] = (round(b1 - 0.1, 6), b2)


def _doubled(t) -> None:
    for g in t["param_groups"]:
        for key in ("initial_lr", "lr"):
            if isinstance(g.get(key), float):
                g[key] *= 2


def _base_lrs(t) -> None:
    t["base_lrs"] = [2 * v for v in t["base_lrs"]]


def _schedule_kind(t) -> None:
    from jax_ucp._src.torchfiles.pickle_format import Call

    kind = t.state["lr_scheduler_type"]
    t.state["lr_scheduler_type"] = (
        Call(kind.fn, ("cosine",)) if isinstance(kind, Call) else "cosine"
    )


def record_disagree(c: Context) -> Mutation | None:
    """One record of a run's settings made to disagree with the others that state the same fact
    (:func:`_record_edits`), the files otherwise intact: the continuation must refuse it by name,
    or give what the intact copy gives."""
    from tests import torch_edit

    edits = _record_edits(c)
    if not edits:
        return None
    rel, what, change = c.rng.choice(edits)
    if isinstance(change, tuple):  # a DCP object: (its name, the change)
        torch_edit.edit_dcp_object(os.path.dirname(c.path(rel)), *change)
    elif change is None:  # trainer_state.json
        doc = json.loads(c.read(rel))
        entry = next(h for h in doc["log_history"] if "learning_rate" in h)
        entry["learning_rate"] = 2 * entry["learning_rate"] or 1e-3
        c.write(rel, json.dumps(doc, indent=2).encode())
    else:
        torch_edit.edit_torch_file(c.path(rel), change)
    return Mutation("record-disagree", rel, what)


def settings_rewrite(c: Context) -> Mutation | None:
    """One run setting ``ucp.json`` records of its source (``source.optimizer``'s param groups,
    config or scheduler, ``source.megatron_optimizer``...) changed, the tensors intact: what a
    continuation reads, so ``verify --against`` the source must report it."""
    if "ucp.json" not in c.files:
        return None
    doc = json.loads(c.read("ucp.json"))
    leaves: list[tuple[list, object]] = []

    def walk(node, at: list) -> None:
        if isinstance(node, dict):
            for k, v in node.items():
                walk(v, [*at, k])
        elif isinstance(node, list):
            for i, v in enumerate(node):
                walk(v, [*at, i])
        elif type(node) in (int, float) and at[-1] != "params":
            leaves.append((at, node))

    for key in ("optimizer", "megatron_optimizer", "lr_scheduler", "recipe"):
        walk((doc.get("source") or {}).get(key), ["source", key])
    trainer = (doc.get("source") or {}).get("trainer")
    for key in sorted(trainer) if isinstance(trainer, dict) else ():  # its run, not its model
        if key != "model_config":
            walk(trainer[key], ["source", "trainer", key])
    if "certificate" in (doc.get("source") or {}):  # the certificate removed: "uncertified"
        leaves.append((["source", "certificate"], None))
    if not leaves:
        return None
    at, value = c.rng.choice(leaves)
    node = doc
    for k in at[:-1]:
        node = node[k]
    if value is None:
        del node[at[-1]]
    else:
        node[at[-1]] = value * 2 if value else 1
    c.write("ucp.json", json.dumps(doc, indent=1).encode())
    said = "removed" if value is None else "changed"
    return Mutation("settings-rewrite", "ucp.json", ".".join(map(str, at)) + " " + said)


def run_record_edit(c: Context) -> Mutation | None:
    """One field of the Megatron run ``ucp.json`` records (``source.megatron_optimizer``: its
    args, scheduler state, param groups and iteration; ``source.iteration``) doubled, gone, or
    made a string, absurd, negative, a list or None: a writer passing the record on (the
    megatron export, into common.pt) must refuse it by name or write what the intact gives.
    Left out: the fields only one record states (:data:`_ONE_RECORD`), whose change no reader
    can tell from a run that had that value, and an argument removed or set to None (or one
    unset given a value): a setting not recorded, or recorded once."""
    if "ucp.json" not in c.files:
        return None
    doc = json.loads(c.read("ucp.json"))
    source = doc.get("source") or {}
    if not isinstance(source.get("megatron_optimizer"), dict):
        return None
    leaves: list[list] = [["iteration"]] if "iteration" in source else []

    def walk(node, at: list) -> None:
        if isinstance(node, dict):
            for k, v in node.items():
                walk(v, [*at, k])
        elif isinstance(node, list) and at[-1] != "betas":
            for i, v in enumerate(node):
                walk(v, [*at, i])
        elif ".".join(str(a) for a in at[1:] if isinstance(a, str)) not in _ONE_RECORD:
            leaves.append(at)

    walk(source["megatron_optimizer"], ["megatron_optimizer"])
    at = c.rng.choice(leaves)
    node = source
    for k in at[:-1]:
        node = node[k]
    old = node[at[-1]]
    number = type(old) in (int, float)
    values = ((2 * old if old else 1) if number else "<gone>", *_FUZZ)
    if at[1:2] == ["args"]:  # an argument left out, or None, is not recorded: a run without it
        values = tuple(v for v in values if v not in ("<gone>", None) and old is not None)
    value = c.rng.choice(values or ("x",))
    if value == "<gone>":
        del node[at[-1]]
    else:
        node[at[-1]] = value
    c.write("ucp.json", json.dumps(doc, indent=1).encode())
    return Mutation("run-record-edit", "ucp.json", f"source.{'.'.join(map(str, at))} -> {value!r}")


#: what ``lora-record-edit`` puts in a field of ``source.lora`` (the adapter_config.json the
#: adapter export writes): each contradicts the tensors or is not a config peft loads as
#: trained. Left out: fields a run could have had otherwise (lora_alpha, dropout, use_rslora,
#: a regex target_modules selecting modules beside the adapted ones): no record tells them
_LORA_EDITS = {
    "peft_type": ("LOHA", "lora", None, 1, "<gone>"),
    "r": (0, -1, "4", 4.0, True, "<r+1>", None, "<gone>"),
    "lora_alpha": ("8", None, [1, 2], True, "<gone>", "NaN"),
    "target_modules": ("<drop one>", "<add o_proj>", [], "x", "(a+)+$", 5, [1], None, "<gone>"),
    "use_dora": ("<toggle>", "yes", 1),
    "modules_to_save": ("lm_head", ["lm_head"], ["q_proj"]),
    "rank_pattern": ({"q_proj": 1}, {"(a+)+": 2}, {"q_proj": "2"}, [1]),
    "lora_bias": (True,),
    "layers_to_transform": ([0],),
    "exclude_modules": (["k_proj"], "(.*)+"),
    "bias": ("all",),
    "frob_config": ({"a": 1},),
}


def _lora_value(lora: dict, field: str, value):
    """``value`` of :data:`_LORA_EDITS` made concrete for ``lora``."""
    targets = lora.get("target_modules") or []
    return (
        {
            "<r+1>": (lora.get("r") or 0) + 1 if type(lora.get("r")) is int else 1,
            "<drop one>": list(targets)[1:],
            "<add o_proj>": [*targets, "o_proj"],
            "<toggle>": not lora.get("use_dora", False),
            "NaN": float("nan"),
        }.get(value, value)
        if isinstance(value, str)
        else value
    )


def lora_record_edit(c: Context) -> Mutation | None:
    """The adapter ``ucp.json`` records edited: one field of ``source.lora`` (peft's
    ``adapter_config.json``, :data:`_LORA_EDITS`), or one LoRA tensor's entry renamed to an
    untargeted module or an unknown role, removed, or given another shape: the adapter export
    must refuse it by name, or write exactly what the intact copy gives."""
    if "ucp.json" not in c.files:
        return None
    doc = json.loads(c.read("ucp.json"))
    lora = (doc.get("source") or {}).get("lora")
    if not isinstance(lora, dict):
        return None
    params = [e for e in doc["entries"] if e.get("entry") == "tensor" and e["key"][0] == "params"]
    if c.rng.random() < 0.6:
        field = c.rng.choice(sorted(_LORA_EDITS))
        value = _lora_value(lora, field, c.rng.choice(_LORA_EDITS[field]))
        if value == "<gone>":
            lora.pop(field, None)
        else:
            lora[field] = value
        said = f"source.lora.{field} -> {value!r}"
    else:
        e = c.rng.choice(params)
        how = c.rng.choice(("module", "role", "removed", "shape"))
        name = e["key"][1]
        if how == "module":
            e["key"][1] = name.replace("_proj.", "_gate.", 1)
        elif how == "role":
            e["key"][1] = name.replace(".lora_", ".lora_C", 1)
        elif how == "removed":
            doc["entries"].remove(e)
        else:
            e["shape"][c.rng.randrange(len(e["shape"]))] += 1
        said = f"params entry {name!r}: {how} -> {e['key'][1] if how != 'shape' else e['shape']}"
    c.write("ucp.json", json.dumps(doc, indent=1).encode())
    return Mutation("lora-record-edit", "ucp.json", said)


#: fields of the record one record alone states, so a change is a run that had that value
_ONE_RECORD = {"file", "args.clip_grad"}


#: what ``group-fuzz`` puts in a param group's field: gone, a string, absurd, negative, a list
_FUZZ = ("<gone>", "x", 1e308, -1, [1, 2, 3], None)


def _fuzz_targets(node, out: list) -> None:
    """Every param group (a dict in a ``param_groups`` list) and every tensor rebuild call of a
    torch pickle's tree, depth first."""
    from jax_ucp._src.torchfiles.pickle_format import Call

    if isinstance(node, dict):
        for k, v in node.items():
            if k == "param_groups" and isinstance(v, list):
                out += [("group", g) for g in v if isinstance(g, dict)]
            _fuzz_targets(v, out)
    elif isinstance(node, list | tuple):
        for v in node:
            _fuzz_targets(v, out)
    elif isinstance(node, Call):
        if getattr(node.fn, "name", "") == "_rebuild_tensor_v2" and len(node.args) > 3:
            out.append(("tensor", node))
        else:
            _fuzz_targets(node.args, out)


def group_fuzz(c: Context) -> Mutation | None:
    """An optimizer's inputs fuzzed in its torch file: one param group field gone or made a
    string, absurd, negative, a list or None; or one state tensor given another shape (a row
    more, or 2**40 elements) than its storage holds. The readers (Adam, SGD, Muon, Adafactor)
    must refuse it by name, never continue on a wrong value."""
    from tests import torch_edit

    torch_files: list = [f for f in c.files if f.endswith((".pt", ".bin"))]
    torch_files += _rank_objects(c)  # (.metadata, a rank's optimizer object in a .distcp)
    if not torch_files:
        return None
    rel = c.rng.choice(torch_files)
    try:
        if isinstance(rel, tuple):
            tree = torch_edit.dcp_object_tree(os.path.dirname(c.path(rel[0])), rel[1])
        else:
            with zipfile.ZipFile(c.path(rel)) as z:
                pkl = [n for n in z.namelist() if n.endswith("data.pkl")]
                tree = torch_edit.loads(z.read(pkl[0])) if pkl else None
    except Exception:
        return None
    targets: list = []
    _fuzz_targets(tree, targets)
    if not targets:
        return None
    groups = [i for i, (what, _) in enumerate(targets) if what == "group"]
    tensors = [i for i, (what, _) in enumerate(targets) if what == "tensor"]
    i = c.rng.choice(c.rng.choice([p for p in (groups, tensors) if p]))  # either, alike
    what, node = targets[i]
    if what == "group":
        key = c.rng.choice(sorted(k for k in node if k != "params") or ["lr"])
        value = c.rng.choice(_FUZZ)
        said = f"param group field {key!r} -> {value!r}"
    else:
        size = tuple(node.args[2])
        absurd = c.rng.random() < 0.5
        shape = (2**40,) if absurd or not size else (size[0] + 1, *size[1:])
        said = f"a state tensor's shape {list(size)} -> {list(shape)}"

    def change(t) -> None:
        found: list = []
        _fuzz_targets(t, found)
        _, target = found[i]
        if what == "tensor":
            args = list(target.args)
            args[2] = shape
            if len(shape) != len(size):  # a contiguous stride for the new shape
                args[3] = (1,)
            object.__setattr__(target, "args", tuple(args))  # a frozen node, edited in place
        elif value == "<gone>":
            target.pop(key, None)
        else:
            target[key] = value

    if isinstance(rel, tuple):
        torch_edit.edit_dcp_object(os.path.dirname(c.path(rel[0])), rel[1], change)
        return Mutation("group-fuzz", rel[0], f"object {rel[1]!r}: {said}")
    torch_edit.edit_torch_file(c.path(rel), change)
    return Mutation("group-fuzz", rel, said)


#: how ``path-form`` hands the entry points their path (the child builds it, from a working
#: directory reached through a link, ``child.path_in_form``); the last two: paths through
#: symlinks, a linked parent folder (a mounted data disk) and a link to the input itself
PATH_FORMS = ("../x", "./../x/", "../x//", "../link/../x", "/abs/./x/", "mnt/x", "x-link")


def path_form(c: Context) -> Mutation | None:
    """Nothing changed but how the path is typed: relative through ``..``, with ``./``,
    trailing or doubled slashes, a link's ``..``, ``/./`` in an absolute path, through a linked
    parent folder or a link to it. The entry points must give what they give the plain path."""
    return Mutation("path-form", c.given, c.rng.choice(PATH_FORMS))


def linked_path_out(c: Context) -> Mutation | None:
    """An array's folder or one chunk moved out and linked back (``array-out``'s links), the
    input handed through a path of links (a linked parent folder, or a link to the input:
    ``path-form``'s last two): a path through links restores what the plain path does, but
    what leaves the input through a link inside it is still refused. The detail starts with
    the path form, then ``;``."""
    metas = [r for r in c.files if os.path.basename(r) in ("zarr.json", ".zarray")]
    arrays = sorted({os.path.dirname(r) for r in metas} - {"", c.given})
    if not arrays:
        return None
    form = c.rng.choice(PATH_FORMS[-2:])
    arr = c.rng.choice(arrays)
    chunks = [r for r in c.files if r.startswith(arr + os.sep) and r not in metas]
    rel = c.rng.choice([arr, *chunks])
    way = "folder linked out" if rel == arr else "chunk linked out"
    return Mutation("linked-path-out", rel, f"{form}; {way} ({_link_out(c, rel)} link)")


#: operators a kind draws from only when it names them (``Kind.ops``): kept out of ``OPS`` so
#: every other kind's (seed, index) still names the mutation it always did
SEMANTIC_OPS = {
    "zarr-codec": zarr_codec,
    "path-form": path_form,
    "record-swap": record_swap,
    "array-out": array_out,
    "record-disagree": record_disagree,
    "settings-rewrite": settings_rewrite,
    "group-fuzz": group_fuzz,
    "run-record-edit": run_record_edit,
    "lora-record-edit": lora_record_edit,
    "linked-path-out": linked_path_out,
}


OPS = {
    "flip-data": flip_data,
    "flip-meta": flip_meta,
    "truncate": truncate,
    "delete": delete,
    "duplicate": duplicate,
    "swap": swap,
    "rename": rename,
    "stray-copy": lambda c: rename(c, keep=True),
    "symlink-out": symlink_out,
    "fifo": fifo,
    "json-value": json_value,
    "json-duplicate-key": json_duplicate_key,
    "zip-duplicate-member": zip_duplicate_member,
    "pickle-hostile": pickle_hostile,
}


def mutate(root: str, rng: random.Random, outside: str, ops=None, given: str = ".") -> Mutation:
    """One mutation of the folder ``root`` in place, chosen by ``rng`` among ``ops`` (default:
    all) that apply to it; links out go to copies under ``outside``; ``given`` (relative to
    ``root``) is the path the entry points are handed, never itself replaced by a link."""
    names = sorted(ops or OPS)
    ctx = Context(root, rng, outside, given)
    every = {**OPS, **SEMANTIC_OPS}
    for _ in range(20):
        op = rng.choice(names)
        m = every[op](ctx)
        if m is not None:
            return m
    return Mutation("none", ".", "no mutation applies")
