"""What a torch pickle may name, and what each becomes: only :data:`BASE_ALLOWED` and the caller's
``extra_classes``, refused before anything is called."""

from __future__ import annotations

import collections
import itertools
import math
import os
import reprlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from jax_ucp._src.errors import SourceError
from jax_ucp._src.torchfiles import dtypes


class TorchFileError(SourceError):
    """A torch file is missing, corrupt, unsupported, or beyond the allow-list (``path``)."""

    def __init__(self, path: os.PathLike | str, message: str):
        self.path = str(path)
        super().__init__(f"{self.path}: {message}")


class _BoundedRepr(reprlib.Repr):
    """``repr`` cut *before* it is built: a few levels, a few items per container."""

    def __init__(self) -> None:
        super().__init__()
        self.maxlevel, self.maxdict, self.maxlist, self.maxtuple = 3, 6, 8, 8
        self.maxset = self.maxfrozenset = self.maxdeque = 8
        self.maxstring, self.maxother, self.maxlong = 80, 80, 40

    def repr1(self, x: Any, level: int) -> str:
        if isinstance(x, StandIn):
            if level <= 0:
                return f"<{x.qualname} ...>"
            return f"<{x.qualname} {self.repr1(dict(x.__dict__), level - 1)}>"
        if isinstance(x, np.ndarray):
            return f"<array {x.shape} {x.dtype}>"
        if type(x) is collections.OrderedDict:
            return self.repr_dict(x, level)
        return super().repr1(x, level)

    def repr_int(self, x: int, level: int) -> str:
        # repr() of an int past Python's 4300-digit limit raises (and is quadratic before it)
        if x.bit_length() > 256:
            return f"<int of {x.bit_length()} bits>"
        return super().repr_int(x, level)

    def repr_dict(self, x: Any, level: int) -> str:  # insertion order: no sort of hostile keys
        if not x:
            return "{}"
        if level <= 0:
            return "{...}"
        items = [
            f"{self.repr1(k, level - 1)}: {self.repr1(v, level - 1)}"
            for k, v in itertools.islice(x.items(), self.maxdict)
        ]
        return "{" + ", ".join(items) + (", ...}" if len(x) > self.maxdict else "}")


_BOUNDED_REPR = _BoundedRepr()


def short_repr(obj: Any, limit: int = 200) -> str:
    """A repr of untrusted data for errors: bounded work, at most ``limit`` characters."""
    r = _BOUNDED_REPR.repr(obj)
    return r if len(r) <= limit else r[: limit - 3] + "..."


class StandIn:
    """Inert stand-in for a pickled object (``REDUCE`` or ``NEWOBJ`` + ``BUILD``): data only."""

    qualname: str = "?"

    def __init__(self, *args: Any, **kwargs: Any):
        self.args = args
        if kwargs:
            self.kwargs = kwargs

    def __setstate__(self, state: Any) -> None:
        if (
            isinstance(state, tuple)
            and len(state) == 2
            and (state[1] is None or isinstance(state[1], dict))
        ):
            state, slots = state
            if slots:
                self._set_attrs(slots)
        if isinstance(state, dict):
            self._set_attrs(state)
        elif state is not None:
            self.__dict__["state"] = state

    def _set_attrs(self, d: dict) -> None:
        for k, v in d.items():
            # an attribute named like a method would shadow it (``get``, ``_set_attrs``)
            if not isinstance(k, str) or k.startswith("__") or hasattr(type(self), k):
                raise TorchFileError(
                    "<pickle>",
                    f"{self.qualname}: refusing attribute {short_repr(k, 80)} in BUILD state",
                )
            self.__dict__[k] = v

    def __repr__(self) -> str:
        return short_repr(self)

    def __eq__(self, other: object) -> bool:
        return type(other) is type(self) and other.__dict__ == self.__dict__

    __hash__ = None  # type: ignore[assignment]


