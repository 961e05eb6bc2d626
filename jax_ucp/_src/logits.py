"""``verify(ckpt, against=src, logits=True)``: does the converted checkpoint compute what the
source model computes? One fixed batch of token ids goes through the source loaded by
transformers' own ``from_pretrained`` (torch, CPU, fp32, eval mode) and through the converted
weights in jax_ucp's flax ``TransformerLM`` (restored with the family's shipped ``hf_*`` spec,
``jax_ucp._src.models.hf_families``); the largest absolute difference of the logits is reported
against a stated tolerance.

Bit-exact tensors (``jax_ucp._src.against``) prove the bytes were copied; equal logits prove they
landed where a model reads them (q/k/v merged in the right head order, gate/up, transposes).
Only models ``TransformerLM`` computes are compared (the ``model_type`` families of
``hf_families.FAMILIES``: Llama, Mistral, Qwen2, Qwen3, GPT-2, Phi-3, Gemma 2/3, Mixtral,
Qwen2-MoE, Qwen3-MoE, Llama 4 text, Granite, OLMo 2, StableLM); any other, or a config field a family does not compute, is refused, never skipped. The torch model is freed before the checkpoint is restored: the two
copies of the weights are never in memory at once.
"""

from __future__ import annotations

import dataclasses
import gc
import math
import os
from collections.abc import Callable
from typing import Any

import numpy as np

from jax_ucp._src.errors import LanguageError, RequestError, SourceError
from jax_ucp._src.format import files
from jax_ucp._src.language import apply_spec_to_tree, load_spec
from jax_ucp._src.models import TransformerLM
from jax_ucp._src.models.hf_families import FAMILIES, LACKS, canonical_config
from jax_ucp._src.models.transformer import hf_model
from jax_ucp._src.restoring.inspecting import inspect
from jax_ucp._src.restoring.restore_entry import restore

__all__ = [
    "DEFAULT_TOLERANCE",
    "SUPPORTED",
    "LogitsComparison",
    "checked_tolerance",
    "compare_export_logits",
    "compare_logits",
]

#: ``model_type`` values of config.json whose model ``TransformerLM`` computes
SUPPORTED = tuple(FAMILIES)
#: largest absolute difference of fp32 logits accepted by default (float32 sums taken in
#: another order differ by ~1e-6 on small models; a misplaced weight moves them by far more)
DEFAULT_TOLERANCE = 1e-4
_BATCH = (2, 16)  # the fixed batch: 2 sequences of 16 token ids (fewer if the model is shorter)
MAX_CONFIG_BYTES = 16 << 20  # a config.json read whole: larger is no model's


@dataclasses.dataclass
class LogitsComparison:
    """The logits of one batch through the source (transformers) and the checkpoint (flax)."""

    max_abs_diff: float
    tolerance: float
    batch: tuple[int, int]
    source: str  # what computed the source's logits (transformers version, class, folder)
    tree: str  # the checkpoint's tree the weights came from ("params" or "model_params")

    @property
    def ok(self) -> bool:
        """Within the tolerance (a NaN difference is not)."""
        return bool(self.max_abs_diff <= self.tolerance)

    def describe(self) -> str:
        """One line for the report: the difference, the tolerance, the batch and who computed."""
        sign = "<=" if self.ok else ">"
        return (
            f"logits of one batch {list(self.batch)}: max |diff| {self.max_abs_diff:.3g} {sign} "
            f"tolerance {self.tolerance:g} ({self.source} vs the checkpoint's {self.tree} in "
            f"jax_ucp.models.TransformerLM, fp32)"
        )


def checked_tolerance(value: Any) -> float:
    """The logits tolerance as a float: a finite number >= 0 (None: :data:`DEFAULT_TOLERANCE`).
    Text, a bool (``True`` is no tolerance of 1.0), a negative, NaN or infinite value is refused
    naming the option: a tolerance that accepts everything proves nothing."""
    if value is None:
        return DEFAULT_TOLERANCE
    if isinstance(value, bool) or not isinstance(value, int | float | np.integer | np.floating):
        raise RequestError(
            f"logits_tolerance (--logits-tolerance) {str(value)[:100]!r}: expected a number "
            f">= 0, found {type(value).__name__}"
        )
    tolerance = float(value)
    if not (math.isfinite(tolerance) and tolerance >= 0):
        raise RequestError(
            f"logits_tolerance (--logits-tolerance) {tolerance}: expected a finite number >= 0"
        )
    return tolerance


