"""Hugging Face safetensors files: the header parser and checks shared by the importer
(``importers.safetensors``) and through it the direct restore.

The format is an 8-byte little-endian header length, a JSON header (name -> dtype, shape,
[begin, end) byte offsets into the data that follows; plus ``__metadata__``) and the raw
little-endian tensor bytes, each tensor one C-ordered byte range. Files are untrusted: the header
is bounded, every range is checked against the file and against its dtype and shape, ranges may
not overlap, keys may not repeat, and the index may only name files beside it.
"""

from __future__ import annotations

import itertools
import json
import os
import re
from typing import Any, Protocol

import ml_dtypes
import numpy as np

from jax_ucp._src.errors import SourceError, UCPError
from jax_ucp._src.format import files, mapped_file

INDEX_FILE = "model.safetensors.index.json"
MAX_HEADER_BYTES = 100 << 20  # the safetensors crate refuses headers over 100 MB too
MAX_INDEX_BYTES = 64 << 20

DTYPES = {
    "F64": np.dtype("<f8"),
    "F32": np.dtype("<f4"),
    "F16": np.dtype("<f2"),
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn),
    "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2),
    "I64": np.dtype("<i8"),
    "I32": np.dtype("<i4"),
    "I16": np.dtype("<i2"),
    "I8": np.dtype("i1"),
    "U64": np.dtype("<u8"),
    "U32": np.dtype("<u4"),
    "U16": np.dtype("<u2"),
    "U8": np.dtype("u1"),
    "BOOL": np.dtype("bool"),
}


#: ``__metadata__`` key of torch.distributed.checkpoint's Hugging Face writer
#: (``torch/distributed/checkpoint/_hf_utils.py``): a JSON map tensor -> {"saved_offsets": [...]}
#: where each tensor of the file sits in the full tensor. Present in the unconsolidated
#: ``shard-<rank>-model-<i>-of-<n>.safetensors`` files, which hold one rank's piece of each: a
#: folder of them is torch DCP's, read by ``torchfiles.dcp_safetensors``, never as plain
#: safetensors.
DCP_SHARDING_INFO = "DCP_SHARDING_INFO"


def strict_json(raw: bytes | str, what: str):
    """JSON with every object's keys unique (``json`` keeps the last silently; the safetensors
    package refuses such a header): ``SourceError`` starting with ``what``; other JSON errors
    are ``ValueError``s (``files.strict_loads``)."""
    try:
        return files.strict_loads(raw)
    except ValueError as e:
        if str(e).startswith("names "):  # files.unique_keys: a key named twice
            raise SourceError(f"{what}: {e}") from None
        raise


def is_safetensors(src) -> bool:
    """A ``.safetensors`` file, or a directory holding one or an index (but not torch DCP's
    Hugging Face shards: :func:`is_dcp_sharded`)."""
    src = os.fspath(src)
    if os.path.isfile(src):
        return src.endswith(".safetensors")
    return (
        os.path.isdir(src)
        and (
            os.path.isfile(os.path.join(src, INDEX_FILE))
            or any(n.endswith(".safetensors") for n in os.listdir(src))
        )
        and not is_dcp_sharded(src)
    )


def is_dcp_sharded(src) -> bool:
    """A local folder whose first ``.safetensors`` file (by name, torch's rank file names
    first: a stray ``model.safetensors`` beside them is no reason to read them as whole tensors)
    is one of torch DCP's Hugging Face writer's: its ``__metadata__`` has
    :data:`DCP_SHARDING_INFO` (a folder of such files is one checkpoint, each tensor assembled
    from every file's piece of it). Only that file's header is read; a file that cannot be read
    says no (its own reader names the fault); the single-process writer's whole tensors
    (:func:`_whole_tensors`) are plain safetensors."""
    src = os.fspath(src)
    if not os.path.isdir(src):
        return False
    names = sorted(
        (n for n in os.listdir(src) if n.endswith(".safetensors")),
        key=lambda n: (RANK_FILE.fullmatch(n) is None, n),
    )
    if not names:
        return False
    try:
        path = os.path.join(src, names[0])
        return SafetensorsFile(path, _inside(src, names[0], src), dcp_shard=True).rank_piece
    except (SourceError, OSError):
        return False


def _inside(src: str, name: str, what: str) -> str:
    try:
        return files.inside_checkpoint(src, name, what)
    except files.UnsafeFileError as e:
        raise SourceError(str(e)) from None


