"""``verify(ckpt, against=src)``: is the converted checkpoint really the run? Every imported
tensor is compared bit for bit with what the source framework's *own* loader reads from the
source (safetensors' ``safe_open``, ``torch.load(weights_only=True)`` of each file or of every
rank file with DTensor shards placed by torch's placement code, torch DCP's ``dcp.load``,
DeepSpeed's ``zero_to_fp32`` and ``ds_to_universal``), one tensor at a time, never with
jax_ucp's own readers.

Tensors an import built (the optimizer step from per-parameter steps, Megatron's
tensor-parallel merges) or no loader reads here (FSDP1's ShardedTensors) are listed as not
compared, with why — said, never counted as equal.

First of all, the source's files are checked against the certificate ``convert`` recorded
(``source.certificate``: each file's size and SHA-256, ``format.certificate``): a file added,
removed or changed since is named, so "this checkpoint is that run's files" is said before any
tensor is read; a checkpoint converted before certificates were says it has none.

The proof does not trust the thing it proves: which source tensor a checkpoint tensor is
compared with is found from the source and the tensor's own key, by planning the import of the
source again (the importer's rules; the options the manifest records), never from the
provenance the checkpoint records, which is only checked against it. Every tensor of that plan
is accounted for: compared, listed in the checkpoint's ``source.skipped``, or reported missing;
a checkpoint tensor the plan does not make is reported as not in the source. Every path derived
from a record (the checkpoint's or the source's) stays inside the source
(``format.files.inside``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import io
import json
import logging
import os
import pickle
import re
import shutil
import sys
from collections.abc import Callable
from typing import Any

import numpy as np

from jax_ucp._src import store, writer
from jax_ucp._src.errors import RequestError, SourceError, UnsafeFileError
from jax_ucp._src.format import certificate, files, keypath
from jax_ucp._src.format.manifest import torch_optimizer_record
from jax_ucp._src.importers import registry
from jax_ucp._src.restoring import locate
from jax_ucp._src.torchfiles import dcp as safe_dcp
from jax_ucp._src.torchfiles import dcp_safetensors

__all__ = [
    "Comparison",
    "compare_with_source",
    "dcp_reader",
    "settings_differ",
    "source_weights",
]

# Every folder this module removes (ds_to_universal's temporary output) is logged here, as
# every deletion jax_ucp makes: ``logging.getLogger("jax_ucp")`` shows it.
log = logging.getLogger(__name__)


class MissingExtraError(SourceError):
    """A source framework's loader that is not installed: the proof cannot be made here, so
    the verify stops naming the extra to install (never a tensor quietly "not compared")."""


@dataclasses.dataclass
class Comparison:
    """What ``verify(..., against=)`` found: tensors equal bit for bit, those that differ (name
    -> what differs: values, a provenance the import of the source contradicts, a tensor the
    source does not hold), those it could not compare (name -> why), and the source's tensors
    the checkpoint lacks without listing them in ``source.skipped`` (name -> which)."""

    equal: list[str] = dataclasses.field(default_factory=list)
    different: dict[str, str] = dataclasses.field(default_factory=dict)
    not_compared: dict[str, str] = dataclasses.field(default_factory=dict)
    missing: dict[str, str] = dataclasses.field(default_factory=dict)
    #: the source's files against the checkpoint's ``source.certificate``, checked first:
    #: file name -> what differs (added, removed, changed); the tensors are compared after,
    #: as far as the import of the source can still be planned
    files: dict[str, str] = dataclasses.field(default_factory=dict)
    #: what the certificate check found, said (``"no certificate recorded"`` for a checkpoint
    #: converted before certificates were)
    certificate: str = ""
    #: what the checkpoint's ``source`` record says otherwise than the import of the source
    #: planned again records (``source.<field>`` -> both values: a run setting a continuation
    #: reads, such as clipping, betas or the scheduler's position), and a certificate missing
    #: without ``accept_uncertified``
    records: dict[str, str] = dataclasses.field(default_factory=dict)
    #: of the compared tensors, those no framework loader gives whole (megatron-core's flat
    #: optimizer buckets, tensor-parallel merges, the step), compared with what the import of
    #: the source planned again builds (``_rebuilt``)
    rebuilt: list[str] = dataclasses.field(default_factory=list)
    #: the import of the source as planned again (``source_weights`` reads by it: no detector
    #: is asked twice per verify)
    planned: Any = dataclasses.field(default=None, repr=False, compare=False)

    @property
    def ok(self) -> bool:
        """Every certified file equal, every recorded setting as planned again, every compared
        tensor equal (and at least one compared), none missing."""
        return (
            not self.files
            and not self.records
            and not self.different
            and not self.missing
            and bool(self.equal)
        )


def _bits(a: np.ndarray) -> np.ndarray:
    a = np.ascontiguousarray(a)
    return a.view(np.dtype(f"u{a.dtype.itemsize}")) if a.dtype.itemsize in (1, 2, 4, 8) else a


def _torch_to_numpy(t: Any) -> np.ndarray:
    import torch  # pyright: ignore[reportMissingImports]  # the torch extra

    t = t.detach().cpu().contiguous()
    if t.dtype == torch.bfloat16:
        import ml_dtypes

        return t.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    return t.numpy()


def _loader(
    fmt: str, src: str, provenance: dict, entry_name: str = "", recorded: str = ""
) -> tuple[Callable[[], np.ndarray], str]:
    """(a function reading the provenance's source tensor with the loader ``registry.AGAINST``
    gives its format, its name), or SourceError saying why it cannot be read that way.
    ``recorded``: the source path the import planned again records, whose tail locates rank
    files under ``src``; every file name becomes a path through ``files.inside_checkpoint``."""
    how, tensors, pattern = _how(fmt), provenance.get("tensors") or [], provenance.get("pattern")
    strip = re.fullmatch(r"vocab\(strip ([0-9]+) -> ([0-9]+)\)", str(pattern))
    if strip and how.loader == "recorded_dcp":  # --vocab-size: the source's first rows
        provenance = {**provenance, "pattern": how.read}
        read, name = _loader(fmt, src, provenance, entry_name, recorded)
        return lambda: _rows(read(), *map(int, strip.groups())), f"{name}[:{strip.group(2)}]"
    if how.read not in (None, pattern or ""):
        raise SourceError(f"built by the import ({pattern})")
    if how.loader == "ranks":
        parts = [
            p for t in tensors for p in _rank_parts(how, src, recorded, provenance, t, entry_name)
        ]
        if not parts:
            raise SourceError("the import names no source tensor")
        return lambda: _from_ranks(parts), ", ".join(f"{f}:{k}" for f, k, _ in parts)
    if how.loader == "zero":
        return _deepspeed_loader(src, provenance, entry_name, recorded)
    if len(tensors) != 1:
        raise SourceError(f"built from {len(tensors)} source tensors by the import")
    if not how.loader:
        raise SourceError(f"no framework loader compared for {fmt!r} imports yet")
    name = tensors[0]
    if how.loader in ("dcp", "recorded_dcp"):
        key = provenance.get("source_name") or name
        if how.loader == "recorded_dcp":  # megatron-core's torch_dist: the tensor as saved
            folder = os.path.dirname(_locate(src, recorded, ".metadata", entry_name))
        elif sub := provenance.get("folder"):
            folder = _inside(src, sub, entry_name)
        else:
            folder = _dcp_folder_holding(src, key)
        return lambda: _dcp_tensor(folder, key), key
    file, _, inner = name.partition(":") if ":" in name else (provenance.get("file"), "", name)
    if not isinstance(file, str):
        raise SourceError("the import names no source file")
    path = src if os.path.isfile(src) else _inside(src, file, entry_name)
    if _is_safetensors(path):  # by its bytes: a cache snapshot's blob has no extension
        return lambda: _safetensors_tensor(path, inner), name
    rows = provenance.get("rows_permuted")
    if isinstance(rows, dict):  # torchtune's q/k moments, moved as its weights are
        return lambda: _hf_rows(_torch_to_numpy(_torch_file_value(path, inner)), **rows), name
    return lambda: _torch_to_numpy(_torch_file_value(path, inner)), name


def _rows(value: np.ndarray, padded: int, kept: int) -> np.ndarray:
    """The first ``kept`` rows of a source tensor of ``padded`` rows (the vocab padding the
    import stripped, ``vocab_size=``)."""
    if value.shape[:1] != (padded,):
        raise SourceError(f"{list(value.shape)} in the source, {padded} rows planned")
    return value[:kept]


def _read(src: str, name: str, planned: dict, source: dict) -> tuple[np.ndarray, str]:
    """(the source tensor of checkpoint tensor ``name``, its name in the source), read by the
    loader of the format its ``planned`` provenance (else the ``source`` record) names; a
    loader's package not installed is the extra to install."""
    fmt, path = planned.get("format") or source.get("framework"), source.get("path")
    try:
        read, source_name = _loader(str(fmt or ""), src, planned, name, str(path or ""))
        return read(), source_name
    except ImportError as e:
        raise (_missing_extra(e) or e) from None