def _checked_numbers(config: dict, cfg: Any, path: str) -> None:
    """Refuses what ``hf_model`` (which refuses any size or rate it reads that no model has)
    would take as a value of its own: a width the heads do not divide without a ``head_dim``
    (floored); naming the field and the file."""
    heads = cfg.num_attention_heads
    if cfg.hidden_size % heads and config.get("head_dim") is None:
        raise SourceError(
            f"{path}: hidden_size {cfg.hidden_size} is not a multiple of num_attention_heads {heads}"
        )


def model_folder(src: str) -> str:
    """The folder whose ``config.json`` names the source's architecture: ``src`` itself (a
    Hugging Face folder, a Trainer ``checkpoint-N/``), else the folder holding it (``src`` a
    weights file, DeepSpeed's ``global_stepN/``, FSDP's ``pytorch_model_fsdp_0/``)."""
    src = os.fspath(src)
    here = src if os.path.isdir(src) else os.path.dirname(os.path.abspath(src))
    for folder in (here, os.path.dirname(os.path.abspath(here))):
        if os.path.isfile(os.path.join(folder, "config.json")):
            return folder
    raise SourceError(
        f"{src}: no config.json here or in the folder above: --logits needs the Hugging Face "
        f"config.json of the model (supported model_type: {', '.join(SUPPORTED)})"
    )


def read_config(folder: str) -> dict:
    """The folder's ``config.json``, bounded, and refused unless its model is one
    ``TransformerLM`` computes, naming what it found."""
    path = files.inside_checkpoint(folder, "config.json", f"{folder}: the model's")
    return checked_config(config_object(files.read_regular(path, MAX_CONFIG_BYTES), path), path)


def config_object(raw: bytes, path: str) -> dict:
    """A ``config.json``'s bytes (read from ``path``) as the JSON object it must hold."""
    config = files.strict_json(raw, path)
    if not isinstance(config, dict):
        raise SourceError(f"{path}: expected a JSON object")
    return config


def checked_config(config: dict, path: str) -> dict:
    """``config`` (a config.json's object, read from ``path``) canonical, refused unless its
    model is one ``TransformerLM`` computes, naming what it found."""
    model_type = config.get("model_type")
    if model_type not in SUPPORTED or "auto_map" in config:
        found = "custom code (auto_map)" if "auto_map" in config else repr(model_type)
        lacks = LACKS.get(str(model_type))
        lacks = f" (TransformerLM lacks {lacks})" if lacks else ""
        raise SourceError(
            f"--logits supports model_type {', '.join(SUPPORTED)} (the models "
            f"jax_ucp.models.TransformerLM computes); found {found}{lacks} in {path}"
        )
    return canonical_config(config)


