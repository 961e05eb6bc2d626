"""Import Megatron Bridge checkpoints (NVIDIA megatron-bridge 0.6) as UCP.

Bridge saves through megatron-core's ``dist_checkpointing`` (``torch_dist``), so the tensors and
the distributed-optimizer state are read by the Megatron importer's torch_dist planner; what
Bridge adds, and this module reads, is around it::

    <root>/latest_train_state.pt           the latest save's TrainState (Bridge's tracker)
    <root>/latest_checkpointed_iteration.txt   Megatron-LM's tracker, written too
    <root>/iter_NNNNNNN/                   megatron-core torch_dist (.metadata, *.distcp,
                                           metadata.json; 0.19 keeps the common state inside)
    <root>/iter_NNNNNNN/train_state.pt     TrainState: step, consumed samples, FLOPs (0-d tensors)
    <root>/iter_NNNNNNN/run_config.yaml    the run's whole ConfigContainer (model, optimizer, ...)

Bridge saves no Megatron-LM ``args``: the model settings a spec needs (heads, query groups, kv
channels, SwiGLU, the tokenizer's vocab size before padding, ...) come from ``run_config.yaml``'s
``model`` section. That file is parsed with ``yaml.safe_load`` semantics only (no tag builds an
object), from at most :data:`MAX_RUN_CONFIG_BYTES`, and refused when its aliases would expand
past :data:`MAX_YAML_NODES` nodes (a billion-laughs file). ``train_state.pt`` is read by the
allow-listed unpickler (:mod:`jax_ucp._src.torchfiles.pickle_format`); nothing pickled is executed.

Output: the Megatron importer's tree and source, with ``framework = "megatron-bridge"``,
``iteration`` = the train state's step and ``bridge`` = the train state and run-config facts.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import re
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import numpy as np
import yaml

from jax_ucp._src.format import files
from jax_ucp._src.importers import runs
from jax_ucp._src.importers.megatron import legacy
from jax_ucp._src.importers.megatron.common import (
    MegatronImportError,
    entries_of,
    listed,
    read_file,
    subfolder,
)
from jax_ucp._src.importers.megatron.run_record import MEGATRON_OPTIMIZER, run_config_args
from jax_ucp._src.importers.plan import ImportPlan
from jax_ucp._src.language import Spec, load_spec
from jax_ucp._src.store.storage import Storage
from jax_ucp._src.torchfiles import allow_list, torch_zip

if TYPE_CHECKING:  # the package imports this module: its names are handed in, never imported
    from jax_ucp._src.importers.megatron import MegatronOptions

__all__ = [
    "LATEST_TRAIN_STATE_FILE",
    "MAX_RUN_CONFIG_BYTES",
    "MAX_YAML_NODES",
    "RUN_CONFIG_FILE",
    "TRAIN_STATE_FILE",
    "BridgeCheckpoint",
    "bridge_settings",
    "find_bridge_checkpoint",
    "is_megatron_bridge",
    "plan_megatron_bridge",
    "read_run_config",
    "read_train_state",
]

TRAIN_STATE_FILE = "train_state.pt"
LATEST_TRAIN_STATE_FILE = "latest_train_state.pt"
RUN_CONFIG_FILE = "run_config.yaml"
#: Bridge's run_config.yaml is ~25 KB for a full ConfigContainer; 16 MiB leaves room for
#: very large recipes and keeps a hostile file from being read whole into memory.
MAX_RUN_CONFIG_BYTES = 16 << 20
#: YAML nodes after expanding aliases: a real run config has a few thousand.
MAX_YAML_NODES = 1_000_000
#: train_state.pt holds eight 0-d tensors (~3.5 KB).
MAX_TRAIN_STATE_BYTES = 1 << 20

# files of a Bridge iteration directory this importer knows (read, or megatron-core's)
_KNOWN_FILES = {".metadata", "metadata.json", "common.pt", TRAIN_STATE_FILE, RUN_CONFIG_FILE}
_ITER_DIR = re.compile(r"iter_([0-9]+)")


@dataclasses.dataclass(frozen=True)
class BridgeCheckpoint:
    """Where a Bridge checkpoint's files are, and its train state."""

    root: str  # the save directory (with latest_train_state.pt), or the iter dir's parent
    iter_dir: Storage  # iter_NNNNNNN/: the torch_dist checkpoint, train_state.pt, run_config.yaml
    train_state: dict[str, Any]  # step, consumed_train_samples, ... as Python scalars


