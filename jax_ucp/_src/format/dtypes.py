"""dtype names as written in the manifest and in zarr v3 metadata.

zarr v3 names the core dtypes like numpy (``float32``, ``int8``, ``bool``); TensorStore adds
``bfloat16`` and the float8 family.  numpy knows the extended ones through ml_dtypes.
"""

from __future__ import annotations

import functools

import ml_dtypes
import numpy as np

from jax_ucp._src.errors import RequestError

#: numpy's casting rules, what every ``casting=`` option accepts (restore, plan, export).
CASTINGS = ("no", "equiv", "safe", "same_kind", "unsafe")

_EXTENDED = {
    name: getattr(ml_dtypes, name)
    for name in [
        "bfloat16",
        "float8_e4m3fn",
        "float8_e4m3fnuz",
        "float8_e4m3b11fnuz",
        "float8_e5m2",
        "float8_e5m2fnuz",
        "int4",
    ]
}

# dtypes zarr-python reads natively (the format promise: `zarr.open` works on these).
ZARR_NATIVE = frozenset(
    [
        "bool",
        "int8",
        "int16",
        "int32",
        "int64",
        "uint8",
        "uint16",
        "uint32",
        "uint64",
        "float16",
        "float32",
        "float64",
        "complex64",
        "complex128",
    ]
)


def dtype_name(dtype) -> str:
    """Canonical name of a numpy/ml_dtypes/jax dtype."""
    dt = np.dtype(dtype)
    name = dt.name
    if name not in SUPPORTED:
        raise RequestError(
            f"dtype {dt} is not supported by the UCP format (expected one of {list(SUPPORTED)})."
        )
    return name


def is_floating(dtype) -> bool:
    """float and complex, numpy's or ml_dtypes' (bfloat16, float8_*: numpy's kind ``V``)."""
    dt = np.dtype(dtype)
    return dt.kind in "fc" or (dt.kind == "V" and "float" in dt.name)


@functools.lru_cache(maxsize=64)  # a few names, asked once per tensor: 100 000 times
def to_numpy_dtype(name: str) -> np.dtype:
    """The numpy dtype of a manifest's dtype name (the inverse of ``dtype_name``)."""
    if name not in SUPPORTED:
        raise RequestError(
            f"Unknown dtype {name!r} in manifest (expected one of {list(SUPPORTED)})."
        )
    return np.dtype(_EXTENDED.get(name, name))


# Every dtype a manifest may name (TensorStore's zarr3 driver stores all of them; uint4 it does not).
SUPPORTED = tuple(sorted(ZARR_NATIVE | set(_EXTENDED)))