def _how(fmt: str) -> Any:
    """How the importers say a tensor of the provenance format ``fmt`` is read (or by none)."""
    return registry.AGAINST.get(fmt) or registry.Against("", read=None)


def _rank_parts(
    how: Any, src: str, recorded: str, provenance: dict, tensor: str, entry_name: str
) -> list[tuple[str, str, int]]:
    """[(path, key, rank)] of the rank files' pieces of one source tensor: named ``FILE<sep>key``
    (verl's), or ``item:key`` once, its rank files ``item_R.pt`` in ``provenance["files"]``
    (torch_checkpointing's)."""
    item, _, key = tensor.partition(how.sep or ":")
    listed = provenance.get("files") or ()
    files = [item] if how.sep else [f for f in listed if f.startswith(f"{item}_")]
    out = []
    for file in files:
        found = re.search(how.rank, file)
        if found is None:
            raise SourceError(f"{file}: no rank in the file name")
        out.append((_locate(src, recorded, file, entry_name), key, int(found.group(1))))
    return out


def _inside(src: str, name: Any, entry_name: str) -> str:
    """``name`` (read from a checkpoint's or the source's records) as a path under the source
    ``src``, refused unless it stays inside it (``format.files.inside``): an absolute path, a
    ``..`` part or a link out of ``src`` is an error naming the tensor and the path."""
    root = src if os.path.isdir(src) else os.path.dirname(os.path.abspath(src))
    return files.inside_checkpoint(root, name, f"{entry_name or 'a tensor'}: its source file")


def _locate(src: str, recorded: str, file: str, entry_name: str) -> str:
    """``file`` under ``src``, found where the recorded source path's tail puts it
    (``global_step_3/actor/``, ``actor/``, or ``src`` itself), never outside ``src``."""
    tail = [p for p in os.path.normpath(recorded).split(os.sep) if p][-3:] if recorded else []
    _inside(src, file, entry_name)  # the name alone first: a '..' is refused, never joined
    for i in range(len(tail) + 1):
        path = _inside(src, "/".join([*tail[i:], file]), entry_name)
        if os.path.isfile(path):
            return path
    raise SourceError(f"{src}: no {file} (the import read {os.path.join(recorded, file)})")