def compare_logits(
    ckpt: str | os.PathLike,
    src: str | os.PathLike,
    *,
    tolerance: float | None = None,
    source_weights: Callable[[str], dict[str, np.ndarray]] | None = None,
) -> LogitsComparison:
    """The logits of one fixed batch through the source loaded by transformers'
    ``from_pretrained`` and through the checkpoint's weights in ``TransformerLM``.

    Args:
        ckpt: the converted checkpoint.
        src: the source it was converted from (a Hugging Face folder, a Trainer ``checkpoint-N/``,
            or a folder under one whose ``config.json`` names the model).
        tolerance: the largest absolute difference accepted (None: :data:`DEFAULT_TOLERANCE`).
        source_weights: for a source holding no weights ``from_pretrained`` reads (a torch DCP
            folder, DeepSpeed, torch.save files beside the config.json), ``source_weights(tree)``
            gives its weights by Hugging Face name, read by its framework's own loader
            (``against.source_weights``); transformers' model is built from the config.json and
            given them.
    """
    tolerance = checked_tolerance(tolerance)
    folder = model_folder(os.fspath(src))
    config = read_config(folder)
    cfg, spec = family_model(config, f"{folder}/config.json")
    tokens = batch(cfg)
    torch, transformers = _torch_and_transformers()
    tree, held = _model_tree(os.fspath(ckpt))
    _check_declared_size(f"{folder}/config.json", cfg, os.fspath(ckpt), tree, held)
    major = int(transformers.__version__.split(".")[0])
    fp32 = {"dtype" if major >= 5 else "torch_dtype": torch.float32}  # transformers 4's name
    if source_weights is not None and not _holds_pretrained_weights(folder):
        model, source = _model_from_config(folder, source_weights(tree), torch, transformers, fp32)
    else:
        model, source = _pretrained_model(folder, transformers, fp32, config["model_type"])
    model.eval()
    with torch.no_grad():
        want = source_logits(model, torch.from_numpy(tokens)).float().numpy()
    del model  # the torch model (and the source's weights) freed before the checkpoint's
    gc.collect()
    got = checkpoint_logits(
        os.fspath(ckpt), cfg, load_spec(spec, **cfg.head_settings), tokens, tree
    )
    if got.shape != want.shape:
        raise SourceError(
            f"{ckpt}: logits of shape {list(got.shape)}, the source's {list(want.shape)}"
        )
    diff = float(np.max(np.abs(got.astype(np.float64) - want.astype(np.float64))))
    return LogitsComparison(diff, tolerance, (tokens.shape[0], tokens.shape[1]), source, tree)


def source_logits(model: Any, tokens: Any) -> Any:
    """transformers' logits of ``tokens`` (text only) through ``model``. A multimodal model
    whose language model is a causal LM of its own (Llama 4's) is asked through it: that is
    what its forward runs on text, and transformers 5.24's ``Llama4ForConditionalGeneration``
    forward fails on text alone (its output lacks ``image_outputs``)."""
    language = getattr(model, "language_model", None)
    if language is not None and hasattr(language, "lm_head"):
        return language(tokens).logits
    return model(tokens).logits


def compare_export_logits(
    ckpt: str,
    config: dict,
    where: str,
    weights: Callable[[], dict[str, Any]],
    tree: str,
    *,
    spec: Any = None,
    tolerance: float | None = None,
    source: str = "the export",
    recorded: dict | None = None,
) -> LogitsComparison:
    """The logits of one fixed batch through ``TransformerLM`` from an export's weights and
    from those of the checkpoint ``ckpt`` it was written from (no torch needed).

    Args:
        ckpt: the checkpoint.
        config: the model's config.json (the export's, else the one the checkpoint recorded).
        where: where ``config`` was read, for messages.
        weights: the export's model weights by its names, as its import reads them; mapped to
            the flax tree by the family's spec (its files' names, else its model's).
        tree: the checkpoint's tree of the same weights (``params`` or ``model_params``).
        spec: the spec the export ran backwards (the checkpoint holds its flax targets); None:
            the checkpoint holds the export's names.
        tolerance: the largest absolute difference accepted (None: :data:`DEFAULT_TOLERANCE`).
        source: what the export is, for the report.
        recorded: the config the checkpoint recorded (None: none), its model for the
            checkpoint's logits."""
    tolerance = checked_tolerance(tolerance)
    cfg, family = family_model(checked_config(config, where), where)
    own = family_model(checked_config(recorded, where), where)[0] if recorded else cfg
    tokens = batch(cfg)
    _check_declared_size(where, cfg, ckpt, tree, _model_tree(ckpt, tree)[1])
    named = {"params": weights()}
    family_spec = load_spec(family, **cfg.head_settings)
    names = ["files", "state_dict"] if "hf_names" in family_spec.settings else [None]
    for i, name in enumerate(names):  # the names the export holds: its files' or its model's
        by_names = family_spec.with_settings(hf_names=name) if name else family_spec
        try:
            params = apply_spec_to_tree(by_names, named)["params"]
            break
        except LanguageError:
            if i == len(names) - 1:
                raise
    want = model_logits(cfg, params, tokens)
    del named, params
    gc.collect()
    got = checkpoint_logits(ckpt, own, None if spec is not None else by_names, tokens, tree)
    diff = float(np.max(np.abs(got.astype(np.float64) - want.astype(np.float64))))
    return LogitsComparison(diff, tolerance, (tokens.shape[0], tokens.shape[1]), source, tree)