def standin_class(qualname: str) -> type[StandIn]:
    """A fresh :class:`StandIn` subclass named after ``qualname`` ("module.Class")."""
    return type(qualname.rsplit(".", 1)[-1], (StandIn,), {"qualname": qualname})


def int_enum_standin(qualname: str, names: Mapping[int, str] | None = None) -> type[int]:
    """Stand-in for an ``IntEnum`` (pickled as ``REDUCE(cls, (value,))``): an ``int`` subclass."""

    def _repr(self: int) -> str:
        n = (names or {}).get(int(self))
        return f"<{qualname}.{n}: {int(self)}>" if n else f"<{qualname}: {int(self)}>"

    return type(qualname.rsplit(".", 1)[-1], (int,), {"qualname": qualname, "__repr__": _repr})


# --------------------------------------------------------------------------- torch pieces


@dataclass(frozen=True)
class StorageType:
    """What a pickled ``torch.FloatStorage`` & co. resolve to: just the element dtype."""

    name: str
    dtype: np.dtype


@dataclass(frozen=True)
class _TensorType:
    """Marker for ``torch.Tensor`` / ``torch.nn.Parameter`` in ``_rebuild_from_type_v2``."""

    name: str


@dataclass
class Storage:
    key: str
    dtype: np.dtype
    raw: np.ndarray  # uint8 view of the member

    def __repr__(self) -> str:
        return f"<storage {self.key!r} {self.raw.size} bytes as {self.dtype}>"


def _as_int_tuple(x: Any, what: str) -> tuple[int, ...]:
    if not isinstance(x, (tuple, list)) or not all(type(v) is int for v in x):
        raise ValueError(f"tensor {what} must be a tuple of ints, found {short_repr(x)}")
    return tuple(x)


def _rebuild_tensor(
    storage: Any, storage_offset: Any, size: Any, stride: Any, dtype: np.dtype | None = None
) -> np.ndarray:
    if not isinstance(storage, Storage):
        raise ValueError(
            f"tensor storage must be a persistent storage reference, found {type(storage).__name__}"
        )
    if type(storage_offset) is not int or storage_offset < 0:
        raise ValueError(f"bad storage offset {short_repr(storage_offset, 80)}")
    shape = _as_int_tuple(size, "size")
    strides = _as_int_tuple(stride, "stride")
    if len(shape) != len(strides) or any(s < 0 for s in shape) or any(s < 0 for s in strides):
        raise ValueError(f"bad tensor geometry size={shape} stride={strides}")
    dt = storage.dtype if dtype is None else dtype
    n_elems = storage.raw.size // dt.itemsize
    numel = int(np.prod(shape, dtype=np.int64)) if shape else 1
    if numel == 0:
        return np.empty(shape, dt)
    extent = storage_offset + sum((n - 1) * s for n, s in zip(shape, strides)) + 1
    if extent > n_elems:
        raise ValueError(
            f"tensor (offset {storage_offset}, size {shape}, stride {strides}) reaches element {extent} "
            f"but storage {storage.key!r} holds {n_elems} {dt} elements"
        )
    if numel > n_elems - storage_offset:
        # stride 0 or overlapping: materialising it could take any memory from a tiny file
        raise ValueError(
            f"tensor of size {shape} (stride {strides}) declares {numel} elements but storage "
            f"{storage.key!r} holds {n_elems - storage_offset} from offset {storage_offset}: "
            "stride-0 or overlapping views are not materialised (save a contiguous copy)"
        )
    flat = storage.raw[: n_elems * dt.itemsize].view(dt)
    if strides == tuple(math.prod(shape[i + 1 :]) for i in range(len(shape))) or numel == 1:
        return flat[storage_offset : storage_offset + numel].reshape(shape)
    return np.lib.stride_tricks.as_strided(
        flat[storage_offset:],
        shape=shape,
        strides=tuple(s * dt.itemsize for s in strides),
        writeable=False,
    )


