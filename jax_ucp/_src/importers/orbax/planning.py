"""The import plan of an Orbax checkpoint: every array and scalar of its PyTree items, keyed by
its tree path, and the options that pick the step."""

from __future__ import annotations

import dataclasses
from typing import Any

from jax_ucp._src.errors import SourceError
from jax_ucp._src.format import files
from jax_ucp._src.importers.orbax.arrays import (
    check_chunks,
    flatten,
    host_items,
    metadata_file,
    tree_metadata,
)
from jax_ucp._src.importers.orbax.layout import (
    CHECKPOINT_METADATA,
    OCDBT_MANIFEST,
    PYTREE_METADATA,
    check_links,
    check_names,
    inside,
    is_orbax,
    resolve,
)
from jax_ucp._src.importers.plan import (
    Detection,
    ImportPlan,
    TaggedOptions,
    refuse_spec,
    skip,
)
from jax_ucp._src.store.storage import Storage


def plan(storage: Storage, options: OrbaxOptions) -> ImportPlan:
    """The import of an Orbax checkpoint, step or manager root (its ``options.tag`` step, None:
    the latest committed): every array and scalar of its PyTree items, keyed by its tree path
    (under the item name when a step has several PyTree items). ``weights_only``: only the
    ``params`` subtree (everything else listed in ``source.skipped``); a spec is refused (an
    Orbax import keeps the saved tree)."""
    refuse_spec(options.spec, "Orbax imports keep the saved tree", SourceError)
    import orbax.checkpoint as ocp

    step_dir, step, items, others = resolve(storage, options.tag)
    source: dict[str, Any] = {
        "framework": "orbax",
        "path": step_dir.root,
        "step": step,
        "items": sorted(items),
        "orbax_version": ocp.__version__,
    }
    found: list[str] = []
    leaves = []  # (output key, key types, source name, item dir, metadata, ocdbt, zarr3)
    for item, path in items.items():
        check_links(step_dir, path)
        check_names(path)  # before Orbax's metadata(), which opens every array itself
        ocdbt = path.exists(OCDBT_MANIFEST)
        md = tree_metadata(path, ocdbt)
        zarr3 = bool(getattr(md, "use_zarr3", False))
        source.setdefault("layout", {})[item] = {"ocdbt": ocdbt, "zarr3": zarr3}
        under = ((item,), ("key",)) if len(items) > 1 else ((), ())
        for key, key_types, leaf in flatten(md.tree):
            out = (under[0] + key, under[1] + key_types)
            if leaf is None:  # an empty node: a None value, no tensor to account for
                leaves.append((*out, ".".join(key), path, None, ocdbt, zarr3))
                continue
            # the array's directory (or OCDBT key) Orbax's read spec joins from its name
            inside(
                path.root,
                leaf.name,
                f"{path.root}/{PYTREE_METADATA}: array {'.'.join(key)[:100]!r}",
            )
            name = f"{item}/{leaf.name}" if item else leaf.name
            chunks = getattr(leaf, "storage", None)  # Orbax's record of the array's chunks
            if (chunk_shape := getattr(chunks, "chunk_shape", None)) is not None:
                where = metadata_file(path, leaf.name, ocdbt, zarr3)
                check_chunks(where, name, tuple(leaf.shape), [tuple(chunk_shape)])
            found.append(name)
            leaves.append((*out, name, path, leaf, ocdbt, zarr3))
    for item, why in others.items():
        found.append(f"{item}/")
        skip(source, [f"{item}/"], why)
    if options.weights_only:
        dropped = [lv for lv in leaves if lv[0][:1] != ("params",)]
        tensors = [lv[2] for lv in dropped if lv[4] is not None]  # empty nodes are no tensors
        skip(source, tensors, "weights_only: not under params/")
        leaves = [lv for lv in leaves if lv[0][:1] == ("params",)]
        if not leaves:
            raise SourceError(f"{step_dir.root}: weights_only, but no tree has a params/ subtree")
    mine = options.share.pick(leaves)
    params = sum(1 for lv in mine if lv[0][:1] == ("params",))
    return ImportPlan(host_items(mine), source, params, source_tensors=found)


@dataclasses.dataclass(frozen=True)
class OrbaxOptions(TaggedOptions):
    """``ImportOptions`` and the step to import (``tag``, None: the latest committed one); a
    string of digits is that step number."""

    def __post_init__(self):
        if isinstance(self.tag, str) and (step := files.name_number(self.tag)) is not None:
            object.__setattr__(self, "tag", step)


def detect(storage: Storage) -> Detection:
    """Whether ``src`` is an Orbax checkpoint, step or CheckpointManager directory, from its
    file names."""
    if is_orbax(storage):
        return Detection(True, "Orbax metadata")
    return Detection(False, f"no Orbax `{CHECKPOINT_METADATA}`, `{PYTREE_METADATA}` or steps")
