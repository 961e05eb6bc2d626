"""A DeepSpeed run's config, as its checkpoint records it, read into a :class:`Recipe`: the Adam or
Lion its config names (each's classes take one step) and its schedule, which after ``c`` optimizer
steps is at ``c - 1``. Every value is checked as DeepSpeed takes it, else refused naming it."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

from jax_ucp._src.continuation.recipe import Recipe, agreed, group_decay
from jax_ucp._src.errors import RequestError
from jax_ucp._src.facts import canonical
from jax_ucp._src.format.manifest import torch_optimizer_record

__all__ = ["SCHEDULERS", "deepspeed_recipe", "deepspeed_schedule", "names_lion"]

#: DeepSpeed's optimizer types that are Adam/AdamW (its config lower-cases the type)
ADAM_TYPES = ("adam", "adamw")
#: other types DeepSpeed builds, refused by name
OTHER_TYPES = (
    "lamb",
    "onebitadam",
    "zerooneadam",
    "onebitlamb",
    "adagrad",
    "muadam",
    "muadamw",
    "musgd",
    "muon",
)
#: the parameters DeepSpeedCPULion / FusedLion take (type "Lion": the engine passes all on)
DS_LION_PARAMS = ("lr", "betas", "weight_decay", "fp32_optimizer_states", "set_grad_none")
#: Adam parameters DeepSpeed's classes (FusedAdam, DeepSpeedCPUAdam, torch's) and engine take
DS_ADAM_PARAMS = ("lr", "betas", "eps", "weight_decay", "bias_correction", "amsgrad")
DS_ENGINE_PARAMS = ("adam_w_mode", "torch_adam", "fp32_optimizer_states", "set_grad_none")
TORCH_ADAM_PARAMS = (
    "lr",
    "betas",
    "eps",
    "weight_decay",
    "amsgrad",
    "foreach",
    "fused",
    "capturable",
    "differentiable",
    "maximize",
)
#: the Adam classes' default learning rate (FusedAdam, DeepSpeedCPUAdam, torch Adam/AdamW)
DEFAULT_LR = 1e-3

_NUMBER = "number"
_INT = "int"
_BOOL = "bool"
_TYPE = "type"
#: scheduler -> parameter -> (kind, default, lowest, lowest excluded); ``REQUIRED`` has no default
REQUIRED = object()
SCHEDULERS: dict[str, dict[str, tuple[str, Any, float, bool]]] = {
    "WarmupLR": {
        "warmup_min_lr": (_NUMBER, 0.0, 0.0, False),
        "warmup_max_lr": (_NUMBER, None, 0.0, False),  # None: the optimizer's lr
        "warmup_num_steps": (_INT, 1000, 0, True),
        "warmup_type": (_TYPE, "log", 0, False),
    },
    "WarmupDecayLR": {
        "total_num_steps": (_INT, REQUIRED, 0, False),
        "warmup_min_lr": (_NUMBER, 0.0, 0.0, False),
        "warmup_max_lr": (_NUMBER, 0.001, 0.0, False),
        "warmup_num_steps": (_INT, 1000, 0, True),
        "warmup_type": (_TYPE, "log", 0, False),
    },
    "WarmupCosineLR": {
        "total_num_steps": (_INT, REQUIRED, 0, False),
        "warmup_min_ratio": (_NUMBER, 0.0, 0.0, False),
        "warmup_num_steps": (_INT, 1000, 0, True),
        "cos_min_ratio": (_NUMBER, 0.0001, 0.0, False),
        "warmup_type": (_TYPE, "log", 0, False),
    },
    "OneCycle": {
        "cycle_min_lr": (_NUMBER, REQUIRED, 0.0, False),
        "cycle_max_lr": (_NUMBER, REQUIRED, 0.0, False),
        "decay_lr_rate": (_NUMBER, 0.0, 0.0, False),
        "cycle_first_step_size": (_NUMBER, 2000, 0.0, True),
        "cycle_second_step_size": (_NUMBER, None, 0.0, False),
        "cycle_first_stair_count": (_INT, 0, 0, False),
        "cycle_second_stair_count": (_INT, None, 0, False),
        "decay_step_size": (_NUMBER, 0, 0.0, False),
        "cycle_momentum": (_BOOL, True, 0, False),
        "cycle_min_mom": (_NUMBER, 0.8, 0.0, False),
        "cycle_max_mom": (_NUMBER, 0.9, 0.0, False),
        "decay_mom_rate": (_NUMBER, 0.0, 0.0, False),
    },
    "LRRangeTest": {
        "lr_range_test_min_lr": (_NUMBER, 1e-3, 0.0, False),
        "lr_range_test_step_size": (_INT, 2000, 0, True),
        "lr_range_test_step_rate": (_NUMBER, 1.0, 0.0, False),
        "lr_range_test_staircase": (_BOOL, False, 0, False),
    },
}
#: the parameters whose value may be a list, one per parameter group (DeepSpeed's _format_param)
PER_GROUP = (
    "warmup_min_lr",
    "warmup_max_lr",
    "cycle_min_lr",
    "cycle_max_lr",
    "cycle_min_mom",
    "cycle_max_mom",
    "lr_range_test_min_lr",
)
#: beta2 OneCycle's momentum cycling sets in every group (its ``(mom, 0.99)`` pairs)
ONE_CYCLE_BETA2 = 0.99


def _value(kind: str, value: Any, low: float, strict: bool, field: str) -> Any:
    """One config value as DeepSpeed's class takes it, else refused naming it."""
    if kind == _BOOL:
        if not isinstance(value, bool):
            raise RequestError(f"{field} = {value!r}: expected true or false")
        return value
    if kind == _TYPE:
        if value not in ("log", "linear"):
            raise RequestError(
                f"{field} = {value!r}: expected 'log' or 'linear' (DeepSpeed falls back to 'log' "
                f"for anything else, with a warning; not taken as said)"
            )
        return value
    ok = isinstance(value, int if kind == _INT else int | float) and not isinstance(value, bool)
    number = float(value) if ok else math.nan
    if not ok or not math.isfinite(number) or number < low or (strict and number == low):
        what = "a whole number" if kind == _INT else "a finite number"
        raise RequestError(f"{field} = {value!r}: expected {what} {'>' if strict else '>='} {low}")
    return value