def is_megatron_bridge(folder: Storage) -> bool:
    """A Bridge save directory (``latest_train_state.pt``, or Megatron-LM's tracker naming an
    iteration directory of Bridge's) or iteration directory (``train_state.pt`` /
    ``run_config.yaml``), from file names and the tracker's number alone."""
    names = listed(folder)
    if names is None:
        return False
    known = (LATEST_TRAIN_STATE_FILE, TRAIN_STATE_FILE, RUN_CONFIG_FILE)
    # listed: a tracker that is a FIFO or a symlink loop is this format's file gone wrong
    if any(name in names for name in known):
        return True
    bridges = [  # the iteration folders holding Bridge's files: the tracker read only then
        n for n in names if _ITER_DIR.fullmatch(n) and set(known[1:]) & set(entries_of(folder, n))
    ]
    try:
        step = _tracker_step(folder, names) if bridges else None
    except MegatronImportError:
        return False  # Megatron-LM's importer names what is wrong with it
    return step is not None and f"iter_{step:07d}" in bridges


def _tracker_step(folder: Storage, names: list[str]) -> int | None:
    """The iteration in Megatron-LM's tracker file in ``folder`` (None: no file, or 'release')."""
    step = legacy.read_tracker(folder, names, MegatronImportError)
    return step if isinstance(step, int) else None


def find_bridge_checkpoint(path: Storage) -> BridgeCheckpoint:
    """The iteration directory Bridge itself would load from ``path``: ``path`` when it is one,
    else the step in ``latest_train_state.pt`` (Megatron-LM's tracker file must agree)."""
    names = listed(path)
    if names is None:
        raise MegatronImportError(f"{path.root}: not a directory")
    latest = path.join(LATEST_TRAIN_STATE_FILE)
    if LATEST_TRAIN_STATE_FILE in names and TRAIN_STATE_FILE not in names:
        step = read_train_state(path, LATEST_TRAIN_STATE_FILE, names)["step"]
        iter_name = f"iter_{step:07d}"
        # Megatron-LM's tracker (Bridge writes it with the same step) must not name another save
        tracked = _tracker_step(path, names)
        if tracked is not None and tracked != step:
            raise MegatronImportError(
                f"{path.join(runs.TRACKER_FILE)}: iteration {tracked}, but {latest} says step "
                f"{step}; the two trackers of one Bridge save agree (a later save by another tool?)"
            )
        iter_dir = subfolder(path, iter_name)  # never read through a link to another run's
        inner = listed(iter_dir) if iter_name in names else None
        if inner is None:
            found = [n for n in names if _ITER_DIR.fullmatch(n)]
            shown = ", ".join(found[:8]) + (f", ... ({len(found)})" if len(found) > 8 else "")
            raise MegatronImportError(
                f"{latest}: step {step}, but {iter_dir.root} (its iteration directory) is "
                f"missing; iteration directories here: {shown or 'none'}"
            )
        state = read_train_state(iter_dir, TRAIN_STATE_FILE, inner)
        if state["step"] != step:
            raise MegatronImportError(
                f"{iter_dir.join(TRAIN_STATE_FILE)}: step {state['step']}, but {latest} says {step}"
            )
        return BridgeCheckpoint(path.absolute(), iter_dir, state)
    step = None if TRAIN_STATE_FILE in names else _tracker_step(path, names)
    if step is not None:  # a save directory whose latest_train_state.pt is gone
        path = subfolder(path, f"iter_{step:07d}")
        names = listed(path) or []
    state = read_train_state(path, TRAIN_STATE_FILE, names)
    match = _ITER_DIR.fullmatch(legacy.name_of(path))
    if match and int(match.group(1)) != state["step"]:
        raise MegatronImportError(
            f"{path.join(TRAIN_STATE_FILE)}: step {state['step']}, but the directory is "
            f"{legacy.name_of(path)} (iteration {int(match.group(1))})"
        )
    return BridgeCheckpoint(path.absolute().rstrip("/").rpartition("/")[0], path, state)