def family_model(config: dict, where: str) -> tuple[Any, str]:
    """(the ``LMConfig``, the family spec's name) of a checked config.json read from ``where``;
    a value the family does not compute is a ``SourceError`` naming it."""
    try:
        cfg, spec = hf_model(config)
    except (RequestError, KeyError, TypeError, ValueError, ArithmeticError) as e:
        raise SourceError(
            f"--logits supports the {config['model_type']} models TransformerLM computes; "
            f"{where}: {e}"
        ) from None
    _checked_numbers(config, cfg, where)
    return cfg, spec


def batch(cfg: Any) -> np.ndarray:
    """The fixed batch of token ids (2 sequences of 16, fewer if the model is shorter)."""
    seq = max(1, min(_BATCH[1], cfg.max_position_embeddings))
    return np.random.default_rng(0).integers(0, cfg.vocab_size, (_BATCH[0], seq))


def _torch_and_transformers() -> tuple[Any, Any]:
    """torch and transformers (the hf extra), or the extra to install."""
    try:
        import torch  # pyright: ignore[reportMissingImports]  # the hf extra
        import transformers  # pyright: ignore[reportMissingImports]
    except ImportError as e:
        raise SourceError(
            f"--logits loads the source with transformers' from_pretrained, which is not "
            f"installed here ({e}); install the extra: pip install 'jax_ucp[hf]'"
        ) from None
    return torch, transformers


def _model_tree(ckpt: str, tree: str | None = None) -> tuple[str, int]:
    """The checkpoint's tree of model weights (``tree``, else ``model_params`` when the import
    kept a model precision apart from fp32 masters, else ``params``) and its element count."""
    tensors = inspect(ckpt).tensors
    names = {e.name.split("/", 1)[0] for e in tensors}
    tree = tree or ("model_params" if "model_params" in names else "params")
    held = sum(math.prod(e.shape) for e in tensors if e.name.split("/", 1)[0] == tree)
    return tree, held


def _check_declared_size(where: str, cfg: Any, ckpt: str, tree: str, held: int) -> None:
    """Refuses a config.json declaring a bigger model than the checkpoint holds, before
    from_pretrained allocates the declared size (an untrusted config may declare any)."""
    dims = (cfg.vocab_size, cfg.hidden_size, cfg.num_layers, cfg.ffn_hidden_size)
    declared = cfg.parameter_count()
    if min(dims) <= 0 or cfg.groups <= 0 or declared > held:
        raise SourceError(
            f"{where} declares a model of {declared:,} parameters (vocab, hidden, "
            f"layers, intermediate {list(dims)}); the checkpoint {ckpt} holds {held:,} in "
            f"'{tree}': not the model it was converted from (from_pretrained would allocate "
            f"the declared size before reading a weight)"
        )


#: the transformers Auto class of a family whose model is no causal LM (its text logits compared)
_AUTO: dict[str, str] = dict.fromkeys(
    ("kimi_k25", "llama4", "qwen3_5", "qwen3_5_moe", "gemma4"), "AutoModelForImageTextToText"
)


