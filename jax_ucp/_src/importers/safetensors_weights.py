"""Hugging Face safetensors weights as an import plan: ``params/<HF name>`` in the stored dtype
(of a multimodal model, :data:`TEXT_MODELS`, its text model's tensors under its own names),
each tensor a read-only view of a memory map (read with ``pread``: the writer streams it, a direct
restore reads each region's rows straight into its buffer), or in an object store or Hub repo a
``Deferred`` whose rows are ranged reads.

Shared importer layer: the safetensors importer's plan, and torchtune's (its ``epoch_N/``
folders are such weights). Format packages never import each other; what two of them share
lives here.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re

import numpy as np

from jax_ucp._src import format as fmt
from jax_ucp._src import store, writer
from jax_ucp._src.errors import CheckpointError, SourceError
from jax_ucp._src.format import files, safetensors
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
    read_json,
)
from jax_ucp._src.store.shard_reader import count_bytes_read
from jax_ucp._src.store.storage import Storage
from jax_ucp._src.store.storage.ranged import RandomAccess, RangeError
from jax_ucp._src.torchfiles import dcp_safetensors

__all__ = [
    "TEXT_MODELS",
    "RemoteTensor",
    "file_tensors",
    "holds_remote",
    "open_remote",
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
    """The import of a Hugging Face safetensors checkpoint (file, directory or sharded index).

    Args:
        src: a ``.safetensors`` file, a folder, or a sharded index.
        options: ``spec`` refused (Hugging Face's names are kept); ``weights_only``: the model
            weights alone, a torch optimizer beside them in ``source.skipped`` (else refused).
    """
    spec, weights_only, share = options.spec, options.weights_only, options.share
    refuse_spec(spec, "safetensors imports keep Hugging Face's names", SourceError)
    storage = store.storage_for(src)  # the importer's (torchtune's: a path)
    src = storage.root
    if storage.local_path() is None:  # an object store's or the Hub's: read by ranges
        return _plan_remote(storage, options)
    opened, owner = safetensors.open_checkpoint(src)
    names = sorted(owner)
    dtypes = sorted({str(owner[n].header[n][0]) for n in names})
    source = {
        "framework": "safetensors",
        "path": os.path.abspath(src),
        "files": [os.path.basename(f.path) for f in opened],
        "dtypes": dtypes,
        "metadata": {k: v for f in opened for k, v in f.metadata.items() if isinstance(v, str)},
    }
    found, config = list(names), None
    # the model's config.json, as its weights are read (a Hub cache snapshot's link into blobs/)
    where = f"{src}: the model's {CONFIG_FILE}"
    if os.path.isdir(src) and os.path.isfile(
        path := files.inside_checkpoint(src, CONFIG_FILE, where)
    ):
        config = read_json(path)
    named = _with_config(source, config, {n: owner[n].header[n][1] for n in names})
    _beside(storage if os.path.isdir(src) else None, source, found, weights_only)
    mine = share.pick(sorted(named))
    items = (
        host_item(
            ("params", n),
            owner[s].tensor(s),  # a mapped view: never touched, read with pread
            {"file": os.path.basename(owner[s].path), "tensors": [s]},
        )
        for n, s in ((n, named[n]) for n in mine)
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


def _plan_remote(storage: Storage, options: ImportOptions) -> ImportPlan:
    """The import of safetensors in an object store or a Hub repo (``hf://``): each tensor's
    rows ranged reads (in slabs when larger than the memory budget); ``path`` the source as
    read, a Hub repo's pinned to the commit it was read at (``hf://ORG/NAME@SHA``); the rest
    recorded as of a local folder (``config.json`` read through the storage)."""
    prefix, tensors, metadata = open_remote(storage)
    names = sorted(tensors)
    source = {
        "framework": "safetensors",
        "path": prefix.absolute(),
        "files": sorted({t.shown.rpartition("/")[2] for t in tensors.values()}),
        "dtypes": sorted({str(tensors[n].dtype) for n in names}),
        "metadata": metadata,
    }
    single = storage.root.rstrip("/").endswith(".safetensors")  # one object: no folder's config
    raw = None if single else prefix.read(CONFIG_FILE, MAX_JSON_BYTES)
    config = None if raw is None else files.strict_json(raw, prefix.join(CONFIG_FILE))
    named = _with_config(source, config, {n: list(tensors[n].shape) for n in names})
    found = list(names)
    _beside(None if single else prefix, source, found, options.weights_only)

    def deferred(t: RemoteTensor) -> writer.Deferred:
        rows = t.shape[0] if t.shape else 1
        return writer.Deferred(
            t.shape,
            t.dtype,
            lambda: t.rows(0, rows).reshape(t.shape),
            rows=t.rows if t.shape else None,
            ranged=True,
        )

    mine = options.share.pick(sorted(named))
    items = (
        host_item(("params", n), deferred(tensors[s]), {"file": tensors[s].shown, "tensors": [s]})
        for n, s in ((n, named[n]) for n in mine)
    )
    return ImportPlan(items, source, len(mine), source_tensors=found)


def holds_remote(prefix: Storage) -> bool:
    """A ``.safetensors`` object, or a prefix / repo holding safetensors (or their index) and
    no ``ucp.json``, in a medium that is no local directory (read by ranges)."""
    if prefix.local_path() is not None:  # a local directory: ``format.safetensors`` maps it
        return False
    if prefix.root.rstrip("/").endswith(".safetensors"):
        return True
    if prefix.exists(fmt.MANIFEST_FILE):
        return False
    names = prefix.names()
    return (
        prefix.exists(safetensors.INDEX_FILE)
        or any("/" not in n and n.endswith(".safetensors") for n in names)
    ) and not dcp_safetensors.holds_rank_pieces(names)  # torch DCP's (importers.torch.dcp)


def _objects(prefix: Storage) -> tuple[Storage, list[str]]:
    """(the medium, the safetensors objects in it) of the checkpoint at ``prefix``: one
    storage, so a Hub repo's files are all read at the commit it resolved once."""
    url = prefix.root.rstrip("/")
    if url.endswith(".safetensors"):  # one object: read from its folder's storage
        folder, _, name = url.rpartition("/")
        return store.storage_for(folder), [name]
    raw = prefix.read(safetensors.INDEX_FILE, safetensors.MAX_INDEX_BYTES)
    if raw is None:
        names = sorted(n for n in prefix.names() if "/" not in n and n.endswith(".safetensors"))
        if len(names) != 1:
            raise SourceError(
                f"{url}: {len(names)} .safetensors objects and no {safetensors.INDEX_FILE} "
                f"saying which belong to the model; add the index, or pass the one you mean."
            )
        return prefix, names
    where = prefix.join(safetensors.INDEX_FILE)
    return prefix, sorted(set(safetensors.weight_map_of(raw, where, ".safetensors").values()))


@dataclasses.dataclass
class RemoteTensor:
    """One tensor of a safetensors object: its rows read as byte ranges of ``file``."""

    file: RandomAccess
    name: str
    dtype: np.dtype
    shape: tuple[int, ...]
    offset: int  # of its first byte in the object

    @property
    def shown(self) -> str:
        return self.file.shown

    @property
    def row_bytes(self) -> int:
        return (
            math.prod(self.shape[1:]) * self.dtype.itemsize if self.shape else self.dtype.itemsize
        )

    def rows(self, a: int, b: int) -> np.ndarray:
        """Rows ``a:b`` of the tensor (``[0:1]`` of a scalar), one ranged read."""
        start, want = self.offset + a * self.row_bytes, (b - a) * self.row_bytes
        try:
            got = self.file.read(start, want)
        except RangeError as e:  # a range past the end: the object shrank since it was opened
            raise CheckpointError(
                f"{self.shown}: tensor {self.name!r}: rows {a}:{b} cannot be read ({e})."
            ) from None
        if got is None or len(got) != want:
            raise CheckpointError(
                f"{self.shown}: tensor {self.name!r} truncated or gone (rows {a}:{b} need "
                f"{want} bytes from byte {start}, got "
                f"{'no object' if got is None else len(got)})."
            )
        count_bytes_read(want)
        return np.frombuffer(got, self.dtype).reshape((b - a, *self.shape[1:]))


def open_remote(storage: Storage) -> tuple[Storage, dict[str, RemoteTensor], dict[str, str]]:
    """(the medium, each tensor by name, the files' str ``__metadata__``) of the safetensors at
    ``storage`` (a ``.safetensors`` object, or a prefix / repo holding them, with the index when
    several), every header checked by the one decoder (``format.safetensors``); no bytes read."""
    prefix, names = _objects(storage)
    tensors: dict[str, RemoteTensor] = {}
    metadata: dict[str, str] = {}
    for name in names:
        got, meta = _remote_file(prefix, name)
        if twice := sorted(set(got) & set(tensors)):
            raise SourceError(f"{storage.root}: tensor {twice[0][:100]!r} is in two objects.")
        tensors.update(got)
        metadata.update(meta)
    return prefix, tensors, metadata


def _remote_file(prefix: Storage, name: str) -> tuple[dict[str, RemoteTensor], dict[str, str]]:
    """(each tensor, the str ``__metadata__``) of object ``name`` of ``prefix``, its header
    checked; no tensor's bytes read."""
    file = prefix.reader(name)
    parsed = safetensors.SafetensorsFile.read_from(file.shown, file)
    tensors = {
        tensor: RemoteTensor(file, tensor, np.dtype(dtype), tuple(shape), parsed.data_start + b)
        for tensor, (dtype, shape, b, _) in parsed.header.items()
    }
    return tensors, {k: v for k, v in parsed.metadata.items() if isinstance(v, str)}


def weight_files(folder: Storage) -> dict[str, tuple[Storage, str]]:
    """{path or URL: (storage, name) it is read at} of the safetensors weights ``folder`` holds
    (its index's shards, else its one file: ``format.safetensors.shard_files``, an object store's
    or Hub repo's by the same rules); {} when it holds none (or torch DCP's rank pieces)."""
    local = folder.local_path()
    if local is not None:
        paths = safetensors.shard_files(local) if safetensors.is_safetensors(local) else []
        return {p: (folder, os.path.basename(p)) for p in paths}
    if not holds_remote(folder):
        return {}
    prefix, names = _objects(folder)
    return {prefix.join(n): (prefix, n) for n in names}


def file_tensors(folder: Storage, name: str) -> dict[str, np.ndarray | RemoteTensor]:
    """Each tensor of safetensors file ``name`` of ``folder`` (:func:`weight_files`), its header
    checked: a read-only view of a local file's map (read with ``pread``), else its rows read by
    ranges when written (:class:`RemoteTensor`)."""
    local = folder.local_path()
    if local is None:
        return dict(_remote_file(folder, name)[0])
    f = safetensors.SafetensorsFile(os.path.join(local, name))
    return {n: f.tensor(n) for n in f.header}
