"""The request model of every restore: what a source holds that may be read (``Available``),
what the caller asks for one leaf (``Request``), and the rules between them that need no data
(dtype casts, shapes, a saved Python value as an array). JAX-free (JAX is imported only to
place a request that carries a sharding, when JAX is loaded already).
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import numpy as np
import tensorstore as ts

from jax_ucp._src import format as fmt
from jax_ucp._src import sharding as sharding_lib
from jax_ucp._src.errors import CheckpointError, RequestError
from jax_ucp._src.format.dtypes import CASTINGS

if TYPE_CHECKING:
    import jax


@dataclasses.dataclass(frozen=True)
class Available:
    """A tensor restore can produce: stored as is, or a lazy view the UCP language built over
    stored tensors (``sources``: their manifest entries, or the keys a ``TensorSource`` knows
    them by)."""

    key: tuple[str, ...]
    key_types: tuple[str, ...]
    shape: tuple[int, ...]
    dtype: np.dtype
    sources: tuple[Any, ...]
    build: Callable[[Mapping[tuple[str, ...], ts.TensorStore]], ts.TensorStore]
    saved_sharding: fmt.SavedSharding | None = None
    logical_axes: tuple | None = None
    stored: bool = False  # the stored tensor itself (no view): may be read region by region

    @property
    def name(self) -> str:
        return fmt.key_to_str(self.key)

    @classmethod
    def view(cls, key, plan, sources: tuple, **fields) -> Available:
        """The view ``plan`` (``language.compile_restore_plan``) builds over ``sources``."""
        key = tuple(key)
        fields.setdefault("logical_axes", plan.logical_axes)
        shape, dtype = tuple(plan.shape), np.dtype(plan.dtype)
        return cls(key, ("key",) * len(key), shape, dtype, sources, plan.build, **fields)


def spec_views(spec, stored: Mapping[tuple[str, ...], Available], source=None):
    """The views ``spec``'s restore plan (``language.compile_restore_plan``) builds over the
    ``stored`` tensors, as ``(Available, plan)`` pairs. A view that is one stored tensor
    unchanged (no transform, its shape and dtype) is read as that tensor, region by region;
    one under its own name and shape keeps its key types, saved sharding and logical axes,
    as in the checkpoint a conversion writes.

    Args:
        spec: a ``language.Spec`` (or a shipped spec's name, a spec file).
        stored: the tensors as stored, by key (``stored=True``, one source each).
        source: ``ucp.json``'s ``source``: a layout no shape shows is warned unless it
            records the writer (``language.layout_assumed``).
    """
    from jax_ucp._src import language  # restore-time transforms

    saved = {k: language.TensorInfo(shape=a.shape, dtype=a.dtype) for k, a in stored.items()}
    plans = language.compile_restore_plan(spec, saved)
    for said in language.layout_assumed(plans, spec, source):
        warnings.warn(said, UserWarning, stacklevel=3)
    for key, plan in plans.items():
        sources = [stored[tuple(s)] for s in plan.sources]
        view = Available.view(key, plan, tuple(a.sources[0] for a in sources))
        one = sources[0] if len(sources) == 1 else None
        if one is not None and not plan.ops and (view.shape, view.dtype) == (one.shape, one.dtype):
            view = dataclasses.replace(  # renamed at most
                one,
                key=view.key,
                key_types=view.key_types,
                saved_sharding=None,
                logical_axes=view.logical_axes,
            )
        if one is not None and one.key == view.key and one.shape == view.shape:
            view = dataclasses.replace(
                view,
                key_types=one.key_types,
                saved_sharding=one.saved_sharding,
                logical_axes=one.logical_axes if view.logical_axes is None else view.logical_axes,
            )
        yield view, plan


@dataclasses.dataclass
class Request:
    """What the caller wants for one leaf: a tensor (sharding None → host numpy) or a value."""

    key: tuple[str, ...]
    dtype: np.dtype | None = None
    shape: tuple[int, ...] | None = None
    sharding: jax.sharding.Sharding | None = None
    python_type: type | None = None  # target leaf was a Python scalar
    wants_array: bool = False  # target leaf was an array (a saved Python value does not fit)
    rows: tuple[int, int] | None = None  # only rows lo:hi of the first axis (a host read)


_KIND_RANK = {"b": 0, "u": 1, "i": 1, "f": 2, "c": 3}


def _kind_rank(dtype: np.dtype) -> int:
    """bool < integers < floats (bfloat16 and float8 included) < complex."""
    # ml_dtypes (kind "V"): bfloat16/float8_* are floats, int4 an integer
    return _KIND_RANK.get(dtype.kind, 2 if "float" in dtype.name else 1)


def check_cast(name: str, saved: np.dtype, wanted: np.dtype, casting: str) -> None:
    """Refuses a dtype conversion ``casting`` does not allow (numpy's vocabulary).

    The default ``same_kind`` lets float32 become bfloat16 (a precision change users ask for)
    but not int8 (300 would wrap to 44, NaN to 0): that needs ``casting="unsafe"``. Values are
    checked as they are converted (``sharding.convert``): under ``same_kind`` a narrowing float
    cast in which a finite value overflows the target (1e10 into float16 or float8) or an inf
    meets a dtype without inf (float8_e4m3fn) is an error after the read; under ``unsafe`` it is
    a RuntimeWarning naming the tensor and the count.

    Args:
        name: the tensor, for the error.
        saved: its dtype in the checkpoint.
        wanted: the dtype asked for.
        casting: numpy's casting rule.
    """
    if casting not in CASTINGS:
        raise RequestError(f"casting must be one of {CASTINGS}, got {casting!r}.")
    if saved == wanted or casting == "unsafe":
        return
    if casting == "same_kind":
        ok = _kind_rank(wanted) >= _kind_rank(saved)
    else:
        try:
            ok = np.can_cast(saved, wanted, casting)
        except TypeError:
            ok = False
    if not ok:
        raise CheckpointError(
            f"Tensor {name!r} was saved as {saved}; converting it to {wanted} is not a "
            f"{casting!r} cast (values would change). Pass casting='unsafe' to convert anyway."
        )


def not_found(name: str, where: str, available: Mapping) -> CheckpointError:
    """A requested tensor ``where`` lacks, naming a few it holds.

    Args:
        name: the requested tensor's name.
        where: the checkpoint (or file) searched.
        available: the tensors it holds, by key path.
    """
    near = [fmt.key_to_str(k) for k in list(available)[:5]]
    return CheckpointError(
        f"Tensor {name!r} is not in {where} ({len(available)} tensors, e.g. {near})."
    )


def check_tensor_request(name: str, req: Request, found, holder, casting: str) -> np.dtype:
    """The checks of a request for a tensor that need no data, whatever the source: shape,
    dtype cast, a Python scalar target (a 0-d tensor only), divisibility by the sharding, a
    64-bit dtype JAX would narrow on device. Returns the dtype it is restored as.

    Args:
      name: the tensor's name.
      req: the request.
      found: what the source holds (``shape``, ``dtype``).
      holder: ``holder()`` names the source in an error, asked only then ("the checkpoint").
      casting: numpy's casting rule.
    """
    if req.shape is not None and tuple(req.shape) != found.shape:
        raise CheckpointError(
            f"Tensor {name!r}: the target asks for shape {tuple(req.shape)}, "
            f"{holder()} holds shape {found.shape}."
        )
    want_dtype = np.dtype(req.dtype) if req.dtype is not None else found.dtype
    check_cast(name, found.dtype, want_dtype, casting)
    if req.python_type is not None and found.shape != ():
        raise CheckpointError(
            f"Leaf {name!r}: the target is a Python {req.python_type.__name__}, but "
            f"{holder()} holds an array of shape {found.shape}."
        )
    if req.sharding is not None:
        sharding_lib.check_divisible(name, found.shape, req.sharding)
        import jax  # a sharding was given: JAX is loaded

        narrowed = np.dtype(jax.dtypes.canonicalize_dtype(want_dtype))
        if narrowed != want_dtype:
            raise CheckpointError(
                f"Tensor {name!r} is {want_dtype}, which JAX would silently narrow to "
                f"{narrowed} on device; enable jax_enable_x64, restore it to host (sharding "
                f"None) or ask for a dtype."
            )
    return want_dtype


def value_as_array(name: str, where: str, value: Any, req: Request, casting: str):
    """A saved Python bool/int/float as the array a target leaf asks for (a ``jax.Array`` on
    its sharding, as Orbax gives ``step=5`` restored into a ``jax.eval_shape`` target), when the
    conversion keeps the value: the cast is one ``casting`` allows from the value's own type
    (bool, int64, float64) and the value survives it (no int wraps, no float overflows).
    Anything else (a str, None, a lossy cast) needs ``casting="unsafe"``.

    Args:
        name: the leaf, for errors.
        where: the checkpoint, for errors ("the checkpoint <dir>").
        value: the saved scalar.
        req: what the target leaf asks for.
        casting: numpy's casting rule.
    """
    want = np.dtype(req.dtype) if req.dtype is not None else None
    shape = tuple(req.shape) if req.shape is not None else ()
    kind = type(value)
    if shape != ():
        raise CheckpointError(
            f"Leaf {name!r}: the target asks for an array of shape {shape}, but "
            f"{where} holds the Python {kind.__name__} {short_repr(value)} (a scalar)."
        )
    if casting != "unsafe":
        why = None
        if kind not in (bool, int, float):
            why = f"holds the Python {kind.__name__} {short_repr(value)}"
        elif want is not None:
            natural = np.dtype(bool if kind is bool else np.int64 if kind is int else np.float64)
            try:
                check_cast(name, natural, want, casting)
                with np.errstate(over="ignore", invalid="ignore"):
                    converted = np.asarray(value).astype(want)
                back = converted.item()
                if kind is int and back != value:
                    why = f"holds the Python int {value}, which {want} cannot hold"
                elif kind is float and np.isfinite(value) and not np.isfinite(float(back)):
                    why = f"holds the Python float {value}, which overflows {want}"
            except (CheckpointError, OverflowError):
                why = (
                    f"holds the Python {kind.__name__} {short_repr(value)}, and {natural} → {want} "
                    f"is not a {casting!r} cast"
                )
        if why is not None:
            raise CheckpointError(
                f"Leaf {name!r}: the target asks for a {want if want is not None else ''} "
                f"array, but {where} {why}. Pass "
                f"casting='unsafe' to turn it into an array anyway."
            )
    try:
        array = np.asarray(value, dtype=want)
    except (OverflowError, ValueError, TypeError):
        with np.errstate(over="ignore", invalid="ignore"):
            array = np.asarray(value).astype(want)
    if req.sharding is not None:
        import jax  # a sharding was given: JAX is loaded

        return jax.device_put(array, req.sharding)
    return array


def short_repr(value: Any, limit: int = 60) -> str:
    """``value`` shown in an error: its repr cut to ``limit`` characters."""
    text = repr(value) if not isinstance(value, str) else repr(value[:limit])
    return text[:limit] + ("…" if len(text) > limit else "")
