"""A peft adapter folder (``SafetensorsExport(adapter=True)``): ``adapter_model.safetensors`` in
peft's names, as the import kept them, and ``adapter_config.json`` exactly as the import recorded
it (``source.lora``), so ``peft.PeftModel.from_pretrained(base, folder)`` loads the adapter.
Nothing peft would otherwise default is filled in: a record without it is refused."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from jax_ucp._src.errors import RequestError
from jax_ucp._src.exporters.by_spec import read_config

WEIGHTS_FILE = "adapter_model.safetensors"
CONFIG_FILE = "adapter_config.json"
#: the fields peft would otherwise default (r=8, lora_alpha=8, the model type's usual targets):
#: a guess the adapter was not trained with
NEEDED = ("peft_type", "r", "lora_alpha", "target_modules")
PREFIX = "base_model.model."  # each tensor of peft's saved adapter


def adapter_config(names: Sequence[str], given: Any, recorded: Any) -> dict[str, Any]:
    """The ``adapter_config.json`` to write: ``given`` (a dict or file), else the import's
    record; refused naming what peft needs and it lacks, or a tensor not of an adapter."""
    lora = recorded.get("lora") if isinstance(recorded, Mapping) else None
    where = "config=" if given is not None else "the checkpoint's source.lora"
    config = read_config(given) if given is not None else dict(lora) if lora else {}
    missing = [k for k in NEEDED if config.get(k) is None]
    if missing:
        raise RequestError(
            f"adapter export: {where} has no {', '.join(missing)} (peft needs each; an import "
            f"from a peft / torchtune adapter records its {CONFIG_FILE}): pass config= the "
            f"adapter's {CONFIG_FILE}"
        )
    stray = [n for n in names if not n.startswith(PREFIX)]
    if stray:
        raise RequestError(
            f"adapter export: tensor {stray[0]!r} is not named as peft saves an adapter's "
            f"({PREFIX}...); select= the adapter's tensors"
        )
    dora = any(n.endswith(".lora_magnitude_vector") for n in names)
    if dora != (config.get("use_dora") is True):
        raise RequestError(
            f"adapter export: {where} has use_dora={config.get('use_dora')!r} but the tensors "
            f"{'hold' if dora else 'hold no'} DoRA magnitudes (lora_magnitude_vector)"
        )
    return config
