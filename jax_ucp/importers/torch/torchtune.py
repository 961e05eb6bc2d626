"""A torchtune output folder: ``epoch_N/`` (Hugging Face safetensors, written by torchtune's
``FullModelHFCheckpointer``) and, for an intermediate checkpoint, ``recipe_state/recipe_state.pt``
(the optimizer, seed, epochs).

The latest epoch's weights are imported as Hugging Face safetensors (names and row order are
Hugging Face's: the checkpointer converts back on save). The optimizer in ``recipe_state.pt`` is
keyed by index over torchtune's own model (its names, ``tok_embeddings``, ``attn.q_proj``, ...,
and its RoPE row order for q/k, which the checkpointer permuted for the weights but not for the
moments); mapping it is not done yet, so it is refused naming why, and with ``weights_only``
listed in ``source.skipped``. Earlier epochs' folders are listed there too.
"""

from __future__ import annotations

import dataclasses
import os
import re
from typing import Any

from jax_ucp.errors import SourceError
from jax_ucp.importers.plan import WHOLE, ImportPlan, Share, skip
from jax_ucp.importers.safetensors_weights import plan_safetensors

__all__ = ["RECIPE_STATE", "is_torchtune", "epoch_folders", "plan_torchtune"]

RECIPE_STATE = os.path.join("recipe_state", "recipe_state.pt")
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
    """The latest epoch's weights; the recipe's optimizer state refused unless weights_only."""
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
            f"{recipe}: torchtune's optimizer state is keyed over torchtune's own model (by "
            f"index in its single-device recipes, by torchtune's parameter names in its "
            f"distributed ones; q/k rows in its RoPE order, which the "
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