def scheduler_params(kind: str, params: Any, groups: int, where: str) -> dict[str, Any]:
    """A DeepSpeed scheduler's ``params`` with its defaults, typed and range-checked, or refused."""
    if kind not in SCHEDULERS:
        raise RequestError(
            f"{where}: DeepSpeed scheduler {kind!r}: reproduced are {', '.join(SCHEDULERS)}"
        )
    if params is None:
        params = {}
    if not isinstance(params, Mapping):
        raise RequestError(f"{where}: the {kind} scheduler's params {params!r} is not a mapping")
    known = SCHEDULERS[kind]
    out: dict[str, Any] = {}
    for name, value in params.items():
        field = f"{where}: scheduler {kind} params.{name}"
        if name == "last_batch_iteration":
            if value != -1 or isinstance(value, bool):
                raise RequestError(
                    f"{field} = {value!r}: a schedule begun mid-way is not reproduced (expected -1)"
                )
            continue
        if name not in known:
            raise RequestError(
                f"{field}: not a parameter of DeepSpeed's {kind} (it takes {', '.join(known)})"
            )
        spec = known[name]
        if value is None and spec[1] is None:
            continue
        if name in PER_GROUP and isinstance(value, list | tuple):
            if len(value) != groups or len({repr(v) for v in value}) != 1:
                raise RequestError(
                    f"{field} = {value!r}: expected one value, or {groups} equal ones (one per "
                    f"parameter group: the continuation has one learning rate)"
                )
            value = value[0]
        out[name] = _value(spec[0], value, spec[2], spec[3], field)
    for name, spec in known.items():
        if name not in out:
            if spec[1] is REQUIRED:
                raise RequestError(f"{where}: DeepSpeed's {kind} scheduler needs params.{name}")
            out[name] = spec[1]
    return out


