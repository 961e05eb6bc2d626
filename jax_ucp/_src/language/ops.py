"""Restore-side operations, run in order over the entries ``(vars, view)`` a rule matched: map ops,
fan-outs introducing a variable ``var`` and fan-ins consuming ``over`` (entries agreeing on the
other variables combined in its order); each a lazy, exact view."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import tensorstore as ts

from jax_ucp._src.errors import LanguageError
from jax_ucp._src.language import views
from jax_ucp._src.language.plain_form import parse_plain_form, plain_fields
from jax_ucp._src.language.settings import eval_int

Env = Mapping[str, Any]
#: the ops of this module by TOML name (each registers itself when defined)
OPS: dict[str, type[Op]] = {}


@dataclass(frozen=True)
class Op:
    """One step of a restore rule: a lazy, exact change of structure; ``op``: the TOML name."""

    op: ClassVar[str] = ""
    arity: ClassVar[str] = "map"

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        if cls.op and cls.__module__ == __name__:
            OPS[cls.op] = cls

    def to_dict(self) -> dict:
        """The op's plain (TOML) form: ``{"op": name}`` plus every field not at its default."""
        return {"op": self.op, **plain_fields(self)}

    def _int(self, value, env: Env) -> int:
        """An op parameter as an int: a literal or a setting expression evaluated over ``env``."""
        return eval_int(value, env, where=f"{self.op}: ")

    def _ints(self, env: Env, *names: str) -> list[int]:
        """The named fields as ints (``_int`` of each)."""
        return [self._int(getattr(self, n), env) for n in names]

    #: (a ``views`` function, the fields passed to it as ints); other ops define ``apply`` / ``combine``
    view: ClassVar[tuple] = ()

    def apply(self, tensor: ts.TensorStore, env: Env) -> ts.TensorStore:
        """A map op's result: one lazy view of ``tensor`` (``env``: settings and captures)."""
        fn, *fields = self.view
        return fn(tensor, *self._ints(env, *fields))


class FanOut(Op):
    """An op turning one tensor into several, labelled by ``var`` (by default its ``parts``)."""

    arity: ClassVar[str] = "fanout"
    var: str
    parts: tuple

    def _pieces(self, tensor: ts.TensorStore, env: Env) -> list:  # pragma: no cover
        raise NotImplementedError

    def labels(self, tensor: ts.TensorStore, env: Env) -> list[str]:
        """The values ``var`` takes, one per part (``"0"``, ``"1"``, ... or ``q``/``k``/``v``)."""
        self._pieces(tensor, env)  # validates
        return list(self.parts)

    def part(self, tensor: ts.TensorStore, env: Env, index: int) -> ts.TensorStore:
        """Part ``index`` of ``tensor`` (the one labelled ``labels(...)[index]``).

        Args:
            tensor: the view to split
            env: settings and captured variables
            index: which part"""
        return self._pieces(tensor, env)[index]


class FanIn(Op):
    """An op that combines the tensors differing only in the variable ``over`` into one."""

    arity: ClassVar[str] = "fanin"
    over: str
    parts: tuple

    def order(self, labels: Sequence[str], env: Env, where: str) -> list[str]:
        """The labels of the parts in the order they combine; a missing one is an error.

        Args:
            labels: the values ``over`` took among the matched tensors
            env: settings and captured variables
            where: the rule, for messages"""
        if sorted(labels) != sorted(self.parts):
            missing = [p for p in self.parts if p not in labels]
            extra = [x for x in labels if x not in self.parts]
            raise LanguageError(
                f"{where}: {self.over!r} parts must be exactly {list(self.parts)}; "
                f"missing {missing}, unexpected {extra}"
            )
        return list(self.parts)

    def combine(self, parts: Sequence[ts.TensorStore], env: Env) -> ts.TensorStore:
        """One lazy view of ``parts``, given in ``order``'s order."""
        fn, *fields = self.view
        return fn(parts, *self._ints(env, *fields))


@dataclass(frozen=True)
class Transpose(Op):
    """numpy.transpose; default reverses axes (torch [out, in] <-> flax [in, out])."""

    op: ClassVar[str] = "transpose"
    perm: tuple | None = None

    def apply(self, tensor, env):
        return views.transpose(
            tensor, None if self.perm is None else [self._int(p, env) for p in self.perm]
        )


