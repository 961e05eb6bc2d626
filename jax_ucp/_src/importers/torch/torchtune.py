"""A torchtune output folder: ``epoch_N/`` (Hugging Face safetensors, written by torchtune's
``FullModelHFCheckpointer``) and, for an intermediate checkpoint, ``recipe_state/recipe_state.pt``
(the optimizer, seed, epochs).

The weights are imported as the checkpointer wrote them (Hugging Face's names and row order).
The optimizer in ``recipe_state.pt`` is over torchtune's own model (keyed by its names, or by
index in the single-device recipes: then ``parameter_order=`` names it), so its moments are
mapped as ``torchtune.models.convert_weights.tune_to_hf`` maps the weights (its name table, its
q/k row permutation with the heads of the epoch's ``config.json``), for the Llama-family models
that function converts; the others are refused naming their ``model_type``.

The asynchronous save (``enable_async_checkpointing``) writes ``dist_epoch_N/`` instead: torch
DCP of the model and optimizer state dicts under torchtune's names (no conversion), the
optimizer keyed by index, imported by the torch DCP importer as saved. The latest epoch of
either kind is imported; the others' folders are listed in ``source.skipped``.

A LoRA recipe writes its adapter beside the merged weights (``adapter_model.pt``, torchtune's
names in its ``model.parameters()`` order; ``adapter_model.safetensors`` / ``.bin`` and
``adapter_config.json``, peft's) and saves its optimizer over the adapter's ``lora_a`` /
``lora_b`` only (and DoRA's ``magnitude``, ``use_dora``). That run imports as the adapter and its
moments, in peft's names and rows (as ``tune_to_peft_adapter_weights`` writes ``adapter_model.
safetensors``, but for DoRA's q/k magnitudes: one per output row, they are permuted as the rows they
scale, which that function leaves undone), so the fine-tune continues;
the merged weights are not the base the adapter trains over (base + alpha/r B A, rounded), so
they are listed in ``source.skipped`` and the base is left to the user (``source.notes`` names
it where ``adapter_config.json`` records it). With weights_only the merged weights import alone.
"""

from __future__ import annotations

import dataclasses
import re
import warnings
from collections.abc import Sequence
from typing import Any, cast

import numpy as np

from jax_ucp._src.errors import SourceError
from jax_ucp._src.format import files
from jax_ucp._src.importers.plan import (
    Detection,
    ImportPlan,
    listed,
    refuse_spec,
    skip,
    tensor_names,
)
from jax_ucp._src.importers.safetensors_weights import plan_safetensors
from jax_ucp._src.importers.torch import dcp, torchtune_order
from jax_ucp._src.importers.torch.options import TorchOptions, refuse_model_config
from jax_ucp._src.importers.torch_state import TensorRef, TorchState, numbered_names, plan_state
from jax_ucp._src.importers.trainer_files import (
    ADAPTER_CONFIG_FILE,
    ADAPTER_WEIGHTS,
    CONFIG_FILE,
    adapter_record,
    side_json,
)
from jax_ucp._src.store.storage import Storage
from jax_ucp._src.torchfiles import allow_list, torch_zip
from jax_ucp._src.torchfiles import dcp as torch_dcp

__all__ = [
    "RECIPE_STATE",
    "TUNE_TO_HF",
    "detect",
    "epoch_folders",
    "peft_name",
    "plan_torchtune",
]

RECIPE_DIR, RECIPE_FILE = "recipe_state", "recipe_state.pt"
RECIPE_STATE = f"{RECIPE_DIR}/{RECIPE_FILE}"
ADAPTER_PT = "adapter_model.pt"  # torchtune's own copy of the adapter: its names and order
OPTIMIZER_KEY = "optimizer"  # torchtune's training.OPT_KEY
#: what a LoRA recipe's checkpointer writes into ``epoch_N/`` beside the merged weights:
#: torchtune's ``ADAPTER_MODEL_FNAME`` as ``.pt`` (its names), ``.safetensors`` or ``.bin``
#: (peft's, ``safe_serialization``), and peft's ``adapter_config.json``
ADAPTER_FILES = (*ADAPTER_WEIGHTS, ADAPTER_CONFIG_FILE)
#: the parameter names only a LoRA / DoRA model has (torchtune's ``LoRALinear``, ``DoRALinear``)
_LORA_NAME = re.compile(r"(^|\.)(lora_a|lora_b|magnitude)(\.|$)")