def deepspeed_schedule(kind: str, kw: Mapping[str, Any], base_lr: float) -> dict[str, Any]:
    """DeepSpeed's ``kind`` schedule of optax's step count: ``{"lr": ..., "beta1": ... or None}``.

    Args:
        kind: one of ``SCHEDULERS``.
        kw: its params, as :func:`scheduler_params` returns them.
        base_lr: the optimizer's learning rate when the scheduler was made (the config's)."""
    import jax.numpy as jnp

    def position(count):
        return jnp.asarray(count, jnp.float32) - 1.0  # the scheduler's last_batch_iteration

    if kind in ("WarmupLR", "WarmupDecayLR", "WarmupCosineLR"):
        warm = max(2, int(kw["warmup_num_steps"]))

        def ramp(p):
            if kw["warmup_type"] == "log":
                return jnp.log(jnp.maximum(p, 0.0) + 1.0) / math.log(warm)
            return p / warm

        if kind == "WarmupCosineLR":
            low, floor = float(kw["warmup_min_ratio"]), float(kw["cos_min_ratio"])
            total = max(1, int(kw["total_num_steps"]) - warm)

            def lr(count):
                p = position(count)
                up = low + ramp(p) * (1.0 - low)
                # (1 + cos(pi * p)) / 2 as sin(pi * (1 - p) / 2) ** 2: float32 keeps its digits
                rest = jnp.maximum(0.0, (total - (p - warm + 1.0)) / total)
                cosine = jnp.sin(0.5 * math.pi * rest) ** 2
                down = jnp.maximum(0.0, floor + (1.0 - floor) * cosine)
                return base_lr * jnp.where(p < 0, 0.0, jnp.where(p < warm, up, down))

            return {"lr": lr, "beta1": None}
        small = float(kw["warmup_min_lr"])
        big = kw["warmup_max_lr"]
        big = base_lr if big is None else float(big)

        def gamma(p):
            if kind == "WarmupLR":
                after = 1.0
            else:
                steps = int(kw["total_num_steps"])
                after = jnp.maximum(0.0, (steps - p) / max(1.0, steps - warm))
            return jnp.where(p < warm, ramp(p), after)

        def warmup_lr(count):
            p = position(count)
            return jnp.where(p < 0, small, small + (big - small) * gamma(p))

        return {"lr": warmup_lr, "beta1": None}
    if kind == "LRRangeTest":
        low, size = float(kw["lr_range_test_min_lr"]), int(kw["lr_range_test_step_size"])
        rate = float(kw["lr_range_test_step_rate"])

        def range_lr(count):
            p = position(count)
            interval = (p + 1.0) / size
            interval = jnp.floor(interval) if kw["lr_range_test_staircase"] else interval
            return jnp.where(p < 0, low, low * (1.0 + rate * interval))

        return {"lr": range_lr, "beta1": None}
    return _one_cycle(kw, position)