def read_train_state(folder: Storage, name: str, names: list[str]) -> dict[str, Any]:
    """Bridge's ``TrainState.state_dict()`` (file ``name`` of ``folder``, whose entries are
    ``names``) as Python scalars (``step`` required, a non-negative int). Read by the
    allow-listed unpickler: torch tensors only."""
    path = folder.join(name)
    if name not in names:
        raise MegatronImportError(
            f"{path}: missing; Megatron Bridge writes {TRAIN_STATE_FILE} into every iteration "
            f"directory (the train state: step, consumed samples)"
        )
    try:  # its size known once mapped (a remote one's zip directory read), before it is read
        with contextlib.closing(torch_zip.TorchArchive(folder, name)) as archive:
            if archive.size > MAX_TRAIN_STATE_BYTES:
                raise MegatronImportError(
                    f"{path}: {archive.size} bytes, more than the {MAX_TRAIN_STATE_BYTES} a "
                    f"train state may have (Bridge's is a few KB)"
                )
            raw = archive.load()
    except (files.UnsafeFileError, allow_list.TorchFileError) as e:
        raise MegatronImportError(str(e)) from None
    if not isinstance(raw, dict) or "step" not in raw:
        raise MegatronImportError(
            f"{path}: holds {allow_list.short_repr(raw)}, expected Bridge's train state "
            f"(a dict with 'step')"
        )
    state: dict[str, Any] = {}
    for key, value in raw.items():
        # a tensor, not anything else with a ``shape`` (an OrderedDict given one by BUILD)
        if not isinstance(key, str) or not isinstance(value, np.ndarray) or value.shape != ():
            raise MegatronImportError(
                f"{path}: entry {allow_list.short_repr(key, 80)} is "
                f"{allow_list.short_repr(value)}, expected a 0-d tensor (Bridge's "
                f"TrainState.state_dict)"
            )
        state[key] = value.item()
    step = state["step"]
    if type(step) is not int or step < 0:
        raise MegatronImportError(
            f"{path}: step {allow_list.short_repr(step, 80)}, expected a non-negative integer"
        )
    return state


# PyYAML's safe loader (only plain data: no tag builds an object), its C parser when built
_SafeLoader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


def read_run_config(folder: Storage) -> dict[str, Any]:
    """``run_config.yaml`` of the iteration folder ``folder`` as plain data, read from at most
    :data:`MAX_RUN_CONFIG_BYTES` and refused when it expands past :data:`MAX_YAML_NODES` nodes
    (aliases counted each time they are used: a billion-laughs file is refused before anything
    walks it)."""
    path = folder.join(RUN_CONFIG_FILE)
    if RUN_CONFIG_FILE not in (listed(folder) or ()):
        raise MegatronImportError(
            f"{path}: missing; Megatron Bridge writes {RUN_CONFIG_FILE} beside "
            f"{TRAIN_STATE_FILE} at every save, and only it records the model settings "
            f"(heads, query groups, kv channels, SwiGLU, vocab size) of a Bridge checkpoint"
        )
    loader = _SafeLoader(read_file(folder, RUN_CONFIG_FILE, MAX_RUN_CONFIG_BYTES))
    try:
        node = loader.get_single_node()
        if node is None:
            raise MegatronImportError(f"{path}: empty, expected Bridge's run config (a mapping)")
        _check_nodes(node, path)
        config = loader.construct_document(node)
    except yaml.YAMLError as e:
        why = " ".join(str(e).split())[:300]  # on one line
        raise MegatronImportError(f"{path}: not valid YAML ({why})") from None
    except RecursionError:
        raise MegatronImportError(f"{path}: nested too deeply to be a run config") from None
    finally:
        loader.dispose()
    if not isinstance(config, dict):
        raise MegatronImportError(
            f"{path}: holds a {type(config).__name__}, expected Bridge's run config (a mapping "
            f"with a 'model' section)"
        )
    return config