def _from_ranks(parts: list[tuple[str, str, int]]) -> np.ndarray:
    """One tensor from every rank's piece, read with ``torch.load(weights_only=True)``: DTensors
    placed where torch's own placement code (``_compute_local_shape_and_global_offset`` over the
    DTensor's mesh and placements) puts each rank's local shard; every element covered once at
    least; plain tensors (a step every rank holds) equal on every rank."""
    import torch  # pyright: ignore[reportMissingImports]  # the torch extra
    from torch.distributed.tensor import DTensor  # pyright: ignore[reportMissingImports]
    from torch.distributed.tensor._utils import (  # pyright: ignore[reportMissingImports]
        _compute_local_shape_and_global_offset,
    )

    pieces = [(path, rank, _torch_file_value(path, key)) for path, key, rank in parts]
    if not any(isinstance(v, DTensor) for _, _, v in pieces):
        first = _torch_to_numpy(pieces[0][2])
        for path, _, v in pieces[1:]:
            if not np.array_equal(_bits(_torch_to_numpy(v)), _bits(first)):
                raise SourceError(f"{path}: the ranks hold different values")
        return first
    out = covered = None
    for path, rank, v in pieces:
        if not isinstance(v, DTensor):
            raise SourceError(f"{path}: a plain tensor where the other ranks hold DTensors")
        mesh = v.device_mesh
        where = (mesh.mesh == rank).nonzero()
        if len(where) != 1:
            raise SourceError(f"{path}: rank {rank} is not in the DTensor's mesh")
        shape, offset = _compute_local_shape_and_global_offset(
            v.shape, mesh.shape, where[0].tolist(), v.placements
        )
        local = v.to_local()
        if tuple(local.shape) != tuple(shape):
            raise SourceError(f"{path}: local shard {list(local.shape)}, placed as {list(shape)}")
        if out is None:
            out = torch.empty(tuple(v.shape), dtype=local.dtype)
            covered = torch.zeros(tuple(v.shape), dtype=torch.bool)
        box = tuple(slice(o, o + n) for o, n in zip(offset, shape, strict=True))
        out[box] = local
        covered[box] = True  # pyright: ignore[reportOptionalSubscript]
    assert out is not None and covered is not None
    if not bool(covered.all()):
        raise SourceError(
            f"the rank files cover {int(covered.sum())} of {covered.numel()} elements"
        )
    return _torch_to_numpy(out)


