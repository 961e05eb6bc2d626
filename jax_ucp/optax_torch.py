"""Continue a PyTorch run in JAX: torch's recorded Adam/AdamW hyper-parameters as an optax
transformation, with its state restored from the converted checkpoint.

An import records the optimizer's ``param_groups`` (betas, eps, weight decay, learning rate,
which parameters each group holds) and, for a Hugging Face Trainer checkpoint, the training
arguments (schedule, warm-up, ``max_grad_norm``) and the scheduler's position. This module turns
them into ``optax.chain(clip_by_global_norm, scale_by_adam, add_decayed_weights(mask),
scale_by_learning_rate(schedule))`` -- torch AdamW's update, term for term -- and fills its state
with the imported moments and step, so the next optax step is torch's next step.
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from collections.abc import Callable
from typing import Any

import numpy as np

from jax_ucp.errors import UnsupportedError

__all__ = ["TorchOptimizer", "optax_from_torch", "hf_schedule"]

#: Hugging Face's schedules (transformers.optimization) this module reproduces
SCHEDULES = ("linear", "cosine", "constant", "constant_with_warmup")


@dataclasses.dataclass
class TorchOptimizer:
    """What continues the run: ``params`` and ``opt_state`` for ``tx``, the learning-rate
    ``schedule`` (of optax's step count), the step the run reached, and how each setting was
    found (``notes``)."""

    tx: Any  # optax.GradientTransformation
    opt_state: Any
    params: Any
    schedule: Callable[[Any], Any]
    step: int
    notes: list[str]


def hf_schedule(kind: str, base_lr: float, warmup: int, total: int) -> Callable[[Any], Any]:
    """transformers' ``get_scheduler(kind)`` learning rate at optimizer step count ``s``."""
    import jax.numpy as jnp

    if kind not in SCHEDULES:
        raise UnsupportedError(
            f"learning-rate schedule {kind!r}: reproduced are {', '.join(SCHEDULES)}"
        )

    def schedule(count):
        s = jnp.asarray(count, jnp.float32)
        warm = s / max(1, warmup)
        progress = (s - warmup) / max(1, total - warmup)
        after = {
            "linear": jnp.maximum(0.0, (total - s) / max(1, total - warmup)),
            "cosine": jnp.maximum(0.0, 0.5 * (1.0 + jnp.cos(math.pi * progress))),
            "constant": jnp.ones_like(s),
            "constant_with_warmup": jnp.ones_like(s),
        }[kind]
        if kind == "constant":
            return base_lr * after
        return base_lr * jnp.where(s < warmup, warm, after)

    return schedule


def _one(groups: list[dict], key: str, where: str) -> Any:
    values = {repr(g.get(key)) for g in groups}
    if len(values) != 1:
        raise UnsupportedError(f"{where}: the parameter groups disagree on {key!r}: {values}")
    return groups[0].get(key)


def _check_adam(groups: list[dict], where: str) -> None:
    for g in groups:
        for flag in ("amsgrad", "maximize", "nesterov"):
            if g.get(flag):
                raise UnsupportedError(f"{where}: torch {flag}=True is not translated to optax")
        if g.get("weight_decay") and g.get("decoupled_weight_decay") is False:
            raise UnsupportedError(
                f"{where}: torch Adam with L2 weight_decay (not AdamW's decoupled decay) is not "
                f"translated to optax"
            )


def _decay(groups: list[dict], where: str) -> tuple[float, dict[str, bool]]:
    """The one non-zero weight decay and, per torch parameter name, whether it is decayed."""
    rates = {float(g.get("weight_decay") or 0.0) for g in groups} - {0.0}
    if len(rates) > 1:
        raise UnsupportedError(f"{where}: several weight decay rates {sorted(rates)}")
    rate = rates.pop() if rates else 0.0
    decayed = {
        name: float(g.get("weight_decay") or 0.0) != 0.0 for g in groups for name in g["params"]
    }
    return rate, decayed


def _schedule(source: dict, groups: list[dict], step: int, notes: list[str]):
    """The Trainer's schedule when recorded (checked against the learning rate the optimizer
    holds for the next step), else that learning rate, constant."""
    where = source.get("path", "checkpoint")
    lr = float(_one(groups, "lr", where))
    trainer = source.get("trainer") or {}
    args = trainer.get("training_args") or {}
    kind = args.get("lr_scheduler_type")
    if "training_args_unread" in trainer:
        note = (
            f"the Trainer's training_args.bin was not read ({trainer['training_args_unread']}): "
            f"no schedule and no clipping are known"
        )
        notes.append(note)
        warnings.warn(f"{where}: {note}", UserWarning, stacklevel=3)
    if kind is None:
        notes.append(f"learning rate {lr}: the optimizer's for the next step; no schedule recorded")
        return lambda count: lr
    total = trainer.get("max_steps") or args.get("max_steps")
    if not isinstance(total, int) or total <= 0:
        raise UnsupportedError(f"{where}: the Trainer's schedule needs max_steps, found {total!r}")
    warmup = args.get("warmup_steps") or 0
    warmup = int(warmup) if warmup >= 1 else math.ceil(total * float(args.get("warmup_ratio") or 0))
    base = _one(groups, "initial_lr", where)
    base = float(base if base is not None else args["learning_rate"])
    last = (trainer.get("scheduler") or {}).get("last_epoch")
    if last is not None and last != step:
        raise UnsupportedError(
            f"{where}: the scheduler stepped {last} times, the optimizer {step}: cannot tell "
            f"where the schedule stands"
        )
    schedule = hf_schedule(kind, base, warmup, total)
    want = float(schedule(step))
    if not math.isclose(want, lr, rel_tol=1e-6, abs_tol=1e-12):
        raise UnsupportedError(
            f"{where}: the Trainer's {kind} schedule (lr {base}, warm-up {warmup}, {total} "
            f"steps) gives {want} at step {step}, the optimizer holds {lr}"
        )
    notes.append(f"{kind} schedule: lr {base}, warm-up {warmup} steps, {total} steps")
    return schedule


def _mask_tree(ckpt, spec, params, decayed: dict[str, bool], where: str):
    """Per leaf of ``params``: decayed or not, from the torch parameters it is made of."""
    import jax

    from jax_ucp import language
    from jax_ucp.api import inspect
    from jax_ucp.store import zarr3

    def of(names: list[str], leaf: str) -> bool:
        flags = {decayed.get(n) for n in names}
        if None in flags or len(flags) != 1:
            raise UnsupportedError(
                f"{where}: {leaf} is made of torch parameters {names} whose weight decay "
                f"differs or is unknown"
            )
        return bool(flags.pop())  # one flag, not None (checked above)

    if spec is None:
        return {name: of([name], name) for name in params}
    manifest = inspect(ckpt)
    saved = {
        e.key: language.TensorInfo(e.shape, zarr3.numpy_dtype(e.dtype)) for e in manifest.tensors
    }
    sources = {
        key[1:]: [s[1] for s in plan.sources]
        for key, plan in language.compile_restore_plan(spec, saved).items()
        if key[0] == "params"
    }
    return jax.tree_util.tree_map_with_path(
        lambda path, _: of(
            sources[tuple(str(getattr(k, "key", k)) for k in path)], jax.tree_util.keystr(path)
        ),
        params,
    )


def _adam_state(opt: dict, where: str) -> tuple[Any, Any]:
    """mu and nu wherever the restore put them (``opt_state/mu`` or a spec's ``opt_state/0/mu``)."""
    for node in (opt, *[v for v in opt.values() if isinstance(v, dict)]):
        if "mu" in node and "nu" in node:
            return node["mu"], node["nu"]
    raise UnsupportedError(f"{where}: no Adam moments (mu, nu) in the checkpoint's opt_state")


def optax_from_torch(ckpt, *, spec: Any = None) -> TorchOptimizer:
    """The optax optimizer and state that continue the torch run converted at ``ckpt``.

    Args:
        ckpt: a UCP checkpoint imported from torch with its Adam/AdamW state (a Hugging Face
            Trainer ``checkpoint-N/``, Accelerate, FSDP2/DCP, torch.save files).
        spec: the spec the parameters are restored with (e.g. ``hf_llama``), or None for
            torch's names; the moments follow it, and the weight-decay mask is computed on the
            restored tree from the torch parameters each leaf is made of.

    Returns:
        A :class:`TorchOptimizer`: ``tx.update(grads, opt_state, params)`` is torch's next step
        (clipping, AdamW with its no-decay groups, the scheduler's learning rate).
    """
    import jax
    import jax.numpy as jnp
    import optax

    from jax_ucp.api import inspect, restore

    manifest = inspect(ckpt)
    source = manifest.source or {}
    where = str(source.get("path") or ckpt)
    optimizer = source.get("optimizer")
    if not optimizer or not optimizer.get("param_groups"):
        raise UnsupportedError(
            f"{where}: no torch optimizer recorded (imported with weights_only, or not from torch)"
        )
    groups = optimizer["param_groups"]
    _check_adam(groups, where)
    tree = restore(ckpt, spec=spec)
    if "opt_state" not in tree:
        raise UnsupportedError(f"{where}: the checkpoint holds no optimizer state")
    params = tree["params"]
    mu, nu = _adam_state(tree["opt_state"], where)
    counts = [v for k, v in _walk(tree["opt_state"]) if k == "count"]
    if len(counts) != 1:
        raise UnsupportedError(f"{where}: expected one step count in opt_state, found {counts}")
    step = int(counts[0])
    notes: list[str] = []
    b1, b2 = (float(b) for b in _one(groups, "betas", where))
    eps = float(_one(groups, "eps", where))
    rate, decayed = _decay(groups, where)
    schedule = _schedule(source, groups, step, notes)
    parts = []
    max_norm = ((source.get("trainer") or {}).get("training_args") or {}).get("max_grad_norm")
    if max_norm:
        parts.append(optax.clip_by_global_norm(float(max_norm)))
        notes.append(f"gradients clipped to global norm {max_norm}")
    parts.append(optax.scale_by_adam(b1, b2, eps))
    if rate:
        mask = _mask_tree(ckpt, spec, params, decayed, where)
        parts.append(optax.add_decayed_weights(rate, mask))
        leaves = jax.tree.leaves(mask)
        notes.append(f"weight decay {rate} on {sum(leaves)} of {len(leaves)} leaves")
    parts.append(optax.scale_by_learning_rate(schedule))
    tx = optax.chain(*parts)
    state = list(tx.init(params))  # pyright: ignore[reportArgumentType]  # optax types OptState as any pytree; a chain's is a tuple
    count = jnp.asarray(step, jnp.int32)
    for i, s in enumerate(state):
        if isinstance(s, optax.ScaleByAdamState):
            state[i] = optax.ScaleByAdamState(count=count, mu=_like(mu, s.mu), nu=_like(nu, s.nu))
        elif isinstance(s, optax.ScaleByScheduleState):
            state[i] = optax.ScaleByScheduleState(count=count)
    return TorchOptimizer(tx, tuple(state), params, schedule, step, notes)


def _like(moment, init):
    """The restored moment in the structure optax made (shapes checked leaf by leaf)."""
    import jax
    import jax.numpy as jnp

    def one(got, want):
        if np.shape(got) != np.shape(want):
            raise UnsupportedError(
                f"moment of shape {np.shape(got)} for a parameter of {np.shape(want)}"
            )
        return jnp.asarray(got)

    return jax.tree.map(one, moment, init)


def _walk(node, key=None):
    if isinstance(node, dict):
        for k, v in node.items():
            yield from _walk(v, k)
    else:
        yield key, node