def _one_cycle(kw: Mapping[str, Any], position: Callable[[Any], Any]) -> dict[str, Any]:
    """OneCycle's learning rate and (``cycle_momentum``) beta1, as its class steps them."""
    import jax.numpy as jnp

    first = float(kw["cycle_first_step_size"])
    second = kw["cycle_second_step_size"]
    second = first if second is None else float(second)
    total, ratio = first + second, first / (first + second)
    stairs1 = int(kw["cycle_first_stair_count"])
    stairs2 = kw["cycle_second_stair_count"]
    stairs2 = stairs1 if stairs2 is None else int(stairs2)
    decay_size = float(kw["decay_step_size"])
    skip_lr = math.isclose(decay_size, 0) or math.isclose(float(kw["decay_lr_rate"]), 0)
    skip_mom = math.isclose(decay_size, 0) or math.isclose(float(kw["decay_mom_rate"]), 0)
    lo, hi = float(kw["cycle_min_lr"]), float(kw["cycle_max_lr"])
    mlo, mhi = float(kw["cycle_min_mom"]), float(kw["cycle_max_mom"])

    def scale(p):
        it = p + 1.0
        x = 1.0 + it / total - jnp.floor(1.0 + it / total)
        rising = x <= ratio
        smooth = jnp.where(rising, x / ratio, (x - 1.0) / (ratio - 1.0) if ratio != 1.0 else 0.0)
        stairs = jnp.where(rising, stairs1, stairs2)
        at = jnp.mod(it, total)
        pos = jnp.where(
            at <= first, at * stairs / first, (total - at) * stairs / (second if second else 1.0)
        )
        stepped = jnp.floor(pos) / jnp.maximum(stairs, 1)
        return jnp.where(stairs > 0, stepped, smooth)

    def lr(count):
        p = position(count)
        decay = 1.0 if skip_lr else 1.0 + float(kw["decay_lr_rate"]) * (p - total + 1) / decay_size
        return jnp.where(p < 0, lo, jnp.where(p < total, lo + (hi - lo) * scale(p), lo / decay))

    def beta1(count):
        p = position(count)
        decay = (
            1.0 if skip_mom else 1.0 + float(kw["decay_mom_rate"]) * (p - total + 1) / decay_size
        )
        return jnp.where(
            p < 0, mlo, jnp.where(p < total, mhi - (mhi - mlo) * scale(p), mhi * decay)
        )

    return {"lr": lr, "beta1": beta1 if kw["cycle_momentum"] else None}


def _adam_params(name: str, params: Mapping[str, Any], field: str) -> float:
    """The config's Adam parameters as DeepSpeed's class takes them, checked; and the lr."""
    torch_adam = params.get("torch_adam", False)
    for key in ("torch_adam", "adam_w_mode", "bias_correction", "amsgrad"):
        if key in params:
            _value(_BOOL, params[key], 0, False, f"{field}.{key}")
    allowed = (
        (TORCH_ADAM_PARAMS + ("torch_adam", "adam_w_mode"))
        if torch_adam
        else (DS_ADAM_PARAMS + DS_ENGINE_PARAMS)
    )
    named = f"{name} ({'torch Adam/AdamW' if torch_adam else 'FusedAdam / DeepSpeedCPUAdam'})"
    _check_allowed(params, field, allowed, named)
    for key in ("amsgrad", "maximize", "capturable", "differentiable"):
        if params.get(key):
            raise RequestError(f"{field}.{key} = true is not translated to optax")
    return _checked_common(
        params, field, "DeepSpeedCPUAdam's moments in the parameters' low precision are"
    )


def _check_allowed(params: Mapping[str, Any], field: str, allowed: tuple, named: str) -> None:
    """Refuses a parameter DeepSpeed's class ``named`` does not take, naming it."""
    for key in params:
        if key not in allowed:
            raise RequestError(
                f"{field}.{key}: not a parameter DeepSpeed's {named} takes; "
                f"translated are {', '.join(allowed)}"
            )


def _checked_common(params: Mapping[str, Any], field: str, low_precision: str) -> float:
    """The parameters Adam's and Lion's classes both take, checked as they take them (the
    CPU class's state in low precision, ``low_precision``, refused); and the lr."""
    for key in ("fp32_optimizer_states", "set_grad_none"):
        if key in params:
            _value(_BOOL, params[key], 0, False, f"{field}.{key}")
    if params.get("fp32_optimizer_states") is False:
        raise RequestError(f"{field}.fp32_optimizer_states = false: {low_precision} not reproduced")
    for key in ("eps", "weight_decay"):
        if key in params:
            _value(_NUMBER, params[key], 0.0, False, f"{field}.{key}")
    _betas(params, field)
    return float(_value(_NUMBER, params.get("lr", DEFAULT_LR), 0.0, False, f"{field}.lr"))


def _betas(params: Mapping[str, Any], field: str) -> None:
    """The config's ``betas`` (both classes' default ``(0.9, 0.999)``): two numbers in [0, 1)."""
    betas = params.get("betas", [0.9, 0.999])
    if not isinstance(betas, list | tuple) or len(betas) != 2:
        raise RequestError(f"{field}.betas = {betas!r}: expected two numbers in [0, 1)")
    for j, b in enumerate(betas):
        if _value(_NUMBER, b, 0.0, False, f"{field}.betas[{j}]") >= 1:
            raise RequestError(f"{field}.betas[{j}] = {b!r}: expected a number in [0, 1)")


