"""Import-side kinds: how one parameter is spread over per-rank fragments, and how to merge them
back (numpy, or with ``lazy=True`` a TensorStore view over the fragments, no copy) and split them
again as TP/PP/EP would. ``KINDS``: TOML name -> class."""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np
import tensorstore as ts

from jax_ucp._src.errors import LanguageError
from jax_ucp._src.format import mapped_file
from jax_ucp._src.language import views
from jax_ucp._src.language.plain_form import parse_plain_form, plain_fields
from jax_ucp._src.language.settings import derived, eval_int, padded_vocab_size


class _NumpyBackend:
    """Kinds merge through a backend: this one computes numpy arrays (reads TensorStore inputs)."""

    lazy = False

    @staticmethod
    def wrap(x):
        if isinstance(x, ts.TensorStore):
            return x.read().result()
        # a view of a memory-mapped file is read with pread, never through the mapping
        return mapped_file.read_out(np.asarray(x), "reading a fragment")

    shape = staticmethod(lambda x: tuple(x.shape))
    concat = staticmethod(lambda xs, axis: xs[0] if len(xs) == 1 else np.concatenate(xs, axis))
    stack = staticmethod(np.stack)
    take = staticmethod(lambda x, axis, i: x[(slice(None),) * axis + (i,)])  # views, no copy
    slice = staticmethod(lambda x, axis, a, b: x[(slice(None),) * axis + (slice(a, b),)])


class _LazyBackend:
    """The lazy backend: TensorStore views (``ts.concat``/``ts.stack``) over the fragments."""

    lazy = True
    wrap = staticmethod(views.as_view)
    shape = staticmethod(_NumpyBackend.shape)
    concat = staticmethod(views.concat)
    stack = staticmethod(views.stack)
    take = staticmethod(views.take)
    slice = staticmethod(views.slice_axis)


def _split_sizes(backend, x, axis, sizes):
    ends = list(itertools.accumulate(sizes))
    return [backend.slice(x, axis, end - s, end) for s, end in zip(sizes, ends)]


