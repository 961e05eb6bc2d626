"""Optax transformations that step as torch's Muon and Hugging Face's Adafactor do, where optax's
own differ (``optax.contrib.muon`` bias-corrects its momentum and orthogonalizes in float32;
``optax.adafactor`` factors only dimensions of 128 and more and has no relative step): a run
continued in JAX takes the next steps torch would have."""

from __future__ import annotations

import functools
import math
from typing import Any, NamedTuple

__all__ = ["HfAdafactorState", "TorchMuonState", "hf_adafactor", "torch_muon"]


class TorchMuonState(NamedTuple):
    """torch Muon's ``momentum_buffer`` per parameter."""

    momentum: Any


class HfAdafactorState(NamedTuple):
    """transformers' Adafactor state: its step and, per parameter, ``exp_avg_sq_row`` /
    ``exp_avg_sq_col`` (factored, else a zero-size placeholder), ``exp_avg_sq`` (unfactored)
    and ``exp_avg`` (with ``beta1``; else a placeholder)."""

    count: Any
    row: Any
    col: Any
    sq: Any
    avg: Any


def _matmul_sequential(a, b):
    """``a @ b`` of bfloat16 matrices as torch's CPU kernel sums it: float32 products added in
    order of the inner index (an XLA dot sums in another order and rounds otherwise)."""
    import jax
    import jax.numpy as jnp

    a, b = a.astype(jnp.float32), b.astype(jnp.float32)

    def add(k, acc):
        col = jax.lax.dynamic_slice_in_dim(a, k, 1, 1)
        row = jax.lax.dynamic_slice_in_dim(b, k, 1, 0)
        return acc + col * row

    zeros = jnp.zeros((a.shape[0], b.shape[1]), jnp.float32)
    return jax.lax.fori_loop(0, a.shape[1], add, zeros)


def _fma(scalar: float, x, t):
    """``scalar * x + t`` rounded once, as torch's fused multiply-add gives it: ``x`` holds
    bfloat16 values, so each half of the float32 ``scalar`` times it is exact, and the sum is
    carried with its rounding error (Knuth's two-sum)."""
    import numpy as np

    whole = np.float32(scalar)
    hi = float(np.array([whole], np.float32).view(np.uint32)[0] & np.uint32(0xFFFFF000))
    hi = float(np.array([hi], np.uint32).view(np.float32)[0])
    lo = float(whole - np.float32(hi))
    p1, p2 = hi * x, lo * x
    s = p1 + t
    back = s - p1
    err = (p1 - (s - back)) + (t - back)
    return s + (err + p2)


def newton_schulz_like_torch(g, coefficients: tuple[float, float, float], steps: int, eps: float):
    """torch's ``_zeropower_via_newtonschulz``: in bfloat16, normalized by the Frobenius norm
    (clamped to ``eps``), ``steps`` quintic iterations on the wide orientation."""
    import jax.numpy as jnp

    a, b, c = coefficients
    f32, bf16 = jnp.float32, jnp.bfloat16
    x = g.astype(bf16)
    wide = x.shape[0] > x.shape[1]
    if wide:
        x = x.T
    norm = jnp.linalg.norm(x.astype(f32)).astype(bf16).astype(f32)
    x = (x.astype(f32) / jnp.maximum(norm, eps)).astype(bf16)
    for _ in range(steps):  # torch.addmm: fma(beta, C, alpha * (A @ B)), in float32
        gram = _matmul_sequential(x, x.T).astype(bf16)
        poly = _fma(b, gram.astype(f32), c * _matmul_sequential(gram, gram)).astype(bf16)
        x = _fma(a, x.astype(f32), _matmul_sequential(poly, x)).astype(bf16)
    return x.T if wide else x


@functools.cache
def _jitted_newton_schulz() -> Any:
    """Compiled once per shape and settings (an eager step would trace its loops every call)."""
    import jax

    return jax.jit(newton_schulz_like_torch, static_argnums=(1, 2, 3))


def adjusted_lr_ratio(adjust_lr_fn: str | None, shape: tuple[int, ...]) -> float:
    """torch Muon's ``_adjust_lr`` factor for a parameter of ``shape``."""
    rows, cols = shape[:2]
    if adjust_lr_fn in (None, "original"):
        return math.sqrt(max(1, rows / cols))
    return 0.2 * math.sqrt(max(rows, cols))  # "match_rms_adamw"


