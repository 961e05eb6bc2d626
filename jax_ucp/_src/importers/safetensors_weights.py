"""Hugging Face safetensors weights as an import plan: ``params/<HF name>`` in the stored dtype
(of a multimodal model, :data:`TEXT_MODELS`, its text model's tensors under its own names),
read by one reader over a ``Storage`` (any medium): each tensor a read-only view of the file's map
where the medium maps it (read with ``pread``: the writer streams it, a direct restore reads each
region's rows straight into its buffer), else a ``Deferred`` whose rows are ranged reads (a small
object's cut from it, fetched whole once).

Shared importer layer: the safetensors importer's plan, and torchtune's (its ``epoch_N/``
folders are such weights). Format packages never import each other; what two of them share
lives here.
"""

from __future__ import annotations

import dataclasses
import math
import os
import posixpath
import re
import threading
from collections.abc import Callable

import numpy as np

from jax_ucp._src import format as fmt
from jax_ucp._src import store, writer
from jax_ucp._src.errors import CheckpointError, SourceError
from jax_ucp._src.format import files, safetensors
from jax_ucp._src.format.safetensors import SafetensorsFile
from jax_ucp._src.importers.plan import (
    ImportOptions,
    ImportPlan,
    host_item,
    jsonable,
    refuse_spec,
    skip,
)
from jax_ucp._src.importers.trainer_files import (
    CONFIG_FILE,
    MAX_JSON_BYTES,
    adapter_beside_model,
)
from jax_ucp._src.store.shard_reader import count_bytes_read
from jax_ucp._src.store.storage import Storage
from jax_ucp._src.store.storage.ranged import RandomAccess, RangeError
from jax_ucp._src.torchfiles import dcp_safetensors

__all__ = [
    "TEXT_MODELS",
    "RangedTensor",
    "file_tensors",
    "holds_remote",
    "plan_safetensors",
    "text_model",
    "weight_files",
]

_LANGUAGE_MODEL = {"model.language_model.": "model.", "lm_head.": "lm_head."}
#: multimodal model_type -> its text model's prefixes as ``save_pretrained`` (transformers 5.24)
#: writes them -> as the text model (``*ForCausalLM``) names them; what has none of them (vision
#: and audio towers, projectors) is not imported (``source.skipped``)
TEXT_MODELS = {
    "qwen3_5": _LANGUAGE_MODEL,
    "qwen3_5_moe": _LANGUAGE_MODEL,
    "gemma4": _LANGUAGE_MODEL,
    "llama4": {"language_model.model.": "model.", "language_model.lm_head.": "lm_head."},
}


def text_model(
    config: dict, names: list[str], shapes: dict | None = None
) -> tuple[dict[str, str], dict | None]:
    """(each imported tensor's name -> its saved name, the config.json of the imported model):
    of a multimodal ``config`` (:data:`TEXT_MODELS`) its text model, named as the text model
    names it, ``text_config`` with the outer ``tie_word_embeddings`` (transformers ties by it);
    else every name as saved and None. A text model the weights do not hold as ``text_config``
    states it (no tensor under its prefixes: another model's ``model_type``; other layers, a
    tower renamed as one; another embedding width, with ``shapes``) is refused."""
    model_type = str(config.get("model_type"))
    prefixes = TEXT_MODELS.get(model_type)
    if prefixes is None:
        return {n: n for n in names}, None
    text = config.get("text_config")
    if not isinstance(text, dict):
        raise SourceError(f"config.json: model_type {model_type!r} without a text_config object")
    renamed = {prefixes[p] + n[len(p) :]: n for n in names for p in prefixes if n.startswith(p)}
    _check_text_model(model_type, text, renamed, prefixes, shapes or {})
    archs = config.get("architectures") or []
    archs = archs if isinstance(archs, list) else [archs]
    archs = [str(a).replace("ForConditionalGeneration", "ForCausalLM") for a in archs]
    tied = {k: config[k] for k in ("tie_word_embeddings",) if k in config}
    return renamed, {"model_type": f"{model_type}_text", **text, **tied, "architectures": archs}