def head_split(n: int, tp: int) -> list[int]:
    """How n heads (or groups) are spread over tp ranks: the first n % tp ranks get one more."""
    return [n // tp + (1 if r < n % tp else 0) for r in range(tp)]


def _bit_patterns(x: np.ndarray) -> np.ndarray:
    """Bit patterns, so that NaNs compare equal to themselves and -0.0 differs from 0.0."""
    x = np.ascontiguousarray(x)
    if x.dtype.itemsize in (1, 2, 4, 8):
        return x.view(np.dtype(f"u{x.dtype.itemsize}"))
    return x.view(np.uint8).reshape(x.shape + (-1,)).copy().view(np.dtype(("V", x.dtype.itemsize)))


def _check_agree(arrs, label: str, what: str) -> None:
    """A LanguageError naming the copies that differ from copy 0 and their first few differences."""
    bad = {r: d for r in range(1, len(arrs)) if (d := _first_diff(arrs[0], arrs[r]))}
    if bad:
        detail = "; ".join(f"{label} {r}: {d}" for r, d in list(bad.items())[:4])
        raise LanguageError(f"{what}: {label} 0 vs {label}(s) {sorted(bad)} ({detail})")


def _first_diff(a: np.ndarray, b: np.ndarray, block: int = 1 << 22) -> str | None:
    """None if a and b are bit-identical, else a short description of the difference."""
    if a.shape != b.shape:
        return f"shape {b.shape} vs {a.shape}"
    if a.dtype != b.dtype:
        return f"dtype {b.dtype} vs {a.dtype}"
    if a.size == 0:
        return None
    fa, fb = a.reshape(-1), b.reshape(-1)
    for s in range(0, fa.size, block):
        xa, xb = _bit_patterns(fa[s : s + block]), _bit_patterns(fb[s : s + block])
        ne = xa != xb
        if ne.any():
            i = int(np.argmax(ne)) + s
            idx = np.unravel_index(i, a.shape)
            return f"first difference at index {tuple(int(j) for j in idx)}: {fb[i - s]!r} vs {fa[i - s]!r}"
    return None


#: the kinds of this module by TOML name (each registers itself when defined)
KINDS: dict[str, type[Kind]] = {}


@dataclass(frozen=True)
class Kind:
    """How one parameter is spread over per-rank fragments, as a value: ``merge`` rebuilds it,
    ``split`` redoes the fragments; parameters may be setting expressions; ``kind``: the TOML
    name."""

    kind: ClassVar[str] = ""

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        if cls.kind and cls.__module__ == __name__:
            KINDS[cls.kind] = cls

    def resolve(self, env: Mapping[str, Any], *, lenient: bool = False) -> Kind:
        """Evaluate setting expressions; ``lenient`` leaves unknown ones for later."""

        def evaluate(x, fname):  # tuples (sizes, rank_sizes) element by element
            if isinstance(x, (tuple, list)):
                return tuple(evaluate(y, fname) for y in x)
            try:
                return eval_int(x, env, where=f"{self.kind}.{fname}: ")
            except LanguageError:
                if lenient:
                    return x
                raise

        kw = {}
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if isinstance(v, Kind):
                v = v.resolve(env, lenient=lenient)
            elif f.metadata.get("int") and v is not None:
                v = evaluate(v, f.name)
            kw[f.name] = v
        return type(self)(**kw)

    def to_dict(self) -> dict:
        """The kind's plain (TOML) form: ``{"kind": name}`` plus every field not at its default."""
        return {"kind": self.kind, **plain_fields(self)}

    def _axis(self, shape, dim: int, name: str) -> int:
        """Dimension ``dim`` of a fragment of ``shape``, checked, made non-negative."""
        return views.checked_axis(shape, dim, f"{name}: {self.kind} dim")

    def _need_ints(self, name: str, *fields: str) -> None:
        """Fields that must hold integers by now (resolved from the settings)."""
        for f in fields:
            if not isinstance(getattr(self, f), int):
                raise LanguageError(
                    f"{name}: {self.kind} needs {f} resolved to an integer (settings), got "
                    f"{getattr(self, f)!r}"
                )

    # implemented by subclasses on an array backend (_NumpyBackend or _LazyBackend)
    def _merge(self, backend, frags, name):  # pragma: no cover
        raise NotImplementedError

    def _split(self, full, n, name) -> list:
        """The per-rank fragments of ``full``; by default every rank holds all of it."""
        return [full] * n


def _int_field(default: Any = None) -> Any:  # a dataclass field, typed by its annotation
    return dataclasses.field(default=default, metadata={"int": True})


@dataclass(frozen=True)
class Replicated(Kind):
    """The same tensor on every rank; merge checks all fragments are bit-identical."""

    kind: ClassVar[str] = "replicated"
    check: bool = True

    def _merge(self, backend, frags, name):
        if self.check and len(frags) > 1:
            arrs = [_NumpyBackend.wrap(f) for f in frags]
            _check_agree(arrs, "rank", f"{name}: {self.kind} fragments disagree across TP ranks")
        return backend.wrap(frags[0])


@dataclass(frozen=True)
class Averaged(Kind):
    """Averaged over ranks (e.g. a norm weight updated independently): sum(fragments) / n."""

    kind: ClassVar[str] = "averaged"

    def _merge(self, backend, frags, name):
        arrs = [_NumpyBackend.wrap(f) for f in frags]
        for r, a in enumerate(arrs):
            if a.shape != arrs[0].shape:
                raise LanguageError(
                    f"{name}: averaged fragment of rank {r} has shape {a.shape}, rank 0 has "
                    f"{arrs[0].shape}"
                )
        # like DeepSpeed's sum(slices) / len(slices): Python's sum starts from 0 (so -0.0 -> 0.0)
        acc = sum(arrs, np.zeros_like(arrs[0]))
        out = (
            (acc / np.asarray(len(arrs), dtype=acc.dtype)).astype(acc.dtype)
            if acc.dtype.kind == "f"
            else acc // len(arrs)
        )
        return backend.wrap(out)


@dataclass(frozen=True)
class Partitioned(Kind):
    """Split along ``dim`` over TP (column parallel 0, row parallel 1), maybe unevenly."""

    kind: ClassVar[str] = "partitioned"
    dim: int = _int_field(0)
    sizes: tuple | None = _int_field(None)

    def _merge(self, backend, frags, name):
        shapes = [backend.shape(f) for f in frags]
        d = self._axis(shapes[0], self.dim, name)
        for r, s in enumerate(shapes):
            if len(s) != len(shapes[0]) or s[:d] + s[d + 1 :] != shapes[0][:d] + shapes[0][d + 1 :]:
                raise LanguageError(
                    f"{name}: partitioned(dim={d}) fragment of rank {r} has shape {s}, "
                    f"incompatible with rank 0's {shapes[0]}"
                )
        if self.sizes is not None and [s[d] for s in shapes] != list(self.sizes):
            raise LanguageError(
                f"{name}: partitioned(dim={d}) fragment widths {[s[d] for s in shapes]} "
                f"differ from the declared sizes {list(self.sizes)}"
            )
        return backend.concat([backend.wrap(f) for f in frags], d)

    def _split(self, full, n, name):
        d = self._axis(full.shape, self.dim, name)
        if self.sizes is None and full.shape[d] % n:
            raise LanguageError(
                f"{name}: dim {d} of size {full.shape[d]} does not split over {n} ranks"
            )
        sizes = [full.shape[d] // n] * n if self.sizes is None else list(self.sizes)
        return _split_sizes(_NumpyBackend, full, d, sizes)


@dataclass(frozen=True)
class SubParams(Kind):
    """A fused parameter whose parts are each split over TP: rank r holds [part0_r; part1_r; ...]
    along ``dim`` (sizes[j] / tp each, or ``rank_sizes``)."""

    kind: ClassVar[str] = "sub_params"
    dim: int = _int_field(0)
    sizes: tuple = _int_field(())
    rank_sizes: tuple | None = _int_field(None)

    def per_rank(self, tp, name):
        if self.rank_sizes is not None:
            rs = [list(x) for x in self.rank_sizes]
            if len(rs) != tp:
                raise LanguageError(f"{name}: rank_sizes lists {len(rs)} ranks, got {tp} fragments")
            for j, s in enumerate(self.sizes):
                if sum(r[j] for r in rs) != s:
                    raise LanguageError(
                        f"{name}: rank_sizes of part {j} add up to {sum(r[j] for r in rs)}, not {s}"
                    )
            return rs
        for j, s in enumerate(self.sizes):
            if s % tp:
                raise LanguageError(
                    f"{name}: sub-param {j} of size {s} does not split evenly over {tp} ranks; "
                    f"give rank_sizes"
                )
        return [[s // tp for s in self.sizes] for _ in range(tp)]

    def _merge(self, backend, frags, name):
        tp = len(frags)
        rs = self.per_rank(tp, name)
        shapes = [backend.shape(f) for f in frags]
        d = self._axis(shapes[0], self.dim, name)
        pieces = []
        for r, f in enumerate(frags):
            if shapes[r][d] != sum(rs[r]):
                raise LanguageError(
                    f"{name}: {self.kind} fragment of rank {r} has size {shapes[r][d]} on dim "
                    f"{d}, expected {sum(rs[r])} = {' + '.join(map(str, rs[r]))}"
                )
            pieces.append(_split_sizes(backend, backend.wrap(f), d, rs[r]))
        return backend.concat([backend.concat(part, d) for part in zip(*pieces)], d)

    def _split(self, full, n, name):
        d = self._axis(full.shape, self.dim, name)
        if full.shape[d] != sum(self.sizes):
            raise LanguageError(
                f"{name}: dim {d} has size {full.shape[d]}, sub-param sizes add up to "
                f"{sum(self.sizes)}"
            )
        rs = self.per_rank(n, name)
        parts = _split_sizes(_NumpyBackend, full, d, list(self.sizes))
        per_part = [
            _split_sizes(_NumpyBackend, p, d, [rs[r][j] for r in range(n)])
            for j, p in enumerate(parts)
        ]
        return [np.concatenate(rank, axis=d) for rank in zip(*per_part)]

    def parts(self, full, names=None) -> dict:
        names = names or [f"part{j}" for j in range(len(self.sizes))]
        d = self._axis(full.shape, self.dim, "?")
        return dict(zip(names, _split_sizes(_NumpyBackend, full, d, list(self.sizes))))


@dataclass(frozen=True)
class SwiGLU(Kind):
    """SwiGLU fc1: the full tensor is [gate; up] along ``dim``; TP rank r holds [gate_r; up_r]."""

    kind: ClassVar[str] = "swiglu"
    dim: int = _int_field(0)

    def _as_sub_params(self, width, name):
        if width % 2:
            raise LanguageError(f"{name}: swiglu dim {self.dim} has odd size {width}")
        return SubParams(dim=self.dim, sizes=(width // 2, width // 2))

    def _merge(self, backend, frags, name):
        shapes = [backend.shape(f) for f in frags]
        d = self._axis(shapes[0], self.dim, name)
        for r, s in enumerate(shapes):
            if s[d] % 2:
                raise LanguageError(
                    f"{name}: swiglu fragment of rank {r} has odd size {s[d]} on dim {d}"
                )
        return self._as_sub_params(sum(s[d] for s in shapes), name)._merge(backend, frags, name)

    def _split(self, full, n, name):
        d = self._axis(full.shape, self.dim, name)
        return self._as_sub_params(full.shape[d], name)._split(full, n, name)

    def parts(self, full, names=("gate", "up")) -> dict:
        d = self._axis(full.shape, self.dim, "?")
        return dict(zip(names, _split_sizes(_NumpyBackend, full, d, [full.shape[d] // 2] * 2)))


@dataclass(frozen=True)
class QKV(Kind):
    """Fused QKV over TP, GQA included: per query group [q heads; k; v], whole groups a rank
    (``interleaved``, Megatron), or [Q; K; V] with rank r holding [Q_r; K_r; V_r]."""

    kind: ClassVar[str] = "qkv"
    dim: int = _int_field(0)
    num_heads: Any = _int_field("num_attention_heads")
    num_kv_heads: Any = _int_field("num_query_groups")
    head_dim: Any = _int_field("head_dim")
    interleaved: bool = True

    def _check(self, name):
        self._need_ints(name, "num_heads", "num_kv_heads", "head_dim")
        if self.num_heads % self.num_kv_heads:
            raise LanguageError(
                f"{name}: num_heads={self.num_heads} is not a multiple of "
                f"num_kv_heads={self.num_kv_heads}"
            )

    @property
    def _heads(self) -> tuple[int, int, int]:
        return self.num_heads, self.num_kv_heads, self.head_dim

    @property
    def group_rows(self):
        return (self.num_heads // self.num_kv_heads + 2) * self.head_dim

    def _as_sub_params(self, tp, name):
        qpg = self.num_heads // self.num_kv_heads
        groups = head_split(self.num_kv_heads, tp)
        hd = self.head_dim
        return SubParams(
            dim=self.dim,
            sizes=(self.num_heads * hd, self.num_kv_heads * hd, self.num_kv_heads * hd),
            rank_sizes=tuple((g * qpg * hd, g * hd, g * hd) for g in groups),
        )

    def _merge(self, backend, frags, name):
        self._check(name)
        shapes = [backend.shape(f) for f in frags]
        d = self._axis(shapes[0], self.dim, name)
        if not self.interleaved:
            return self._as_sub_params(len(frags), name)._merge(backend, frags, name)
        gr = self.group_rows
        for r, s in enumerate(shapes):
            if s[d] % gr:
                raise LanguageError(
                    f"{name}: qkv fragment of rank {r} has size {s[d]} on dim {d}, not a whole "
                    f"number of query groups of {gr} rows ((heads/groups + 2) * head_dim)"
                )
        total = sum(s[d] for s in shapes)
        if total != self.num_kv_heads * gr:
            raise LanguageError(
                f"{name}: qkv fragments add up to {total} rows on dim {d}, expected "
                f"{self.num_kv_heads * gr} (num_heads={self.num_heads}, "
                f"num_kv_heads={self.num_kv_heads}, head_dim={self.head_dim})"
            )
        return Partitioned(dim=d)._merge(backend, frags, name)

    def _split(self, full, n, name):
        self._check(name)
        if not self.interleaved:
            return self._as_sub_params(n, name)._split(full, n, name)
        d = self._axis(full.shape, self.dim, name)
        gr = self.group_rows
        if full.shape[d] != self.num_kv_heads * gr:
            raise LanguageError(
                f"{name}: qkv dim {d} has size {full.shape[d]}, expected {self.num_kv_heads * gr}"
            )
        return _split_sizes(
            _NumpyBackend, full, d, [g * gr for g in head_split(self.num_kv_heads, n)]
        )

    def parts(self, full) -> dict:
        """{'q', 'k', 'v'}: q has the heads in order (group by group)."""
        self._check("?")
        d = self._axis(full.shape, self.dim, "?")
        qkv = views.split_qkv(views.as_view(full), d, *self._heads, interleaved=self.interleaved)
        return {k: x.read().result() for k, x in zip("qkv", qkv)}

    def join(self, q, k, v) -> np.ndarray:
        self._check("?")
        d = self._axis(np.shape(q), self.dim, "?")
        return (
            views.merge_qkv(q, k, v, d, *self._heads, interleaved=self.interleaved).read().result()
        )


@dataclass(frozen=True)
class Vocab(Kind):
    """Vocab-parallel over TP, padded to a multiple of divisible_by * tp."""

    kind: ClassVar[str] = "vocab"
    dim: int = _int_field(0)
    vocab_size: Any = _int_field("vocab_size")
    divisible_by: Any = _int_field(1)
    padded_size: Any = _int_field(None)
    inner: Kind | None = None  # the TP kind before stripping (default: partitioned(dim))

    def _tp_kind(self):
        return self.inner if self.inner is not None else Partitioned(dim=self.dim)

    def _merge(self, backend, frags, name):
        self._need_ints(name, "vocab_size")
        full = self._tp_kind()._merge(backend, frags, name)
        d = self._axis(backend.shape(full), self.dim, name)
        n = backend.shape(full)[d]
        if n < self.vocab_size:
            raise LanguageError(
                f"{name}: merged vocab dim {d} has {n} rows, fewer than vocab_size="
                f"{self.vocab_size}"
            )
        return full if n == self.vocab_size else backend.slice(full, d, 0, self.vocab_size)

    def target_size(self, tp):
        if self.padded_size is not None:
            return self.padded_size
        return padded_vocab_size(self.vocab_size, self.divisible_by, tp)

    def _split(self, full, n, name):
        d = self._axis(full.shape, self.dim, name)
        size = self.target_size(n)
        if size < full.shape[d] or (self.inner is None and size % n):
            raise LanguageError(
                f"{name}: cannot pad vocab of {full.shape[d]} to {size} over {n} ranks"
            )
        if size > full.shape[d]:
            pad = [(0, 0)] * full.ndim
            pad[d] = (0, size - full.shape[d])
            full = np.pad(full, pad)
        return self._tp_kind()._split(full, n, name)


@dataclass(frozen=True)
class PipelineTied(Kind):
    """A weight held alike on several pipeline stages (tied embeddings)."""

    kind: ClassVar[str] = "pipeline_tied"
    inner: Kind | None = None

    def _merge(self, backend, frags, name):
        per_stage = [
            self.inner._merge(_NumpyBackend, f, name)
            if self.inner is not None
            else _NumpyBackend.wrap(f)
            for f in frags
        ]
        _check_agree(per_stage, "stage", f"{name}: pipeline-tied copies disagree")
        if backend.lazy and self.inner is not None:
            return self.inner._merge(backend, frags[0], name)
        return backend.wrap(frags[0] if self.inner is None else per_stage[0])


@dataclass(frozen=True)
class Expert(Kind):
    """MoE experts over EP ranks; fragments per EP rank in order, each a list of TP fragments when
    ``inner`` (the per-expert TP kind) is given.

    layout="stacked": each EP rank holds [E_local, ...] along ``dim``. layout="grouped":
    grouped-GEMM, E_local experts' blocks concatenated along ``dim`` (megatron-core's weight2; its
    weight1 is merged flat by the Megatron importer and reinterpreted by the mixtral spec).
    layout="per_expert": a list of per-expert tensors per rank, stacked [E, ...]."""

    kind: ClassVar[str] = "expert"
    layout: str = "stacked"
    dim: int = _int_field(0)
    num_experts: Any = _int_field("num_experts")
    inner: Kind | None = None

    def __post_init__(self):
        if self.layout not in ("stacked", "grouped", "per_expert"):
            raise LanguageError(
                f"expert layout must be stacked, grouped or per_expert, got {self.layout!r}"
            )

    def _num_local(self, ep, name):
        self._need_ints(name, "num_experts")
        if self.num_experts % ep:
            raise LanguageError(
                f"{name}: {self.num_experts} experts do not divide over {ep} EP ranks"
            )
        return self.num_experts // ep

    def _merge(self, backend, frags, name):
        ep = len(frags)
        nl = self._num_local(ep, name)
        experts = []
        for r, f in enumerate(frags):
            if self.layout == "per_expert":
                if len(f) != nl:
                    raise LanguageError(
                        f"{name}: EP rank {r} holds {len(f)} experts, expected {nl}"
                    )
                experts += [
                    self.inner._merge(backend, x, name) if self.inner else backend.wrap(x)
                    for x in f
                ]
                continue
            tps = [backend.wrap(x) for x in (f if self.inner is not None else [f])]
            d = self._axis(backend.shape(tps[0]), self.dim, name)
            for t, x in enumerate(tps):
                if self.layout == "stacked" and backend.shape(x)[d] != nl:
                    raise LanguageError(
                        f"{name}: EP rank {r} (TP rank {t}) holds {backend.shape(x)[d]} experts on "
                        f"dim {d}, expected {nl} = {self.num_experts} / {ep}"
                    )
                if self.layout == "grouped" and backend.shape(x)[d] % nl:
                    raise LanguageError(
                        f"{name}: EP rank {r} (TP rank {t}) dim {d} of size {backend.shape(x)[d]} "
                        f"does not hold {nl} equal expert blocks"
                    )
            if self.layout == "stacked":
                per_tp = [[backend.take(x, d, e) for e in range(nl)] for x in tps]
            else:
                per_tp = [
                    _split_sizes(backend, x, d, [backend.shape(x)[d] // nl] * nl) for x in tps
                ]
            for e in range(nl):
                blocks = [p[e] for p in per_tp]
                experts.append(
                    self.inner._merge(backend, blocks, f"{name}[expert {r * nl + e}]")
                    if self.inner is not None
                    else blocks[0]
                )
        if self.layout == "grouped":
            return backend.concat(experts, self._axis(backend.shape(experts[0]), self.dim, name))
        return backend.stack(experts, 0 if self.layout == "per_expert" else self.dim)

    def _split(self, full, n, name):
        """n = EP degree. Returns per EP rank the local tensor (no TP split; split each with inner)."""
        nl = self._num_local(n, name)
        d = self._axis(full.shape, 0 if self.layout == "per_expert" else self.dim, name)
        if self.layout == "per_expert":
            return [[full[e] for e in range(r * nl, (r + 1) * nl)] for r in range(n)]
        if self.layout == "stacked":
            if full.shape[d] != self.num_experts:
                raise LanguageError(
                    f"{name}: dim {d} has {full.shape[d]} experts, expected {self.num_experts}"
                )
        elif full.shape[d] % self.num_experts:
            raise LanguageError(
                f"{name}: dim {d} of size {full.shape[d]} is not {self.num_experts} blocks"
            )
        return Partitioned(dim=d)._split(full, n, name)

    def split_tp(self, local, tp, *, num_local: int | None = None, name: str = "?") -> list:
        """Split one EP rank's local tensor over TP with ``inner``, expert by expert.

        Args:
            local: one EP rank's local tensor.
            tp: the tensor-parallel degree.
            num_local: experts on this EP rank (grouped layout).
            name: the tensor, for errors."""
        if self.inner is None:
            return [local for _ in range(tp)]
        if self.layout == "per_expert":
            per = [self.inner._split(np.asarray(x), tp, name) for x in local]
            return [[p[t] for p in per] for t in range(tp)]
        d = self._axis(local.shape, self.dim, name)
        if self.layout == "stacked":
            per = [
                self.inner._split(np.take(local, e, axis=d), tp, name)
                for e in range(local.shape[d])
            ]
            return [np.stack([p[t] for p in per], axis=d) for t in range(tp)]
        if num_local is None:
            raise LanguageError(f"{name}: split_tp of a grouped expert tensor needs num_local")
        blocks = _split_sizes(_NumpyBackend, local, d, [local.shape[d] // num_local] * num_local)
        per = [self.inner._split(b, tp, name) for b in blocks]
        return [np.concatenate([p[t] for p in per], axis=d) for t in range(tp)]


def expert_global_index(local_index: int, ep_rank: int, num_experts: int, ep: int) -> int:
    """Megatron's numbering: EP rank r holds experts [r * E/ep, (r+1) * E/ep).

    Args:
        local_index: the expert's index on its EP rank
        ep_rank: the expert-parallel rank
        num_experts: experts in the layer (all ranks)
        ep: expert-parallel size"""
    if num_experts % ep:
        raise LanguageError(f"{num_experts} experts do not divide over {ep} EP ranks")
    nl = num_experts // ep
    if not 0 <= local_index < nl:
        raise LanguageError(f"local expert index {local_index} out of range (0..{nl - 1})")
    return ep_rank * nl + local_index


def kind_from_obj(obj, *, where: str = "") -> Kind:
    """A Kind from its plain form (``"replicated"``, ``{kind = "partitioned", dim = 1}``)."""
    if isinstance(obj, Kind):
        return obj

    def convert(k, v):
        if k == "inner":
            return kind_from_obj(v, where=where + "inner: ")
        if isinstance(v, list):
            return tuple(tuple(x) if isinstance(x, list) else x for x in v)
        return v

    cls, kw = parse_plain_form(
        obj, tag="kind", registry=KINDS, a_noun="a kind", where=where, convert=convert
    )
    try:
        return cls(**kw)
    except LanguageError as e:
        raise LanguageError(f"{where}{e}") from None


def _resolved_kind(kind, settings, name):
    k = kind_from_obj(kind, where=f"{name}: ")
    return k.resolve(derived(settings or {}))


def merge(
    kind,
    fragments: Sequence,
    *,
    name: str = "<tensor>",
    settings: Mapping | None = None,
    lazy: bool = False,
):
    """Merge per-rank fragments into the consolidated array (numpy; a lazy ts view if lazy).

    Args:
        kind: the fragments' kind (a ``language.kinds`` instance or its name)
        fragments: one array per rank, in rank order
        name: the tensor's name, for messages
        settings: run settings the kind reads (head counts, ...)
        lazy: return a lazy TensorStore view instead of numpy"""
    if len(fragments) == 0:
        raise LanguageError(f"{name}: no fragments to merge")
    k = _resolved_kind(kind, settings, name)
    return k._merge(_LazyBackend if lazy else _NumpyBackend, list(fragments), name)


def split(kind, full, n: int, *, name: str = "<tensor>", settings: Mapping | None = None) -> list:
    """The inverse of ``merge``: the per-rank fragments of ``full`` over ``n`` ranks (numpy).

    Args:
        kind: the kind of the fragments to produce
        full: the consolidated array
        n: how many ranks
        name: the tensor's name, for messages
        settings: run settings the kind reads"""
    if n <= 0:
        raise LanguageError(f"{name}: cannot split over {n} ranks")
    k = _resolved_kind(kind, settings, name)
    full = full.read().result() if isinstance(full, ts.TensorStore) else np.asarray(full)
    return k._split(full, n, name)


def split_parts(kind, full, *, settings: Mapping | None = None) -> dict:
    """Split a fused parameter into named parts: qkv -> q, k, v; swiglu -> gate, up.

    Args:
        kind: a fused kind (qkv, swiglu)
        full: the fused array
        settings: run settings the kind reads (head counts, ...)"""
    k = _resolved_kind(kind, settings, "<tensor>")
    if not hasattr(k, "parts"):
        raise LanguageError(f"kind {k.kind!r} has no named parts")
    return getattr(k, "parts")(np.asarray(full))  # noqa: B009 (checked above; Kind has no .parts)