def _rebuild_tensor_v2(
    storage, storage_offset, size, stride, requires_grad=False, backward_hooks=None, metadata=None
):
    return _rebuild_tensor(storage, storage_offset, size, stride)


def _rebuild_tensor_v3(
    storage, storage_offset, size, stride, requires_grad, backward_hooks, dtype, metadata=None
):
    if not isinstance(dtype, np.dtype):
        raise ValueError(
            f"_rebuild_tensor_v3 dtype must be a torch dtype, found {short_repr(dtype, 80)}"
        )
    return _rebuild_tensor(storage, storage_offset, size, stride, dtype)


def _rebuild_parameter(data, requires_grad=False, backward_hooks=None, state=None):
    if not isinstance(data, np.ndarray):
        raise ValueError(f"parameter data must be a tensor, found {type(data).__name__}")
    return data


@dataclass(frozen=True, slots=True, eq=False)
class Allowed:
    """A resolved global that may be called (REDUCE/INST/OBJ) or instantiated (NEWOBJ)."""

    qualname: str
    fn: Callable[..., Any]

    def __repr__(self) -> str:
        return f"<allowed {self.qualname}>"


@dataclass(frozen=True)
class _WrapperClass:
    """A tensor subclass pickled via ``_rebuild_wrapper_subclass``: its name only, never called."""

    qualname: str


@dataclass(eq=False)
class WrapperTensor:
    """A pickled DTensor or ShardedTensor as inert data: ``shape``, ``dtype``, pickled ``state``."""

    qualname: str
    shape: tuple[int, ...]
    dtype: np.dtype
    state: Any = None

    def __repr__(self) -> str:
        return f"<{self.qualname.rsplit('.', 1)[-1]} {self.shape} {self.dtype}>"


def _rebuild_wrapper_subclass(
    cls, dtype, size, stride, storage_offset, layout, device, requires_grad
) -> WrapperTensor:
    if not isinstance(cls, _WrapperClass):
        raise ValueError(f"_rebuild_wrapper_subclass of {short_repr(cls, 80)} is not supported")
    if not isinstance(dtype, np.dtype):
        raise ValueError(f"{cls.qualname} dtype must be a torch dtype, found {short_repr(dtype)}")
    shape = _as_int_tuple(tuple(size) if isinstance(size, (list, tuple)) else size, "size")
    if any(d < 0 for d in shape):
        raise ValueError(f"{cls.qualname} size {shape} is negative")
    return WrapperTensor(cls.qualname, shape, dtype)


def _rebuild_from_type_v2(func, new_type, args, state):
    if isinstance(func, Allowed) and func.fn is _rebuild_wrapper_subclass:
        if not isinstance(args, tuple) or not args or args[0] != new_type:
            raise ValueError(f"_rebuild_wrapper_subclass args {short_repr(args, 80)} do not match")
        out = _rebuild_wrapper_subclass(*args)
        out.state = state
        return out
    if not isinstance(func, Allowed) or func.fn not in (
        _rebuild_tensor_v2,
        _rebuild_tensor_v3,
        _rebuild_parameter,
    ):
        raise ValueError(
            f"_rebuild_from_type_v2 may only call tensor rebuild functions, found {short_repr(func, 80)}"
        )
    if not isinstance(new_type, _TensorType):
        raise ValueError(
            f"_rebuild_from_type_v2 with tensor subclass {short_repr(new_type, 80)} is not supported"
        )
    if not isinstance(args, tuple):
        raise ValueError("_rebuild_from_type_v2 args must be a tuple")
    return func.fn(*args)


def _torch_size(dims=()):
    return _as_int_tuple(tuple(dims), "torch.Size")


def _torch_device(*args):
    if not args or not all(isinstance(a, (str, int)) for a in args):
        raise ValueError(f"bad torch.device args {short_repr(args)}")
    return ":".join(str(a) for a in args)


