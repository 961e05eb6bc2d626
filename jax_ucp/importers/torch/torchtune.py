"""A torchtune output folder: ``epoch_N/`` (Hugging Face safetensors, written by torchtune's
``FullModelHFCheckpointer``) and, for an intermediate checkpoint, ``recipe_state/recipe_state.pt``
(the optimizer, seed, epochs).

The latest epoch's weights are imported as Hugging Face safetensors (names and row order are
Hugging Face's: the checkpointer converts back on save). The optimizer in ``recipe_state.pt`` is
over torchtune's own model (keyed by index in the single-device recipes, by torchtune's names,
``tok_embeddings``, ``attn.q_proj``, ..., in the distributed ones; q/k in its RoPE row order,
which the checkpointer permuted for the weights but not for the moments); mapping it is not
done yet, so it is refused saying what the file holds, and with ``weights_only`` listed in
``source.skipped``. Earlier epochs' folders are listed there too.
"""

from __future__ import annotations

import dataclasses
import os
import re
from typing import Any

from jax_ucp.errors import SourceError
from jax_ucp.importers.plan import WHOLE, ImportPlan, Share, skip
from jax_ucp.importers.safetensors_weights import plan_safetensors
from jax_ucp.torchfiles import unpickler

__all__ = ["RECIPE_STATE", "is_torchtune", "epoch_folders", "plan_torchtune"]

RECIPE_STATE = os.path.join("recipe_state", "recipe_state.pt")
OPTIMIZER_KEY = "optimizer"  # torchtune's training.OPT_KEY
_EPOCH = re.compile(r"epoch_(\d+)")


def epoch_folders(src: str) -> list[str]:
    """``epoch_N`` folders holding safetensors, by N."""
    found = []
    for name in os.listdir(src):
        m = _EPOCH.fullmatch(name)
        path = os.path.join(src, name)
        if m and os.path.isdir(path) and not os.path.islink(path):
            if any(n.endswith(".safetensors") for n in os.listdir(path)):
                found.append((int(m.group(1)), name))
    return [name for _, name in sorted(found)]


def _names(keys: list, count: int = 3) -> str:
    shown = ", ".join(unpickler.short_repr(k, 60) for k in keys[:count])
    return shown + (", ..." if len(keys) > count else "")


def recipe_optimizer(path: str) -> str:
    """What ``recipe_state.pt`` holds of the optimizer, said as found: a state dict keyed by
    index (the single-device recipes), by torchtune's parameter names (the distributed
    recipes' full optimizer state dict), one optimizer per parameter (optimizer in backward),
    or none; the file read through the allow-listed unpickler (never run)."""
    try:
        recipe = unpickler.load_torch_file(path)
    except unpickler.TorchFileError as e:
        return f"not read ({str(e)[:200]})"
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
        if keys and all(isinstance(k, str) for k in keys):
            return (
                f"keyed by torchtune's parameter names ({len(keys)} parameters {where}, e.g. "
                f"{_names(keys)})"
            )
        return f"keyed by {_names(keys)} ({len(keys)} parameters {where})"
    per = [k for k, v in optimizer.items() if isinstance(v, dict) and "state" in v]
    if per and len(per) == len(optimizer):
        return (
            f"one optimizer per parameter (optimizer in backward), keyed by torchtune's "
            f"parameter names ({len(per)} parameters, e.g. {_names(per)})"
        )
    return f"a dict with keys {_names(list(optimizer), 8)}, not a torch optimizer state dict"


def is_torchtune(src: os.PathLike | str) -> bool:
    """torchtune's layout: ``epoch_N/`` safetensors folders, with or without recipe state."""
    src = os.fspath(src)
    return os.path.isdir(src) and bool(epoch_folders(src))


def plan_torchtune(
    src: os.PathLike | str,
    *,
    spec: Any = None,
    weights_only: bool = False,
    share: Share = WHOLE,
    parameter_order: Any = None,
) -> ImportPlan:
    """The latest epoch's weights; the recipe's optimizer state refused unless weights_only.

    Args:
        src: the torchtune output folder (``epoch_N/``, ``recipe_state/``).
        spec: refused when given, as by the safetensors import of the latest epoch: the import
            keeps Hugging Face's names (a spec maps them at restore).
        weights_only: import the weights alone (else the recipe's optimizer is refused).
        share: this process's part of a distributed import.
        parameter_order: refused when given: the recipe's optimizer state is not imported, so
            there is no index-keyed optimizer to order.
    """
    src = os.fspath(src)
    if parameter_order is not None:
        raise SourceError(
            f"{src}: parameter_order does not apply to a torchtune folder (its optimizer state "
            f"is not imported yet)"
        )
    epochs = epoch_folders(src)
    if not epochs:
        raise SourceError(f"{src}: no torchtune epoch_N/ folder holding safetensors")
    recipe = os.path.join(src, RECIPE_STATE)
    has_recipe = os.path.lexists(recipe)
    if has_recipe and not weights_only:
        raise SourceError(
            f"{recipe}: torchtune's optimizer state, {recipe_optimizer(recipe)}, is over "
            f"torchtune's own model (its parameter names, q/k rows in its RoPE order, which the "
            f"checkpointer converted for the weights in {epochs[-1]}/ but not for the "
            f"moments); importing it is not supported yet. Convert with weights_only=True to "
            f"import {epochs[-1]}/'s weights"
        )
    latest = os.path.join(src, epochs[-1])
    plan = plan_safetensors(latest, spec=spec, share=share)
    source = dict(plan.source)
    source.update(framework="torchtune", path=os.path.abspath(src), epoch=epochs[-1])
    units = [f"{e}/" for e in epochs[:-1]]
    skip(source, units, f"an earlier epoch's weights ({epochs[-1]}/ imported)")
    if has_recipe:
        units.append(RECIPE_STATE)
        skip(source, [RECIPE_STATE], "weights_only: torchtune's recipe state (optimizer, seed)")
    return dataclasses.replace(
        plan, source=source, source_tensors=[*(plan.source_tensors or ()), *units]
    )
