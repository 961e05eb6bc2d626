"""What every exporter shares: a checkpoint's tensors as ``RowSlabs`` arrays read row slab by row
slab only as a writer writes them, the tensors under ``select``, and the transaction the files are
written in."""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import numpy as np

from jax_ucp._src import format as fmt
from jax_ucp._src import store, writer
from jax_ucp._src.errors import RequestError
from jax_ucp._src.exporters import by_spec
from jax_ucp._src.exporters.options import Exported
from jax_ucp._src.restoring import model
from jax_ucp._src.restoring.sources import ucp_source
from jax_ucp._src.writer import commit


@dataclasses.dataclass(frozen=True)
class RowSlabs:
    """An array of known shape and dtype whose ``slabs()`` are read only when written."""

    shape: tuple[int, ...]
    dtype: np.dtype
    slabs: Callable[[], Iterable[np.ndarray]]


def pieces(value: np.ndarray | RowSlabs, where: str) -> Iterator[np.ndarray]:
    """The C-ordered little-endian data of ``value``, each slab checked against the plan."""
    if not isinstance(value, RowSlabs):
        value = RowSlabs(tuple(value.shape), value.dtype, lambda a=value: [a])
    rows = 0
    for slab in value.slabs():
        if slab.dtype != value.dtype or (slab.shape[1:] if slab.ndim else ()) != value.shape[1:]:
            raise RequestError(
                f"{where}: read {slab.dtype}{list(slab.shape)}, planned "
                f"{np.dtype(value.dtype)}{list(value.shape)}"
            )
        rows += slab.shape[0] if slab.ndim else 1
        yield np.ascontiguousarray(slab, dtype=slab.dtype.newbyteorder("<"))
        del slab
    if rows != (value.shape[0] if value.shape else 1) and math.prod(value.shape):
        raise RequestError(f"{where}: read {rows} rows, planned {list(value.shape)}")


@dataclasses.dataclass
class Source:
    """Reads the checkpoint's tensors as ``RowSlabs`` arrays, counting them for ``progress``."""

    root: str
    manifest: fmt.Manifest
    available: Any
    casting: str = "same_kind"
    progress: Callable[[str, int, int], None] | None = None
    total: int = 0
    done: int = 0

    def tensor(self, key: tuple[str, ...], dtype: Any = None, name: str = "") -> RowSlabs:
        """Tensor ``key`` (as ``dtype``), ``progress`` called under ``name`` once it is read."""
        found = self.available[key]
        dtype = found.dtype if dtype is None else np.dtype(dtype)
        return RowSlabs(tuple(found.shape), dtype, lambda: self._slabs(key, dtype, name))

    def _slabs(self, key, dtype, name: str) -> Iterator[np.ndarray]:
        yield from ucp_source.read_rows(
            self.root,
            self.manifest,
            key,
            available=self.available,
            dtype=dtype,
            casting=self.casting,
            max_bytes=max(writer.memory_budget() // 2, 1),
        )
        if name:
            self.done += 1
            if self.progress is not None:
                self.progress(name, self.done, self.total)


@dataclasses.dataclass(frozen=True)
class Tensor:
    """One tensor to export: its name in the output, shape and dtype (as written)."""

    name: str
    shape: tuple[int, ...]
    dtype: np.dtype

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) * self.dtype.itemsize


@dataclasses.dataclass(frozen=True)
class Selection:
    """The tensors under ``select`` as written, the saved values, and every other leaf's name."""

    tensors: list[Tensor]
    arrays: list[RowSlabs]
    paths: list[tuple[str, ...]]
    values: list[tuple[str, tuple[str, ...], Any]]
    skipped: list[str]
    save_id: str
    spec: Any = None  # the spec exported by (run backwards if an import's), or None
    recorded: Any = None  # the checkpoint's ``source`` record (its import's config.json)

    def exported(self, path: str, files: list[str]) -> Exported:
        nbytes = sum(t.nbytes for t in self.tensors)
        return Exported(path, files, len(self.tensors), nbytes, self.skipped)


def select(root: str, options: Any, check_dtype: Callable, *, with_values: bool) -> Selection:
    """The tensors (and values) under ``options.select``, named by their ``.``-joined key path.

    Args:
        root: the UCP checkpoint directory.
        options: the format's options (``select``, ``spec``, ``dtype``, ``casting``).
        check_dtype: refuses an output dtype the format cannot store.
        with_values: also the saved Python values (formats that can hold them)."""
    manifest = store.read_manifest(root)
    # safetensors: the config.json written beside gives the spec its head settings
    config = getattr(options, "config", None)
    spec = by_spec.load(options.spec, manifest, config, state_dict=options.state_dict_names)
    available = ucp_source.available_tensors(manifest, spec)
    prefix = tuple(p for p in (options.prefix or "").split("/") if p)
    chosen, values, skipped, seen = [], [], [], {}

    def name_of(key):
        name = ".".join(key[len(prefix) :]) or key[-1]
        if name in seen:
            raise RequestError(
                f"leaves {fmt.key_to_str(seen[name])!r} and {fmt.key_to_str(key)!r} would both "
                f"be named {name!r} in the export"
            )
        seen[name] = key
        return name

    for key in available:
        if tuple(key[: len(prefix)]) != prefix:
            skipped.append(fmt.key_to_str(key))
        else:
            chosen.append((name_of(key), key))
    for entry in manifest.values:
        if with_values and tuple(entry.key[: len(prefix)]) == prefix:
            values.append((name_of(entry.key), tuple(entry.key[len(prefix) :]), entry.value))
        else:
            skipped.append(fmt.key_to_str(entry.key))
    tensors = []
    for name, key in chosen:  # every dtype and cast checked before anything is written
        saved = available[key].dtype
        target = saved if options.dtype is None else options.dtype
        model.check_cast(name, saved, target, options.casting)
        check_dtype(name, target)
        tensors.append(Tensor(name, tuple(available[key].shape), target))
    if not tensors:
        raise RequestError(f"{root}: no tensor under {options.prefix!r} to export")
    source = Source(root, manifest, available, options.casting, options.progress, len(tensors))
    arrays = [source.tensor(k, t.dtype, t.name) for (_, k), t in zip(chosen, tensors)]
    paths = [tuple(k[len(prefix) :]) for _, k in chosen]
    return Selection(
        tensors, arrays, paths, values, skipped, str(manifest.save_id), spec, manifest.source
    )