@dataclass(frozen=True)
class RopeHalf(Op):
    """q/k rows from RoPE's interleaved pairs to rotate-half order (for ``over`` in ``parts``);
    ``inverse``: back to interleaved pairs (an export's)."""

    op: ClassVar[str] = "rope_half"
    axis: Any = 0
    head_dim: Any = "head_dim"
    over: str = "part"
    parts: tuple = ("q", "k")
    inverse: bool = False

    def apply(self, tensor, env):
        if self.over in env and str(env[self.over]) not in self.parts:
            return tensor
        args = self._ints(env, "axis", "head_dim")
        return views.rope_interleaved_to_half(tensor, *args, inverse=self.inverse)


@dataclass(frozen=True)
class SplitDim(Op):
    """Reshape one axis into two: sizes=[a, b] (one may be -1), e.g. [d, H*hd] -> [d, H, hd]."""

    op: ClassVar[str] = "split_dim"
    axis: Any = 0
    sizes: tuple = ()

    def apply(self, tensor, env):
        if len(self.sizes) != 2:
            raise LanguageError(f"split_dim needs sizes=[a, b], got {list(self.sizes)}")
        return views.split_dim(
            tensor, self._int(self.axis, env), [self._int(s, env) for s in self.sizes]
        )


@dataclass(frozen=True)
class MergeDims(Op):
    """Reshape axes (axis, axis+1) into one (row-major), e.g. [d, H, hd] -> [d, H*hd];
    ``sizes`` = [a, b] (one may be -1), when given, are checked: what an export splits back."""

    op: ClassVar[str] = "merge_dims"
    axis: Any = 0
    sizes: tuple = ()

    def apply(self, tensor, env):
        axis = self._int(self.axis, env)
        want, have = [self._int(s, env) for s in self.sizes], list(tensor.shape[axis : axis + 2])
        if want and (len(want) != 2 or any(w not in (-1, h) for w, h in zip(want, have))):
            raise LanguageError(f"merge_dims: axes {axis}, {axis + 1} of sizes {have}, not {want}")
        return views.merge_dims(tensor, axis)


@dataclass(frozen=True)
class GroupStages(Op):
    """[L, ...] -> [stages, L/stages, ...]."""

    op: ClassVar[str] = "group_stages"
    view: ClassVar[tuple] = (views.group_stages, "stages", "axis")
    stages: Any = "pp"
    axis: Any = 0


@dataclass(frozen=True)
class UngroupStages(Op):
    """[stages, L/stages, ...] -> [L, ...]: ``merge_dims`` of the stage axis and the next."""

    op: ClassVar[str] = "ungroup_stages"
    view: ClassVar[tuple] = (views.merge_dims, "axis")
    axis: Any = 0


@dataclass(frozen=True)
class RegroupStages(Op):
    """[S, L/S, ...] -> [stages, L/stages, ...]; error if L does not divide by stages."""

    op: ClassVar[str] = "regroup_stages"
    view: ClassVar[tuple] = (views.regroup_stages, "stages", "axis")
    stages: Any = "pp"
    axis: Any = 0


@dataclass(frozen=True)
class Slice(Op):
    """Keep [start, stop) of an axis (e.g. strip vocab padding: stop = "vocab_size")."""

    op: ClassVar[str] = "slice"
    axis: Any = 0
    start: Any = 0
    stop: Any = None

    def apply(self, tensor, env):
        tensor = views.as_view(tensor)
        a = self._int(self.axis, env)
        stop = tensor.shape[a] if self.stop is None else self._int(self.stop, env)
        return views.slice_axis(tensor, a, self._int(self.start, env), stop)


