"""Distributed-optimizer state saved in model space (``fully_reshardable``, megatron-core < 0.15's
``fully_sharded_model_space``): one ``optimizer.state.<state>.<parameter>`` tensor per state and
parameter, shaped like the parameter or N-D flattened (:func:`unflatten`)."""

from __future__ import annotations

import re
from typing import Any

import numpy as np

from jax_ucp._src.importers.megatron import dcp
from jax_ucp._src.importers.megatron.common import (
    SUPPORTED_LAYOUTS,
    WEIGHTS_ONLY_HINT,
    MegatronImportError,
    element_count,
    is_optimizer_name,
    sharding_type,
)
from jax_ucp._src.importers.plan import ADAM_TREES

_OPTIMIZER_PREFIX = "optimizer.state."


# megatron-core's optimizer state names, and where each goes in the output tree
OPTIMIZER_STATE_TREES = {"param": ("params",), "fp32_param": ("params",), **ADAM_TREES}


def model_space_tensors(checkpoint: dcp.DcpCheckpoint, common: Any) -> dict[str, dict[str, str]]:
    """``{parameter: {state name: tensor name}}`` of the model-space optimizer state."""
    found: dict[str, dict[str, str]] = {}
    for tensor in (n for n in checkpoint.tensors if is_optimizer_name(n)):
        # a ChainedOptimizer (MoE: dense + experts) prefixes each member's keys with chained_N.
        m = re.match(r"(chained_[0-9]+\.)?" + re.escape(_OPTIMIZER_PREFIX), tensor)
        if m is None:
            raise MegatronImportError(
                f"tensor {tensor!r} in {checkpoint.index}: unsupported "
                f"distributed-optimizer layout ({sharding_type(common)!r}); "
                f"{SUPPORTED_LAYOUTS}. {WEIGHTS_ONLY_HINT}"
            )
        state_name, _, parameter = tensor[m.end() :].partition(".")
        if state_name in found.get(parameter, {}):
            raise MegatronImportError(
                f"{checkpoint.index}: both {found[parameter][state_name]!r} and "
                f"{tensor!r} hold {state_name!r} of {parameter!r}"
            )
        if state_name not in OPTIMIZER_STATE_TREES:
            raise MegatronImportError(
                f"tensor {tensor!r} in {checkpoint.index}: unknown optimizer state {state_name!r}"
            )
        found.setdefault(parameter, {})[state_name] = tensor
    return found


def check_model_space_tensors(
    checkpoint: dcp.DcpCheckpoint,
    common: Any,
    common_path: str,
    optimizer_tensors: dict[str, dict[str, str]],
    model_names: list[str],
) -> None:
    """One master weight and both moments per parameter, shaped like it, none for an unknown one.

    Args:
        checkpoint: the torch_dist checkpoint.
        common: its loaded ``common.pt``.
        common_path: the path of ``common.pt``.
        optimizer_tensors: {parameter: {state: tensor name}} found.
        model_names: the model tensors.
    """
    metadata = checkpoint.index
    sharding = sharding_type(common)
    if sharding not in (None, "fully_reshardable", "fully_sharded_model_space"):
        raise MegatronImportError(
            f"{common_path}: distributed optimizer sharding type {sharding!r} is not supported "
            f"({SUPPORTED_LAYOUTS}). {WEIGHTS_ONLY_HINT}"
        )
    for parameter in model_names:
        have = optimizer_tensors.get(parameter, {})
        if "param" in have and "fp32_param" in have:
            raise MegatronImportError(
                f"tensor {parameter!r}: both {have['param']!r} and {have['fp32_param']!r} "
                f"in {metadata}; expected one master-weight tensor"
            )
        missing = [k for k in ("exp_avg", "exp_avg_sq") if k not in have] + (
            [] if ("param" in have or "fp32_param" in have) else ["param"]
        )
        if missing:
            raise MegatronImportError(
                f"tensor {parameter!r}: optimizer state {missing} missing in {metadata}"
            )
    for parameter, have in optimizer_tensors.items():
        if parameter not in checkpoint.tensors:
            raise MegatronImportError(
                f"optimizer state {sorted(have.values())} refers to model tensor {parameter!r} "
                f"that is not in {metadata}"
            )
        model = checkpoint.tensors[parameter]
        chunk_shapes = {c.sizes for c in model.chunks}
        for tensor in have.values():
            shape = checkpoint.tensors[tensor].shape
            flattened = sharding == "fully_sharded_model_space" and any(
                shape == flattened_shape(model.shape, local) for local in chunk_shapes
            )
            if shape != model.shape and not flattened:
                raise MegatronImportError(
                    f"tensor {tensor!r}: shape {list(shape)} is neither the parameter's "
                    f"{list(model.shape)} nor its N-D flattened form (chunks "
                    f"{sorted(chunk_shapes)}) in {metadata}"
                )


def flattened_shape(shape: tuple[int, ...], local: tuple[int, ...]) -> tuple[int, ...]:
    """How megatron-core < 0.15 saves model-space optimizer state with ``flattened_range``
    (``fully_sharded_model_space``): a tensor of global ``shape`` held in chunks of ``local``
    shape becomes ``[X // x, Y // y, ..., x * y * ...]``, the last axis each chunk's elements
    in C order, split over DP ranks by flat ranges."""
    return (*(g // n for g, n in zip(shape, local)), element_count(local))


def unflatten(flat: np.ndarray, shape: tuple[int, ...], name: str = "") -> np.ndarray:
    """The global ``shape`` array of an N-D flattened tensor (inverse of ``flattened_shape``).

    Args:
        flat: the flattened tensor as saved.
        shape: its global shape.
        name: the tensor, for errors.
    """
    grid = flat.shape[:-1]
    if len(grid) != len(shape) or any(n == 0 or g % n for g, n in zip(shape, grid)):
        raise MegatronImportError(
            f"tensor {name!r}: shape {list(flat.shape)} is not an N-D flattened form of "
            f"{list(shape)}"
        )
    local = tuple(g // n for g, n in zip(shape, grid))
    if element_count(local) != flat.shape[-1]:
        raise MegatronImportError(
            f"tensor {name!r}: flattened chunks of {flat.shape[-1]} elements, but {list(shape)} "
            f"over a {list(grid)} grid has chunks of {list(local)}"
        )
    # [f0, f1, ..., n] -> [f0, l0, f1, l1, ...] -> [f0 * l0, f1 * l1, ...]
    blocks = flat.reshape(*grid, *local)
    order = [i for k in range(len(shape)) for i in (k, len(shape) + k)]
    return blocks.transpose(order).reshape(shape)
