"""torchtune's parameter order, rebuilt by torchtune's own model builder when torchtune is
installed: what numbers an optimizer saved keyed by index (the single-device full-finetune
recipes' ``recipe_state.pt``, the asynchronous ``dist_epoch_N/``), as the Trainer's order is
rebuilt with transformers (:mod:`hf_trainer`).

The checkpoint does not name the recipe's builder (``llama3_2_1b``, ``llama3_1_8b``,
``mistral_7b``, ...), and every Llama-family builder makes the same ``TransformerDecoder`` (token
embeddings, per layer attention q/k/v/output, MLP w1/w2/w3, the two RMS norms, the final norm and
output projection, in that order). So the model is built on the meta device by torchtune's
``llama3_2`` component builder (the one of them taking ``tie_word_embeddings``) with the sizes the
checkpoint's tensors have, and its order is used only when it makes exactly the checkpoint's
parameters, every name and shape: anything else (a bias, another block, an extra module) is no
Llama-family model and the caller refuses as without torchtune.
"""

from __future__ import annotations

import importlib.util
import math
import re
from collections.abc import Mapping

from jax_ucp._src.errors import SourceError

__all__ = ["builder_order", "torchtune_builder"]

_LAYER = re.compile(r"^layers\.([0-9]+)\.", re.ASCII)


def torchtune_builder():
    """(torch, torchtune, the ``llama3_2`` component builder), or None when not installed
    (asked first without importing torch)."""
    if importlib.util.find_spec("torchtune") is None:
        return None
    try:
        import torch  # pyright: ignore[reportMissingImports]  # the torch extra
        import torchtune  # pyright: ignore[reportMissingImports]  # installed by the user
        from torchtune.models.llama3_2._component_builders import (  # pyright: ignore[reportMissingImports]
            llama3_2,
        )
    except ImportError:
        return None
    return torch, torchtune, llama3_2


def _sizes(shapes: Mapping[str, tuple[int, ...]], where: str) -> dict | None:
    """The builder's arguments from the parameters' shapes; None when they are not a Llama's."""
    try:
        vocab, dim = shapes["tok_embeddings.weight"]
        q_rows, _ = shapes["layers.0.attn.q_proj.weight"]
        kv_rows, _ = shapes["layers.0.attn.k_proj.weight"]
        hidden, _ = shapes["layers.0.mlp.w1.weight"]
    except (KeyError, ValueError):
        return None
    layers = {int(m.group(1)) for n in shapes if (m := _LAYER.match(n))}
    if q_rows != dim or not layers or layers != set(range(max(layers) + 1)):
        return None  # the builder's head_dim is embed_dim // num_heads: q_proj is dim x dim
    # any head_dim dividing both gives the same parameters (the order does not depend on it)
    head_dim = math.gcd(dim, kv_rows)
    if head_dim <= 0:
        raise SourceError(f"{where}: attention sizes {dim} / {kv_rows}: not a model's")
    return {
        "vocab_size": vocab,
        "num_layers": len(layers),
        "num_heads": dim // head_dim,
        "num_kv_heads": kv_rows // head_dim,
        "embed_dim": dim,
        "max_seq_len": 1,
        "intermediate_dim": hidden,
        "tie_word_embeddings": "output.weight" not in shapes,
    }


def builder_order(
    shapes: Mapping[str, tuple[int, ...]], where: str
) -> tuple[list[str], str] | str | None:
    """``model.named_parameters()`` order of torchtune's Llama-family model with exactly these
    parameters (torchtune's names -> shapes) and how it was built; a reason when torchtune's
    builder makes other parameters; None when torchtune is not installed.

    Args:
        shapes: the checkpoint's model parameters under torchtune's names.
        where: the checkpoint, for errors.
    """
    found = torchtune_builder()
    if found is None:
        return None
    torch, torchtune, llama3_2 = found
    sizes = _sizes(shapes, where)
    if sizes is None:
        return "its tensors are not a Llama-family TransformerDecoder's"
    with torch.device("meta"):
        model = llama3_2(**sizes)
    built = {n: tuple(p.shape) for n, p in model.named_parameters()}
    if built != {n: tuple(s) for n, s in shapes.items()}:
        other = sorted(set(built) ^ set(shapes)) or [
            n for n in built if built[n] != tuple(shapes[n])
        ]
        return f"torchtune's llama3_2 builder makes other parameters ({other[:3]})"
    # the heads are left out: any that fit the shapes build the same parameters in one order
    shown = ("vocab_size", "num_layers", "embed_dim", "intermediate_dim", "tie_word_embeddings")
    args = ", ".join(f"{k}={sizes[k]}" for k in shown)
    version = getattr(torchtune, "__version__", "?")
    return list(built), f"torchtune {version} llama3_2({args}) on the meta device"