def _codecs_encode(s, encoding="utf-8"):
    if not isinstance(s, str) or encoding not in ("latin1", "latin-1", "utf-8", "utf8"):
        raise ValueError(
            f"_codecs.encode only decodes str with latin1/utf-8, found {short_repr(encoding, 80)}"
        )
    return s.encode(encoding)


def _slice(*args):
    if not all(a is None or type(a) is int for a in args):
        raise ValueError(f"bad slice args {short_repr(args)}")
    return slice(*args)


def _complex(re=0.0, im=0.0):
    if not all(type(v) in (int, float) for v in (re, im)):
        raise ValueError(f"bad complex args {short_repr((re, im))}")
    return complex(re, im)


def _bytearray(x=b"", encoding=None):
    if isinstance(x, str):
        return bytearray(_codecs_encode(x, encoding or "latin1"))
    if isinstance(x, (bytes, list)):
        return bytearray(x)
    raise ValueError(f"bad bytearray args {short_repr(x)}")


def _ordered_dict(items=()):
    """``OrderedDict(items)``, every key checked by :func:`hashable_key` before it is hashed."""
    if isinstance(items, dict):  # built by this unpickler: its keys were checked
        return collections.OrderedDict(items)
    if not isinstance(items, (list, tuple)):
        raise ValueError(f"OrderedDict items must be a list of pairs, found {type(items).__name__}")
    out = collections.OrderedDict()
    for pair in items:
        if not isinstance(pair, (list, tuple)) or len(pair) != 2:
            raise ValueError(f"OrderedDict item {short_repr(pair, 80)} is not a (key, value) pair")
        out[hashable_key(pair[0])] = pair[1]
    return out


def _set(items=()):
    return set(hashable_key(k, "set element") for k in items)


def _frozenset(items=()):
    return frozenset(hashable_key(k, "frozenset element") for k in items)


_KEY_SCALARS = (str, bytes, int, float, bool, type(None), np.dtype)


def hashable_key(key: Any, what: str = "dict key") -> Any:
    """``key`` if hashing it takes bounded work (no nested tuples: exponential hashing)."""
    if isinstance(key, _KEY_SCALARS):
        return key
    if type(key) is tuple and len(key) <= 64 and all(isinstance(k, _KEY_SCALARS) for k in key):
        return key
    if isinstance(key, StandIn) and type(key).__hash__ is not None:
        return key
    raise ValueError(f"{what} {short_repr(key, 80)} is not a scalar or a flat tuple of scalars")


def _base_allowed() -> dict[str, Any]:
    d: dict[str, Any] = {
        "torch._utils._rebuild_tensor_v2": _rebuild_tensor_v2,
        "torch._utils._rebuild_tensor_v3": _rebuild_tensor_v3,
        "torch._utils._rebuild_parameter": _rebuild_parameter,
        "torch._utils._rebuild_parameter_with_state": _rebuild_parameter,
        "torch._tensor._rebuild_from_type_v2": _rebuild_from_type_v2,
        "torch.Tensor": _TensorType("torch.Tensor"),
        "torch._tensor.Tensor": _TensorType("torch.Tensor"),
        "torch.nn.parameter.Parameter": _TensorType("torch.nn.Parameter"),
        "torch.Size": _torch_size,
        "torch.device": _torch_device,
        "collections.OrderedDict": _ordered_dict,
        "builtins.set": _set,
        "builtins.frozenset": _frozenset,
        "builtins.slice": _slice,
        "builtins.complex": _complex,
        "builtins.bytearray": _bytearray,
        "_codecs.encode": _codecs_encode,
    }
    for name, dt in dtypes.BY_NAME.items():
        d[f"torch.{name}"] = dt
    for name, dt in dtypes.STORAGES.items():
        st = StorageType(name, dtypes.BY_NAME[dt])
        d[f"torch.{name}"] = st
        d[f"torch.storage.{name}"] = st
        d[f"torch.cuda.{name}"] = st
    return d


#: The allow-list every load uses: ``"module.QualName" -> value or safe callable``.
BASE_ALLOWED: Mapping[str, Any] = _base_allowed()