def read_weight_map(
    index: str, suffix: str = "", error: type[UCPError] = SourceError
) -> dict[str, str]:
    """The ``weight_map`` (tensor name -> file name) of a Hugging Face index
    (``model.safetensors.index.json``, ``pytorch_model.bin.index.json``): read bounded, strict
    JSON (a repeated key refused), every file a plain name beside the index ending in
    ``suffix``. Errors are ``error``s naming the index (and the entry).

    Args:
        index: the index file.
        suffix: what every file name must end with ("" for any).
        error: the error class raised (the caller's format's).

    Returns:
        The weight map as written.
    """
    return weight_map_of(files.read_regular(index, MAX_INDEX_BYTES), index, suffix, error)


def weight_map_of(
    raw: bytes, index: str, suffix: str = "", error: type[UCPError] = SourceError
) -> dict[str, str]:
    """:func:`read_weight_map` of an index's bytes ``raw`` (read by the caller, bounded; an
    object store's): ``index`` names it in errors."""
    try:
        data = strict_json(raw, index)
    except SourceError as e:  # a repeated key
        raise (e if error is SourceError else error(str(e))) from None
    except (ValueError, RecursionError) as e:
        raise error(f"{index}: not a valid JSON index ({str(e)[:200]})") from None
    weight_map = data.get("weight_map") if isinstance(data, dict) else None
    if not isinstance(weight_map, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items()
    ):
        raise error(f"{index}: expected a 'weight_map' of tensor name -> file name.")
    if not weight_map:  # a model of no tensors: an import of nothing would pass as done
        raise error(f"{index}: its 'weight_map' names no tensor.")
    for name, tensor in first_tensors(weight_map).items():
        if os.path.basename(name) != name or name in (".", "..") or not name.endswith(suffix):
            raise error(
                f"{index}: weight_map entry {tensor[:100]!r} names {name[:100]!r}; expected a "
                f"{suffix + ' ' if suffix else ''}file beside the index (no directories)."
            )
    return weight_map


def first_tensors(weight_map: dict[str, str]) -> dict[str, str]:
    """File name -> the first tensor a ``weight_map`` puts in it, by file name (the entry an
    error about the file names)."""
    first: dict[str, str] = {}
    for tensor, name in weight_map.items():
        first.setdefault(name, tensor)
    return dict(sorted(first.items()))


class RandomAccess(Protocol):
    """A file read by byte ranges, whatever its medium (``store.storage.ranged``, or a local
    file's mapping): what the one header decoder reads."""

    def read(self, offset: int, n: int) -> bytes | None:
        """Up to ``n`` bytes from ``offset``; None: no such file; a range the medium refuses:
        a ``ValueError``."""
        ...

    def holds(self, size: int) -> bool:
        """Whether the file has at least ``size`` bytes."""
        ...


class _Mapped:
    """A local file's mapping as a ``RandomAccess``: read with pread (``mapped_file``)."""

    def __init__(self, mm: mapped_file.FileMap):
        self.mm = mm

    def read(self, offset: int, n: int) -> bytes:
        return mapped_file.read_bytes(self.mm, offset, n, "the header")

    def holds(self, size: int) -> bool:
        return len(self.mm) >= size


#: torch's rank-local file name (``_hf_utils.SHARDED_FILE_NAME``): the rank, from 1, first
RANK_FILE = re.compile(r"shard-([0-9]{5,})-model-[0-9]{5,}-of-[0-9]{5,}\.safetensors")
#: the single-process writer's file name (torch's ``_hf_utils.FILE_NAME``), not a rank's
_WHOLE_FILE = re.compile(r"model-[0-9]{5,}-of-[0-9]{5,}\.safetensors")


def _whole_tensors(path: str, sharding: Any, header: dict) -> bool:
    """A file of torch DCP's Hugging Face writer run in one process (``model-0000K-of-0000N``,
    not a rank's ``shard-0000R-model-...``): every tensor whole, at offsets zero and its own
    global shape; read as plain safetensors (from an object store or the Hub too)."""
    if not _WHOLE_FILE.fullmatch(os.path.basename(path)) or not isinstance(sharding, str):
        return False
    try:
        info = json.loads(sharding)
    except (ValueError, RecursionError):
        return False
    if not isinstance(info, dict) or set(info) != set(header) - {"__metadata__"}:
        return False
    for name, entry in info.items():
        shape = (
            (header.get(name) or {}).get("shape") if isinstance(header.get(name), dict) else None
        )
        if not isinstance(entry, dict) or not isinstance(shape, list):
            return False
        offsets, whole = entry.get("saved_offsets"), entry.get("global_shape", shape)
        if not isinstance(offsets, list) or any(o != 0 for o in offsets) or whole != shape:
            return False
    return True


