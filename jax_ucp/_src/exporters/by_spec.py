"""What an export by spec runs and writes beside the tensors: the spec a user imported with run
backwards (``language.inverse``) with the head settings of the config or of what the source
recorded, and the ``config.json``: the one given (a dict, a file, or a ``TransformerLM``'s
``LMConfig``), else the one the import recorded, always of a family the spec maps, so names of
one family never go out under another's config."""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from typing import Any

from jax_ucp._src import format as fmt
from jax_ucp._src.errors import RequestError


def load(spec: Any, manifest: fmt.Manifest, config: Any, *, state_dict: bool = False) -> Any:
    """``spec`` (a name, a file or a ``Spec``; None: none) ready to export: completed with the
    heads of ``config`` (a config.json, its path or an ``LMConfig``; else of what
    ``manifest.source`` recorded, for a name) and, an import's spec, run backwards.
    ``state_dict``: a spec with an ``hf_names`` setting writes the names transformers' model
    holds (its experts fused), not its files' (a torch state dict is loaded as the model has it)."""
    if spec is None:
        return None
    from jax_ucp._src import language
    from jax_ucp._src.language.inverse import export_spec
    from jax_ucp._src.language.recorded import spec_with_recorded_settings
    from jax_ucp._src.language.settings import hf_head_settings

    heads: dict[str, int] = {}
    if hasattr(config, "head_settings"):  # an LMConfig
        heads = dict(config.head_settings)
    elif config is not None:
        config = read_config(config)
        if "num_attention_heads" in config or "n_head" in config:  # n_head: GPT-2's
            heads = hf_head_settings(config, "config")
    if heads and isinstance(spec, (str, os.PathLike)):
        spec = language.load_spec(spec, **heads)
    spec = language.load_spec(spec_with_recorded_settings(spec, manifest.source))
    if state_dict and "hf_names" in spec.settings:
        spec = spec.with_settings(hf_names="state_dict")
    return export_spec(spec)


def config_for(spec: Any, given: Any, recorded: Any) -> dict[str, Any] | None:
    """The ``config.json`` to write: ``given`` (a dict, a file, an ``LMConfig``), else the one
    the checkpoint's ``source`` record holds (None without), checked against ``spec``'s
    families; of a multimodal model's text model (``source.multimodal_config``) never the
    multimodal config."""
    if given is None:
        config = recorded_config(recorded)
    elif hasattr(given, "head_settings"):  # an LMConfig: its model imports JAX already
        from jax_ucp._src.models.hf_config import hf_config

        config = hf_config(given, _model_types(spec) or ("llama",))
    else:
        config = read_config(given)
    if config is not None and spec is not None:
        check_family(config, spec)
    multimodal = recorded.get("multimodal_config") if isinstance(recorded, Mapping) else None
    if (
        config
        and isinstance(multimodal, Mapping)
        and config.get("model_type")
        in (
            multimodal.get("model_type"),
            None,
        )
    ):
        raise RequestError(
            f"config.json: model_type {config.get('model_type')!r}: the checkpoint holds the "
            f"text model of that multimodal model (its towers were not imported), named as "
            f"the text model names it; exported with the text model's config.json (the one "
            f"recorded, written by default), never under the multimodal one"
        )
    return config


def recorded_config(source: Any) -> dict[str, Any] | None:
    """The ``config.json`` an import recorded: a safetensors folder's (``source.config``), a
    Trainer's or verl's model fields (``source.trainer.model_config``); None without."""
    source = source if isinstance(source, Mapping) else {}
    trainer = source.get("trainer")
    for config in (
        source.get("config"),
        isinstance(trainer, Mapping) and trainer.get("model_config"),
    ):
        if isinstance(config, Mapping) and "model_type" in config:
            return dict(config)
    return None


def _model_types(spec: Any) -> tuple[str, ...]:
    """The ``model_type`` values ``spec`` maps (an export spec: those of the spec it inverts)."""
    from jax_ucp._src import language

    if spec.model_types or not spec.inverts:
        return tuple(spec.model_types)
    return tuple(language.load_spec(spec.inverts).model_types)


def _family(name: str) -> str:
    """``Phi3ForCausalLM`` / ``phi3`` -> ``phi3``: a class or model_type, compared loosely."""
    name = re.sub(r"(ForCausalLM|LMHeadModel)$", "", str(name)).lower().replace("_", "")
    return name.removesuffix("text")


def check_family(config: Mapping[str, Any], spec: Any) -> None:
    """A ``RequestError`` when ``config`` (its ``model_type`` or ``architectures``) is of a family
    ``spec`` does not map: its names under that config would load as random weights."""
    wanted = _model_types(spec)
    if not wanted:  # a user's spec says nothing of families
        return
    shown = spec.inverts or spec.name
    model_type = config.get("model_type")
    archs = config.get("architectures") or []
    archs = archs if isinstance(archs, list) else [archs]
    if model_type not in wanted:
        raise RequestError(
            f"config.json: model_type {model_type!r} (architectures {archs}) is not a family "
            f"spec {shown!r} writes ({', '.join(wanted)}); export with the spec of "
            f"{model_type!r} or give its own config"
        )
    wrong = [a for a in archs if _family(a) != _family(model_type)]
    if wrong:
        raise RequestError(
            f"config.json: architectures {wrong} are not of model_type {model_type!r}, the "
            f"family spec {shown!r} writes"
        )


def read_config(config: Mapping[str, Any] | str | os.PathLike) -> dict[str, Any]:
    """A ``config.json`` (dict or path), read within a size bound, checked to be an object."""
    if isinstance(config, Mapping):
        return dict(config)
    try:
        raw = fmt.files.read_regular(os.fspath(config), 16 << 20)
        loaded = fmt.files.strict_loads(raw)
    except (OSError, ValueError, RecursionError) as e:
        raise RequestError(f"config {config}: not a readable JSON file ({e})") from None
    if not isinstance(loaded, dict):
        raise RequestError(f"config {config}: a config.json holds a JSON object")
    return loaded