_SHARDED_TENSOR = "torch.distributed._shard.sharded_tensor.api.ShardedTensor"


def _process_group_state(owner: Any, name: Any) -> Allowed:
    """``ShardedTensor.ProcessGroupState``, the one attribute lookup its pickle makes."""
    if owner != _WrapperClass(_SHARDED_TENSOR) or name != "ProcessGroupState":
        raise ValueError(f"getattr{short_repr((owner, name), 120)} is not allowed")
    qualname = f"{_SHARDED_TENSOR}.ProcessGroupState"
    return Allowed(qualname, standin_class(qualname))


def get_layout(name: Any) -> str:
    """``torch.serialization._get_layout``: the one layout a tensor's bytes are read in."""
    if name != "torch.strided":
        raise ValueError(f"layout {short_repr(name, 80)} is not read (only torch.strided)")
    return name


def _sharded_tensor_classes() -> dict[str, Any]:
    d: dict[str, Any] = {
        "torch._utils._rebuild_wrapper_subclass": _rebuild_wrapper_subclass,
        "torch.serialization._get_layout": get_layout,
        "torch.distributed.tensor.DTensor": _WrapperClass("torch.distributed.tensor.DTensor"),
        "torch.distributed.tensor._api.DTensor": _WrapperClass("torch.distributed.tensor.DTensor"),
        _SHARDED_TENSOR: _WrapperClass(_SHARDED_TENSOR),
        "builtins.getattr": _process_group_state,
        "torch.distributed._shard.sharded_tensor.metadata.MEM_FORMAT_ENCODING": int_enum_standin(
            "torch.distributed._shard.sharded_tensor.metadata.MEM_FORMAT_ENCODING"
        ),
    }
    for name in (
        "torch.distributed.tensor._dtensor_spec.DTensorSpec",
        "torch.distributed.tensor._dtensor_spec.TensorMeta",
        "torch.distributed.tensor._dtensor_spec.ShardOrderEntry",
        "torch.distributed.tensor.placement_types.Shard",
        "torch.distributed.tensor.placement_types.Replicate",
        "torch.distributed.tensor.placement_types._StridedShard",
        "torch.distributed.tensor.placement_types.Partial",
        "torch.distributed.device_mesh.DeviceMesh",
        "torch.distributed._mesh_layout._MeshLayout",
        "torch.distributed._mesh_layout._FlatLayout",
        "torch.distributed._shard.metadata.ShardMetadata",
        "torch.distributed._shard.sharded_tensor.shard.Shard",
        "torch.distributed._shard.sharded_tensor.metadata.ShardedTensorMetadata",
        "torch.distributed._shard.sharded_tensor.metadata.TensorProperties",
        "torch.distributed._shard.sharding_spec.chunk_sharding_spec.ChunkShardingSpec",
        "torch.distributed.remote_device._remote_device",
    ):
        d[name] = standin_class(name)
    return d


#: Extra classes for files holding DTensors and ShardedTensors (FSDP2 / FSDP1): each a
#: :class:`WrapperTensor`, its mesh, placements and shard metadata inert stand-ins.
SHARDED_TENSOR_CLASSES: Mapping[str, Any] = _sharded_tensor_classes()


def _numpy_classes() -> dict[str, Any]:
    array, scalar = standin_class("numpy.ndarray"), standin_class("numpy.scalar")
    return {
        "numpy.ndarray": array,
        "numpy.core.multiarray._reconstruct": array,
        "numpy._core.multiarray._reconstruct": array,
        "numpy.dtype": standin_class("numpy.dtype"),
        "numpy.core.multiarray.scalar": scalar,
        "numpy._core.multiarray.scalar": scalar,
    }


#: numpy's pickled arrays, dtypes and scalars (a run's RNG state) as inert stand-ins.
NUMPY_CLASSES: Mapping[str, Any] = _numpy_classes()
