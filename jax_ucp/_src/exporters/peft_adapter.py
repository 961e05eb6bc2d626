"""A peft adapter folder (``SafetensorsExport(adapter=True)``): ``adapter_model.safetensors`` in
peft's names, as the import kept them, and ``adapter_config.json`` exactly as the import recorded
it (``source.lora``), so ``peft.PeftModel.from_pretrained(base, folder)`` loads the adapter.
Nothing peft would otherwise default is filled in: a record without it is refused."""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NoReturn

from jax_ucp._src.errors import RequestError
from jax_ucp._src.exporters import peft_match
from jax_ucp._src.exporters.by_spec import read_config
from jax_ucp._src.exporters.source import Tensor

WEIGHTS_FILE = "adapter_model.safetensors"
CONFIG_FILE = "adapter_config.json"
#: the fields peft would otherwise default (r=8, lora_alpha=8, the model type's usual targets):
#: a guess the adapter was not trained with
NEEDED = ("peft_type", "r", "lora_alpha", "target_modules")
PREFIX = "base_model.model."  # each tensor of peft's saved adapter
#: what this export writes: LoRA, and DoRA as peft saves it (LORA with use_dora)
PEFT_TYPES = ("LORA",)
#: peft's prompt-learning adapters this export writes: one tensor, the virtual tokens' embedding
PROMPT_TYPES = ("PREFIX_TUNING", "PROMPT_TUNING")
#: a module's tensors as peft saves them (its adapter name taken out): the role of each
ROLES = {
    ".lora_A.weight": "A",
    ".lora_B.weight": "B",
    ".lora_embedding_A": "A",
    ".lora_embedding_B": "B",
    ".lora_magnitude_vector": "magnitude",
}
#: fields peft reads that change neither which modules are adapted nor their tensors' names and
#: shapes, written as recorded; any other field is checked below or must be off (None, False,
#: empty): layers_to_transform, lora_bias, trainable_token_indices... add tensors or targets
FREE = frozenset(
    ("auto_mapping", "base_model_name_or_path", "revision", "task_type", "inference_mode",
     "fan_in_fan_out", "init_lora_weights", "lora_dropout", "peft_version", "megatron_core",
     "loftq_config", "eva_config", "corda_config", "qalora_group_size", "ensure_weight_tying",
     "layers_pattern")
)  # fmt: skip
CHECKED = frozenset(
    (*NEEDED, "use_dora", "use_rslora", "modules_to_save", "rank_pattern", "alpha_pattern",
     "exclude_modules", "bias")
)  # fmt: skip

#: refuses naming the field, the expected value, what was found and the tensor
Refuse = Callable[..., NoReturn]


def adapter_config(tensors: Sequence[Tensor], given: Any, recorded: Any) -> dict[str, Any]:
    """The ``adapter_config.json`` to write: ``given`` (a dict or file), else the import's
    record, checked against the tensors as ``PeftModel.from_pretrained`` would load them (see
    :func:`check`); refused naming what peft needs and it lacks, or what disagrees."""
    lora = recorded.get("lora") if isinstance(recorded, Mapping) else None
    where = "config=" if given is not None else "the checkpoint's ucp.json source.lora"
    if given is None and lora is not None and not isinstance(lora, Mapping):
        raise RequestError(f"adapter export: {where} is {type(lora).__name__}, not an object")
    config = read_config(given) if given is not None else dict(lora) if lora else {}
    if config.get("peft_type") in PROMPT_TYPES:
        _prompt(config, tensors, where)
        return config
    missing = [k for k in NEEDED if config.get(k) is None]
    if missing:
        raise RequestError(
            f"adapter export: {where} has no {', '.join(missing)} (peft needs each; an import "
            f"from a peft / torchtune adapter records its {CONFIG_FILE}): pass config= the "
            f"adapter's {CONFIG_FILE}"
        )
    stray = [t.name for t in tensors if not t.name.startswith(PREFIX)]
    if stray:
        raise RequestError(
            f"adapter export: tensor {stray[0]!r} is not named as peft saves an adapter's "
            f"({PREFIX}...); select= the adapter's tensors"
        )
    check(config, tensors, where)
    return config


def without_base(tensors: Sequence[Tensor], recorded: Any) -> list[Tensor]:
    """The adapter's tensors: an import with ``base_model=`` (``source.base_model``) also holds
    the base model's weights, its parameters without optimizer state, which peft does not load
    from an adapter folder."""
    record = recorded if isinstance(recorded, Mapping) else {}
    optimizer = record.get("optimizer")
    frozen = optimizer.get("no_state") if isinstance(optimizer, Mapping) else None
    if not record.get("base_model") or not isinstance(frozen, list):
        return list(tensors)
    return [t for t in tensors if t.name not in set(frozen)]


