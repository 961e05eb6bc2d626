"""A spec named by the caller completed with the model settings its source recorded (a shipped
spec's q/k/v ops need the heads): one rule for every caller, so a restore and a continuation of a
source read the same model."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from jax_ucp._src.errors import LanguageError
from jax_ucp._src.format import files
from jax_ucp._src.language.settings import hf_head_settings, normalize
from jax_ucp._src.language.toml_io import load_spec

#: Megatron's run arguments (``source.settings``) that are head settings, canonical names
_MEGATRON_HEADS = ("num_attention_heads", "num_query_groups", "head_dim")


def recorded_settings(source: Mapping[str, Any] | None) -> tuple[dict[str, int], str]:
    """The head settings ``source`` records (a Trainer's, verl's or a safetensors folder's
    ``config.json``, else Megatron's args) and what recorded them; ``({}, "")`` without; a bad value is a ``LanguageError``."""
    source = source if isinstance(source, Mapping) else {}
    trainer = source.get("trainer")
    model = trainer.get("model_config") if isinstance(trainer, Mapping) else None
    for config, field in ((model, "trainer.model_config"), (source.get("config"), "config")):
        if isinstance(config, Mapping) and ("num_attention_heads" in config or "n_head" in config):
            where = f"the config.json the source recorded (source.{field})"
            return hf_head_settings(config, where), "the recorded config.json"
    args = source.get("settings")
    if not isinstance(args, Mapping):
        return {}, ""
    args = normalize(args)
    heads = args.get("num_attention_heads")
    if heads is None:
        return {}, ""
    out: dict[str, int] = {}
    for name in _MEGATRON_HEADS:
        value = args.get(name)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise LanguageError(
                f"source.settings (Megatron's recorded run arguments): {name} = {value!r}; "
                f"expected a positive integer"
            )
        out[name] = value
    if args.get("group_query_attention") is False:  # Megatron keeps its default groups unused
        out["num_query_groups"] = out["num_attention_heads"]
    return out, "Megatron's recorded run arguments"


def spec_with_recorded_settings(
    spec: Any, source: Mapping[str, Any] | None, notes: list[str] | None = None
) -> Any:
    """``spec`` (a name or file) with the head settings ``source`` recorded, said in ``notes``."""
    if not isinstance(spec, (str, os.PathLike)):
        return spec
    loaded = load_spec(spec)
    settings, origin = recorded_settings(source)
    missing = {k: v for k, v in settings.items() if k not in loaded.settings}
    if not missing:
        return loaded
    if notes is not None:
        notes.append(f"spec {os.fspath(spec)!r} with {origin}'s settings {missing}")
    return loaded.with_settings(**missing)


def layout_assumed(plans: Mapping[Any, Any], spec: Any, source: Any) -> list[str]:
    """What ``plans`` (``compile_restore_plan``'s) read in a rule's ``layout`` that no shape
    shows (a square fused tensor) and no ``config.json`` ``source`` records confirms (one of the
    spec's model types, transformers 5 or later: that model's layout): a sentence, or none."""
    assumed = [p.assumed for p in plans.values() if p.assumed]
    source = source if isinstance(source, Mapping) else {}
    trainer = source.get("trainer") if isinstance(source.get("trainer"), Mapping) else {}
    config = next((c for c in (trainer.get("model_config"), source.get("config"))
                   if isinstance(c, Mapping)), {})  # fmt: skip
    major = files.name_number(str(config.get("transformers_version") or "").split(".")[0])
    types = getattr(spec, "model_types", ())
    if not assumed or (major is not None and major >= 5 and config.get("model_type") in types):
        return []
    more = f" (and {len(assumed) - 2} more alike)" if len(assumed) > 2 else ""
    return [
        f"{'; '.join(assumed[:2])}{more}: no file records which layout its writer used (a "
        f"config.json naming the model type and a transformers version would): check that it "
        f"holds it so, or the values are transposed"
    ]