#: torchtune's parameter names -> Hugging Face's: ``torchtune.models.convert_weights._FROM_HF``
#: (0.6.1) inverted, as ``tune_to_hf`` inverts it; ``{}`` is the layer number.
TUNE_TO_HF = {
    "tok_embeddings.weight": "model.embed_tokens.weight",
    "layers.{}.attn.q_proj.weight": "model.layers.{}.self_attn.q_proj.weight",
    "layers.{}.attn.k_proj.weight": "model.layers.{}.self_attn.k_proj.weight",
    "layers.{}.attn.v_proj.weight": "model.layers.{}.self_attn.v_proj.weight",
    "layers.{}.attn.output_proj.weight": "model.layers.{}.self_attn.o_proj.weight",
    "layers.{}.mlp.w1.weight": "model.layers.{}.mlp.gate_proj.weight",
    "layers.{}.mlp.w3.weight": "model.layers.{}.mlp.up_proj.weight",
    "layers.{}.mlp.w2.weight": "model.layers.{}.mlp.down_proj.weight",
    "layers.{}.sa_norm.scale": "model.layers.{}.input_layernorm.weight",
    "layers.{}.mlp_norm.scale": "model.layers.{}.post_attention_layernorm.weight",
    "norm.scale": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
#: Hugging Face ``model_type``s whose torchtune checkpointer path is the default ``tune_to_hf``
#: (torchtune's LLAMA2 / LLAMA3 / LLAMA3_2 / MISTRAL model types); Qwen2, Phi-3, Gemma 2,
#: vision and reward models have converters of their own, not mapped here.
DEFAULT_CONVERT_MODEL_TYPES = ("llama", "mistral")


def epoch_folders(storage: Storage, dist: bool = False) -> list[str]:
    """``epoch_N`` folders of ``storage`` holding safetensors, by N; ``dist``: ``dist_epoch_N``
    ones with torch DCP's ``.metadata`` (DistributedCheckpointer's ``_checkpoint_dir_prefix``)."""

    def holds(name: str) -> bool:
        try:
            names = listed(storage.folder(name, link=False)) or []
        except OSError:  # a link (out of the folder or not): no epoch of this run
            return False
        return ".metadata" in names if dist else any(n.endswith(".safetensors") for n in names)

    pattern = rf"{'dist_' if dist else ''}epoch_([0-9]+)"
    named = ((re.fullmatch(pattern, n, re.ASCII), n) for n in listed(storage) or ())
    found = [(int(m.group(1)), n) for m, n in named if m and holds(n)]
    return list(files.numbered_names(found, storage.root, "epoch").values())


def adapter_files(folder: Storage) -> list[str]:
    """:data:`ADAPTER_FILES` among ``folder``'s entries (links too: listed, never read)."""
    return [n for n in ADAPTER_FILES if n in (listed(folder) or ())]


def _adapter_units(folder: Storage, epoch: str) -> tuple[list[str], str]:
    """(the adapter files of the latest epoch ``folder`` as source units, why they are not
    imported): the merged weights are imported, the adapter's ``lora_a`` / ``lora_b`` are in
    them; an adapter-only save (``save_adapter_weights_only``) imports its ``adapter_model.
    safetensors``, torchtune's own ``.pt`` copy of it skipped."""
    found, names = adapter_files(folder), listed(folder) or ()
    merged = any(n.endswith(".safetensors") and n not in ADAPTER_FILES for n in names)
    if not merged:
        found = [n for n in found if n != "adapter_model.safetensors"]
        why = "torchtune's LoRA adapter in its own names (adapter_model.safetensors imported)"
    else:
        why = (
            f"a LoRA adapter (torchtune's LoRA recipe): its lora_a / lora_b are merged into the "
            f"{epoch}/ weights imported"
        )
    return [f"{epoch}/{n}" for n in found], why


def _lora_refusal(recipe: str, epoch: str, found: list[str], state: dict) -> SourceError:
    """The one refusal of a LoRA recipe's optimizer state, naming what said LoRA."""
    keys = [k for k in state if isinstance(k, str) and _LORA_NAME.search(k)]
    said = ", ".join(f"{epoch}/{n}" for n in found) if found else _names(keys)
    return SourceError(
        f"{recipe}: LoRA optimizer state (torchtune's LoRA recipe: {said}): its moments are "
        f"of the adapter's lora_a / lora_b parameters ({len(state)} entries), which "
        f"{epoch}/'s merged weights do not hold, so they belong to no imported weight: not "
        f"imported. Convert with weights_only=True to import {epoch}/'s merged weights (the "
        f"adapter files listed in source.skipped), and start a new optimizer"
    )


def _epoch_number(name: str) -> int:
    return int(name.rsplit("_", 1)[1])


def renamed(name: str, table: dict[str, str]) -> str | None:
    """Parameter ``name`` through torchtune's name ``table`` (:data:`TUNE_TO_HF`: torchtune's
    as Hugging Face's; :data:`_HF_TO_TUNE`, inverted), or None when the table has none
    (``get_mapped_key``: every ``.<digits>`` is the layer number)."""
    layer = re.search(r"\.([0-9]+)", name)
    mapped = table.get(re.sub(r"\.[0-9]+", ".{}", name))
    if mapped is None:
        return None
    return mapped.format(layer.group(1)) if layer else mapped


_HF_TO_TUNE = {hf: tune for tune, hf in TUNE_TO_HF.items()}


def _dist_order(folder: Storage) -> tuple[list[str], str] | None:
    """torchtune's builder's order of a ``dist_epoch_N/``'s model (its ``model.*`` tensors),
    when torchtune is installed and builds exactly those parameters."""
    if torchtune_order.torchtune_builder() is None:
        return None
    checkpoint = torch_dcp.open_dcp(folder)  # the DCP importer's reader, in place
    prefix = "model."
    shapes = {
        n[len(prefix) :]: tuple(t.shape)
        for n, t in checkpoint.tensors.items()
        if n.startswith(prefix)
    }
    rebuilt = torchtune_order.builder_order(shapes, folder.root) if shapes else None
    return rebuilt if isinstance(rebuilt, tuple) else None


def permute_rows(value: np.ndarray, heads: int, head_dim: int) -> np.ndarray:
    """torchtune's q/k rows in Hugging Face's order: ``tune_to_hf``'s ``_permute``, ``[heads,
    head_dim/2, 2, ...]`` with the middle axes swapped (rows moved, never a value changed).

    Args:
        value: a q or k projection, its ``lora_b`` or DoRA ``magnitude`` (one value per row), or
            a moment of one, torchtune's row order.
        heads: its head count (``num_attention_heads`` or ``num_key_value_heads``).
        head_dim: rows per head.
    """
    moved = value.reshape(heads, head_dim // 2, 2, -1).transpose(0, 2, 1, 3)
    return np.ascontiguousarray(moved.reshape(value.shape))


def _names(keys: list, count: int = 3) -> str:
    shown = ", ".join(allow_list.short_repr(k, 60) for k in keys[:count])
    return shown + (", ..." if len(keys) > count else "")


def recipe_optimizer(recipe: Any) -> str:
    """What the loaded ``recipe_state.pt`` holds of the optimizer, said as found when it is
    refused: a state dict keyed by index (the single-device recipes) or by anything but names
    alone (one keyed by torchtune's names is imported, never said), one optimizer per parameter
    (optimizer in backward), or none."""
    if not isinstance(recipe, dict):
        return f"absent (the file holds a {type(recipe).__name__}, expected a dict)"
    optimizer = recipe.get(OPTIMIZER_KEY)
    if not isinstance(optimizer, dict):
        keys = _names(sorted(map(str, recipe)), 8)
        return f"absent (no {OPTIMIZER_KEY!r} dict among its keys {keys or 'none'})"
    state, groups = optimizer.get("state"), optimizer.get("param_groups")
    if isinstance(state, dict) and isinstance(groups, list):
        keys = list(state)
        where = f"in {len(groups)} param group{'s' if len(groups) != 1 else ''}"
        if keys and all(isinstance(k, int) for k in keys):
            return (
                f"keyed by index ({len(keys)} parameters {where}, indices {_names(keys)}, "
                f"without their names)"
            )
        return f"keyed by {_names(keys)} ({len(keys)} parameters {where})"
    per = [k for k, v in optimizer.items() if isinstance(v, dict) and "state" in v]
    if per and len(per) == len(optimizer):
        return (
            f"one optimizer per parameter (optimizer in backward), keyed by torchtune's "
            f"parameter names ({len(per)} parameters, e.g. {_names(per)})"
        )
    return f"a dict with keys {_names(list(optimizer), 8)}, not a torch optimizer state dict"


def detect(storage: Storage) -> Detection:
    """Whether ``storage`` is a torchtune output folder, from names: ``epoch_N/`` safetensors
    folders (with or without recipe state) or the asynchronous save's ``dist_epoch_N/`` torch
    DCP folders; a weak claim (``epoch_N/`` holds safetensors, as other formats' folders may)."""
    if epoch_folders(storage) or epoch_folders(storage, dist=True):
        return Detection(True, "a torchtune checkpoint", weak=True)
    return Detection(False, "no torchtune `epoch_N/` or `dist_epoch_N/`")


def plan_torchtune(storage: Storage, options: TorchOptions) -> ImportPlan:
    """The latest epoch's weights and, unless weights_only, the recipe's optimizer state mapped
    onto them (Hugging Face's names and q/k row order).

    Args:
        storage: the torchtune output folder (``epoch_N/``, ``recipe_state/``).
        options: ``spec`` refused (the names are Hugging Face's, as the checkpointer wrote the
            weights); ``weights_only``: the weights alone, ``recipe_state.pt`` in
            ``source.skipped``; ``parameter_order``: torchtune's parameter names in
            ``model.parameters()`` order, for an optimizer keyed by index (the single-device
            recipes).
    """
    src = storage.root
    refuse_model_config(src, options)
    spec, weights_only = options.spec, options.weights_only
    parameter_order = options.parameter_order
    epochs, dist = epoch_folders(storage), epoch_folders(storage, dist=True)
    if not epochs and not dist:
        raise SourceError(
            f"{src}: no torchtune epoch_N/ folder holding safetensors, nor dist_epoch_N/ "
            f"holding torch DCP"
        )
    here = RECIPE_DIR in (listed(storage) or ())  # never linked out of the output folder
    has_recipe = here and RECIPE_FILE in (listed(storage.folder(RECIPE_DIR)) or ())
    if here and not has_recipe and not weights_only:
        raise SourceError(  # torchtune makes the folder to write the file: the file was lost
            f"{src}: recipe_state/ is here without {RECIPE_FILE} (the "
            f"recipe's optimizer state and seed, written into it for a resumable checkpoint); "
            f"pass weights_only=True to take the weights alone"
        )
    if dist and (not epochs or _epoch_number(dist[-1]) > _epoch_number(epochs[-1])):
        folder = storage.folder(dist[-1])
        rebuilt = None  # the index-keyed optimizer's order, by torchtune's builder if installed
        if parameter_order is None and not weights_only:
            rebuilt = _dist_order(folder)
            if rebuilt is not None:
                options = dataclasses.replace(options, parameter_order=rebuilt[0])
        plan = dcp.plan_torch_dcp(folder, options)
        if rebuilt is not None:
            plan.source["parameter_order"] = rebuilt[1]
        others = [f"{e}/" for e in epochs + dist[:-1]] + [RECIPE_STATE] * has_recipe
        return _as_dist_epoch(plan, storage, dist[-1], others)
    loaded = _load(storage, RECIPE_STATE) if has_recipe and not weights_only else None
    said = None if weights_only else _recipe_not_the_latest(storage, loaded, has_recipe, epochs)
    if has_recipe and not weights_only and said is None:
        refuse_spec(spec, "torchtune imports keep Hugging Face's names", SourceError)
        return _plan_with_optimizer(storage, (epochs, dist), loaded, options, parameter_order)
    if parameter_order is not None and said is None:
        raise SourceError(
            f"{src}: parameter_order numbers the optimizer of {RECIPE_STATE}, which "
            f"{'weights_only leaves out' if has_recipe else 'this folder does not hold'}"
        )
    latest = storage.folder(epochs[-1])
    plan = plan_safetensors(latest, dataclasses.replace(options, weights_only=False))
    source = dict(plan.source)
    source.update(framework="torchtune", path=storage.absolute(), epoch=epochs[-1])
    # the adapter files the safetensors plan listed by their names in the epoch: listed below
    # by their path in the output folder, with torchtune's reason
    source["skipped"] = {
        k: v for k, v in source.get("skipped", {}).items() if k not in ADAPTER_FILES
    }
    if not source["skipped"]:
        del source["skipped"]
    tensors = [n for n in plan.source_tensors or () if n not in ADAPTER_FILES]
    units = [f"{e}/" for e in epochs[:-1] + dist]
    skip(source, units, f"an earlier epoch's checkpoint ({epochs[-1]}/ imported)")
    adapters, why = _adapter_units(latest, epochs[-1])
    if adapters:
        units.extend(adapters)
        skip(source, adapters, why)
    if has_recipe:
        units.append(RECIPE_STATE)
        skip(
            source,
            [RECIPE_STATE],
            said or "weights_only: torchtune's recipe state (optimizer, seed)",
        )
    if said is not None:
        source["notes"] = [*source.get("notes", []), said]
        warnings.warn(f"{src}: {said}", stacklevel=3)
    return dataclasses.replace(plan, source=source, source_tensors=[*tensors, *units])


def _load(storage: Storage, name: str) -> Any:
    """torch.save file ``name`` of ``storage`` (a link out of the folder refused as such)."""
    try:
        return torch_zip.load_torch_file((storage, name))
    except allow_list.TorchFileError:
        storage.exists(name)  # a local link out of the folder: UnsafeFileError
        raise


def _recipe_not_the_latest(storage: Storage, loaded: Any, has_recipe: bool, epochs: list[str]):
    """Why the latest epoch's weights come without an optimizer, when the folder shows they
    had one or have another's (None: the recipe state is the latest epoch's, or no sign). A
    recipe writes ``recipe_state.pt`` at every epoch but the last and never removes it: one
    whose ``epochs_run`` is not the latest epoch's is another epoch's; none beside two epochs,
    or a name like it (``recipe_state.bak``), was removed or renamed."""
    latest = epochs[-1] if epochs else None
    if has_recipe and latest is not None:
        run = loaded.get("epochs_run") if isinstance(loaded, dict) else None
        if type(run) is int and run != _epoch_number(latest) + 1:
            return (
                f"{RECIPE_STATE} is the recipe state saved after {run} epoch(s) (epoch_"
                f"{run - 1}/'s), not {latest}/'s (a final epoch's save writes none): "
                f"{latest}/'s weights imported alone"
            )
        return None
    odd = [n for n in listed(storage) or () if "recipe_state" in n and n != RECIPE_DIR]
    if latest is not None and (odd or len(epochs) > 1):
        return (
            f"no {RECIPE_STATE} beside {', '.join(odd[:3]) or ', '.join(epochs[:3])}: "
            f"the recipe's optimizer state was removed or renamed (or {latest}/ is a final "
            f"epoch, saved without one): {latest}/'s weights imported alone"
        )
    return None


def _as_dist_epoch(plan: ImportPlan, storage: Storage, epoch: str, units: list[str]) -> ImportPlan:
    """The torch DCP importer's plan of the latest ``dist_epoch_N/`` (torchtune's names as
    saved) as torchtune's; the other epochs' folders and ``recipe_state.pt`` (the synchronous
    saves': ``units``) skipped."""
    source = dict(plan.source)
    source.update(
        framework="torchtune",
        saved_by="torchtune DistributedCheckpointer (asynchronous save, torch DCP)",
        path=storage.absolute(),
        epoch=epoch,
        folders=[epoch],
        names="torchtune's (its model as trained: no Hugging Face conversion)",
    )
    if units:  # (no empty source.skipped)
        skip(source, units, f"an earlier epoch's checkpoint ({epoch}/ imported)")
    items = (
        dataclasses.replace(item, provenance={**(item.provenance or {}), "folder": epoch})
        for item in plan.items
    )
    return dataclasses.replace(
        plan, items=items, source=source, source_tensors=[*(plan.source_tensors or ()), *units]
    )


def _heads(folder: Storage) -> tuple[dict[str, Any], tuple[int, int, int]]:
    """(config, (q heads, kv heads, head_dim)) from the epoch's ``config.json``, as the
    checkpointer read them; a model ``tune_to_hf`` does not convert is refused."""
    path = folder.join(CONFIG_FILE)
    try:  # a bounded read of a regular file inside the checkpoint (never a link out, a FIFO)
        config = cast(Any, side_json(folder, CONFIG_FILE) or (None,))[0]
        if CONFIG_FILE not in (listed(folder) or ()) and config is None:  # a remote one
            raise FileNotFoundError(f"no {CONFIG_FILE} in {folder.root}")
    except (OSError, SourceError) as e:
        raise SourceError(
            f"{path}: not read ({e}); the q/k heads its moments are permuted by are in it"
        ) from None
    model_type = config.get("model_type") if isinstance(config, dict) else None
    if model_type not in DEFAULT_CONVERT_MODEL_TYPES:
        raise SourceError(
            f"{path}: model_type {model_type!r}; torchtune's optimizer state is mapped for "
            f"{', '.join(DEFAULT_CONVERT_MODEL_TYPES)} models (torchtune's default tune_to_hf) "
            f"only. Convert with weights_only=True to import the weights"
        )
    try:
        heads, kv_heads = int(config["num_attention_heads"]), int(config["num_key_value_heads"])
        dim = int(config["hidden_size"])
        head_dim = int(config.get("head_dim") or (dim // heads if heads > 0 else 0))
    except (KeyError, TypeError, ValueError) as e:
        raise SourceError(f"{path}: no usable {e} (the attention heads)") from None
    if min(heads, kv_heads, head_dim) <= 0:
        raise SourceError(
            f"{path}: num_attention_heads {heads}, num_key_value_heads {kv_heads}, head_dim "
            f"{head_dim}: each must be a positive integer (the q/k moments' rows are permuted "
            f"by them)"
        )
    return config, (heads, kv_heads, head_dim)


def _optimizer_names(
    state: dict, groups: list, order: Sequence[str] | None, recipe: str, described: str
) -> dict[Any, str]:
    """{optimizer key: torchtune's parameter name}: the keys themselves (distributed recipes)
    or, keyed by index, ``order`` along the groups' ``params`` (torch numbers them so)."""
    keys = list(state)
    if keys and all(isinstance(k, str) for k in keys):
        if order is not None:
            raise SourceError(
                f"{recipe}: the optimizer is keyed by torchtune's parameter names; "
                f"parameter_order does not apply"
            )
        return {k: k for k in keys}
    if not (keys and all(isinstance(k, int) for k in keys)):
        raise SourceError(f"{recipe}: torchtune's optimizer state, {described}: not imported")
    if order is None:
        names = (
            "[n for n, _ in model.named_parameters()]"
            if len(groups) <= 1
            else "[its parameters' names group after group, as the optimizer was built: "
            "the groups' name lists concatenated, not model.named_parameters() order]"
        )
        raise SourceError(
            f"{recipe}: torchtune's optimizer state, {described}. Give its order: "
            f"parameter_order={names} of the torchtune model "
            f"the recipe trained (torchtune's names, the order it gave them to the optimizer; "
            f"--parameter-order FILE on the CLI), "
            f"or convert with weights_only=True to import the weights"
        )
    ids = [i for g in groups if isinstance(g, dict) for i in g.get("params", ())]
    return numbered_names(ids, keys, order, recipe)


def _recipe_optimizer(loaded: Any, recipe: str, epoch: str) -> tuple[dict, dict, list]:
    """(the recipe state, its optimizer's ``state``, its ``param_groups``); refused when the
    recipe holds no torch optimizer state dict (the weights still import alone)."""
    optimizer = loaded.get(OPTIMIZER_KEY) if isinstance(loaded, dict) else None
    state = optimizer.get("state") if isinstance(optimizer, dict) else None
    groups = optimizer.get("param_groups") if isinstance(optimizer, dict) else None
    if not (isinstance(state, dict) and isinstance(groups, list)):
        raise SourceError(
            f"{recipe}: torchtune's optimizer state, {recipe_optimizer(loaded)}: not imported. "
            f"Convert with weights_only=True to import {epoch}/'s weights"
        )
    assert isinstance(loaded, dict)
    return loaded, state, groups


def _epoch_weights(folder: Storage, epoch: str) -> tuple[dict[str, TensorRef], list[str]]:
    """The epoch's safetensors as lazy references (Hugging Face's names and rows, as the
    checkpointer wrote them), as the safetensors importer reads them, and their files."""
    params: dict[str, TensorRef] = {}
    for item in plan_safetensors(folder, TorchOptions(weights_only=True)).items:
        value, where = item.value, cast(dict, item.provenance)  # a map's view, or a Deferred
        (name,), base = where["tensors"], where["file"].rpartition("/")[2]  # (remote: by ranges)
        params[name] = TensorRef(
            name,
            tuple(value.shape),
            value.dtype,
            getattr(value, "make", lambda v=value: v),
            {"format": "safetensors", "file": f"{epoch}/{base}"},
            rows=getattr(value, "rows", None),
        )
    return params, sorted({ref.where["file"].partition("/")[2] for ref in params.values()})


def _row_ref(
    name: str, value: np.ndarray, rows: int | None, head_dim: int, where: dict
) -> TensorRef:
    """``value`` as a reference, its q/k rows permuted as ``tune_to_hf`` permutes the weight
    (``rows`` heads; None: as saved)."""
    if rows is None:
        return TensorRef(name, tuple(value.shape), value.dtype, lambda: value, where)
    return TensorRef(
        name,
        tuple(value.shape),
        value.dtype,
        lambda: permute_rows(value, rows, head_dim),
        where | {"rows_permuted": {"heads": rows, "head_dim": head_dim}},
    )


def _moments(
    state: dict, to_name: dict[Any, str], recipe: str, heads: tuple[int, int, int], epoch: str
) -> tuple[dict[str, dict[str, TensorRef]], dict[str, str]]:
    """({Hugging Face name: {state: reference}}, {torchtune name: Hugging Face name}): the
    moments renamed by torchtune's own table (a LoRA adapter's by :func:`peft_name`); a name it
    does not know is refused, q/k moments without the rows config.json's heads say too (the
    permutation would scramble them)."""
    q_heads, kv_heads, head_dim = heads
    states: dict[str, dict[str, TensorRef]] = {}
    moved: dict[str, str] = {}
    for key, per in state.items():
        tune = to_name[key]
        hf = peft_name(tune) if _LORA_NAME.search(tune) else renamed(tune, TUNE_TO_HF)
        if hf is None:
            raise SourceError(
                f"{recipe}: optimizer state of torchtune's {tune!r}, which torchtune's "
                f"tune_to_hf table does not name (known: {_names(sorted(TUNE_TO_HF), 4)})"
            )
        moved[tune] = hf
        rows = _permuted_heads(tune, q_heads, kv_heads)
        for st, value in per.items() if isinstance(per, dict) else ():
            if not isinstance(value, np.ndarray):
                if not (st == "step" and isinstance(value, (int, float))):
                    continue  # not a tensor: not in found either
                value = np.asarray(value, np.float64)
            permuted = rows is not None and st != "step" and value.ndim in (1, 2)
            states.setdefault(hf, {})[st] = _row_ref(
                f"{RECIPE_STATE}:{OPTIMIZER_KEY}.state.{key}.{st}",
                value,
                rows if permuted else None,
                head_dim,
                {"format": "torch_files", "file": RECIPE_STATE, "torchtune_name": tune},
            )
        exp_avg = states.get(hf, {}).get("exp_avg")
        if rows is not None and exp_avg is not None:
            shape = exp_avg.shape
            if len(shape) not in (1, 2) or shape[0] != rows * head_dim or head_dim % 2:
                raise SourceError(
                    f"{recipe}: {tune!r} has moments of shape {list(shape)}, expected "
                    f"[{rows} heads x head_dim {head_dim}, ...] from {epoch}/config.json"
                )
    return states, moved


def _progress_agrees(progress: dict[str, int], state: dict, recipe: str) -> None:
    """The Adam step against the recipe's progress, which also states it: torchtune saves
    ``recipe_state.pt`` at an epoch's end and resumes its schedule at ``epochs_run`` x the steps
    of one epoch (alike every epoch, ``max_steps_per_epoch`` at most), so a step no such run
    takes (or more epochs run than ``total_epochs``) is refused, each record named."""
    held = [per.get("step") for per in state.values() if isinstance(per, dict)]
    numbers = [np.asarray(v, np.float64) for v in held if isinstance(v, int | float)]
    numbers += [v for v in held if isinstance(v, np.ndarray) and v.dtype.kind == "f"]  # torch's
    steps = {float(v.reshape(-1)[0]) for v in numbers if v.size == 1}
    run, most = progress.get("epochs_run"), progress.get("max_steps_per_epoch")
    total = progress.get("total_epochs")
    if len(steps) != 1 or run is None:
        return  # none, or refused by plan_state (every parameter's step must agree)
    step = steps.pop()
    said = f"{recipe}: optimizer state step = {step:g}, epochs_run = {run}"
    if total is not None and run > total:
        raise SourceError(f"{said}, total_epochs = {total}: more epochs run than the run has")
    if step % run if run > 0 else step:
        raise SourceError(
            f"{said}: not a whole number of steps per epoch (torchtune steps "
            f"alike every epoch and saves this at an epoch's end)"
        )
    if most is not None and step > run * most:
        raise SourceError(
            f"{said}, max_steps_per_epoch = {most}: more steps than "
            f"{run} x {most}, which these records allow"
        )


@dataclasses.dataclass(frozen=True)
class _Mapped:
    """What recipe_state.pt's moments are mapped onto: the epoch's weights, or a LoRA recipe's
    adapter (the merged weights then skipped)."""

    params: dict[str, TensorRef]  # Hugging Face's (peft's) name -> tensor
    to_name: dict[Any, str]  # optimizer key -> torchtune's parameter name
    skipped: dict[str, str]  # the epoch's files not imported -> why
    source: dict[str, Any]  # its part of the source record


def _plan_with_optimizer(
    storage: Storage,
    folders: tuple[list[str], list[str]],
    loaded: Any,
    options: TorchOptions,
    order: Sequence[str] | None,
) -> ImportPlan:
    """The latest epoch's weights (or a LoRA recipe's adapter) with recipe_state.pt's moments
    (``loaded``), renamed and row-permuted as torchtune's checkpointer converts the weights;
    every other tensor of recipe_state.pt and every older epoch (``folders``: both kinds) skipped."""
    (epochs, dist), recipe = folders, storage.join(RECIPE_STATE)
    epoch, latest = epochs[-1], storage.folder(epochs[-1])
    loaded, state, groups = _recipe_optimizer(loaded, recipe, epoch)
    progress = {
        k: loaded[k]
        for k in ("seed", "epochs_run", "total_epochs", "max_steps_per_epoch")
        if isinstance(loaded.get(k), int)
    }
    _progress_agrees(progress, state, recipe)
    found = adapter_files(latest)
    config, heads = _heads(latest)
    if found or any(isinstance(k, str) and _LORA_NAME.search(k) for k in state):
        if ADAPTER_PT not in found:
            raise _lora_refusal(recipe, epoch, found, state)
        mapped = _lora_adapter(storage, epoch, (state, groups, order), heads)
    else:
        mapped = _epoch_mapped(latest, epoch, recipe, (loaded, state, groups), order)
    states, moved = _moments(state, mapped.to_name, recipe, heads, epoch)
    recipe_tensors = [f"{RECIPE_STATE}:{n}" for n in tensor_names(loaded)]
    optimizer_sources = [n for n in recipe_tensors if n.startswith(f"{RECIPE_STATE}:optimizer.")]
    skipped = dict(mapped.skipped)
    for n in recipe_tensors:
        if n not in optimizer_sources:
            skipped[n] = "torchtune recipe state, not a model weight or optimizer state"
        elif n.startswith(f"{RECIPE_STATE}:{OPTIMIZER_KEY}.param_groups."):
            skipped[n] = "optimizer hyper-parameter, recorded in source.optimizer.param_groups"
    units = [f"{e}/" for e in epochs[:-1] + dist]
    skipped.update(dict.fromkeys(units, f"an earlier epoch's checkpoint ({epoch}/ imported)"))
    named_groups = [  # a parameter without state (frozen) is in source.optimizer.no_state
        {
            **g,
            "params": [
                moved[t] for i in g.get("params", ()) if (t := mapped.to_name.get(i)) in moved
            ],
        }
        for g in groups
        if isinstance(g, dict)
    ]
    refs = [n for ref in mapped.params.values() for n in ref.names]
    sources = [*refs, *mapped.skipped, *recipe_tensors, *units]
    torch_state = TorchState(
        mapped.params, states, named_groups, skipped, recipe, sources, optimizer_sources
    )
    source = {
        "framework": "torchtune",
        "path": storage.absolute(),
        "epoch": epoch,
        "optimizer_keyed_by": "index" if all(isinstance(k, int) for k in state) else "name",
        "qk_permuted": dict(zip(("heads", "kv_heads", "head_dim"), heads)),
        "recipe": progress,
        "model_type": config.get("model_type"),
        **mapped.source,
    }
    return plan_state(torch_state, source, options)


def _epoch_mapped(
    latest: Storage,
    epoch: str,
    recipe: str,
    opened: tuple[dict, dict, list],
    order: Sequence[str] | None,
) -> _Mapped:
    """The epoch's weights and the optimizer's keys' torchtune names (keyed by index:
    ``order``, or torchtune's builder's if installed)."""
    loaded, state, groups = opened
    params, files = _epoch_weights(latest, epoch)
    described, rule = recipe_optimizer(loaded), None
    if order is None and state and all(isinstance(k, int) for k in state):
        # keyed by index: torchtune's builder, if installed, rebuilds the order
        tune = {
            t: ref.shape for n, ref in params.items() if (t := renamed(n, _HF_TO_TUNE)) is not None
        }
        rebuilt = torchtune_order.builder_order(tune, recipe) if len(tune) == len(params) else None
        if isinstance(rebuilt, tuple):
            order, rule = rebuilt
        elif isinstance(rebuilt, str):
            described += f"; torchtune's builder did not rebuild its order: {rebuilt}"
    to_name = _optimizer_names(state, groups, order, recipe, described)
    source: dict[str, Any] = {"files": files}
    if rule is not None:
        source["parameter_order"] = rule
    return _Mapped(params, to_name, {}, source)


def _permuted_heads(tune: str, q_heads: int, kv_heads: int) -> int | None:
    """The heads whose rows ``tune_to_hf`` permutes in torchtune's ``tune`` (q / k projections;
    of an adapter ``lora_b``, as ``tune_to_peft_adapter_weights``, and DoRA's ``magnitude``,
    which scales those rows), else None."""
    if ".lora_a." in tune:
        return None
    return q_heads if "q_proj" in tune else kv_heads if "k_proj" in tune else None


def peft_name(tune: str) -> str | None:
    """torchtune's adapter parameter name as peft's (``tune_to_peft_adapter_weights``:
    ``layers.0.attn.q_proj.lora_a.weight`` -> ``base_model.model.model.layers.0.self_attn.
    q_proj.lora_A.weight``, DoRA's ``...q_proj.magnitude`` -> ``...q_proj.lora_magnitude_vector``),
    or None for a name it does not map."""
    m = re.fullmatch(r"(.+)\.(lora_a\.weight|lora_b\.weight|magnitude)", tune)
    base = renamed(f"{m.group(1)}.weight", TUNE_TO_HF) if m else None
    if m is None or base is None:
        return None
    part = _PEFT_PARTS[m.group(2)]
    return f"base_model.model.{base.removesuffix('.weight')}.{part}"


#: torchtune's adapter parameters -> peft's (``convert_weights._TO_PEFT_KEYS``)
_PEFT_PARTS = {
    "lora_a.weight": "lora_A.weight",
    "lora_b.weight": "lora_B.weight",
    "magnitude": "lora_magnitude_vector",
}


def _adapter_order(
    state: dict, groups: list, adapter: dict, order: Sequence[str] | None, recipe: str, pt: str
) -> tuple[dict[Any, str], str]:
    """({optimizer key: torchtune name}, how): by name as saved (the distributed recipe), by
    ``order``, or for one group over ``model.parameters()`` (the single-device recipe: only the
    adapter has state) its indices ascending as ``adapter_model.pt``'s tensors (saved from
    ``model.state_dict()``, that same order)."""
    keys = list(state)
    if order is not None or (keys and all(isinstance(k, str) for k in keys)):
        how = "parameter_order" if order is not None else "keyed by torchtune's names"
        return _optimizer_names(state, groups, order, recipe, "of a LoRA recipe"), how
    if not (keys and all(isinstance(k, int) for k in keys)) or len(groups) != 1:
        raise SourceError(
            f"{recipe}: LoRA optimizer state in {len(groups)} groups, keyed by "
            f"{_names(keys)}: expected one group keyed by index; give parameter_order=[the "
            f"model's parameters' torchtune names, as the optimizer numbers them]"
        )
    if len(keys) != len(adapter):
        raise SourceError(
            f"{recipe}: {len(keys)} parameters have optimizer state, {pt} holds "
            f"{len(adapter)} adapter tensors: expected one per adapter tensor (only the "
            f"adapter trains); give parameter_order="
        )
    how = (
        f"the optimizer's indices with state, ascending, as {pt}'s tensors (torchtune's "
        f"model.parameters() order: the frozen base has no state)"
    )
    return dict(zip(sorted(keys), adapter)), how


def _adapter_modules(adapter: dict[str, np.ndarray], pt: str) -> None:
    """Each adapted module's tensors are LoRA's ``lora_a`` [r, in] and ``lora_b`` [out, r], with
    DoRA's ``magnitude`` [out] (one per output row: ``DoRALinear``) or without; anything else
    under those names is refused, naming it (it would be permuted and continued as one)."""
    modules: dict[str, dict[str, tuple[int, ...]]] = {}
    for tune, value in adapter.items():  # each one peft_name maps: <module>.<part>[.weight]
        module, _, part = tune.removesuffix(".weight").rpartition(".")
        modules.setdefault(module, {})[part] = tuple(value.shape)
    for module, got in modules.items():
        a, b = got.get("lora_a", ()), got.get("lora_b", ())
        lora = len(a) == len(b) == 2 and a[0] == b[1]
        if not lora or got.get("magnitude", b[:1]) != b[:1]:
            said = ", ".join(f"{k} {list(v)}" for k, v in got.items())
            raise SourceError(
                f"{pt}: {module}'s adapter tensors are {said}: expected lora_a [r, in] and "
                f"lora_b [out, r] (LoRALinear), with DoRA's magnitude [out] (DoRALinear) or "
                f"without: not imported"
            )


def _lora_adapter(
    storage: Storage, epoch: str, opened: tuple[dict, list, Any], heads: tuple[int, int, int]
) -> _Mapped:
    """A LoRA recipe's adapter (``adapter_model.pt``) in peft's names and q/k rows; the merged
    weights and peft's copies of the adapter skipped."""
    (state, groups, order), recipe = opened, storage.join(RECIPE_STATE)
    latest = storage.folder(epoch)
    pt = f"{epoch}/{ADAPTER_PT}"
    adapter = _load(storage, pt)
    tensors = isinstance(adapter, dict) and all(isinstance(v, np.ndarray) for v in adapter.values())
    if not (tensors and adapter):
        raise SourceError(f"{pt}: expected torchtune's adapter state dict (name -> tensor)")
    unmapped = [n for n in adapter if not isinstance(n, str) or peft_name(n) is None]
    if unmapped:
        raise SourceError(
            f"{pt}: adapter tensors {_names(unmapped)} have no peft name (lora_a / lora_b and "
            f"DoRA's magnitude of the tune_to_hf table's modules are mapped): not imported. "
            f"Convert with weights_only=True to import {epoch}/'s merged weights"
        )
    _adapter_modules(adapter, pt)
    to_name, how = _adapter_order(state, groups, adapter, order, recipe, pt)
    q_heads, kv_heads, head_dim = heads
    params: dict[str, TensorRef] = {}
    for tune, value in adapter.items():
        rows = _permuted_heads(tune, q_heads, kv_heads)
        where = {"format": "torch_files", "file": pt, "torchtune_name": tune}
        params[str(peft_name(tune))] = _row_ref(f"{pt}:{tune}", value, rows, head_dim, where)
    merged = sorted(
        f"{epoch}/{n}"
        for n in listed(latest) or ()
        if n.endswith(".safetensors") and n not in ADAPTER_FILES
    )
    dora = [n for n in adapter if n.endswith(".magnitude")]
    skipped = dict.fromkeys(
        merged,
        f"the merged weights (the base + alpha/r lora_b @ lora_a{', DoRA-scaled' if dora else ''}"
        f", rounded): not the base the adapter trains over; weights_only=True imports them",
    )
    peft_copies = [f"{epoch}/{n}" for n in adapter_files(latest) if n != ADAPTER_PT]
    skipped.update(dict.fromkeys(peft_copies, f"peft's copy of {pt} (imported in peft's names)"))
    lora = adapter_record(latest)
    base = lora.get("base_model_name_or_path")
    note = (
        f"torchtune LoRA recipe: the adapter ({len(params)} tensors of {pt}, in peft's names "
        f"and rows as {epoch}/adapter_model.safetensors) and its moments imported; the base "
        f"model it trains over is not in this folder ({epoch}/'s weights are merged), "
        + (
            f"{ADAPTER_CONFIG_FILE} names it {base!r}"
            if isinstance(base, str) and base
            else f"{ADAPTER_CONFIG_FILE} names none"
        )
        + ": import it beside, frozen"
    )
    dora_note = (
        f"DoRA (use_dora; {ADAPTER_CONFIG_FILE} says peft_type LORA without it): the "
        f"{len(dora)} magnitudes imported as peft's lora_magnitude_vector, the q/k ones "
        f"permuted as the rows they scale (torchtune's adapter_model.safetensors leaves them "
        f"unpermuted, which peft's DoRA forward does not match)"
    )
    source = {
        "files": [ADAPTER_PT],
        "parameter_order": how,
        "lora": lora | ({"use_dora": True} if dora else {}),
        "notes": [note, dora_note] if dora else [note],
    }
    return _Mapped(params, to_name, skipped, source)
