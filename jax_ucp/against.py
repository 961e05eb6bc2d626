"""``verify(ckpt, against=src)``: is the converted checkpoint really the run? Every imported
tensor is compared bit for bit with what the source framework's *own* loader reads from the
source (safetensors' ``safe_open``, ``torch.load(weights_only=True)``, torch DCP's ``dcp.load``),
one tensor at a time (bounded memory), never with jax_ucp's own readers.

Only tensors an import copied one for one (its provenance names one source tensor) can be
compared this way; those an import built (DeepSpeed's flat partitions, Megatron's tensor-parallel
merges) are listed as not compared, with why — said, never counted as equal.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable
from typing import Any

import numpy as np

from jax_ucp.errors import SourceError

__all__ = ["Comparison", "compare_with_source"]


@dataclasses.dataclass
class Comparison:
    """What ``verify(..., against=)`` found: tensors equal bit for bit, those that differ (name
    -> what differs), and those it could not compare (name -> why)."""

    equal: list[str] = dataclasses.field(default_factory=list)
    different: dict[str, str] = dataclasses.field(default_factory=dict)
    not_compared: dict[str, str] = dataclasses.field(default_factory=dict)

    @property
    def ok(self) -> bool:
        """Every compared tensor equal (and at least one compared)."""
        return not self.different and bool(self.equal)


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


def _loader(fmt: str, src: str, provenance: dict) -> tuple[Callable[[], np.ndarray], str]:
    """(a function reading the provenance's one source tensor with the framework's own loader,
    its name), or SourceError saying why it cannot be read that way."""
    tensors = provenance.get("tensors") or []
    if len(tensors) != 1:
        raise SourceError(f"built from {len(tensors)} source tensors by the import")
    name = tensors[0]
    if fmt == "torch_dcp":
        key = provenance.get("source_name") or name
        folder = os.path.join(src, provenance["folder"]) if provenance.get("folder") else src
        return lambda: _dcp_tensor(folder, key), key
    if fmt in ("torch_files", "safetensors"):
        file, _, inner = name.partition(":") if ":" in name else (provenance.get("file"), "", name)
        path = src if os.path.isfile(src) else os.path.join(src, str(file))
        if path.endswith(".safetensors"):
            return lambda: _safetensors_tensor(path, inner), name
        rows = provenance.get("rows_permuted")
        if isinstance(rows, dict):  # torchtune's q/k moments, moved as its weights are
            return lambda: _hf_rows(_torch_file_tensor(path, inner), **rows), name
        return lambda: _torch_file_tensor(path, inner), name
    raise SourceError(f"no framework loader compared for {fmt!r} imports yet")


def _hf_rows(value: np.ndarray, heads: int, head_dim: int) -> np.ndarray:
    """torchtune's ``tune_to_hf`` q/k row permutation (``[heads, head_dim/2, 2, dim]``, the
    middle axes swapped), which its checkpointer applies to the weights and the import to the
    moments: the source tensor as torch reads it, moved the same way before comparing."""
    dim = value.shape[1]
    return value.reshape(heads, head_dim // 2, 2, dim).transpose(0, 2, 1, 3).reshape(-1, dim)


def _safetensors_tensor(path: str, name: str) -> np.ndarray:
    try:
        import torch  # pyright: ignore[reportMissingImports]  # noqa: F401
    except ImportError:
        from safetensors import safe_open

        with safe_open(path, "np") as f:
            return f.get_tensor(name)
    from safetensors import safe_open

    with safe_open(path, "pt") as f:
        return _torch_to_numpy(f.get_tensor(name))


_TORCH_FILES: dict[str, Any] = {}


def _torch_file_tensor(path: str, name: str) -> np.ndarray:
    import torch  # pyright: ignore[reportMissingImports]  # the torch extra

    if path not in _TORCH_FILES:
        _TORCH_FILES.clear()  # one file loaded at a time (memory-mapped)
        _TORCH_FILES[path] = torch.load(path, weights_only=True, mmap=True, map_location="cpu")
    node: Any = _TORCH_FILES[path]
    flat = _flatten(node)
    if name not in flat:
        raise SourceError(f"{path}: torch.load finds no tensor {name!r}")
    return _torch_to_numpy(flat[name])


def _flatten(node: Any, prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    if isinstance(node, dict):
        for k, v in node.items():
            out.update(_flatten(v, f"{prefix}{k}."))
    elif isinstance(node, list | tuple):
        for i, v in enumerate(node):
            out.update(_flatten(v, f"{prefix}{i}."))
    elif hasattr(node, "shape"):
        out[prefix[:-1]] = node
    return out


def _dcp_tensor(src: str, key: str) -> np.ndarray:
    import torch  # pyright: ignore[reportMissingImports]  # the torch extra
    from torch.distributed.checkpoint.filesystem import (  # pyright: ignore[reportMissingImports]
        FileSystemReader,
    )
    from torch.distributed.checkpoint.metadata import (  # pyright: ignore[reportMissingImports]
        TensorStorageMetadata,
    )
    from torch.distributed.checkpoint.state_dict_loader import (  # pyright: ignore[reportMissingImports]
        load,
    )

    meta = FileSystemReader(src).read_metadata().state_dict_metadata.get(key)
    if not isinstance(meta, TensorStorageMetadata):
        raise SourceError(f"{src}: torch DCP's metadata has no tensor {key!r}")
    out = torch.empty(tuple(meta.size), dtype=meta.properties.dtype)
    load({key: out}, checkpoint_id=src, no_dist=True)
    return _torch_to_numpy(out)


def compare_with_source(ckpt: str, src: str, progress=None) -> Comparison:
    """Each tensor of the checkpoint at ``ckpt`` against the source ``src`` it was imported
    from, read by the source framework's own loader (see the module).

    Args:
        ckpt: the UCP checkpoint.
        src: the source checkpoint (the path the import read).
        progress: called as ``progress(name, done, total)`` after each tensor.
    """
    from jax_ucp import store
    from jax_ucp.restoring import locate, requests
    from jax_ucp.restoring.options import RestoreOptions

    manifest = locate.read_consistently(ckpt, store.read_manifest)
    framework = str((manifest.source or {}).get("framework") or "")
    result = Comparison()
    total = len(manifest.tensors)
    for done, entry in enumerate(manifest.tensors, 1):
        prov = entry.provenance or {}
        try:
            read, source_name = _loader(str(prov.get("format") or framework), src, prov)
            want = read()
        except (SourceError, ImportError, OSError, ValueError, RuntimeError) as e:
            result.not_compared[entry.name] = str(e)[:300]
        else:
            options = RestoreOptions(select=lambda n, name=entry.name: n == name)
            got = requests.restore_tree(ckpt, options)
            for part in entry.key:
                got = got[part]
            got = np.asarray(got)
            if got.shape != want.shape or got.dtype != want.dtype:
                result.different[entry.name] = (
                    f"{source_name}: {want.dtype}{list(want.shape)} in the source, "
                    f"{got.dtype}{list(got.shape)} imported"
                )
            elif not np.array_equal(_bits(got), _bits(want)):
                diff = int(np.count_nonzero(_bits(got) != _bits(want)))
                result.different[entry.name] = f"{source_name}: {diff} of {got.size} elements"
            else:
                result.equal.append(entry.name)
        if progress is not None:
            progress(entry.name, done, total)
    _TORCH_FILES.clear()
    return result
