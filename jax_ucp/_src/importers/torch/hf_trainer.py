"""A Hugging Face Trainer ``checkpoint-N/``: which parameter each index of ``optimizer.pt`` is.

``optimizer.pt`` numbers parameters group after group, and the Trainer makes two groups
(weight-decayed, then the rest: biases and norms) from ``model.named_parameters()`` without
keeping their names. The order is rebuilt the way the Trainer built it: the architecture named
by ``config.json`` is instantiated on torch's meta device (no weights, no code from the folder:
only classes transformers itself ships, never ``trust_remote_code``) and transformers' own
decay rule splits its named parameters. transformers is optional: without it the mapping is
refused, naming why. The caller checks each candidate against the checkpoint (group sizes,
every moment's shape) and uses it only when exactly one fits. (The Trainer's side files are
:mod:`jax_ucp._src.importers.trainer_files`'.)
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import re
from collections.abc import Iterator
from typing import Any

import numpy as np

from jax_ucp._src.errors import SourceError, UCPError
from jax_ucp._src.format import files
from jax_ucp._src.importers.torch_state import clean_name
from jax_ucp._src.importers.trainer_files import (
    ADAPTER_CONFIG_FILE,
    CONFIG_FILE,
    is_adapter_checkpoint,
    read_json,
    side_json,
)
from jax_ucp._src.store.storage import LocalDirectory, Storage

__all__ = [
    "ORDER_HINT",
    "Candidate",
    "check_base_model",
    "trainer_candidates",
]

#: what ``parameter_order=`` lists for an optimizer keyed by index: its parameters group after
#: group as the optimizer was built (torch numbers them so), which for several groups (the
#: Trainer's weight-decayed ones, then the rest) is not ``model.named_parameters()`` order
ORDER_HINT = (
    "parameter_order=[the trainable parameters' names as saved, group after group as the "
    "optimizer was built: one group, [n for n, _ in model.named_parameters()]; the Trainer's "
    "two, its weight-decayed parameters (Trainer.get_decay_parameter_names) then the others, "
    "each in model.named_parameters() order: decay_names + no_decay_names, not "
    "model.named_parameters() order, which interleaves the groups] (--parameter-order FILE on "
    "the command line)"
)


@dataclasses.dataclass(frozen=True)
class Candidate:
    """One way the Trainer may have grouped the parameters: names per group, and shapes."""

    rule: str  # which decay rule, for the manifest and errors
    groups: tuple[tuple[str, ...], ...]
    shapes: dict  # parameter name -> shape on the meta model


#: config keys that count modules transformers builds (layers, blocks, stages, experts)
_COUNT_KEY = re.compile(r"layer|depth|block|stage|expert", re.IGNORECASE)


def _module_counts(config: Any, path: str = "") -> Iterator[tuple[str, int]]:
    """Every module count a config asks for, wherever it nests (``text_config``'s
    ``num_hidden_layers``, ConvNext's ``depths`` list, summed): each costs memory even on the
    meta device, so each is bounded by the checkpoint before anything is built. Walked without
    recursion into a config nested absurdly deep (the JSON reader bounds the depth)."""
    stack = [(path, config)]
    while stack:
        where, node = stack.pop()
        if isinstance(node, dict):
            for key, value in node.items():
                name = f"{where}.{key}" if where else str(key)
                counted = isinstance(key, str) and _COUNT_KEY.search(key)
                if counted and isinstance(value, int) and not isinstance(value, bool):
                    yield name, value
                elif counted and isinstance(value, list) and value:
                    ints = [v for v in value if isinstance(v, int) and not isinstance(v, bool)]
                    if len(ints) == len(value):
                        yield name, sum(ints)
                if isinstance(value, dict | list):
                    stack.append((name, value))
        elif isinstance(node, list):
            stack.extend((f"{where}[{i}]", v) for i, v in enumerate(node))


def _config(folder: Storage, model_config: str | None, why: str) -> tuple[Any, str, str]:
    """(the ``config.json`` to build the model from, its path or URL, where it came from when not
    the folder's own): ``model_config``, else the folder's own (read through ``folder``); for a peft adapter folder (its adapter's
    config, not the base model's) the base model's, found from ``adapter_config.json``'s
    ``base_model_name_or_path`` on this machine (:func:`_base_model_config`), else refused
    naming what was tried."""
    way_out = (
        f"pass model_config= (--model-config on the command line) the model's {CONFIG_FILE}, "
        f"or {ORDER_HINT}, or convert with weights_only=True"
    )
    if model_config is not None:
        path = os.fspath(model_config)
        if not os.path.isfile(path):
            raise SourceError(f"model_config={path}: no such file (expected a {CONFIG_FILE})")
        return read_json(path), path, ""
    adapter = _adapter(folder)
    if adapter is not None:
        base, tried = _base_model_config(adapter[0])
        if base is not None:
            return read_json(base), base, tried
        raise SourceError(
            f"{folder.root}: a peft adapter checkpoint ({ADAPTER_CONFIG_FILE}) without the base "
            f"model's {CONFIG_FILE} ({tried}): {why}; {way_out}"
        )
    got = side_json(folder, CONFIG_FILE, absent_ok=True)
    if got is None:
        raise SourceError(f"{folder.root}: no {CONFIG_FILE}: {why}; {way_out}")
    return *got, ""


def _adapter(folder: Storage) -> tuple[Any, str] | None:
    """(``adapter_config.json``, its path) of a peft adapter checkpoint ``folder``, else None."""
    if not is_adapter_checkpoint(folder):
        return None
    return side_json(folder, ADAPTER_CONFIG_FILE, absent_ok=True)


#: a Hugging Face Hub repo id (``org/name`` or ``name``), as huggingface_hub accepts one
_REPO_ID = re.compile(r"(?:[A-Za-z0-9][\w.-]{0,95}/)?[A-Za-z0-9][\w.-]{0,95}")
_COMMIT = re.compile(r"[0-9a-f]{40}")


def _hub_cache() -> str:
    """huggingface_hub's cache folder, as it resolves it (``HF_HUB_CACHE``, the older
    ``HUGGINGFACE_HUB_CACHE``, ``$HF_HOME/hub``, ``$XDG_CACHE_HOME/huggingface/hub``,
    ``~/.cache/huggingface/hub``), without importing it and without the network."""
    for name in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"):
        if os.environ.get(name):
            return os.path.expanduser(os.environ[name])
    home = os.environ.get("HF_HOME") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join("~", ".cache"), "huggingface"
    )
    return os.path.join(os.path.expanduser(home), "hub")


def _base_model_config(adapter: Any) -> tuple[str | None, str]:
    """(the base model's ``config.json``, where it came from) for a peft adapter, from its
    ``adapter_config.json``'s ``base_model_name_or_path``: a local folder holding a
    ``config.json``, else the snapshot of that Hub repo id in the local Hugging Face cache
    (``refs/<revision or main>``, or its one snapshot). Never the network, never code.
    (None, what was tried) when neither holds one. The name is untrusted: a folder's
    ``config.json`` is reached through :func:`files.inside_checkpoint` (a link out of the folder
    or out of its cache repo refused), a ref read bounded and used only as a commit hash."""
    name = adapter.get("base_model_name_or_path") if isinstance(adapter, dict) else None
    where = f"{ADAPTER_CONFIG_FILE}'s base_model_name_or_path"
    if not isinstance(name, str) or not name or "\0" in name:
        return None, f"{where} is {name!r}"
    tried: list[str] = []
    folders: list[str] = []
    cached: dict[str, str] = {}  # a cache snapshot folder -> its name below the cache
    if os.path.isdir(name):
        folders.append(name)
    else:
        tried.append(f"no folder {name}")
    cache = _hub_cache()
    revision = adapter.get("revision") or "main"
    if _REPO_ID.fullmatch(name) and ".." not in name and isinstance(revision, str):
        repo = os.path.join(cache, "models--" + name.replace("/", "--"))
        snapshots = os.path.join(repo, "snapshots")
        commit = revision if _COMMIT.fullmatch(revision) else None
        ref = os.path.join(repo, "refs", revision)
        if commit is None and _REPO_ID.fullmatch(revision) and os.path.isfile(ref):
            try:
                text = files.read_regular(ref, 4096).decode("ascii", "replace").strip()
            except (UCPError, OSError) as e:
                tried.append(f"{ref}: {e}")
            else:
                commit = text if _COMMIT.fullmatch(text) else None
                if commit is None:
                    tried.append(f"{ref} holds no commit hash")
        if commit is None and os.path.isdir(snapshots):
            found = sorted(os.listdir(snapshots))
            if len(found) == 1 and _COMMIT.fullmatch(found[0]):
                commit = found[0]  # a cache without refs/ (copied): its one snapshot
            else:
                tried.append(f"{snapshots}: {len(found)} snapshots and no refs/{revision}")
        if commit is not None:
            folders.append(os.path.join(snapshots, commit))
            cached[folders[-1]] = os.path.relpath(folders[-1], cache)
        elif not os.path.isdir(snapshots):
            tried.append(f"no {snapshots} in the Hugging Face cache")
    else:
        tried.append(f"{name!r} is not a Hub repo id to look up in the cache {cache}")
    for folder in folders:
        try:
            if folder in cached:  # a snapshot folder linked out of the cache is not followed
                files.inside(cache, cached[folder], f"{folder}: the base model's snapshot")
            path = files.inside_checkpoint(folder, CONFIG_FILE, f"{folder}: the base model's")
            files.check_regular(path)
        except (UCPError, OSError) as e:
            tried.append(str(e)[:300])
            continue
        return path, f"the base model's {path}, from {where} {name!r}"
    return None, f"{where} {name!r}: " + "; ".join(tried)


def _model_on_meta(
    folder: Storage,
    n_tensors: int,
    model_config: str | None = None,
    why: str = "cannot rebuild the optimizer's parameter order",
):
    """The config's architecture, built by transformers on the meta device (no weights):
    ``model_config`` (a Hugging Face ``config.json`` the caller gives, for a folder without
    one), else the folder's own ``config.json``.

    An untrusted config could ask for millions of layers (modules cost memory even on the meta
    device): a layer count above the checkpoint's tensor count is refused before building."""
    config, path, origin = _config(folder, model_config, why)
    if not isinstance(config, dict):
        raise SourceError(f"{path}: expected a JSON object")
    if "auto_map" in config:
        raise SourceError(
            f"{path}: the architecture is custom code (auto_map); jax_ucp never runs code from "
            f"a checkpoint (trust_remote_code), so {why}"
        )
    archs = config.get("architectures")
    model_type = config.get("model_type")
    if not (isinstance(archs, list) and len(archs) == 1 and isinstance(archs[0], str)):
        raise SourceError(f"{path}: 'architectures' is {archs!r}, expected one name: {why}")
    for key, count in _module_counts(config):
        if not 0 <= count <= n_tensors:
            raise SourceError(
                f"{path}: {key} asks for {count} modules, but the checkpoint holds {n_tensors} "
                f"tensors: {why}"
            )
    try:
        import torch  # pyright: ignore[reportMissingImports]  # the torch extra, absent in the default CI run
        import transformers  # pyright: ignore[reportMissingImports]
        from transformers.models.auto import (  # pyright: ignore[reportMissingImports]
            configuration_auto,
            modeling_auto,
        )
    except ImportError as e:
        raise SourceError(
            f"{folder.root}: {why} without transformers ({e}); install transformers (with torch), "
            f"or pass {ORDER_HINT}"
        ) from None
    shipped = {
        name
        for attr, mapping in vars(modeling_auto).items()
        if attr.endswith("_MAPPING_NAMES") and isinstance(mapping, dict)
        for value in mapping.values()
        for name in (value if isinstance(value, (list, tuple)) else (value,))
    }
    # transformers re-exports CONFIG_MAPPING_NAMES without "as", which hides it from pyright
    config_names = configuration_auto.CONFIG_MAPPING_NAMES  # pyright: ignore[reportPrivateImportUsage]
    if archs[0] not in shipped or model_type not in config_names:
        raise SourceError(
            f"{path}: architecture {archs[0]!r} (model_type {model_type!r}) is not one "
            f"transformers {transformers.__version__} ships: {why}"
        )
    try:
        cls = getattr(transformers, archs[0])
        cfg = configuration_auto.CONFIG_MAPPING[str(model_type)].from_dict(dict(config))
        # Without torch installed pyright resolves ``torch`` to this sibling package (its
        # local-directory fallback), hence the ignore.
        with torch.device("meta"):  # pyright: ignore[reportAttributeAccessIssue]
            model = cls(cfg)
    except Exception as e:  # transformers' own refusal of this config
        raise SourceError(
            f"{path}: transformers {transformers.__version__} cannot build {archs[0]} from it "
            f"({type(e).__name__}: {str(e)[:200]}): {why}"
        ) from None
    what = f"transformers {transformers.__version__} {archs[0]}"
    return model, f"{what} ({origin})" if origin else what


def check_base_model(src: Storage, base: str, weights: dict, adapter: dict) -> None:
    """A base model given beside the peft adapter ``src`` (``base_model=``) must be the one it
    was trained on: its ``config.json``'s sizes those peft filled the prompt adapter's config
    from, each LoRA pair's sides the shape of the base weight it adapts, and (transformers
    installed) its weights the tensors that config's model holds. Else refused naming the
    field or tensor, the file and both values: imported, the two would never run together.

    Args:
        src: the adapter checkpoint's folder.
        base: the base model's folder.
        weights: ``{name: (tensor, file, name)}`` of the base's files.
        adapter: the same of the adapter's files.
    """
    config_path = os.path.join(base, CONFIG_FILE)
    config = read_json(config_path) if os.path.isfile(config_path) else None
    settings, adapter_path = side_json(src, ADAPTER_CONFIG_FILE, absent_ok=True) or (None, "")
    prompt = isinstance(settings, dict) and settings.get("peft_type") in _PROMPT_TYPES
    if isinstance(config, dict) and prompt:
        assert isinstance(settings, dict)
        _check_prompt_sizes(settings, adapter_path, config, config_path)
    for name, (value, file, _) in adapter.items():
        lora = _LORA_SIDE.match(name)
        if lora is None or len(np.shape(value)) != 2:
            continue
        target = f"{lora.group(1)}.weight"
        if target not in weights:
            raise SourceError(
                f"base_model={base}: the adapter's {name!r} ({os.path.basename(file)}) adapts "
                f"{target!r}, which the base model does not hold"
            )
        held, side = np.shape(weights[target][0]), 1 if lora.group(2) == "A" else 0
        if len(held) != 2 or held[side] != np.shape(value)[side]:
            raise SourceError(
                f"base_model={base}: the adapter's {name!r} {list(np.shape(value))} "
                f"({os.path.basename(file)}) does not fit the base's {target!r} {list(held)} "
                f"({os.path.basename(weights[target][1])}): another model's adapter"
            )
    if isinstance(config, dict) and importlib.util.find_spec("transformers") is not None:
        _check_base_weights(base, weights)


#: a LoRA pair's side as peft saves it: ``base_model.model.<module>.lora_A.weight``
_LORA_SIDE = re.compile(r"base_model\.model\.(.+)\.lora_([AB])\.(?:[^.]+\.)?weight")


def _check_prompt_sizes(settings: dict, adapter_path: str, config: dict, config_path: str) -> None:
    """peft fills a prompt adapter's ``num_layers`` and ``token_dim`` from the base model's
    config (``token_dim`` per key-value head for prefix tuning): they must still agree."""
    inner = config.get("text_config")
    text: dict = inner if isinstance(inner, dict) else config
    sizes: dict[str, int | None] = {
        key: next((text[k] for k in names if isinstance(text.get(k), int)), None)
        for key, names in (
            ("hidden", ("hidden_size", "n_embd", "d_model")),
            ("layers", ("num_hidden_layers", "n_layer", "num_layers")),
            ("heads", ("num_attention_heads", "n_head")),
        )
    }
    hidden, layers, heads = sizes["hidden"], sizes["layers"], sizes["heads"]
    kv = text.get("num_key_value_heads") or heads
    layer_count = settings.get("num_layers")
    if layers is not None and layer_count is not None and layer_count != layers:
        raise SourceError(
            f"{adapter_path}: num_layers={layer_count!r}, but the base model's {config_path} "
            f"has {layers} layers: another model's adapter"
        )
    dim = settings.get("token_dim")
    if hidden is not None and dim is not None:
        dims = {hidden, hidden // heads * kv} if heads and isinstance(kv, int) else {hidden}
        if dim in dims:
            return
        raise SourceError(
            f"{adapter_path}: token_dim={dim!r}, but the base model's {config_path} has "
            f"hidden size {hidden} (token_dim {' or '.join(map(str, sorted(dims)))}): another "
            f"model's adapter"
        )


def _check_base_weights(base: str, weights: dict) -> None:
    """The base's weights against the model its config builds (meta device): a tensor of
    another shape, or a module of the model with none of its tensors in the files, is refused.
    Names the files hold beyond the model (buffers older versions saved, a checkpoint's own
    layout of fused experts) are left to the import."""
    model, what = _model_on_meta(
        LocalDirectory(base), len(weights), why="cannot check the base model's weights"
    )
    by_tensor: dict[int, list[str]] = {}
    for name, value in model.state_dict(keep_vars=True).items():
        by_tensor.setdefault(id(value), []).append(name)
    for names in by_tensor.values():  # tied names: one of them saved
        shapes = {n: tuple(model.state_dict(keep_vars=True)[n].shape) for n in names}
        held = [n for n in names if n in weights]
        for n in held:
            found = tuple(np.shape(weights[n][0]))
            if found != shapes[n]:
                raise SourceError(
                    f"base_model={base}: {n!r} is {list(found)} in "
                    f"{os.path.basename(weights[n][1])}, but its config.json's model ({what}) "
                    f"has {list(shapes[n])}"
                )
        module = names[0].rpartition(".")[0]
        if not held and not any(w.startswith(module + ".") for w in weights):
            raise SourceError(
                f"base_model={base}: no tensor of {names[0]!r} (module {module!r}) in its "
                f"weights, though its config.json's model ({what}) has it: an incomplete or "
                f"another model's folder"
            )


def _legacy_decay_names(model) -> list[str]:
    """transformers 4.x before the norm-name patterns: outside nn.LayerNorm, no 'bias'."""
    from torch import nn  # pyright: ignore[reportMissingImports, reportAttributeAccessIssue]  # the torch extra (see _model_on_meta)
    from transformers.trainer_pt_utils import (  # pyright: ignore[reportMissingImports]
        get_parameter_names,
    )

    return [n for n in get_parameter_names(model, [nn.LayerNorm]) if "bias" not in n]


def _installed_decay_names(model) -> list[str]:
    """The installed transformers' Trainer rule (it does not use ``self``)."""
    from transformers import Trainer  # pyright: ignore[reportMissingImports]  # the torch extra

    return list(Trainer.get_decay_parameter_names(None, model))  # pyright: ignore[reportArgumentType]  # self is unused


def trainer_candidates(
    folder: Storage, n_tensors: int, model_config: str | None = None
) -> list[Candidate]:
    """The Trainer's groupings of the config's model, distinct ones only: the installed
    transformers' decay rule and the 4.x rule (checkpoints of an older transformers); with
    ``model_config`` also one group of ``model.named_parameters()`` (``AdamW(model.parameters())``).

    Args:
        folder: the checkpoint folder (its ``config.json``).
        n_tensors: the checkpoint's model tensor count, a bound on the model's size.
        model_config: a ``config.json`` given for a folder without one (an Accelerate
            ``save_state``, a Trainer checkpoint without its config).
    """
    adapter = _adapter(folder)
    prompt = _prompt_candidates(*adapter) if adapter is not None else None
    if prompt is not None:  # one embedding of the adapter's own: no base model to build
        return prompt
    model, what = _model_on_meta(folder, n_tensors, model_config)
    if adapter:  # the base model's
        return _lora_candidates(*adapter, model, what)
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    shapes = {n: tuple(p.shape) for n, p in named}
    out: list[Candidate] = []
    if model_config is not None:
        out.append(
            Candidate(
                f"{what}, one group in model.named_parameters() order",
                (tuple(n for n, _ in named),),
                shapes,
            )
        )
    for rule, decay_names in (
        (f"{what}, Trainer.get_decay_parameter_names", _installed_decay_names),
        (f"{what}, transformers 4.x decay rule (no nn.LayerNorm, no 'bias')", _legacy_decay_names),
    ):
        try:
            decay = set(decay_names(model))
        except Exception as e:  # a rule this transformers cannot run
            raise SourceError(
                f"{folder.root}: {what}: the Trainer's decay rule failed ({type(e).__name__}: "
                f"{str(e)[:200]})"
            ) from None
        groups = (
            tuple(n for n, _ in named if n in decay),
            tuple(n for n, _ in named if n not in decay),
        )
        if all(c.groups != groups for c in out):
            out.append(Candidate(rule, groups, shapes))
    return out


#: adapter_config.json fields that change which modules a LoRA adapter wraps or what it trains
#: beyond what :func:`_lora_candidates` rebuilds: a value other than these is refused
_LORA_PLAIN = {
    "layers_to_transform": (None,),
    "layers_pattern": (None,),
    "exclude_modules": (None,),
    "target_parameters": (None,),
    "rank_pattern": ({},),
    "bias": ("none",),
    "lora_bias": (False,),
    "use_dora": (False, True),
    "layer_replication": (None,),
    "trainable_token_indices": (None,),
}
#: the Trainer's no-decay name patterns (``get_decay_parameter_names``: biases, norms)
_NO_DECAY = re.compile(r"bias|layernorm|rmsnorm", re.IGNORECASE)


def _names_list(adapter: dict, key: str, path: str) -> list[str]:
    """``adapter[key]`` as a list of module names (None: empty), else refused."""
    value = adapter.get(key) or []
    if not (isinstance(value, list) and all(isinstance(t, str) and t for t in value)):
        raise SourceError(
            f"{path}: {key} {value!r}: only a list of module names is rebuilt; pass "
            f"parameter_order="
        )
    return value


def _lora_config(adapter: Any, path: str) -> tuple[list[str], list[str], int, bool]:
    """(target modules, modules to save, r, use_dora) of a LoRA ``adapter_config.json``; one
    :func:`_lora_candidates` cannot rebuild is refused naming the field (``path``: its file)."""
    if not isinstance(adapter, dict) or adapter.get("peft_type") != "LORA":
        raise SourceError(
            f"{path}: not a LoRA adapter config (peft_type "
            f"{adapter.get('peft_type') if isinstance(adapter, dict) else adapter!r})"
        )
    targets = _names_list(adapter, "target_modules", path)
    saved = _names_list(adapter, "modules_to_save", path)
    rank = adapter.get("r")
    if not targets:
        raise SourceError(f"{path}: target_modules {adapter.get('target_modules')!r}: none")
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
        raise SourceError(f"{path}: r={rank!r}, expected a positive int")
    for key, plain in _LORA_PLAIN.items():
        if adapter.get(key, plain[0]) not in plain:
            raise SourceError(
                f"{path}: {key}={adapter[key]!r}: the adapter's parameters cannot "
                f"be rebuilt from its target modules alone; pass parameter_order="
            )
    return targets, saved, rank, adapter.get("use_dora") is True


def _lora_candidates(adapter: Any, path: str, model, what: str) -> list[Candidate]:
    """The trainable parameters of a peft LoRA adapter over ``model`` (the base model on the
    meta device), in peft's ``named_parameters()`` order, named as peft saves them (the adapter
    name dropped): each target module (peft's rule: the module's name is a target or ends with
    ``"." + target``) its ``lora_A.weight``, ``lora_B.weight`` and with ``use_dora`` its
    ``lora_magnitude_vector`` (one per output row); each ``modules_to_save`` module (peft's rule:
    its name ends with the entry) its own parameters (a trained copy, saved under the module's
    name), all in the base model's module order. Target modules must be ``nn.Linear``; a field
    of :data:`_LORA_PLAIN` set otherwise is refused."""
    targets, saved, rank, dora = _lora_config(adapter, path)
    names, shapes, no_decay, inside = [], {}, set(), None
    for module_name, module in model.named_modules():
        if inside is not None and module_name.startswith(inside):
            continue  # within a module to save: its parameters are listed with it
        target = any(module_name == t or module_name.endswith("." + t) for t in targets)
        if module_name and any(module_name.endswith(t) for t in saved):
            if target:
                raise SourceError(
                    f"{path}: module {module_name} is both a target and in modules_to_save: "
                    f"pass parameter_order="
                )
            inside = module_name + "."
            norm = "Norm" in type(module).__name__
            for pname, p in module.named_parameters():
                name = clean_name(f"base_model.model.{module_name}.{pname}")[0]
                names.append(name)
                shapes[name] = tuple(p.shape)
                if norm or _NO_DECAY.search(name):
                    no_decay.add(name)
            continue
        if not target:
            continue
        weight = getattr(module, "weight", None)
        if type(module).__name__ != "Linear" or weight is None or weight.dim() != 2:
            raise SourceError(
                f"{path}: target module {module_name} is a "
                f"{type(module).__name__}, not a Linear: pass parameter_order="
            )
        out_features, in_features = weight.shape
        parts = [("lora_A.weight", (rank, in_features)), ("lora_B.weight", (out_features, rank))]
        for part, shape in parts + ([("lora_magnitude_vector", (out_features,))] if dora else []):
            name = clean_name(f"base_model.model.{module_name}.{part}")[0]
            names.append(name)
            shapes[name] = shape
    if not names:
        raise SourceError(f"{path}: target_modules {targets} match no module of {what}")
    rule = f"{what} + peft {'DoRA' if dora else 'LoRA'} r={rank} on {', '.join(targets)}"
    rule += f", modules_to_save {', '.join(saved)}" if saved else ""
    decay = tuple(n for n in names if n not in no_decay)
    return [  # AdamW(model.parameters()), and the Trainer's decay / no-decay groups
        Candidate(f"{rule}, one group", (tuple(names),), shapes),
        Candidate(
            f"{rule}, the Trainer's groups",
            (decay, tuple(n for n in names if n in no_decay)),
            shapes,
        ),
    ]


#: peft's prompt-learning adapters: the virtual tokens' embedding is their one trained tensor,
#: saved as ``prompt_embeddings``
_PROMPT_TYPES = ("PREFIX_TUNING", "PROMPT_TUNING", "P_TUNING")


def _prompt_candidates(adapter: Any, path: str) -> list[Candidate] | None:
    """The one trainable parameter of a peft prompt-learning adapter (prefix or prompt tuning),
    ``prompt_encoder.<adapter>.embedding.weight`` saved as ``prompt_embeddings``: prefix tuning
    ``[num_virtual_tokens, num_layers * 2 * token_dim]`` (each layer's key and value prefix),
    prompt tuning ``[num_virtual_tokens * num_transformer_submodules, token_dim]``; in the
    Trainer's decay group. None for another peft type. A prompt encoder that trains more than
    the tensor it saves (p-tuning's MLP / LSTM, ``prefix_projection``'s MLP: the file holds
    their output) is refused naming why (``path``: the adapter config's file)."""
    kind = adapter.get("peft_type") if isinstance(adapter, dict) else None
    if kind not in _PROMPT_TYPES:
        return None
    assert isinstance(adapter, dict)
    if kind == "P_TUNING" or adapter.get("prefix_projection"):
        field = "peft_type P_TUNING" if kind == "P_TUNING" else "prefix_projection true"
        raise SourceError(
            f"{path}: {field}: its prompt encoder trains an MLP / LSTM whose output, not its "
            f"parameters, is saved as prompt_embeddings; the optimizer's state cannot be "
            f"matched (weights_only=True imports the saved embeddings)"
        )
    sizes = {}
    for key in ("num_virtual_tokens", "token_dim", "num_layers", "num_transformer_submodules"):
        value = adapter.get(key, 1 if key == "num_transformer_submodules" else None)
        if isinstance(value, bool) or not isinstance(value, int) or not 0 < value < 2**31:
            raise SourceError(f"{path}: {key}={value!r}, expected a positive int")
        sizes[key] = value
    tokens, dim = sizes["num_virtual_tokens"], sizes["token_dim"]
    if kind == "PREFIX_TUNING":
        shape = (tokens, sizes["num_layers"] * 2 * dim)
    else:
        shape = (tokens * sizes["num_transformer_submodules"], dim)
    rule = f"peft {kind.lower()}: prompt_embeddings {list(shape)}"
    shapes = {"prompt_embeddings": shape}
    return [
        Candidate(f"{rule}, one group", (("prompt_embeddings",),), shapes),
        Candidate(f"{rule}, the Trainer's groups", (("prompt_embeddings",), ()), shapes),
    ]