class SafetensorsFile:
    """One safetensors file: its validated header and read-only views of its tensors."""

    def __init__(self, path: str, real: str | None = None, *, dcp_shard: bool = False):
        """``path`` as the checkpoint names it; ``real``, when given, what it resolved to (the
        file opened). ``dcp_shard``: a torch DCP Hugging Face shard is opened (its
        :data:`DCP_SHARDING_INFO` JSON kept in ``sharding``) rather than refused."""
        fd = files.open_regular(real or path)
        try:
            size = os.fstat(fd).st_size
            if size < 8:
                raise SourceError(f"{path}: {size} bytes, too short for a header.")
            # bytes are read with pread through mapped_file, never by touching the mapping: a
            # file truncated meanwhile is an error naming it, not SIGBUS
            mapped = mapped_file.map_file(path, fd)
        finally:
            os.close(fd)
        if mapped is None or len(mapped) != size:
            raise SourceError(f"{path}: changed size while being opened.")
        self.map: mapped_file.FileMap | None = mapped
        self._decode(path, _Mapped(mapped), size, dcp_shard)

    @classmethod
    def read_from(
        cls,
        path: str,
        file: RandomAccess,
        *,
        dcp_shard: bool = False,
        mapped: mapped_file.FileMap | None = None,
    ) -> SafetensorsFile:
        """The checked header of a file read by ranges (an object store's object, a Hub file),
        or of its map (``mapped``: a local file's, whose tensors are then views of it):
        ``header`` and ``metadata`` as for a local file; without a map its size is unknown, the
        data must end where its last tensor ends.

        Args:
            path: names the file in errors.
            file: the file, read by ranges.
            dcp_shard: as for a local file.
            mapped: the file's map (its size known: read through it).
        """
        self = cls.__new__(cls)
        self.map = mapped
        size = None if mapped is None else len(mapped)
        self._decode(path, file if mapped is None else _Mapped(mapped), size, dcp_shard)
        return self

    @property
    def rank_piece(self) -> bool:
        """One rank's file of torch DCP's Hugging Face writer (its tensors pieces of larger
        ones), not the single-process writer's whole tensors."""
        shapes = {name: {"shape": list(entry[1])} for name, entry in self.header.items()}
        return self.sharding is not None and not _whole_tensors(self.path, self.sharding, shapes)

    def _decode(self, path: str, file: RandomAccess, size: int | None, dcp_shard: bool) -> None:
        """The one decoder: the header's length (bounded), the header, every tensor's range
        checked against the file (``size``; None: unknown, the file's end asked instead)."""
        self.path, self.dcp_shard, self.sharding = path, dcp_shard, None
        head = self._range(file, 0, 8)
        if head is None:
            raise SourceError(f"{path}: no such object.")
        if len(head) < 8:
            raise SourceError(f"{path}: {len(head)} bytes, too short for a header.")
        n = int.from_bytes(head, "little")
        if n > MAX_HEADER_BYTES or (size is not None and 8 + n > size):
            known = "" if size is None else f"file {size} bytes, "
            raise SourceError(
                f"{path}: header of {n} bytes ({known}at most {MAX_HEADER_BYTES} allowed)."
            )
        raw = self._range(file, 8, n) or b""
        if len(raw) != n:
            raise SourceError(f"{path}: header of {n} bytes, the file ends after {len(raw)}.")
        self.data_start = 8 + n
        self.data_size = 2**62 if size is None else size - self.data_start
        self.header, self.metadata = self._parse(raw)
        if size is None:  # the data ends where the last tensor ends: the file must end there
            end = self.data_start + max((e for *_, e in self.header.values()), default=0)
            if not file.holds(end) or file.holds(end + 1):
                raise SourceError(
                    f"{path}: the header's tensors end at byte {end}; the file is "
                    f"{'longer' if file.holds(end) else 'shorter (truncated)'}."
                )

    def _range(self, file: RandomAccess, offset: int, n: int) -> bytes | None:
        try:
            return file.read(offset, n)
        except ValueError as e:  # the medium's refusal (a Range ignored, an error status)
            raise SourceError(f"{self.path}: {e}") from None

    def _parse(self, raw: bytes) -> tuple[dict, dict]:
        try:
            header = strict_json(raw.decode("utf-8"), f"{self.path}: the header")
        except SourceError:
            raise
        except (UnicodeDecodeError, ValueError, RecursionError) as e:
            raise SourceError(f"{self.path}: corrupt header ({str(e)[:200]}).") from None
        if not isinstance(header, dict):
            raise SourceError(f"{self.path}: the header is not a JSON object.")
        metadata = header.pop("__metadata__", None) or {}
        if isinstance(metadata, dict) and DCP_SHARDING_INFO in metadata:
            sharding = metadata[DCP_SHARDING_INFO]
            if not self.dcp_shard and not _whole_tensors(self.path, sharding, header):
                self._refuse_dcp_shard(sharding)
            if not isinstance(sharding, str):
                raise SourceError(
                    f"{self.path}: __metadata__ {DCP_SHARDING_INFO} is a "
                    f"{type(sharding).__name__}, expected a JSON string"
                )
            self.sharding = sharding
        tensors = {name: self._entry(name, info) for name, info in header.items()}
        ranges = sorted((b, e, name) for name, (_, _, b, e) in tensors.items() if e > b)
        for (_, end, a), (begin, _, b) in itertools.pairwise(ranges):
            if begin < end:
                raise SourceError(
                    f"{self.path}: tensors {a[:100]!r} and {b[:100]!r} overlap in the file."
                )
        return tensors, metadata if isinstance(metadata, dict) else {}

    def _refuse_dcp_shard(self, sharding: Any) -> None:
        """A file written by torch DCP's Hugging Face writer without consolidation holds one
        rank's piece of each tensor: imported alone, rank 0's half would become the whole
        tensor. Refused as a plain safetensors file, whatever its offsets say (rank 0's are all
        zeros); its folder is read whole as torch DCP (``torchfiles.dcp_safetensors``)."""
        example = ""
        try:
            info = json.loads(sharding) if isinstance(sharding, str) else {}
            name, entry = next(iter(info.items()))
            example = (
                f" (e.g. {name[:100]!r} has saved_offsets {str(entry.get('saved_offsets'))[:60]})"
            )
        except (ValueError, RecursionError, StopIteration, AttributeError, TypeError):
            pass
        raise SourceError(
            f"{self.path}: an unconsolidated shard of torch.distributed.checkpoint's Hugging Face "
            f"writer (__metadata__ has {DCP_SHARDING_INFO}): its tensors are pieces of larger "
            f"ones{example}, assembled only from every rank's file. Pass the folder holding all "
            "of them (read as torch DCP), not one file."
        )

    def _entry(self, name: str, info: Any) -> tuple[np.dtype, tuple[int, ...], int, int]:
        where = f"{self.path}: tensor {name[:100]!r}"
        if not isinstance(info, dict) or set(info) != {"dtype", "shape", "data_offsets"}:
            raise SourceError(f"{where}: expected dtype, shape and data_offsets.")
        dtype = DTYPES.get(info["dtype"]) if isinstance(info["dtype"], str) else None
        if dtype is None:
            raise SourceError(
                f"{where}: dtype {str(info['dtype'])[:20]!r} is not supported "
                f"(expected one of {', '.join(DTYPES)})."
            )
        shape, offsets = info["shape"], info["data_offsets"]
        if not (
            isinstance(shape, list)
            and all(
                isinstance(d, int) and not isinstance(d, bool) and 0 <= d < 2**48 for d in shape
            )
            and isinstance(offsets, list)
            and len(offsets) == 2
            and all(isinstance(o, int) and not isinstance(o, bool) for o in offsets)
        ):
            raise SourceError(f"{where}: malformed shape or data_offsets.")
        begin, end = offsets
        nbytes = int(np.prod(shape, dtype=object)) * dtype.itemsize
        if not 0 <= begin <= end <= self.data_size or end - begin != nbytes:
            raise SourceError(
                f"{where}: bytes [{begin}, {end}) do not hold a {info['dtype']} array of shape "
                f"{shape} ({nbytes} bytes) inside the file's {self.data_size} data bytes."
            )
        return dtype, tuple(shape), begin, end

    def tensor(self, name: str) -> np.ndarray:
        """A read-only view of ``name`` (no copy; the map stays open while the view lives),
        to be read with :mod:`jax_ucp._src.format.mapped_file` (pread), never touched directly."""
        (dtype, shape, begin, end), mm = self.header[name], self.map
        assert mm is not None, f"{self.path}: read by ranges, no map to view"
        count, start = (end - begin) // dtype.itemsize, self.data_start + begin
        return np.frombuffer(mm, dtype, count=count, offset=start).reshape(shape)