def torch_muon(
    learning_rate: float,
    *,
    momentum: float,
    nesterov: bool,
    weight_decay: float,
    ns_coefficients: tuple[float, float, float],
    ns_steps: int,
    eps: float,
    adjust_lr_fn: str | None,
) -> Any:
    """``torch.optim.Muon``'s step (2-D parameters): the buffer ``lerp``\\ ed to the gradient,
    Nesterov's look-ahead, bfloat16 Newton-Schulz, the learning rate adjusted for the shape and
    decoupled weight decay ``lr * weight_decay * param``."""
    import jax
    import jax.numpy as jnp

    lr, w = learning_rate, 1.0 - momentum

    def init(params):
        return TorchMuonState(jax.tree.map(jnp.zeros_like, params))

    def update(updates, state, params=None):
        if params is None:
            raise ValueError("torch Muon's weight decay needs the params: tx.update(g, s, params)")
        buf = jax.tree.map(lambda b, g: b + w * (g - b), state.momentum, updates)

        def one(g, b, p):
            u = g + momentum * (b - g) if nesterov else b
            o = _jitted_newton_schulz()(u, ns_coefficients, ns_steps, eps).astype(jnp.float32)
            scaled = lr * adjusted_lr_ratio(adjust_lr_fn, p.shape)
            return (-(lr * weight_decay) * p - scaled * o).astype(p.dtype)

        return jax.tree.map(one, updates, buf, params), TorchMuonState(buf)

    return _gradient_transformation(init, update)


def _gradient_transformation(init, update) -> Any:
    import optax

    return optax.GradientTransformation(init, update)


def factored(shape: tuple[int, ...]) -> bool:
    """transformers' Adafactor factors the second moment of every parameter of 2 or more dims."""
    return len(shape) >= 2


def hf_adafactor(
    *,
    lr: float | None,
    eps: tuple[float, float],
    clip_threshold: float,
    decay_rate: float,
    beta1: float | None,
    weight_decay: float,
    scale_parameter: bool,
    relative_step: bool,
    warmup_init: bool,
) -> Any:
    """``transformers.optimization.Adafactor``'s step, its updates (learning rate and decay
    included) as optax updates: ``tx.update(grads, state, params)`` needs the params."""
    import jax
    import jax.numpy as jnp

    eps1, eps2 = eps

    def placeholder(p):
        return jnp.zeros((0,), p.dtype)

    def init(params):
        return HfAdafactorState(
            jnp.zeros([], jnp.int32),
            jax.tree.map(
                lambda p: jnp.zeros(p.shape[:-1]) if factored(p.shape) else placeholder(p), params
            ),
            jax.tree.map(
                lambda p: (
                    jnp.zeros((*p.shape[:-2], p.shape[-1])) if factored(p.shape) else placeholder(p)
                ),
                params,
            ),
            jax.tree.map(
                lambda p: placeholder(p) if factored(p.shape) else jnp.zeros_like(p), params
            ),
            jax.tree.map(
                lambda p: jnp.zeros_like(p) if beta1 is not None else placeholder(p), params
            ),
        )

    def rms(x):
        return jnp.linalg.norm(x) / math.sqrt(x.size) if x.size else jnp.zeros([], x.dtype)

    def update(updates, state, params=None):
        if params is None:
            raise ValueError("Adafactor's step needs the params: tx.update(grads, state, params)")
        count = state.count + 1
        step = count.astype(jnp.float32)
        size: Any = lr
        if relative_step:
            floor = 1e-6 * step if warmup_init else 1e-2
            size = jnp.minimum(floor, 1.0 / jnp.sqrt(step))
        beta2t = 1.0 - jnp.power(step, decay_rate)

        def one(g, p, row, col, sq, avg):
            rate = size * jnp.maximum(eps2, rms(p)) if scale_parameter else size
            g2 = g * g + eps1
            if factored(p.shape):
                row = beta2t * row + (1.0 - beta2t) * jnp.mean(g2, axis=-1)
                col = beta2t * col + (1.0 - beta2t) * jnp.mean(g2, axis=-2)
                r = jax.lax.rsqrt(row / jnp.mean(row, axis=-1, keepdims=True))[..., None]
                u = r * jax.lax.rsqrt(col)[..., None, :] * g
            else:
                sq = beta2t * sq + (1.0 - beta2t) * g2
                u = jax.lax.rsqrt(sq) * g
            u = u / jnp.maximum(rms(u) / clip_threshold, 1.0) * rate
            if beta1 is not None:
                avg = beta1 * avg + (1.0 - beta1) * u
                u = avg
            out = -u - weight_decay * rate * p if weight_decay else -u
            return out.astype(p.dtype), (row, col, sq, avg)

        both = jax.tree.map(one, updates, params, state.row, state.col, state.sq, state.avg)
        treedef = jax.tree.structure(updates)
        pairs = treedef.flatten_up_to(both)
        out = treedef.unflatten([o for o, _ in pairs])
        parts = [treedef.unflatten([s[i] for _, s in pairs]) for i in range(4)]
        return out, HfAdafactorState(count, *parts)

    return _gradient_transformation(init, update)