def _check_text_model(model_type: str, text: dict, renamed: dict, prefixes, shapes) -> None:
    where = f"config.json: model_type {model_type!r}"
    if not renamed:
        raise SourceError(
            f"{where}, but no tensor is under its text model's prefixes "
            f"({', '.join(prefixes)}): another model's config.json?"
        )
    layers = {int(m.group(1)) for n in renamed if (m := re.match(r"model\.layers\.([0-9]+)\.", n))}
    count = text.get("num_hidden_layers")
    if isinstance(count, int) and (count != len(layers) or layers != set(range(count))):
        raise SourceError(
            f"{where}: text_config's num_hidden_layers is {count}, but the weights hold its "
            f"text model's layers {sorted(layers)[:8]}{' ...' if len(layers) > 8 else ''}"
        )
    embed = renamed.get("model.embed_tokens.weight")
    rows, width = [*(shapes.get(embed) or ()), None, None][:2]
    for field, held in (("vocab_size", rows), ("hidden_size", width)):
        value = text.get(field)
        if isinstance(value, int) and held is not None and held != value:
            raise SourceError(
                f"{where}: text_config's {field} is {value}, but {embed!r} is {list(shapes[embed])}"
            )


def plan_safetensors(src, options: ImportOptions) -> ImportPlan:
    """The import of a Hugging Face safetensors checkpoint (file, directory or sharded index),
    on any medium: ``path`` the source as read (a Hub repo's pinned to the commit it was read
    at, ``hf://ORG/NAME@SHA``), ``config.json`` read through its storage.

    Args:
        src: a ``.safetensors`` file, a folder, or a sharded index.
        options: ``spec`` refused (Hugging Face's names are kept); ``weights_only``: the model
            weights alone, a torch optimizer beside them in ``source.skipped`` (else refused).
    """
    refuse_spec(options.spec, "safetensors imports keep Hugging Face's names", SourceError)
    storage = store.storage_for(src)  # the importer's (torchtune's: a path)
    folder, opened = _open_weights(storage)
    single = folder is not storage  # one file given: that file only, no folder's config.json
    owner = {t: (name, f, v) for name, (f, values) in opened.items() for t, v in values.items()}
    shapes = {t: list(f.header[t][1]) for t, (_, f, _) in owner.items()}
    source = {
        "framework": "safetensors",
        "path": posixpath.join(folder.absolute(), *opened) if single else folder.absolute(),
        "files": list(opened),
        "dtypes": sorted({str(f.header[t][0]) for t, (_, f, _) in owner.items()}),
        "metadata": {
            k: v for f, _ in opened.values() for k, v in f.metadata.items() if type(v) is str
        },
    }
    raw = None if single else folder.read(CONFIG_FILE, MAX_JSON_BYTES)
    config = None if raw is None else files.strict_json(raw, folder.join(CONFIG_FILE))
    named, found = _with_config(source, config, shapes), sorted(owner)
    _beside(None if single else folder, source, found, options.weights_only)
    mine = options.share.pick(sorted(named))
    items = (
        host_item(("params", n), v.deferred() if isinstance(v, RangedTensor) else v, where)
        for n in mine
        for name, _, v in [owner[named[n]]]
        for where in [{"file": name, "tensors": [named[n]]}]
    )
    return ImportPlan(items, source, len(mine), source_tensors=found)


def _beside(folder: Storage | None, source: dict, found: list[str], weights_only: bool) -> None:
    """A Trainer's ``optimizer.pt`` (Accelerate's ``optimizer.bin``) in ``folder`` would be lost
    without a word if the weights were imported alone: refused, or with ``weights_only`` listed
    in ``source.skipped``, unread; LoRA / peft adapter files beside the model listed, never
    ignored (each appended to ``found``). ``folder`` None: a file given by its own path or URL,
    that file only."""
    if folder is None:
        return
    beside = [n for n in ("optimizer.pt", "optimizer.bin") if n in folder.names()]
    if beside:
        optimizer_file = beside[0]
        trainer = optimizer_file == "optimizer.pt"
        writer_name = "Hugging Face Trainer" if trainer else "Accelerate save_state"
        if not weights_only:
            raise SourceError(
                f"{folder.join(optimizer_file)}: {'a' if trainer else 'an'} {writer_name} "
                f"{'checkpoint' if trainer else 'folder'}; its "
                f"torch optimizer state ({optimizer_file}, keyed by parameter index) is not "
                f"imported. To import the model weights without it: convert(..., "
                f"importing=ImportOptions(weights_only=True)) / jax-ucp convert --weights-only"
            )
        # not opened (it is not read): accounted for as one unit
        skip(source, [optimizer_file], f"weights_only: {writer_name}'s torch optimizer state")
        found.append(optimizer_file)
    for name, why in adapter_beside_model(folder).items():
        skip(source, [name], why)
        found.append(name)