def _lion(params: Mapping[str, Any], groups: list[dict], where: str) -> tuple[str, float]:
    """(how, lr) of the Lion DeepSpeed built from the config's ``params``, its groups checked to
    be a Lion's (``lr``, ``betas``, ``weight_decay``; no Adam ``eps`` / ``bias_correction``)."""
    field = f"{where}: DeepSpeed optimizer params"
    _check_allowed(params, field, DS_LION_PARAMS, "Lion (DeepSpeedCPULion / FusedLion)")
    lr = _checked_common(
        params, field, "DeepSpeedCPULion's momentum in the parameters' low precision is"
    )
    how = "DeepSpeed Lion: config type 'Lion' (DeepSpeedCPULion under offload, else FusedLion)"
    for i, g in enumerate(groups):  # a resumed DeepSpeedCPULion adds amsgrad: false to them
        has = set(g)
        if not {"lr", "betas", "weight_decay"} <= has or has & {"eps", "bias_correction"}:
            raise RequestError(
                f"{where}: param_groups[{i}] ({', '.join(sorted(has))}): not the groups of the "
                f"Lion the config names (lr, betas, weight_decay; no eps or bias_correction)"
            )
    return how, lr


def _made_from_config(made: Any, groups: list[dict], where: str) -> tuple[str, str, bool, float]:
    """(kind, how, bias_correction, lr) of the Adam or Lion DeepSpeed built from ``optimizer``."""
    if not isinstance(made, Mapping) or not isinstance(made.get("type"), str):
        raise RequestError(f"{where}: DeepSpeed config optimizer {made!r}: expected a 'type'")
    name = made["type"]
    params = made.get("params") or {}
    if not isinstance(params, Mapping):
        raise RequestError(f"{where}: DeepSpeed optimizer params {params!r} is not a mapping")
    if name.lower() == "lion":
        how, lr = _lion(params, groups, where)
        return "lion", how, True, lr
    if name.lower() not in ADAM_TYPES:
        other = name.lower() in OTHER_TYPES
        raise RequestError(
            f"{where}: the run's DeepSpeed optimizer is {name!r} "
            f"({'a DeepSpeed optimizer' if other else 'not one DeepSpeed builds as Adam'}): "
            f"optax_from_torch continues types 'Adam', 'AdamW' and 'Lion'; restore the weights "
            f"(select=r'params/.*') and start a new optimizer"
        )
    torch_adam = params.get("torch_adam", False)
    lr = _adam_params(name, params, f"{where}: DeepSpeed optimizer params")
    adam_w_mode = params.get("adam_w_mode", True)
    decoupled = name.lower() == "adamw" or adam_w_mode
    bias_correction = params.get("bias_correction", True)
    how = (
        f"DeepSpeed {'AdamW' if decoupled else 'Adam'}: config optimizer {name!r}"
        + (", torch_adam" if torch_adam else " (FusedAdam, or DeepSpeedCPUAdam under offload)")
        + (f", adam_w_mode={adam_w_mode}" if "adam_w_mode" in params else "")
        + ("" if bias_correction else ", bias_correction=false")
    )
    for i, g in enumerate(groups):
        has = set(g)
        want = {"bias_correction"} if not torch_adam else {"amsgrad"}
        if not want <= has:
            raise RequestError(
                f"{where}: param_groups[{i}] ({', '.join(sorted(has))}) lacks {sorted(want)}: "
                f"not the groups of the optimizer {how} builds"
            )
        if not torch_adam and bool(g["bias_correction"]) != bias_correction:
            raise RequestError(
                f"{where}: param_groups[{i}].bias_correction = {g['bias_correction']!r}, the "
                f"config says {bias_correction!r}"
            )
    return ("adamw" if decoupled else "adam"), how, bool(bias_correction), float(lr)