@dataclass(frozen=True)
class Pad(Op):
    """Zero-pad an axis to ``size`` or to the next multiple of ``multiple`` (vocab for a target)."""

    op: ClassVar[str] = "pad"
    axis: Any = 0
    size: Any = None
    multiple: Any = None

    def apply(self, tensor, env):
        tensor = views.as_view(tensor)
        a = self._int(self.axis, env)
        n = tensor.shape[a]
        if self.size is not None:
            size = self._int(self.size, env)
        elif self.multiple is not None:
            m = self._int(self.multiple, env)
            size = -(-n // m) * m
        else:
            raise LanguageError("pad needs size= or multiple=")
        return views.pad_axis(tensor, a, size)


@dataclass(frozen=True)
class Unstack(FanOut):
    r"""[L, ...] -> L tensors; the index becomes variable ``var``. ``if_unbound=true``: a no-op for a
    name that already bound ``var`` (an optional group), so one rule covers stacked and per-layer
    layers: ``decoder\\.layers\\.(?:(?P<i>\\d+)\\.)?x``."""

    op: ClassVar[str] = "unstack"
    axis: Any = 0
    var: str = "i"
    if_unbound: bool = False

    def labels(self, tensor, env):
        return [str(i) for i in range(tensor.shape[self._int(self.axis, env)])]

    def part(self, tensor, env, index):
        return views.take(tensor, self._int(self.axis, env), index)


@dataclass(frozen=True)
class Split(FanOut):
    """Split an axis into named parts (equal sizes unless ``sizes``), e.g. SwiGLU fc1 -> gate, up."""

    op: ClassVar[str] = "split"
    axis: Any = 0
    parts: tuple = ("gate", "up")
    sizes: tuple | None = None
    var: str = "part"

    def _pieces(self, tensor, env):
        a = self._int(self.axis, env)
        if self.sizes is None:
            return views.split_even(tensor, a, len(self.parts))
        if len(self.sizes) != len(self.parts):
            raise LanguageError(f"split: {len(self.parts)} parts but {len(self.sizes)} sizes")
        return views.split_sizes(tensor, a, [self._int(s, env) for s in self.sizes])


@dataclass(frozen=True)
class SplitQKV(FanOut):
    """Fused QKV -> q, k, v along ``axis`` (Megatron's per-group order by default)."""

    op: ClassVar[str] = "split_qkv"
    axis: Any = 0
    var: str = "part"
    parts: tuple = ("q", "k", "v")
    interleaved: bool = True
    num_heads: Any = "num_attention_heads"
    num_kv_heads: Any = "num_query_groups"
    head_dim: Any = "head_dim"

    def _pieces(self, tensor, env):
        args = self._ints(env, "axis", "num_heads", "num_kv_heads", "head_dim")
        return views.split_qkv(tensor, *args, interleaved=self.interleaved)


@dataclass(frozen=True)
class Stack(FanIn):
    """Tensors indexed 0..L-1 by variable ``over`` -> one [L, ...] tensor (stacked at ``axis``)."""

    op: ClassVar[str] = "stack"
    view: ClassVar[tuple] = (views.stack, "axis")
    over: str = "i"
    axis: Any = 0

    def order(self, labels, env, where):
        try:
            idx = sorted(int(x) for x in labels)
        except ValueError:
            raise LanguageError(
                f"{where}: stack over {self.over!r} needs integer values, got {sorted(labels)}"
            ) from None
        if len(set(idx)) != len(labels):
            raise LanguageError(f"{where}: duplicate {self.over!r} values in {sorted(labels)}")
        missing = sorted(set(range(len(idx))) - set(idx))
        if idx[0] != 0 or idx[-1] != len(idx) - 1:
            raise LanguageError(
                f"{where}: {self.over!r} values must be 0..{len(idx) - 1} without gaps; "
                f"found {idx[:8]}{'...' if len(idx) > 8 else ''}, missing "
                f"{missing[:8] or 'values below ' + str(idx[0])}"
            )
        return sorted(labels, key=int)


@dataclass(frozen=True)
class Concat(FanIn):
    """Named parts (in ``parts`` order) concatenated along ``axis``, e.g. gate, up -> SwiGLU fc1."""

    op: ClassVar[str] = "concat"
    view: ClassVar[tuple] = (views.concat, "axis")
    over: str = "part"
    axis: Any = 0
    parts: tuple = ("gate", "up")


@dataclass(frozen=True)
class MergeQKV(FanIn):
    """q, k, v -> fused QKV along ``axis`` (Megatron per-group interleaved order by default)."""

    op: ClassVar[str] = "merge_qkv"
    over: str = "part"
    axis: Any = 0
    parts: tuple = ("q", "k", "v")
    interleaved: bool = True
    num_heads: Any = "num_attention_heads"
    num_kv_heads: Any = "num_query_groups"
    head_dim: Any = "head_dim"

    def combine(self, parts, env):
        args = self._ints(env, "axis", "num_heads", "num_kv_heads", "head_dim")
        q, k, v = parts
        return views.merge_qkv(q, k, v, *args, interleaved=self.interleaved)


def op_from_obj(obj, *, where: str = "") -> Op:
    """An Op from its plain form: ``"transpose"`` or ``{op = "unstack", axis = 0, var = "i"}``."""
    if isinstance(obj, Op):
        return obj
    cls, kw = parse_plain_form(
        obj,
        tag="op",
        registry=OPS,
        a_noun="an op",
        where=where,
        convert=lambda k, v: tuple(v) if isinstance(v, list) else v,
    )
    return cls(**kw)