def _with_config(source: dict, config, shapes: dict[str, list[int]]) -> dict[str, str]:
    """{imported name: saved name} of the tensors ``shapes`` names, the model's ``config.json``
    (None: none) recorded in ``source``, of a multimodal model the text model's (:func:`text_model`,
    the towers skipped): one step for a local folder and a remote one, so both record alike."""
    if isinstance(config, dict):
        source["config"] = {k: jsonable(v) for k, v in config.items()}
    named, text = text_model(config if isinstance(config, dict) else {}, sorted(shapes), shapes)
    if text is not None:  # its text model: the towers listed, the outer config kept
        source["multimodal_config"], source["config"] = source["config"], jsonable(text)
        others = sorted(set(shapes) - set(named.values()))
        why = f"{source['multimodal_config']['model_type']}: not its text model (imported alone)"
        skip(source, others, why)
    return named


#: a safetensors object of at most this many bytes is fetched in one GET, its tensors cut from
#: it: a Trainer's or adapter's small files hold hundreds of tensors, each a round trip (tens of
#: ms to S3 or the Hub's CDN) when read alone, where 4 MiB arrive in about as long; above it each
#: tensor's rows are ranged reads, a process fetching only the rows it restores
SMALL_OBJECT = 4 << 20
Tensors = dict[str, "np.ndarray | RangedTensor"]


def _single(storage: Storage) -> bool:
    """A ``.safetensors`` file or object given by its own path or URL, not a folder."""
    return storage.root.rstrip("/").endswith(".safetensors")


def holds_remote(prefix: Storage) -> bool:
    """:func:`_holds` in a medium that is no local directory (the detector's question)."""
    return prefix.local_path() is None and _holds(prefix)


def _holds(prefix: Storage) -> bool:
    """A ``.safetensors`` file, or a folder holding safetensors (or their index) and no
    ``ucp.json`` nor torch DCP's rank files (``importers.torch.dcp``); names only."""
    if _single(prefix):
        return True
    if prefix.exists(fmt.MANIFEST_FILE):
        return False
    names = [n for n in prefix.names() if "/" not in n]
    held = prefix.exists(safetensors.INDEX_FILE) or any(n.endswith(".safetensors") for n in names)
    return held and not dcp_safetensors.holds_rank_pieces(names)


def _objects(prefix: Storage) -> tuple[Storage, list[str], dict[str, str] | None]:
    """(the folder, the safetensors files of the checkpoint at ``prefix`` in it, the index's
    ``weight_map`` or None): one storage, a Hub repo's files all read at one commit."""
    single = _single(prefix)
    try:
        raw = None if single else prefix.read(safetensors.INDEX_FILE, safetensors.MAX_INDEX_BYTES)
    except NotADirectoryError:  # a file given by its path, whatever its name
        raw, single = None, True
    if single:  # one file: read from its folder
        folder, name = posixpath.split(prefix.root.rstrip("/"))
        return prefix.at(folder or os.curdir), [name], None
    if raw is not None:
        where = prefix.join(safetensors.INDEX_FILE)
        weight_map = safetensors.weight_map_of(raw, where, ".safetensors")
        return prefix, sorted(set(weight_map.values())), weight_map
    names = sorted(n for n in prefix.names() if "/" not in n and n.endswith(".safetensors"))
    if len(names) == 1:
        return prefix, names, None
    for name in names:  # torch DCP's unconsolidated shards: refused, naming the format
        _open(prefix, name)
    index = safetensors.INDEX_FILE
    raise SourceError(
        f"{prefix.root}: {len(names)} .safetensors files but no {index} saying which belong to "
        f"the model ({', '.join(names[:5])}); add the index, or pass the one file you mean."
        if names
        else f"{prefix.root}: no .safetensors file and no {index}."
    )


def _open_weights(storage: Storage) -> tuple[Storage, dict[str, tuple[SafetensorsFile, Tensors]]]:
    """(the folder, each file of the safetensors checkpoint at ``storage``: its checked header and
    its tensors), no tensor's bytes read; a tensor in two files, or in another than the index
    says, is refused naming them."""
    folder, names, weight_map = _objects(storage)
    index = folder.join(safetensors.INDEX_FILE)
    first = safetensors.first_tensors(weight_map or {})
    opened, owner = {}, {}
    for name in names:
        what = f"{index}: weight_map entry {first[name][:100]!r}" if weight_map else None
        opened[name] = _open(folder, name, what)
        for t in opened[name][0].header:
            if owner.setdefault(t, name) != name:
                raise SourceError(
                    f"{storage.root}: tensor {t[:100]!r} is in both {folder.join(owner[t])} "
                    f"and {folder.join(name)}."
                )
    listed = weight_map or owner
    wrong = sorted(t for t in {*listed, *owner} if listed.get(t) != owner.get(t))
    if wrong:  # a tensor in another file than the index says, in none, or not in the index
        t = wrong[0]
        raise SourceError(
            f"{index}: weight_map and the files disagree on {len(wrong)} tensors: {t[:100]!r} is "
            f"in {listed.get(t, 'no file')} by the index, {owner.get(t, 'no file')} by the headers."
        )
    return folder, opened


