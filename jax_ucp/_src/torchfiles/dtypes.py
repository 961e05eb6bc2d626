"""torch's dtypes as its files name them, both ways: what the reader maps a pickled
``torch.float32`` / ``torch.FloatStorage`` to, and what the writers pickle for a numpy dtype.
One table, so a dtype read and a dtype written never disagree."""

from __future__ import annotations

import ml_dtypes
import numpy as np

from jax_ucp._src.errors import RequestError

__all__ = ["BY_NAME", "STORAGES", "TORCH_DTYPES", "torch_dtype"]

#: torch dtype name (aliases included) -> numpy dtype (bfloat16 and float8 from ``ml_dtypes``)
BY_NAME: dict[str, np.dtype] = {
    name: np.dtype(getattr(ml_dtypes, name) if name.startswith(("bfloat", "float8")) else name)
    for name in [
        "float64",
        "float32",
        "float16",
        "bfloat16",
        "float8_e4m3fn",
        "float8_e5m2",
        "float8_e4m3fnuz",
        "float8_e5m2fnuz",
        "int64",
        "int32",
        "int16",
        "int8",
        "uint8",
        "uint16",
        "uint32",
        "uint64",
        "bool",
        "complex64",
        "complex128",
    ]
}
BY_NAME.update(  # torch's other names for some of them
    (alias, BY_NAME[name])
    for alias, name in {
        "double": "float64",
        "float": "float32",
        "half": "float16",
        "long": "int64",
        "int": "int32",
        "short": "int16",
        "cfloat": "complex64",
        "cdouble": "complex128",
    }.items()
)

#: numpy dtype -> (torch dtype name, legacy typed storage class) as torch.save pickles them
TORCH_DTYPES: dict[np.dtype, tuple[str, str]] = {
    BY_NAME[name]: (name, storage)
    for name, storage in (
        ("float64", "DoubleStorage"),
        ("float32", "FloatStorage"),
        ("float16", "HalfStorage"),
        ("bfloat16", "BFloat16Storage"),
        ("int64", "LongStorage"),
        ("int32", "IntStorage"),
        ("int16", "ShortStorage"),
        ("int8", "CharStorage"),
        ("uint8", "ByteStorage"),
        ("bool", "BoolStorage"),
        ("complex64", "ComplexFloatStorage"),
        ("complex128", "ComplexDoubleStorage"),
    )
}

#: a pickled storage class -> its element dtype's torch name (``UntypedStorage``: bytes)
STORAGES: dict[str, str] = {storage: name for name, storage in TORCH_DTYPES.values()} | {
    "UntypedStorage": "uint8"
}


def torch_dtype(tensor: str, dtype: np.dtype) -> tuple[str, str]:
    """(torch dtype name, storage class) of ``dtype``, or an error naming the tensor."""
    found = TORCH_DTYPES.get(np.dtype(dtype))
    if found is None:
        raise RequestError(
            f"tensor {tensor!r}: dtype {np.dtype(dtype)} has no torch storage type that "
            f"torch.save writes; pass dtype= to convert it"
        )
    return found