def _number(x: Any) -> bool:
    return type(x) in (int, float) and math.isfinite(x)


def _names(x: Any) -> bool:
    return isinstance(x, list) and all(isinstance(s, str) for s in x)


def _fields(config: Mapping[str, Any], refuse: Refuse) -> None:
    """Each field of the types peft gives it, the writable ones only."""
    if config["peft_type"] not in PEFT_TYPES:
        refuse("peft_type", f"one of {list(PEFT_TYPES)} (DoRA: LORA with use_dora)")
    if type(config["r"]) is not int or config["r"] <= 0:
        refuse("r", "a positive integer")
    if not _number(config["lora_alpha"]):
        refuse("lora_alpha", "a finite number")
    if not (isinstance(config["target_modules"], str) or _names(config["target_modules"])):
        refuse("target_modules", "a list of module names or a regex string")
    for key in ("use_dora", "use_rslora"):
        if key in config and type(config[key]) is not bool:
            refuse(key, "true or false")
    _patterns(config, refuse)


def _patterns(config: Mapping[str, Any], refuse: Refuse) -> None:
    """The fields naming modules besides ``target_modules``, and every field else off."""
    saved = config.get("modules_to_save")
    if saved is not None and not (
        _names(saved) and all(re.fullmatch(r"[\w.]+", s, re.ASCII) for s in saved)
    ):
        refuse("modules_to_save", "null or a list of module names")
    for key, ok in (
        ("rank_pattern", lambda v: type(v) is int and v > 0),
        ("alpha_pattern", _number),
    ):
        pattern = config.get(key, {})
        if not isinstance(pattern, Mapping) or not all(
            isinstance(k, str) and ok(v) for k, v in pattern.items()
        ):
            refuse(
                key, "an object of module patterns to " + ("ranks" if key[0] == "r" else "numbers")
            )
    exclude = config.get("exclude_modules")
    if exclude is not None and not (isinstance(exclude, str) or _names(exclude)):
        refuse("exclude_modules", "null, a list of module names or a regex string")
    if config.get("bias", "none") != "none":
        refuse("bias", "'none' (peft then saves the base model's biases too)")
    for key, value in config.items():
        if key not in FREE and key not in CHECKED and value not in (None, False, {}, []):
            refuse(key, "unset (null, false or empty): it adds tensors or targets not checked")


def check(config: Mapping[str, Any], tensors: Sequence[Tensor], where: str) -> None:
    """``config`` against the tensors as peft loads them: the fields' types; every tensor a
    target module's ``lora_A`` of ``r`` rows (``rank_pattern``'s rank for that module) and
    ``lora_B`` of ``r`` columns, with a DoRA magnitude (one per ``lora_B`` row) iff
    ``use_dora``, or of a ``modules_to_save`` module; each name it lists used. peft loads
    state dicts non-strictly: a tensor its config does not target is dropped without an error."""

    def refuse(key: str, expected: str, found: Any = None, tensor: str | None = None) -> NoReturn:
        value = config.get(key) if found is None else found
        at = f" tensor {tensor!r}:" if tensor else ""
        raise RequestError(
            f"adapter export: {where} {key}:{at} expected {expected}, found {value!r}; nothing "
            f"was written (pass config= the adapter's {CONFIG_FILE} it was trained with)"
        )

    _fields(config, refuse)
    modules: dict[str, dict[str, Tensor]] = {}
    others: dict[str, str] = {}  # a modules_to_save module's tensor -> its module
    for t in tensors:
        name = t.name[len(PREFIX) :]
        suffix = next((s for s in ROLES if name.endswith(s)), None)
        if suffix is None:
            others[t.name] = name.rpartition(".")[0]
            continue
        roles = modules.setdefault(name[: -len(suffix)], {})
        if ROLES[suffix] in roles:
            refuse("target_modules", f"one {suffix} per module", "two", t.name)
        roles[ROLES[suffix]] = t
    targets, exclude = config["target_modules"], config.get("exclude_modules")
    for key, patterns in (
        ("target_modules", [targets] if isinstance(targets, str) else []),
        ("exclude_modules", [exclude] if isinstance(exclude, str) else []),
        ("rank_pattern", list(config.get("rank_pattern", {}))),
        ("alpha_pattern", list(config.get("alpha_pattern", {}))),
    ):
        peft_match.checked(patterns, sorted(modules), key, where)
    saved = config.get("modules_to_save") or []
    for tensor, module in others.items():
        if not any(module.endswith(m) for m in saved):
            refuse("modules_to_save", f"a module of {tensor!r} (it is no LoRA tensor)", saved)
    for module, roles in sorted(modules.items()):
        _module(config, module, roles, refuse)
    for key, listed, pool, sep in (
        ("target_modules", targets, sorted(modules), "."),
        ("modules_to_save", saved, sorted(others.values()), ""),
    ):
        for n in [] if isinstance(listed, str) else listed:
            if not any(x == n or x.endswith(sep + n) for x in pool):
                refuse(key, f"each name a module of the tensors ({n!r} is none)", listed)