#: Longest number a run config may spell (Bridge's are a few digits; Python refuses to build an
#: int from 4300 decimal digits, and would build one from millions of hex digits).
MAX_NUMBER_CHARS = 64
_NUMBER_TAGS = ("tag:yaml.org,2002:int", "tag:yaml.org,2002:float")


def _check_nodes(root: yaml.Node, path: str) -> None:
    """Refuse, before anything is built, a document whose nodes, aliases expanded, exceed
    MAX_YAML_NODES, that contains itself, or that spells a number with more than
    :data:`MAX_NUMBER_CHARS` characters (naming its key and line); linear in the composed graph
    (each node checked once, its expanded size computed once)."""
    size: dict[int, int] = {}
    on_path: set[int] = set()
    stack: list[tuple[yaml.Node, str, bool]] = [(root, "(document)", False)]
    while stack:
        node, key, done = stack.pop()
        if done:
            on_path.discard(id(node))
            total = 1 + sum(size[id(child)] for child, _ in _children(node, key))
            if total > MAX_YAML_NODES:
                raise MegatronImportError(
                    f"{path}: more than {MAX_YAML_NODES} YAML nodes once its aliases are "
                    f"expanded (an alias bomb?); Bridge's run config has a few thousand"
                )
            size[id(node)] = total
            continue
        if id(node) in size:
            continue
        if id(node) in on_path:
            raise MegatronImportError(f"{path}: a YAML alias that contains itself")
        number = isinstance(node, yaml.ScalarNode) and node.tag in _NUMBER_TAGS
        if number and len(node.value) > MAX_NUMBER_CHARS:
            raise MegatronImportError(
                f"{path}: {key} (line {node.start_mark.line + 1}) is a number of "
                f"{len(node.value)} characters ({node.value[:20]}...); a run config's "
                f"numbers have at most {MAX_NUMBER_CHARS}"
            )
        on_path.add(id(node))
        stack.append((node, key, True))
        for child, child_key in _children(node, key):
            if id(child) in on_path:
                raise MegatronImportError(f"{path}: a YAML alias that contains itself")
            if id(child) not in size:
                stack.append((child, child_key, False))


def _children(node: yaml.Node, key: str) -> list[tuple[yaml.Node, str]]:
    """A node's children, each with the key path errors name it by."""
    if isinstance(node, yaml.SequenceNode):
        return [(v, f"{key}[{i}]") for i, v in enumerate(node.value)]
    if not isinstance(node, yaml.MappingNode):
        return []
    out = []
    for k, v in node.value:
        name = k.value[:100] if isinstance(k, yaml.ScalarNode) else "(a key)"
        out += [(k, f"a key under {key}"), (v, name if key == "(document)" else f"{key}.{name}")]
    return out


# run_config.yaml model field -> import setting (Megatron-LM's argument names, which the
# default import rules and the shipped specs use)
_MODEL_INTS = {
    "num_layers": "num_layers",
    "hidden_size": "hidden_size",
    "num_attention_heads": "num_attention_heads",
    "num_query_groups": "num_query_groups",
    "kv_channels": "kv_channels",
    "ffn_hidden_size": "ffn_hidden_size",
    "num_moe_experts": "num_experts",
    "seq_length": "max_position_embeddings",
    "tensor_model_parallel_size": "tp",
    "pipeline_model_parallel_size": "pp",
    "expert_model_parallel_size": "ep",
}
_MODEL_BOOLS = {
    "gated_linear_unit": "swiglu",
    "add_bias_linear": "add_bias_linear",
    "share_embeddings_and_output_weights": "untie_embeddings_and_output_weights",  # inverted
}
_MODEL_STRINGS = {
    "normalization": "normalization",
    "position_embedding_type": "position_embedding_type",
}


