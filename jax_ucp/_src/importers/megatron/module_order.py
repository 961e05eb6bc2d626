"""The order megatron-core registers a model's parameters in: its DDP grad buffers walk that
order (reversed), so it places the flat distributed-optimizer state of each parameter."""

from __future__ import annotations

import itertools
import re
from collections.abc import Callable

import numpy as np

from jax_ucp._src.importers.megatron import dcp
from jax_ucp._src.importers.megatron.common import WEIGHTS_ONLY_HINT, MegatronImportError

#: megatron-core's parameter registration order within a transformer layer (what its DDP grad
#: buffer walks, reversed), by torch_dist name after ``decoder.layers.``. The local spec's
#: input_layernorm (saved as ``linear_qkv.layer_norm_*``) precedes the attention; Transformer
#: Engine's fused LayerNormLinear registers it inside linear_qkv, after linear_proj (``_TE``).
_LAYER_ORDER = [
    f"{module}{param}"  # each module's weight, then its bias
    for module in (
        "input_layernorm.",
        "self_attention.linear_qkv.layer_norm_",
        "self_attention.linear_proj.",
        "self_attention.linear_qkv.",
        "self_attention.q_layernorm.",
        "self_attention.k_layernorm.",
        "pre_mlp_layernorm.",
        "mlp.linear_fc1.layer_norm_",
        "mlp.linear_fc1.",
        "mlp.linear_fc2.",
        "mlp.router.",
        "mlp.experts.experts.linear_fc1.",
        "mlp.experts.experts.linear_fc2.",
        "mlp.shared_experts.linear_fc1.",
        "mlp.shared_experts.linear_fc2.",
    )
    for param in ("weight", "bias")
] + ["mlp.shared_experts.gate_weight"]
_TE = [*_LAYER_ORDER[:2], *_LAYER_ORDER[4:6], *_LAYER_ORDER[2:4], *_LAYER_ORDER[6:]]
#: Expert tensors as megatron-core saves them, stacked ``[layers, experts, ...]``: SequentialMLP's
#: and (transposed from its ``weight1`` / ``weight2``) the legacy GroupedMLP's, under one name.
STACKED_EXPERT = re.compile(r"decoder\.layers\.mlp\.experts\.experts\.linear_fc[12]\.(weight|bias)")
PER_LAYER = re.compile(r"decoder\.layers\.([0-9]+)\.(.*)")
_TOP_BEFORE = ["embedding.word_embeddings.weight", "embedding.position_embeddings.weight"]
_TOP_AFTER = [
    "decoder.final_layernorm.weight",
    "decoder.final_layernorm.bias",
    "output_layer.weight",
    "output_layer.bias",
]


def _module_orders(names: list[str]) -> list[list[str]]:
    """The orders megatron-core's modules can have registered ``names`` in (local spec, then
    Transformer Engine's), when every name is known; then the order of ``.metadata``, which
    is module order only for a save that was not split over data-parallel ranks (Megatron-LM's
    default fully parallel save orders tensors by how the save work was split)."""
    out = []
    for layer in (_LAYER_ORDER, _TE):
        keys = {n: k for n in names if (k := _order_key(n, layer)) is not None}
        if len(keys) == len(names):
            order = sorted(names, key=keys.__getitem__)
            if order not in out:
                out.append(order)
    if names not in out:
        out.append(list(names))
    return out


def _order_key(name: str, layer: list[str]) -> tuple | None:
    """Where ``name`` sorts in module order (per-layer singleton_local_shards names by layer,
    then as in ``layer``; a SwiGLU ``_w`` half before its ``_v``), None if unknown."""
    if name in _TOP_BEFORE:
        return (0, _TOP_BEFORE.index(name), 0, 0)
    if name in _TOP_AFTER:
        return (2, _TOP_AFTER.index(name), 0, 0)
    stacked = name.removeprefix("decoder.layers.")
    if stacked != name and stacked in layer:  # all layers in one tensor
        return (1, 0, layer.index(stacked), 0)
    m = PER_LAYER.fullmatch(name)
    if m is None:
        return None
    rest, half = m.group(2), 0
    if rest.endswith(("_w", "_v")):
        rest, half = rest[:-2], 1 if rest.endswith("_v") else 0
    if rest not in layer:
        return None
    return (1, int(m.group(1)), layer.index(rest), half)


def in_module_order(make: Callable, checkpoint: dcp.DcpCheckpoint, names: list[str], *a, **k):
    """``make``'s state laid out over the first module order of ``names`` that fits the saved
    buckets and whose masters equal (fp32) or round to (bf16) the model weights of the small
    tensors (norms, biases: a wrong order misplaces them); the first error if none fits.

    Args:
        make: builds the state per order (``distopt.bucket_states``, ...).
        checkpoint: the torch_dist checkpoint.
        names: the model's parameter names.
        *a: passed on to ``make``.
        **k: passed on to ``make``.
    """
    first: MegatronImportError | None = None
    orders = _module_orders(names)
    # the legacy GroupedMLP's experts are saved like SequentialMLP's but sit in the grad buffer
    # as one weight1 / weight2 per layer: tried when the SequentialMLP layout does not fit
    grouped = (False, True) if any(STACKED_EXPERT.fullmatch(n) for n in names) else (False,)
    for order, is_grouped in itertools.product(orders, grouped):
        try:
            states = make(checkpoint, order, *a, grouped=is_grouped, **k)
        except MegatronImportError as e:
            first = first or e
            continue
        wrong = states.spot_check()
        if wrong is None:
            return states
        if first is None:
            rounds = "equal" if checkpoint.tensors[wrong].dtype == np.float32 else "round to"
            experts = ", each with SequentialMLP and GroupedMLP experts" if len(grouped) > 1 else ""
            first = MegatronImportError(
                f"tensor {wrong!r}: the fp32 master found in the {states.sharding} state of "
                f"{states.where} does not {rounds} the model weight in megatron-core's parameter "
                f"order (tried {len(orders)}: local spec, Transformer Engine, .metadata"
                f"{experts}); another megatron-core version or DDP config? {WEIGHTS_ONLY_HINT}"
            )
    assert first is not None  # at least one order was tried
    raise first