def _open(folder: Storage, name: str, what: str | None = None) -> tuple[SafetensorsFile, Tensors]:
    """File ``name`` of ``folder``: its header checked (through its map where the medium maps
    it), and its tensors; ``what``: the index entry naming it, for the error if it is not there."""
    shown = folder.join(name)
    file = folder.reader(name, what or shown)
    try:
        parsed = SafetensorsFile.read_from(shown, file, mapped=file.mapped())
    except SourceError as e:  # a shard the index names that is not there: the index's fault
        if what is None or str(e) != f"{shown}: no such object.":
            raise
        gone = f"{what} names the file {name!r}, which is not in {folder.root}."
        raise SourceError(gone) from None
    if parsed.map is not None:  # views of the map, never touched: read with pread
        return parsed, {t: parsed.tensor(t) for t in parsed.header}
    end = parsed.data_start + max((e for *_, e in parsed.header.values()), default=0)
    whole = _once(file, parsed.data_start, end) if end <= SMALL_OBJECT else None
    return parsed, {
        t: RangedTensor(file, t, dtype, shape, parsed.data_start + b, whole)
        for t, (dtype, shape, b, _) in parsed.header.items()
    }


def _once(file: RandomAccess, at: int, end: int) -> Callable[[int, int], memoryview]:
    """``cut(start, n)``: ``n`` bytes from ``start`` of ``file``'s ``[at, end)``, read once, kept."""
    lock, kept = threading.Lock(), []

    def cut(start: int, n: int) -> memoryview:
        with lock:
            kept[:] = kept or [memoryview(file.read(at, end - at) or b"")]
        return kept[0][start - at :][:n]

    return cut


@dataclasses.dataclass
class RangedTensor:
    """One tensor of a safetensors file that is not mapped: its rows byte ranges of ``file``,
    or cut from the whole (small) file read once (``whole``)."""

    file: RandomAccess
    name: str
    dtype: np.dtype
    shape: tuple[int, ...]
    offset: int  # of its first byte in the file
    whole: Callable[[int, int], memoryview] | None = None

    def rows(self, a: int, b: int) -> np.ndarray:
        """Rows ``a:b`` of the tensor (``[0:1]`` of a scalar), one ranged read (or cut)."""
        row = math.prod(self.shape[1:]) * self.dtype.itemsize
        start, want, shown = self.offset + a * row, (b - a) * row, self.file.shown
        try:
            got = (self.whole or self.file.read)(start, want)
        except RangeError as e:  # a range past the end: the object shrank since it was opened
            got = e
        if not isinstance(got, bytes | memoryview) or len(got) != want:
            said = got if isinstance(got, RangeError) else f"got {len(got or b'')} bytes"
            raise CheckpointError(
                f"{shown}: tensor {self.name!r}: rows {a}:{b} ({want} bytes from byte {start}) "
                f"cannot be read, the file truncated or gone ({said})."
            )
        count_bytes_read(want)
        return np.frombuffer(got, self.dtype).reshape((b - a, *self.shape[1:]))

    def deferred(self) -> writer.Deferred:
        """The tensor as the writer builds it: whole, or in row slabs."""
        make = lambda: self.rows(0, self.shape[0] if self.shape else 1).reshape(self.shape)
        rows = self.rows if self.shape else None
        return writer.Deferred(self.shape, self.dtype, make, rows=rows, ranged=True)


def weight_files(folder: Storage) -> dict[str, tuple[Storage, str]]:
    """{path or URL: (storage, name) it is read at} of the safetensors weights ``folder`` holds
    (its index's shards, else its one file); {} when it holds none (or torch DCP's rank pieces)."""
    if not _holds(folder):
        return {}
    prefix, names, _ = _objects(folder)
    return {prefix.join(n): (prefix, n) for n in names}


def file_tensors(folder: Storage, name: str) -> Tensors:
    """Each tensor of safetensors file ``name`` of ``folder`` (:func:`weight_files`), its header
    checked: a read-only view of a local file's map (read with ``pread``), else its rows read by
    ranges when written (:class:`RangedTensor`)."""
    return _open(folder, name)[1]