@dataclasses.dataclass(frozen=True)
class AdamKeys:
    """A checkpoint's parameters and their Adam state, found by manifest role: what an export to
    a framework that continues Adam (DeepSpeed universal, megatron-core) writes."""

    params: dict[tuple, tuple]  # each parameter's key: its path under the params root
    moments: dict[tuple[tuple, str], tuple]  # (parameter key, "mu" / "nu"): the moment's key
    model: dict[tuple, tuple]  # parameter key: its model-precision copy's (mixed precision)
    count: tuple | None  # the optimizer's step count

    @property
    def missing(self) -> list[str]:
        """Each parameter's moment the checkpoint lacks, for the export's refusal."""
        return [
            f"{fmt.key_to_str(p)} ({m})"
            for p in self.params
            for m in ("mu", "nu")
            if (p, m) not in self.moments
        ]


def adam_keys(entries: dict[tuple, Any], *, frozen: bool) -> AdamKeys:
    """The :class:`AdamKeys` among ``entries`` ({key: its manifest entry, a view's: its first
    source's}); a moment is matched to its parameter at ``.../mu/<the parameter's path>``.

    Args:
        entries: the checkpoint's tensors by key, each with its manifest entry.
        frozen: include frozen parameters (they have no optimizer state)."""
    params = {
        k: k[1:]
        for k, e in entries.items()
        if e.role == "param"
        and e.sub_role is None
        and e.tied_to is None
        and (frozen or not e.frozen)
    }
    by_path = {rel: k for k, rel in params.items()}
    moments, model, count = {}, {}, None
    for key, e in entries.items():
        if e.role == "param" and e.sub_role == "model" and key[1:] in by_path:
            model[by_path[key[1:]]] = key
        elif e.role == "opt_state" and e.sub_role in ("mu", "nu"):
            for rel, pkey in by_path.items():
                if key[-len(rel) - 1 :] == (e.sub_role, *rel):
                    moments[(pkey, e.sub_role)] = key
        elif e.role == "opt_state" and e.sub_role == "count":
            count = key
    return AdamKeys(params, moments, model, count)


def write_atomically(
    dst: str, write: Callable[[str], Any], force: bool, *, staged: bool = True
) -> Any:
    """``write(tmp)`` in the export's ``commit.transaction``; returns what it returned. A
    destination the transaction refuses is a ``RequestError``.

    Args:
        dst: the export's destination directory.
        write: writes the files into the directory it is given.
        force: replace an earlier export at ``dst`` (never anything jax_ucp did not write).
        staged: into a temporary sibling renamed into place, its files recorded as the export's
            (what a later force may replace: these files only); False: into ``dst`` itself,
            which Orbax stages and renames on its own."""
    with contextlib.ExitStack() as stack:
        try:
            tx = stack.enter_context(
                commit.transaction(dst, force=force, kind="export", export=True, staged=staged)
            )
        except (commit.SaveConflictError, FileExistsError) as e:
            raise RequestError(str(e)) from None
        if staged:
            stack.enter_context(commit.export_record(tx.path))
        return write(tx.path)


def required_adam_keys(root: str, by_key: Mapping[tuple, Any], what: str) -> tuple[AdamKeys, tuple]:
    """:func:`adam_keys` of the trained parameters (frozen ones have no optimizer state) and the
    step count's key, or a ``RequestError`` naming ``what`` (the format) when a moment or the
    step count is missing."""
    found = adam_keys(dict(by_key), frozen=False)
    if not found.params or found.missing or found.count is None:
        raise RequestError(
            f"{root}: {what} needs every parameter's Adam moments and the step "
            f"count; missing: {found.missing[:5] or ([] if found.params else ['params'])}"
            f"{'' if found.count is not None else ' and opt_state count'}"
        )
    return found, found.count


def plain(values: Mapping[str, Any]) -> dict[str, Any]:
    """The values a pickle of plain data holds (a record's ``<type>`` stand-ins dropped, ``betas``
    a tuple as torch keeps it): a recorded optimizer group written back."""
    ok = (type(None), bool, int, float, str, list, tuple)
    return {
        str(k): tuple(v) if isinstance(v, list) and k == "betas" else v
        for k, v in values.items()
        if isinstance(v, ok) and not (isinstance(v, str) and v.startswith("<"))
    }