def _overridden(params: Mapping[str, Any], held: dict[str, Any], rate: float) -> list[str]:
    """The one difference the files may hold on purpose, said: the client's param groups
    (``deepspeed.initialize(model_parameters=[{..., "betas": ...}])``, or a resume keeping the
    saved groups under an edited config) set what the config's optimizer params also set; the
    groups' values are what the optimizer stepped with, and are continued."""
    if rate:
        held = {**held, "weight_decay": rate}
    return [
        f"the param groups hold {key} {held[key]}, the DeepSpeed config's optimizer params "
        f"{params[key]}: the groups' (set by the client, or kept from a resumed save) are what "
        f"the optimizer stepped with, and are continued"
        for key in held
        if key in params and repr(canonical(params[key])) != repr(canonical(held[key]))
    ]


def recorded_config(source: dict) -> dict | None:
    """The DeepSpeed config its import recorded (``source.optimizer.config``, or ``.deepspeed``
    in a manifest written before that key: docs/FORMAT.md 2.2.3; None: none)."""
    record = torch_optimizer_record(source)
    config = record.get("config", record.get("deepspeed"))
    return config if isinstance(config, dict) else None


def names_lion(source: dict) -> bool:
    """Whether the recorded DeepSpeed config's optimizer is type Lion (its groups have no eps)."""
    made = (recorded_config(source) or {}).get("optimizer")
    return isinstance(made, Mapping) and str(made.get("type")).lower() == "lion"