def bridge_settings(run_config: Mapping[str, Any], where: str) -> dict[str, Any]:
    """Import settings from a run config's ``model`` section (its ``transformer`` sub-section
    for Bridge's newer ``GPTModelConfig``) and its ``ddp`` gradient-bucket settings: the values
    a spec needs, each type-checked."""
    model = run_config.get("model")
    if not isinstance(model, dict):
        raise MegatronImportError(
            f"{where}: no 'model' section (found {sorted(map(str, run_config))[:12]}); Bridge's "
            f"run config records the model provider there"
        )
    fields = dict(model)
    if isinstance(model.get("transformer"), dict):  # GPTModelConfig keeps them one level down
        fields = {**model["transformer"], **{k: v for k, v in model.items() if k != "transformer"}}
    if "vocab_size" not in fields:
        # Bridge writes every field of its model provider, vocab_size (maybe null) among them;
        # without it the embedding's padding rows cannot be told apart: a cut or edited file
        raise MegatronImportError(
            f"{where}: the 'model' section has no 'vocab_size' (Bridge writes every field of the "
            f"model provider; found {len(fields)} fields): the run config is truncated or not "
            f"Bridge's"
        )
    settings: dict[str, Any] = {}
    _named_settings(fields, where, settings)
    if fields.get("vocab_size") is not None:
        vocab = settings["vocab_size"] = _int_field(fields["vocab_size"], "vocab_size", where)
        if fields.get("should_pad_vocab") is not True:  # vocab_size is the embedding's row count
            settings["padded_vocab_size"] = vocab
        elif (divisible := fields.get("make_vocab_size_divisible_by")) is not None:
            # Bridge pads it to a multiple of divisible_by * TP
            key = "make_vocab_size_divisible_by"
            settings[key] = _int_field(divisible, key, where)
    ddp = _section(run_config, "ddp")
    if type(ddp.get("overlap_grad_reduce")) is bool:
        settings["overlap_grad_reduce"] = ddp["overlap_grad_reduce"]
    if ddp.get("bucket_size") is not None:
        settings["ddp_bucket_size"] = _int_field(ddp["bucket_size"], "ddp.bucket_size", where)
    return settings


def _named_settings(fields: dict[str, Any], where: str, settings: dict) -> None:
    """The int, bool and name fields that map one to one onto a setting, and the tied-embedding
    flag (inverted), into ``settings``."""
    for key, name in _MODEL_INTS.items():
        if fields.get(key) is not None:
            settings[name] = _int_field(fields[key], key, where)
    for key, name in _MODEL_BOOLS.items():
        if (value := fields.get(key)) is not None:
            if type(value) is not bool:
                raise MegatronImportError(f"{where}: model.{key} is {value!r}, expected true/false")
            settings[name] = not value if name.startswith("untie_") else value
    for key, name in _MODEL_STRINGS.items():
        if (value := fields.get(key)) is not None:
            if not isinstance(value, str) or len(value) > 100:
                raise MegatronImportError(f"{where}: model.{key} is {value!r}, expected a name")
            settings[name] = value


def _int_field(value: Any, key: str, where: str) -> int:
    if type(value) is not int or not 0 <= value < 2**63:
        shown = (
            f"an integer of {value.bit_length()} bits"
            if type(value) is int and value.bit_length() > 64
            else allow_list.short_repr(value, 80)
        )
        raise MegatronImportError(
            f"{where}: {key if '.' in key else 'model.' + key} is {shown}, expected a "
            f"non-negative integer below 2**63"
        )
    return value


def _section(run_config: Mapping[str, Any], name: str) -> dict:
    value = run_config.get(name)
    return value if isinstance(value, dict) else {}