def _pretrained_model(
    folder: str, transformers: Any, fp32: dict, model_type: str
) -> tuple[Any, str]:
    """(transformers' model loaded from ``folder`` (local files only, no code from the folder)
    in fp32, what it is); a weight the folder lacks is refused (it would be initialised at
    random, not compared)."""
    try:
        auto = _AUTO.get(model_type, "AutoModelForCausalLM")
        loaded: Any = getattr(transformers, auto).from_pretrained(
            folder,
            local_files_only=True,
            trust_remote_code=False,
            output_loading_info=True,
            **fp32,
        )
        model, info = loaded  # (model, loading info) with output_loading_info=True
    except Exception as e:  # transformers' own refusal of the folder
        raise SourceError(
            f"{folder}: transformers {transformers.__version__} from_pretrained cannot load it "
            f"({type(e).__name__}: {str(e)[:300]}); --logits needs the model's weights there "
            f"in a form from_pretrained reads (model.safetensors, pytorch_model.bin)"
        ) from None
    missing = list(info.get("missing_keys") or ())
    if missing:
        raise SourceError(
            f"{folder}: from_pretrained found no weights for {len(missing)} parameters "
            f"({', '.join(sorted(missing)[:3])}, ...): they would be random, not the run's"
        )
    return model, f"transformers {transformers.__version__} {type(model).__name__} from {folder}"


#: the weight files ``from_pretrained`` reads from a folder
PRETRAINED_WEIGHTS = (
    "model.safetensors",
    "model.safetensors.index.json",
    "pytorch_model.bin",
    "pytorch_model.bin.index.json",
)


def _holds_pretrained_weights(folder: str) -> bool:
    return any(os.path.lexists(os.path.join(folder, name)) for name in PRETRAINED_WEIGHTS)


def _model_from_config(
    folder: str, weights: dict[str, np.ndarray], torch: Any, transformers: Any, fp32: dict
) -> tuple[Any, str]:
    """(transformers' model of the ``folder``'s config.json (built by ``from_config`` in fp32,
    no code from the folder) holding ``weights`` (the source's, by Hugging Face name, read by
    its framework's loader), what it is); a weight the model has and ``weights`` lack (a tied
    output layer apart), or one it has not, is refused."""
    config = transformers.AutoConfig.from_pretrained(
        folder, local_files_only=True, trust_remote_code=False
    )
    model: Any = transformers.AutoModelForCausalLM.from_config(config, **fp32)
    # bf16 / fp16 weights (ml_dtypes' bfloat16 torch cannot take) computed in fp32, as the
    # checkpoint's are: both sides then hold the same values, and the default tolerance holds
    state = {name: torch.from_numpy(np.asarray(v, np.float32)) for name, v in weights.items()}
    result = model.load_state_dict(state, strict=False)
    tied = {"lm_head.weight"} if getattr(config, "tie_word_embeddings", False) else set()
    missing = sorted(set(result.missing_keys) - tied)
    if missing or result.unexpected_keys:
        raise SourceError(
            f"{folder}: the source's weights do not fill transformers' "
            f"{type(model).__name__}: {len(missing)} missing ({', '.join(missing[:3])}), "
            f"{len(result.unexpected_keys)} not in the model "
            f"({', '.join(sorted(result.unexpected_keys)[:3])})"
        )
    if tied:
        model.tie_weights()
    return model, (
        f"transformers {transformers.__version__} {type(model).__name__} built from "
        f"{folder}/config.json, its {len(state)} weights read by the source framework's loader"
    )


def checkpoint_logits(ckpt: str, cfg: Any, spec: Any, tokens: np.ndarray, tree: str) -> np.ndarray:
    """The logits ``TransformerLM(cfg)`` computes for ``tokens`` from the checkpoint's model
    weights (``tree``, :func:`_model_tree`), restored through ``spec`` (the family's; None: the
    flax tree as saved) alone: no optimizer state is read."""
    return model_logits(cfg, restore(ckpt, spec=spec, select=rf"{tree}/.*")[tree], tokens)


def model_logits(cfg: Any, params: Any, tokens: np.ndarray) -> np.ndarray:
    """The logits ``TransformerLM(cfg)`` computes for ``tokens`` from the flax ``params``, each
    weight as fp32 (bf16 / fp16 ones too, as the torch side computes)."""
    import jax
    import jax.numpy as jnp

    params = {"params": jax.tree.map(lambda a: np.asarray(a).astype(np.float32), params)}
    logits = TransformerLM(cfg).apply(params, jnp.asarray(tokens, jnp.int32))
    return np.asarray(logits, np.float32)