def deepspeed_recipe(
    source: dict, where: str, client: tuple[str, str] | None = None
) -> Recipe | None:
    """The Recipe of a run whose DeepSpeed config made its optimizer or schedule, else None.

    Args:
        source: the import's record (a manifest's ``source``).
        where: the checkpoint, for errors.
        client: ``(kind, how)`` of the client's torch optimizer (``identify``), needed when the
            config has a scheduler but no optimizer."""
    record, ds = torch_optimizer_record(source), recorded_config(source)
    if ds is None or (ds.get("optimizer") is None and ds.get("scheduler") is None):
        return None
    groups = record.get("param_groups") or []
    if not groups:
        raise RequestError(f"{where}: the DeepSpeed import records no param_groups")
    notes: list[str] = []
    made = ds.get("optimizer")
    if made is not None:
        kind, how, bias_correction, base_lr = _made_from_config(made, groups, where)
    else:
        if client is None:
            raise RequestError(f"{where}: the client's optimizer is not identified")
        kind, how = client[0], f"torch {'AdamW' if client[0] == 'adamw' else 'Adam'}: {client[1]}"
        bias_correction, base_lr = True, math.nan
    clip = ds.get("gradient_clipping", 0.0)
    clip = float(_value(_NUMBER, clip, 0.0, False, f"{where}: DeepSpeed gradient_clipping"))
    b1, b2 = (float(b) for b in agreed(groups, "betas", where))
    lion = kind == "lion"
    eps = 0.0 if lion else float(agreed(groups, "eps", where))
    held = float(agreed(groups, "lr", where))  # the next step's, as the scheduler left it
    rate, decayed = group_decay(groups, where)
    if made is not None:
        held_params = {"betas": [b1, b2], **({} if lion else {"eps": eps})}
        notes.extend(_overridden(made.get("params") or {}, held_params, rate))
    scheduler = ds.get("scheduler")
    beta1 = None
    saved = record.get("scheduler") or {}
    if scheduler is not None:
        if not isinstance(scheduler, Mapping) or not isinstance(scheduler.get("type"), str):
            raise RequestError(f"{where}: DeepSpeed config scheduler {scheduler!r}: no 'type'")
        name = scheduler["type"]
        kw = scheduler_params(name, scheduler.get("params"), len(groups), where)
        if (
            made is None
            and name in ("WarmupLR", "WarmupCosineLR")
            and (name == "WarmupCosineLR" or kw["warmup_max_lr"] is None)
        ):
            raise RequestError(
                f"{where}: DeepSpeed's {name} scales the client optimizer's learning rate at its "
                f"making, which the files do not record; pass schedule="
            )
        if "last_epoch" in saved:
            raise RequestError(
                f"{where}: the config names scheduler {name!r} but the saved scheduler state is a "
                f"torch scheduler's (last_epoch): the client's scheduler ran, not the config's"
            )
        made_schedule = deepspeed_schedule(name, kw, base_lr)
        lr, beta1 = made_schedule["lr"], made_schedule["beta1"]
        notes.append(f"DeepSpeed {name} schedule: {dict(sorted(kw.items()))}")
        if beta1 is not None:
            if lion:
                raise RequestError(
                    f"{where}: OneCycle with cycle_momentum cycles Lion's beta1, which optax's "
                    f"Lion takes as a constant: not translated (set cycle_momentum false)"
                )
            if b2 != ONE_CYCLE_BETA2:
                raise RequestError(
                    f"{where}: OneCycle with cycle_momentum sets every group's beta2 to "
                    f"{ONE_CYCLE_BETA2}, the groups hold {b2}: not the run the config describes"
                )
            notes.append(
                f"OneCycle cycle_momentum: beta1 cycled from {kw['cycle_min_mom']} to "
                f"{kw['cycle_max_mom']}, beta2 {ONE_CYCLE_BETA2} (as OneCycle sets them)"
            )
    else:
        lr = None  # the client's scheduler: read by the torch path (the Trainer's), or none
    if clip:
        notes.append(f"gradients clipped to global norm {clip} (DeepSpeed gradient_clipping)")
    if lion:
        notes.append(
            "Lion's sign of b1 * m + (1 - b1) * g: where that is exactly 0 (no gradient nor "
            "momentum yet) optax steps by 0, DeepSpeedCPULion by -lr and FusedLion by +lr"
        )
    notes.append(
        "fp16 dynamic loss scaling (if the run used it) has no optax counterpart: a step DeepSpeed "
        "skips on an overflow is not skipped here; bf16 and fp32 runs skip none"
    )
    at_step = _position_check(
        name if scheduler is not None else None, lr, beta1, saved, held, b1, where
    )
    return Recipe(
        optimizer=kind,
        how=how,
        betas=(b1, b2),
        eps=eps,
        learning_rate=lr if lr is not None else (lambda count: held),
        weight_decay=rate,
        decayed=decayed,
        clip=clip or None,
        bias_correction=bias_correction,
        notes=tuple(notes),
        beta1=beta1,
        at_step=at_step,
        schedule_recorded=scheduler is not None,  # else the client's: the caller's to read
    )


def _position_check(
    name: str | None,
    lr: Callable[[Any], Any] | None,
    beta1: Callable[[Any], Any] | None,
    saved: Mapping[str, Any],
    held: float,
    b1: float,
    where: str,
) -> Callable[[int], list[str]] | None:
    """Checks, once the step is restored, that the scheduler stands where the files say."""
    if name is None or lr is None:
        return None

    def check(step: int) -> list[str]:
        notes = []
        last = saved.get("last_batch_iteration")
        if last is None:
            notes.append(f"{name}: no saved last_batch_iteration; its position checked by the lr")
        elif type(last) is not int or last != step - 1:
            raise RequestError(
                f"{where}: DeepSpeed's {name} scheduler saved last_batch_iteration {last!r}, the "
                f"optimizer stepped {step} times (expected {step - 1}): cannot tell where the "
                f"schedule stands"
            )
        want = float(lr(step))
        if not math.isclose(want, held, rel_tol=1e-5, abs_tol=1e-12):
            raise RequestError(
                f"{where}: DeepSpeed's {name} schedule gives lr {want} for step {step + 1}, the "
                f"optimizer holds {held}"
            )
        if beta1 is not None and not math.isclose(float(beta1(step)), b1, rel_tol=1e-5):
            raise RequestError(
                f"{where}: OneCycle gives beta1 {float(beta1(step))} for step {step + 1}, the "
                f"optimizer holds {b1}"
            )
        return notes

    return check