def _module(
    config: Mapping[str, Any], module: str, roles: dict[str, Tensor], refuse: Refuse
) -> None:
    """One adapted module: targeted as peft selects, its tensors of its rank, DoRA's alike."""
    first = next(iter(roles.values())).name
    targets, exclude = config["target_modules"], config.get("exclude_modules")
    saved, ranks = config.get("modules_to_save") or [], dict(config.get("rank_pattern", {}))
    if not peft_match.selects(targets, module):
        refuse("target_modules", f"a name selecting module {module!r}", tensor=first)
    if exclude and peft_match.selects(exclude, module):
        refuse("exclude_modules", f"no name selecting module {module!r}", tensor=first)
    if peft_match.saved_by(saved, module):
        refuse("modules_to_save", f"no name of module {module!r} (peft adapts none)", saved, first)
    key = peft_match.rank_key(list(ranks), module)
    r, field = (ranks[key], "rank_pattern") if key is not None else (config["r"], "r")
    a, b, m = roles.get("A"), roles.get("B"), roles.get("magnitude")
    if a is None or b is None:
        return refuse("target_modules", f"{module!r}'s lora_A and lora_B", sorted(roles), first)
    if len(a.shape) < 2 or a.shape[0] != r:
        refuse(field, f"lora_A of {r} rows ({field}={r})", list(a.shape), a.name)
    if len(b.shape) < 2 or b.shape[1] != r:
        refuse(field, f"lora_B of {r} columns ({field}={r})", list(b.shape), b.name)
    dora = config.get("use_dora", False)
    if (m is not None) != dora:
        refuse("use_dora", f"a DoRA magnitude of {module!r} iff use_dora", dora, first)
    if m is not None and tuple(m.shape) != (b.shape[0],):
        refuse("use_dora", f"a magnitude of shape {[b.shape[0]]}", list(m.shape), m.name)


def _prompt(config: Mapping[str, Any], tensors: Sequence[Tensor], where: str) -> None:
    """A prefix / prompt tuning adapter: its one tensor ``prompt_embeddings`` of the shape peft
    builds from the config (prefix: ``[num_virtual_tokens, num_layers * 2 * token_dim]``; prompt:
    ``[num_virtual_tokens * num_transformer_submodules, token_dim]``), no projection (peft would
    run an untrained MLP over it)."""

    def refuse(key: str, expected: str, found: Any) -> NoReturn:
        raise RequestError(
            f"adapter export: {where} {key}: expected {expected}, found {found!r}; nothing "
            f"was written (pass config= the adapter's {CONFIG_FILE} it was trained with)"
        )

    prefix = config["peft_type"] == "PREFIX_TUNING"
    keys = ("num_virtual_tokens", "token_dim", *(("num_layers",) if prefix else ()))
    sizes: dict[str, int] = {}
    for key in (*keys, "num_transformer_submodules"):
        value = config.get(key, 1 if key == "num_transformer_submodules" else None)
        if type(value) is not int or value <= 0:
            refuse(key, "a positive integer", value)
        sizes[key] = value
    if config.get("prefix_projection"):
        refuse("prefix_projection", "false (the projection's MLP is not in the tensors)", True)
    tokens, dim = sizes["num_virtual_tokens"], sizes["token_dim"]
    shape = (
        [tokens, sizes["num_layers"] * 2 * dim]
        if prefix
        else [tokens * sizes["num_transformer_submodules"], dim]
    )
    found = {t.name: list(t.shape) for t in tensors}
    if found != {"prompt_embeddings": shape}:
        refuse("peft_type", f"one tensor prompt_embeddings {shape} (select= it)", found)