def plan_megatron_bridge(
    src: Storage,
    options: MegatronOptions,
    plan_megatron: Callable[[Storage, MegatronOptions], ImportPlan],
) -> ImportPlan:
    """The import of a Megatron Bridge checkpoint: the model settings from ``run_config.yaml``,
    the rest the Megatron importer's torch_dist import.

    Args:
        src: a Bridge save directory or one ``iter_N/``.
        options: ``spec``: a UCP-language spec (``Spec``, shipped name or TOML path) with
            import rules / settings, its own settings overriding the run config's;
            ``vocab_size``: the tokenizer's vocabulary size, before Megatron's padding
            (overrides the run config's); ``weights_only``: the model weights alone, the
            optimizer state skipped and listed in ``source.skipped``.
        plan_megatron: the Megatron importer's planner (``megatron.plan_megatron``), run on
            the iteration folder with the merged settings.
    """
    spec = options.spec
    checkpoint = find_bridge_checkpoint(src)
    config_path = checkpoint.iter_dir.join(RUN_CONFIG_FILE)
    run_config = read_run_config(checkpoint.iter_dir)
    settings = bridge_settings(run_config, config_path)
    ckpt_format = _section(run_config, "checkpoint").get("ckpt_format", "torch_dist")
    if ckpt_format != "torch_dist":
        raise MegatronImportError(
            f"{config_path}: checkpoint.ckpt_format is {ckpt_format!r}; Bridge checkpoints are "
            f"imported from megatron-core's 'torch_dist' format only"
        )
    user_spec = None if spec is None else spec if isinstance(spec, Spec) else load_spec(spec)
    if user_spec is None:
        merged = Spec(name="megatron-bridge-run-config", settings=settings, strict=False)
    else:  # the user's own settings win over the run config's
        theirs = set(user_spec.settings)
        merged = user_spec.with_settings(
            **{k: v for k, v in Spec(settings=settings).settings.items() if k not in theirs}
        )
    plan = plan_megatron(checkpoint.iter_dir, dataclasses.replace(options, spec=merged))
    source = dict(plan.source)
    source["framework"] = "megatron-bridge"
    source["iteration"] = checkpoint.train_state["step"]
    source["bridge"] = _bridge_info(checkpoint, run_config)
    args = run_config_args(run_config)
    if args:  # Bridge saves no args: its run config names the optimizer and schedule
        record: dict[str, Any] = dict(source.get(MEGATRON_OPTIMIZER) or {"file": RUN_CONFIG_FILE})
        record["args"] = {**args, **dict(record.get("args") or {})}
        record["args_file"] = RUN_CONFIG_FILE
        source[MEGATRON_OPTIMIZER] = record
    notes = [n for n in source.pop("notes", []) if not n.startswith("vocab padding kept")]
    notes += _notes(checkpoint, run_config, source)
    if notes:
        source["notes"] = notes
    return dataclasses.replace(plan, source=source)


def _bridge_info(checkpoint: BridgeCheckpoint, run_config: dict) -> dict:
    """What the manifest records of the Bridge save beyond the torch_dist checkpoint."""
    model = _section(run_config, "model")
    checkpoint_cfg = _section(run_config, "checkpoint")
    state = {
        k: v
        for k, v in checkpoint.train_state.items()
        if isinstance(v, (bool, int)) or (isinstance(v, float) and math.isfinite(v))
    }
    info = {
        "root": checkpoint.root,
        "run_config": f"{checkpoint.iter_dir.absolute()}/{RUN_CONFIG_FILE}",
        "train_state": state,
        "model_provider": model.get("_target_") if isinstance(model.get("_target_"), str) else None,
    }
    for key in ("save_optim", "save_rng", "dist_ckpt_optim_fully_reshardable"):
        if type(checkpoint_cfg.get(key)) is bool:
            info[key] = checkpoint_cfg[key]
    optimizer = _section(run_config, "optimizer")
    for key in ("optimizer", "use_distributed_optimizer", "bf16", "fp16"):
        value = optimizer.get(key)
        if isinstance(value, (bool, str)) and len(str(value)) <= 100:
            info[f"optimizer_{key}" if key != "optimizer" else "optimizer"] = value
    return info


def _notes(checkpoint: BridgeCheckpoint, run_config: dict, source: dict) -> list[str]:
    """What a reader of the manifest should know about what was not read."""
    notes = []
    if source.get("vocab_size") is None:
        notes.append(
            "vocab padding kept: run_config.yaml records no model.vocab_size and none was given "
            "(vocab_size= / --vocab-size)"
        )
    extra = [
        name
        for name in listed(checkpoint.iter_dir) or ()
        if name not in _KNOWN_FILES and not name.endswith(".distcp")
    ]
    if extra:
        notes.append(
            f"not read from {legacy.name_of(checkpoint.iter_dir)}/: {', '.join(extra[:12])} (Bridge's "
            f"extra artifacts: hf/ = a Hugging Face export of these weights, modelopt_state/ = "
            f"ModelOpt quantization state, tokenizer files)"
        )
    if run_config.get("peft") is not None:
        notes.append("peft: Bridge saves only the adapter weights of a PEFT run")
    return notes