def _hf_rows(value: np.ndarray, heads: int, head_dim: int) -> np.ndarray:
    """torchtune's ``tune_to_hf`` q/k row permutation (``[heads, head_dim/2, 2, dim]``, the
    middle axes swapped), which its checkpointer applies to the weights and the import to the
    moments: the source tensor as torch reads it, moved the same way before comparing."""
    dim = value.shape[1]
    return value.reshape(heads, head_dim // 2, 2, dim).transpose(0, 2, 1, 3).reshape(-1, dim)


def _is_safetensors(path: str) -> bool:
    """Whether the file at ``path`` is in safetensors' format (an 8-byte little-endian header
    size, then the JSON header's ``{``), whatever its name."""
    fd = files.open_regular(path)
    try:
        head = os.pread(fd, 9, 0)
    finally:
        os.close(fd)
    return len(head) == 9 and head[8:9] == b"{"


def _safetensors_tensor(path: str, name: str) -> np.ndarray:
    from safetensors import safe_open

    try:
        import torch  # pyright: ignore[reportMissingImports]  # noqa: F401
    except ImportError:
        with safe_open(path, "np") as f:
            return f.get_tensor(name)
    with safe_open(path, "pt") as f:
        return _torch_to_numpy(f.get_tensor(name))


_TORCH_FILES: dict[str, dict[str, Any]] = {}
_DEEPSPEED: dict[str, dict[str, Any]] = {}


def _deepspeed_loader(
    src: str, provenance: dict, entry_name: str, recorded: str
) -> tuple[Callable[[], np.ndarray], str]:
    """A ZeRO import's fp32 weights against DeepSpeed's own consolidation
    (``zero_to_fp32.get_fp32_state_dict_from_zero_checkpoint``, the whole state once, as
    DeepSpeed reads it); its moments against DeepSpeed's ``ds_to_universal`` (run once into a
    temporary folder, removed after: disk for one copy of the weights and moments), each
    ``zero/<param>/<state>.pt`` read with ``torch.load(weights_only=True)``; a weight the
    model states file holds (its ``module``) with ``torch.load``."""
    tensors = provenance.get("tensors") or []
    if provenance.get("pattern") == "module" and len(tensors) == 1:
        file, _, inner = tensors[0].partition(":")
        path = _locate(src, recorded, file, entry_name)
        return lambda: _torch_to_numpy(_torch_file_value(path, inner)), tensors[0]
    kind, _, rest = entry_name.partition("/")
    stage = provenance.get("zero_stage")
    if stage not in (1, 2, 3):
        raise SourceError(f"built by the import ({provenance.get('pattern')})")
    name = rest.rsplit("/", 1)[-1]  # parameter names hold dots, never slashes
    if kind == "params":

        def read() -> np.ndarray:
            state = _cached(src, "zero_to_fp32", _zero_to_fp32)
            if name not in state:
                raise SourceError(f"{src}: zero_to_fp32 gives no weight {name!r}")
            return _torch_to_numpy(state[name])

        return read, f"zero_to_fp32:{name}"
    moment = str(tensors[0]).rsplit(".", 1)[-1] if tensors else ""
    if kind != "opt_state" or not moment.startswith("exp_avg"):
        raise SourceError(f"no DeepSpeed loader gives {entry_name!r} whole")

    def read_moment() -> np.ndarray:
        import torch  # pyright: ignore[reportMissingImports]  # the torch extra

        folder = _cached(src, "ds_to_universal", _ds_to_universal)["folder"]
        path = os.path.join(folder, "zero", name, f"{moment}.pt")
        if not os.path.isfile(path):
            raise SourceError(f"{src}: ds_to_universal writes no {name}/{moment}.pt")
        try:
            value = torch.load(path, weights_only=True, map_location="cpu")
        except pickle.UnpicklingError as e:  # DeepSpeed's classes in its own output
            raise SourceError(
                f"no framework loader reads it here: torch.load(weights_only=True) refuses "
                f"ds_to_universal's {name}/{moment}.pt ({str(e).splitlines()[-1][:200]})"
            ) from None
        value = value["param"] if isinstance(value, dict) else value
        if stage == 3 and value.dim() == 1:  # ZeRO-3's stay flat; shaped as zero_to_fp32's
            weight = _cached(src, "zero_to_fp32", _zero_to_fp32).get(name)
            if weight is not None and weight.numel() == value.numel():
                value = value.view(weight.shape)
        return _torch_to_numpy(value)

    return read_moment, f"ds_to_universal:{name}/{moment}"


def _cached(src: str, what: str, make: Callable[[str], dict[str, Any]]) -> dict[str, Any]:
    """One DeepSpeed consolidation of ``src`` kept for the whole comparison; DeepSpeed's own
    tool failing on it (zero_to_fp32 on a pipeline-parallel save, ds_to_universal on a class
    torch.load refuses) is said once, as no framework loader reading it here."""
    key = f"{what}:{src}"
    if key not in _DEEPSPEED:
        try:
            _DEEPSPEED[key] = make(src)
        except (ImportError, SourceError):
            raise
        except Exception as e:  # DeepSpeed's own tool on its own files: its error, named
            why = f"{type(e).__name__}: {str(e)[:200]}"
            _DEEPSPEED[key] = {"failed": f"no framework loader reads it here: {what} fails ({why})"}
    if "failed" in _DEEPSPEED[key]:
        raise SourceError(_DEEPSPEED[key]["failed"])
    return _DEEPSPEED[key]


def _tag_folder(src: str) -> str:
    latest = os.path.join(src, "latest")
    if os.path.isfile(latest):  # the run folder (the Trainer's checkpoint-N)
        tag = files.read_regular(latest, 4096).decode("utf-8", "replace").strip()
        return files.inside(src, tag, f"{latest}: the tag it names")
    return src


def _ds_to_universal(src: str) -> dict[str, Any]:
    import argparse
    import tempfile

    from deepspeed.checkpoint import ds_to_universal  # pyright: ignore[reportMissingImports]

    # DeepSpeed writes its tracker `latest_universal` beside the output folder: inside our own
    # folder, never straight into /tmp (found by tests/hostile)
    parent = tempfile.mkdtemp(prefix="ucp-against-")
    folder = os.path.join(parent, "universal")
    args = argparse.Namespace(
        input_folder=_tag_folder(src),
        output_folder=folder,
        num_extract_workers=1,  # in this process (DeepSpeed's serial path)
        num_merge_workers=1,
        keep_temp_folder=False,
        strict=True,
        inject_missing_state=True,  # the Trainer's saves lack universal_checkpoint_info
    )
    try:
        with contextlib.redirect_stdout(sys.stderr):
            ds_to_universal.main(args)
    except BaseException:
        _discard(parent, "ds_to_universal's output of a failed run")
        raise
    return {"folder": folder}


def _discard(folder: str, why: str) -> None:
    """Removes a temporary folder this module made (never a user's), logging it."""
    log.info("removing %s (%s)", folder, why)
    shutil.rmtree(folder, ignore_errors=True)


#: the loaders' packages -> the extra that installs them
_EXTRAS = {
    "deepspeed": ("DeepSpeed's own zero_to_fp32 and ds_to_universal", "deepspeed"),
    "torch": ("torch's own loaders (torch.load, dcp.load)", "hf"),
}


def _missing_extra(e: ImportError) -> MissingExtraError | None:
    """The error naming the extra to install, when ``e`` is a source loader's package missing."""
    root = (e.name or "").split(".")[0]
    if root not in _EXTRAS:
        return None
    what, extra = _EXTRAS[root]
    return MissingExtraError(
        f"--against reads this source with {what}, and {root} is not installed here ({e}); "
        f"install the extra: pip install 'jax_ucp[{extra}]'"
    )


def _zero_to_fp32(src: str) -> dict[str, Any]:
    from deepspeed.utils.zero_to_fp32 import (  # pyright: ignore[reportMissingImports]
        get_fp32_state_dict_from_zero_checkpoint,
    )

    parent, tag = os.path.split(os.path.normpath(_tag_folder(src)))  # the tag 'latest' names
    with contextlib.redirect_stdout(sys.stderr):  # its progress lines, not verify's output
        state = get_fp32_state_dict_from_zero_checkpoint(parent, tag=tag)
    if state is None:
        raise SourceError(f"{src}: DeepSpeed's zero_to_fp32 finds no weights")
    return dict(state)


def _torch_file_value(path: str, name: str) -> Any:
    """Tensor ``name`` (dotted) of the torch.save file ``path``, as torch.load(weights_only=True)
    reads it; a few files stay loaded (memory-mapped), enough for every rank of a tensor."""
    import torch  # pyright: ignore[reportMissingImports]  # the torch extra

    if path not in _TORCH_FILES:
        if len(_TORCH_FILES) >= 16:
            _TORCH_FILES.pop(next(iter(_TORCH_FILES)))
        try:
            node = torch.load(path, weights_only=True, mmap=True, map_location="cpu")
        except pickle.UnpicklingError as e:
            if "ShardedTensor" in str(e):  # FSDP1's SHARDED_STATE_DICT (verl's FSDP1 ranks)
                raise SourceError(
                    f"{path}: torch.load(weights_only=True) refuses ShardedTensor, and torch "
                    "rebuilds one only inside the process group of the rank that saved it: no "
                    "torch loader reads it here"
                ) from e
            raise SourceError(f"{path}: torch.load(weights_only=True) refuses it: {e}") from e
        _TORCH_FILES[path] = _flatten(node)
    flat = _TORCH_FILES[path]
    if name not in flat:
        raise SourceError(f"{path}: torch.load finds no tensor {name!r}")
    return flat[name]


def _flatten(node: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(node, dict | list | tuple):
        items = node.items() if isinstance(node, dict) else enumerate(node)
        return {n: t for k, v in items for n, t in _flatten(v, f"{prefix}{k}.").items()}
    return {prefix[:-1]: node} if hasattr(node, "shape") else {}


def _dcp_folder_holding(src: str, key: str) -> str:
    """``src`` when it is a torch DCP folder, else its one DCP subfolder whose metadata holds
    ``key`` (the Trainer's ``pytorch_model_fsdp_0/`` and ``optimizer_0/`` beside its files)."""
    storage = safe_dcp.folder(src)  # read through its Storage, as the import read it
    try:
        names = storage.names()
    except (NotADirectoryError, FileNotFoundError):  # one file: the import's, named as given
        return src
    if safe_dcp.METADATA_FILE in names or dcp_safetensors.is_rank_local(storage):
        return src
    for name in names:
        folder = storage.at(storage.join(name))  # a DCP folder linked in is the import's too
        if folder.exists(safe_dcp.METADATA_FILE) and key in _dcp_keys(folder.root):
            return folder.root
    raise SourceError(f"{src}: no torch DCP folder in it holds {key!r}")


@functools.cache
def _dcp_keys(folder: str) -> set[str]:
    return set(dcp_reader(folder).read_metadata().state_dict_metadata)


#: OLMo-core's RemoteFileSystemWriter pickles its own ``_StorageInfo`` (torch's fields:
#: relative_path, offset, length) into ``.metadata``; without OLMo-core installed, torch's
#: reader takes that one class as torch's own.
_OLMO_STORAGE_INFO = ("olmo_core.distributed.checkpoint.filesystem", "_StorageInfo")


_VETTED: set[str] = set()


def dcp_reader(folder: str) -> Any:
    """torch DCP's ``FileSystemReader`` for ``folder``, reading OLMo-core's metadata too.

    torch's reader unpickles ``.metadata`` with plain pickle (any class, any callable): the
    allow-listed reader of :mod:`jax_ucp._src.torchfiles.dcp` reads it first, so a pickle
    naming anything but DCP's own data classes is refused before torch sees it."""
    from torch.distributed.checkpoint import filesystem  # pyright: ignore[reportMissingImports]

    rank_local = dcp_safetensors.is_rank_local(folder)  # torch's HF writer: safetensors, no pickle
    if folder not in _VETTED:
        if rank_local:  # vetted for its pickles, whatever its layout (fsdp_dtensor too)
            dcp_safetensors.open_rank_local(folder)
        else:
            safe_dcp.open_dcp(folder, fsdp_dtensor=True)
        _VETTED.add(folder)
    if rank_local:
        from torch.distributed.checkpoint import (  # pyright: ignore[reportMissingImports]
            hf_storage,
        )

        return hf_storage.HuggingFaceStorageReader(folder)

    class Unpickler(pickle.Unpickler):
        def find_class(self, module: str, name: str) -> Any:
            if (module, name) == _OLMO_STORAGE_INFO:
                return filesystem._StorageInfo
            return super().find_class(module, name)

    class Reader(filesystem.FileSystemReader):
        def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
            try:
                return super().read_metadata(*args, **kwargs)
            except ModuleNotFoundError as e:
                if e.name is None or not e.name.startswith("olmo_core"):
                    raise
            data = safe_dcp.folder(folder).read(safe_dcp.METADATA_FILE, safe_dcp.MAX_METADATA_BYTES)
            metadata = Unpickler(io.BytesIO(data or b"")).load()  # vetted: open_dcp read it
            if getattr(metadata, "storage_meta", None) is None:
                from torch.distributed.checkpoint.metadata import (  # pyright: ignore[reportMissingImports]
                    StorageMeta,
                )

                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata

    return Reader(folder)


def _dcp_tensor(src: str, key: str) -> np.ndarray:
    import torch  # pyright: ignore[reportMissingImports]  # the torch extra
    from torch.distributed.checkpoint.metadata import (  # pyright: ignore[reportMissingImports]
        TensorStorageMetadata,
    )
    from torch.distributed.checkpoint.state_dict_loader import (  # pyright: ignore[reportMissingImports]
        load,
    )

    try:
        meta = dcp_reader(src).read_metadata().state_dict_metadata.get(key)
    except (ValueError, TypeError, AttributeError) as e:  # its unpickled classes another torch's
        raise SourceError(
            f"{src}: torch {torch.__version__}'s own DCP reader cannot read its .metadata "
            f"({type(e).__name__}: {e}; written by another torch release?)"
        ) from None
    if not isinstance(meta, TensorStorageMetadata):
        raise SourceError(f"{src}: torch DCP's metadata has no tensor {key!r}")
    from torch.distributed.checkpoint.api import (  # pyright: ignore[reportMissingImports]
        CheckpointException,
    )

    out = torch.empty(tuple(meta.size), dtype=meta.properties.dtype)
    try:
        load({key: out}, storage_reader=dcp_reader(src), no_dist=True)
    except CheckpointException as e:  # a BaseException: torch's own read of the files failed
        why = "; ".join(f"{type(x).__name__}: {x}"[:200] for x, _ in e.failures.values())
        raise SourceError(f"{src}: torch DCP's own load of {key!r} fails ({why})") from None
    return _torch_to_numpy(out)


@dataclasses.dataclass(frozen=True)
class _Expected:
    """The import of the source planned again: where each checkpoint key comes from."""

    source: dict[str, Any]  # the plan's source record (framework, path, skipped)
    provenance: dict[tuple[str, ...], dict]  # output key -> provenance, as JSON
    how: str  # the options it was planned with, for the messages
    #: output key -> the re-planned item, kept where it is lazy (``writer.Deferred``) or small:
    #: what a tensor no framework loader gives whole is compared with (``_rebuilt``)
    items: dict[tuple[str, ...], Any] = dataclasses.field(default_factory=dict)
    #: source fields that say how the order was given (``parameter_order=`` now, the
    #: ``model_config=`` it was rebuilt from then): not compared as settings
    unsaid: tuple[str, ...] = ()


def _json(value: Any) -> Any:
    """``value`` as the manifest holds it (tuples as lists), to compare records."""
    return json.loads(json.dumps(value, sort_keys=True, default=str))


def _recorded_order(source: dict) -> list[str] | None:
    """The parameter order the import was given (``parameter_order=`` / ``model_config=``), as
    the manifest records it (``source.optimizer.param_groups[*].params``); None when the import
    found the order in the source itself (names, the Trainer's groups) or there is none."""
    keys = str(source.get("optimizer_keys") or "")
    given = source.get("optimizer_keyed_by") == "index" or (
        any(word in keys for word in ("parameter_order", "model_config"))
        and "Trainer's groups" not in keys  # rebuilt from the source's own config.json again
    )
    groups = torch_optimizer_record(source).get("param_groups") if given else None
    if not isinstance(groups, list):
        return None
    names = [n for g in groups if isinstance(g, dict) for n in g.get("params") or ()]
    return names if names and all(isinstance(n, str) for n in names) else None


def _plan_again(src: str, manifest: Any) -> _Expected:
    """The import of ``src`` planned again by its importer (detected from the files), with the
    options the manifest records: ``weights_only`` when it holds no optimizer state and its
    ``source.skipped`` says so, the parameter order the import was given. Its items are walked
    for their keys and provenance (each importer's accounting runs: every source tensor
    imported or skipped with a reason)."""
    recorded = manifest.source or {}
    skipped = recorded.get("skipped")
    said = skipped.values() if isinstance(skipped, dict) else ()
    fields: dict[str, Any] = {  # no optimizer state, and source.skipped says weights_only
        "weights_only": not any(tuple(e.key[:1]) == ("opt_state",) for e in manifest.tensors)
        and any("weights_only" in str(why) for why in said)
    }
    order = _recorded_order(recorded)
    if order is not None:
        fields["parameter_order"] = order
    if isinstance(recorded.get("vocab_size"), int):  # --vocab-size: the padding it stripped
        fields["vocab_size"] = recorded["vocab_size"]
    how = ", ".join(
        f"{k}={v!r}" if k != "parameter_order" else f"{k}=source.optimizer's {len(v)} names"
        for k, v in fields.items()
    )
    try:
        # the importer reading it whole (a taker's too), detected once and handed to the plan
        whole = registry.ImportOptions(weights_only=fields["weights_only"])
        importer = registry.importer_for(src, options=whole)
        known = {f.name for f in dataclasses.fields(importer.options)}
        options = registry.importer_options(
            importer, **{k: v for k, v in fields.items() if k in known}
        )
        plan = registry.plan_import(src, options, format=importer)
        provenance, items = {}, {}
        for item in plan.items:
            provenance[tuple(item.key)] = _json(item.provenance or {})
            if _lazy(item.value):
                items[tuple(item.key)] = item
    except (SourceError, RequestError) as e:
        raise SourceError(
            f"{src}: its import cannot be planned again ({how}) to find the source tensor of "
            f"each checkpoint tensor (never taken from the checkpoint's own records): {e}"
        ) from None
    unsaid = ("optimizer_keys", "parameter_order", "notes") if order is not None else ()
    return _Expected(_json(plan.source), provenance, how, items, unsaid)


def _shown(provenance: dict) -> str:
    """A provenance's source tensors (or files), short, for a message."""
    names = provenance.get("tensors") or provenance.get("files") or provenance.get("file") or []
    names = [names] if isinstance(names, str) else list(names)
    return ", ".join(str(n)[:120] for n in names[:3]) + (" ..." if len(names) > 3 else "") or "none"


def _recorded_files(fmt: str, provenance: dict) -> list[Any]:
    """Every file name a recorded provenance holds, as ``_loader`` would join it to the source:
    ``file``, ``folder``, ``files`` and the file part of each source tensor's name."""
    names = [provenance[k] for k in ("file", "folder") if provenance.get(k) is not None]
    listed = provenance.get("files")
    names += list(listed) if isinstance(listed, list) else [listed] if listed is not None else []
    sep = _how(fmt).sep
    for tensor in provenance.get("tensors") or ():
        if sep and sep in str(tensor):
            names.append(str(tensor).partition(sep)[0])
    return names


#: fields of the ``source`` record that may differ from the import planned again: where the
#: source was (it may have moved since) and the certificate ``convert`` adds
_NOT_SETTINGS = ("path", "trainer_path", "orbax_version", certificate.KEY)
#: the library that read a record, named in it (``transformers 5.24.0 LlamaForCausalLM``): the
#: one installed here may be another release, which is no other run
_READ_BY = re.compile(r"\b(transformers|torchtune|torch|deepspeed|orbax) [0-9][^ ,;)]*")


def settings_differ(
    recorded: Any, planned: Any, path: str = "source", unsaid: tuple[str, ...] = ()
) -> dict[str, str]:
    """``{source.field: both values}`` of each field the checkpoint's ``source`` record
    (``recorded``) says otherwise than the import of the source planned again (``planned``),
    walked into objects: each run setting a continuation reads (``optax_from_torch``: clipping,
    betas, eps, weight decay, the schedule and its position, the optimizer, the step)."""
    out: dict[str, str] = {}
    if isinstance(recorded, dict) and isinstance(planned, dict):
        for key in sorted({*recorded, *planned}):
            if path == "source" and key in (*_NOT_SETTINGS, *unsaid):
                continue
            absent = "(absent)"
            out.update(
                settings_differ(
                    recorded.get(key, absent), planned.get(key, absent), f"{path}.{key}"
                )
            )
        return out
    if (  # a list of objects (param_groups) by index; of numbers (betas) whole
        isinstance(recorded, list)
        and isinstance(planned, list)
        and len(recorded) == len(planned)
        and all(isinstance(v, dict) for v in (*recorded, *planned))
    ):
        for i, (a, b) in enumerate(zip(recorded, planned, strict=True)):
            out.update(settings_differ(a, b, f"{path}.{i}"))
        return out
    if recorded == planned or (
        isinstance(recorded, str)
        and isinstance(planned, str)
        and _READ_BY.sub(r"\1", recorded) == _READ_BY.sub(r"\1", planned)
    ):
        return {}
    return {
        path: f"{path}: ucp.json records {str(recorded)[:200]}, the import of the source planned "
        f"again records {str(planned)[:200]}"
    }


def compare_with_source(
    ckpt: str, src: str, progress=None, accept_uncertified: bool = False
) -> Comparison:
    """Each tensor of the checkpoint at ``ckpt`` against the source ``src`` it was imported
    from, read by the source framework's own loader (see the module): the source tensor of
    each is found by planning the import of ``src`` again; every tensor of that plan is
    compared, listed in the checkpoint's ``source.skipped``, or reported missing.

    Args:
        ckpt: the UCP checkpoint.
        src: the source checkpoint (the path the import read).
        progress: called as ``progress(name, done, total)`` after each tensor.
        accept_uncertified: a checkpoint whose ``ucp.json`` records no certificate of the
            source's files (converted before jax_ucp recorded one, from an object store, or
            with it deleted) is compared without it; otherwise that is a problem.
    """
    manifest = locate.read_consistently(ckpt, store.read_manifest)
    recorded_framework = str((manifest.source or {}).get("framework") or "")
    for entry in manifest.tensors:  # a record that leads out of the source is refused first
        prov = entry.provenance or {}
        for name in _recorded_files(str(prov.get("format") or recorded_framework), prov):
            _inside(src, name, f"{ckpt}: {entry.name} (its provenance)")
    files_found, said, held = _check_certificate(src, manifest.source or {})
    records: dict[str, str] = {}
    if (manifest.source or {}).get(certificate.KEY) is None and not accept_uncertified:
        records["source.certificate"] = (
            f"{ckpt}: ucp.json records no certificate of the source's files (converted before "
            f"jax_ucp recorded one, from an object store, or with it removed): nothing says "
            f"{src} is the source that was converted; compare without it only on purpose "
            f"(accept_uncertified=True, --accept-uncertified)"
        )
    try:
        expected = _plan_again(src, manifest)
    except SourceError as e:
        if not files_found or not held:
            # no certified file at ``src`` at all: another folder; the import's reason says more
            raise SourceError(f"{e} (certificate: {said})" if files_found else str(e)) from None
        return Comparison(
            files=files_found, certificate=f"{said}; no tensor compared: {e}", records=records
        )
    records.update(
        settings_differ(_json(manifest.source or {}), expected.source, unsaid=expected.unsaid)
    )
    try:
        result = _compare(ckpt, src, manifest, expected, progress)
    except MissingExtraError as e:
        if not files_found:
            raise
        # the certificate already fails it: named, with why no tensor could be compared here
        return Comparison(
            files=files_found, certificate=f"{said}; no tensor compared: {e}", records=records
        )
    finally:
        _clear_loaded()
    result.files, result.certificate, result.planned = files_found, said, expected
    result.records = records
    return result


def _check_certificate(src: str, source: dict) -> tuple[dict[str, str], str, int]:
    """(file name -> what differs, what was found said, how many certified files ``src``
    holds, equal or changed) of ``src``'s files against the checkpoint's
    ``source.certificate`` (``format.certificate``)."""
    recorded = source.get(certificate.KEY)
    if recorded is None:
        return {}, "no certificate recorded (converted before jax_ucp recorded one)", 0
    problems, equal = certificate.check(src, recorded)
    if problems:
        changed = sum(why.startswith(certificate.CHANGED) for why in problems.values())
        return (
            {
                name: f"{name}: the source differs from the certificate convert recorded: {why}"
                for name, why in problems.items()
            },
            f"{equal} certified files equal, {len(problems)} not",
            equal + changed,
        )
    said = f"{equal} certified files equal ({certificate.ALGORITHM})"
    checked = recorded.get("checked_by_import")
    if isinstance(checked, list) and checked:
        said += "; at import: " + "; ".join(str(c)[:200] for c in checked[:3])
    return {}, said, equal


def _clear_loaded() -> None:
    """What the loaders kept while a source was read (files, DCP keys, DeepSpeed's outputs)
    dropped, ds_to_universal's temporary folder removed."""
    _TORCH_FILES.clear()
    _dcp_keys.cache_clear()
    for key, value in _DEEPSPEED.items():
        if key.startswith("ds_to_universal:") and "folder" in value:
            # its parent: our mkdtemp, which holds DeepSpeed's latest_universal too
            _discard(os.path.dirname(value["folder"]), "ds_to_universal's output, compared")
    _DEEPSPEED.clear()


def source_weights(ckpt: str, src: str, tree: str, planned=None) -> dict[str, np.ndarray]:
    """The source's tensors of the checkpoint's model weights (``tree``: ``params`` or
    ``model_params``), by their name below it (the Hugging Face names an import keeps), each
    read by the source framework's own loader, as ``compare_with_source`` reads them: what
    ``verify(logits=True)`` loads into transformers' model when the source holds no weights
    ``from_pretrained`` reads (a DCP folder, DeepSpeed, torch.save files). A weight no loader
    reads here is a ``SourceError`` naming it and why; ``planned``: ``Comparison.planned`` of
    the same source (None: its import planned again here)."""
    manifest = locate.read_consistently(ckpt, store.read_manifest)
    expected = planned or _plan_again(src, manifest)
    out: dict[str, np.ndarray] = {}
    try:
        for entry in manifest.tensors:
            if tuple(entry.key[:1]) != (tree,):
                continue
            name = ".".join(str(k) for k in entry.key[1:])
            planned = expected.provenance.get(tuple(entry.key))
            if planned is None:
                raise SourceError(f"{entry.name}: the import of {src} makes no such tensor")
            try:
                out[name], _ = _read(src, entry.name, planned, expected.source)
            except (SourceError, OSError, ValueError, RuntimeError) as e:
                if isinstance(e, (UnsafeFileError, MissingExtraError)):
                    raise
                raise SourceError(
                    f"{entry.name}: no loader of the source reads it here ({str(e)[:300]})"
                ) from None
    finally:
        _clear_loaded()
    return out


def _compare(ckpt: str, src: str, manifest: Any, expected: _Expected, progress) -> Comparison:
    """``compare_with_source`` once the import is planned again."""
    framework = str(expected.source.get("framework") or "")
    result = Comparison()
    total = len(manifest.tensors)
    for done, entry in enumerate(manifest.tensors, 1):
        planned = expected.provenance.get(tuple(entry.key))
        if planned is None:
            result.different[entry.name] = (
                f"not in the source: the import of {src} ({framework}; {expected.how}) makes no "
                f"{entry.name!r}"
            )
        else:
            item = expected.items.get(tuple(entry.key))
            _compare_one(ckpt, src, entry, planned, expected.source, result, item)
        if progress is not None:
            progress(entry.name, done, total)
    held = {tuple(e.key) for e in (*manifest.tensors, *manifest.values)}
    skipped = (manifest.source or {}).get("skipped") or {}
    skipped = skipped if isinstance(skipped, dict) else {}
    for key, planned in expected.provenance.items():
        if key in held:
            continue
        name = keypath.key_to_str(key)
        tensors = [str(t) for t in planned.get("tensors") or ()]
        if tensors and all(skipped.get(t) for t in tensors):
            result.not_compared[name] = (
                f"not imported: the checkpoint's source.skipped lists {_shown(planned)}: "
                f"{str(skipped[tensors[0]])[:200]}"
            )
            continue
        result.missing[name] = (
            f"the import of {src} makes it from {_shown(planned)}; the checkpoint holds no "
            f"{name!r} and its source.skipped does not list its source"
        )
    for tensor, why in (expected.source.get("skipped") or {}).items():
        if tensor not in skipped:  # left out by the plan, but not said so by the checkpoint
            result.missing[tensor] = (
                f"a tensor of {src} the import leaves out ({str(why)[:200]}), which the "
                f"checkpoint's source.skipped does not list"
            )
    return result


#: how a reason that no framework loader gives a tensor whole starts: then compared with the
#: import planned again
_NO_LOADER = ("built ", "no framework loader", "no DeepSpeed loader")


def _lazy(value: Any) -> bool:
    """Whether a planned item's value holds no tensor's memory yet (built when asked: a
    ``writer.Deferred``) or little (a step, a scalar)."""
    return isinstance(value, writer.Deferred) or getattr(value, "nbytes", 1 << 20) < 1 << 16


def _dcp_read_by_torch():
    """Within it, each DCP tensor an importer reads (megatron-core's flat optimizer buckets) is
    read whole by torch's own ``dcp.load`` instead (``dcp.tensors_read_by``), a few kept."""
    kept: dict[tuple[str, str], np.ndarray] = {}

    def read(path: str, name: str, start: int, stop: int | None) -> np.ndarray:
        if (path, name) not in kept:
            if len(kept) >= 6:
                kept.pop(next(iter(kept)))
            kept[(path, name)] = _dcp_tensor(path, name)
        return np.array(kept[(path, name)] if stop is None else kept[(path, name)][start:stop])

    return safe_dcp.tensors_read_by(read)


def _rebuilt(item: Any, fmt: str, why: str) -> tuple[np.ndarray, str]:
    """(the value the import of the source planned again builds for ``item``, what read it):
    a tensor no framework loader gives whole (megatron-core's flat distributed-optimizer
    buckets, a tensor-parallel merge, the step). Of a torch_dist source every byte is read by
    torch's own ``dcp.load`` (each parameter's place in the buckets the import derives, every
    fp32 master checked against the model weight torch reads); of others by the import's
    readers, from the certified files."""
    by_torch = fmt in ("torch_dist", "fsdp_dtensor")
    try:
        with _dcp_read_by_torch() if by_torch else contextlib.nullcontext():
            value = item.value
            value = value.build("/".join(item.key)) if isinstance(value, writer.Deferred) else value
            value = np.asarray(value)
    except ImportError as e:
        raise (_missing_extra(e) or e) from None
    reader = "torch's dcp.load" if by_torch else "jax_ucp's readers"
    return value, f"the import planned again ({why}; bytes read by {reader})"


def _compare_one(
    ckpt: str, src: str, entry: Any, planned: dict, source: dict, result, item: Any = None
) -> None:
    """One checkpoint tensor against the source tensor the import of ``src`` takes it from
    (``planned``), else (one no framework loader gives whole) against the value the re-planned
    ``item`` builds; a recorded provenance that says otherwise is reported."""
    from jax_ucp._src.restoring import restore_entry
    from jax_ucp._src.restoring.options import RestoreOptions

    said = []
    recorded = _json(entry.provenance or {})
    if recorded != planned:
        fields = sorted(k for k in {*recorded, *planned} if recorded.get(k) != planned.get(k))
        said.append(  # the fields that differ, each with both values: never one name twice
            f"the checkpoint records it as made from {_shown(recorded)}, the import of {src} "
            f"makes it from {_shown(planned)} ("
            + "; ".join(
                f"{k}: {str(recorded.get(k))[:80]} recorded, {str(planned.get(k))[:80]} planned"
                for k in fields[:3]
            )
            + ")"
        )
    try:
        try:
            want, source_name = _read(src, entry.name, planned, source)
        except SourceError as e:
            if item is None or not str(e).startswith(_NO_LOADER):
                raise
            fmt = str(planned.get("format") or source.get("framework") or "")
            want, source_name = _rebuilt(item, fmt, str(e))
            result.rebuilt.append(entry.name)
    except (UnsafeFileError, MissingExtraError):
        raise
    except (SourceError, OSError, ValueError, RuntimeError) as e:
        if not said:
            result.not_compared[entry.name] = str(e)[:300]
    else:
        options = RestoreOptions(select=lambda n, name=entry.name: n == name)
        got = restore_entry.restore_tree(ckpt, options)
        for part in entry.key:
            got = got[part]
        got = np.asarray(got)
        if got.shape != want.shape or got.dtype != want.dtype:
            said.append(
                f"{source_name}: {want.dtype}{list(want.shape)} in the source, "
                f"{got.dtype}{list(got.shape)} imported"
            )
        elif not np.array_equal(_bits(got), _bits(want)):
            diff = int(np.count_nonzero(_bits(got) != _bits(want)))
            said.append(f"{source_name}: {diff} of {got.size} elements")
        elif not said:
            result.equal.append(entry.name)
    if said:
        result.different[entry.name] = "; ".join(said)
