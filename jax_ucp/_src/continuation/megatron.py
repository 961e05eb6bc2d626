"""How a Megatron run stepped (its ``args``, scheduler state, param groups) as a :class:`Recipe`.
Its scheduler counts samples (``get_lr(count * global_batch_size)``): a batch-size ramp-up is
refused. Schedules as megatron-core 0.16's ``get_lr`` / ``get_wd``."""

from __future__ import annotations

import dataclasses
import fnmatch
import math
import re
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from jax_ucp._src.continuation.recipe import Recipe
from jax_ucp._src.errors import RequestError, SourceError
from jax_ucp._src.facts import Facts
from jax_ucp._src.format.manifest import torch_optimizer_record

__all__ = ["MegatronSchedule", "check_megatron_record", "megatron_recipe"]

#: the ``source`` key Megatron's importers record the run's optimizer under: this reader's cue
RECORD = "megatron_optimizer"
LR_DECAY_STYLES = ("constant", "linear", "cosine", "inverse-square-root", "WSD")
WSD_DECAY_STYLES = ("linear", "cosine", "exponential", "minus_sqrt")
WD_INCR_STYLES = ("constant", "linear", "cosine")
# keys of AnnealingLR's state before the scheduler counted samples (load_state_dict's fallbacks)
_OLD_KEYS = ("start_lr", "warmup_iter", "warmup_steps", "end_iter", "decay_steps", "num_iters")
#: the OptimizerParamScheduler state this reader knows (megatron-core 0.16's, and later fields)
SCHEDULER_KEYS = (
    "max_lr",
    "min_lr",
    "lr_warmup_steps",
    "lr_decay_steps",
    "lr_decay_style",
    "num_steps",
    "start_wd",
    "end_wd",
    "wd_incr_steps",
    "wd_incr_style",
    "init_lr",
    "wsd_decay_steps",
    "lr_wsd_decay_style",
)


@dataclasses.dataclass(frozen=True)
class MegatronSchedule:
    """megatron-core's ``OptimizerParamScheduler`` values (its ``num_steps`` counts samples)."""

    init_lr: float
    max_lr: float
    min_lr: float
    lr_warmup_steps: float
    lr_decay_steps: float
    lr_decay_style: str
    start_wd: float
    end_wd: float
    wd_incr_steps: float
    wd_incr_style: str
    wsd_decay_steps: float | None = None
    lr_wsd_decay_style: str | None = None

    def lr(self, num_steps: Any, xp: Any = np) -> Any:
        """``OptimizerParamScheduler.get_lr`` at ``num_steps`` samples (numpy or jax.numpy)."""
        n = xp.asarray(num_steps, dtype=float) if xp is np else num_steps
        warm, decay = float(self.lr_warmup_steps), float(self.lr_decay_steps)
        max_lr, min_lr, init = self.max_lr, self.min_lr, self.init_lr
        warmup = init + (max_lr - init) * n / (warm if warm > 0 else 1.0)
        if self.lr_decay_style == "constant":
            decayed = xp.full_like(n, max_lr)
        elif self.lr_decay_style == "inverse-square-root":
            decayed = xp.maximum(min_lr, max_lr * max(warm, 1.0) ** 0.5 / xp.sqrt(xp.maximum(n, 1)))
            decayed = xp.where(n > decay, min_lr, decayed)
        else:
            ratio = xp.clip((n - warm) / (decay - warm), 0.0, 1.0)
            if self.lr_decay_style == "linear":
                coeff = 1.0 - ratio
            elif self.lr_decay_style == "cosine":
                coeff = 0.5 * (xp.cos(math.pi * ratio) + 1.0)
            else:  # WSD
                wsd = float(self.wsd_decay_steps or 0)
                start = decay - wsd
                r = xp.clip((n - start) / (wsd if wsd > 0 else 1.0), 0.0, 1.0)
                style = self.lr_wsd_decay_style
                if style == "linear":
                    anneal = 1.0 - r
                elif style == "cosine":
                    anneal = 0.5 * (xp.cos(math.pi * r) + 1.0)
                elif style == "exponential":
                    anneal = 2.0 * xp.power(0.5, r) - 1.0
                else:  # minus_sqrt
                    anneal = 1.0 - xp.sqrt(r)
                coeff = xp.where(n <= start, 1.0, anneal)
            decayed = xp.where(n > decay, min_lr, min_lr + coeff * (max_lr - min_lr))
        if warm > 0:
            return xp.where(n <= warm, warmup, decayed)
        return decayed

    def wd(self, num_steps: Any, xp: Any = np) -> Any:
        """``OptimizerParamScheduler.get_wd`` at ``num_steps`` samples."""
        n = xp.asarray(num_steps, dtype=float) if xp is np else num_steps
        start, end = self.start_wd, self.end_wd
        if self.wd_incr_style == "constant":
            return xp.full_like(n, end)
        ratio = xp.clip(n / float(self.wd_incr_steps), 0.0, 1.0)
        if self.wd_incr_style == "linear":
            coeff = ratio
        else:  # cosine
            coeff = 0.5 * (xp.cos(math.pi * (1.0 - ratio)) + 1.0)
        return xp.where(n > self.wd_incr_steps, end, start + coeff * (end - start))


# ----------------------------------------------------------------------------- reading the record


class _Fields:
    """One section of the record, read with its file named in every refusal."""

    def __init__(self, values: Mapping[str, Any], section: str, where: str):
        self.values, self.section, self.where = values, section, where

    def has(self, key: str) -> bool:
        return self.values.get(key) is not None

    def refuse(self, key: str, expected: str) -> SourceError:
        found = self.values.get(key, "<missing>")
        return SourceError(f"{self.where}: {self.section}.{key} = {found!r}: expected {expected}")

    def number(
        self,
        key: str,
        *,
        integer: bool = False,
        low: float = 0.0,
        high: float = math.inf,
        above: bool = False,
    ) -> float:
        """A finite number in [low, high] (``above``: > low); an integer when ``integer``."""
        value = self.values.get(key)
        kind = "an integer" if integer else "a number"
        bound = f"{'>' if above else '>='} {low}" + (f" and <= {high}" if high < math.inf else "")
        ok = (
            isinstance(value, (int, float))
            and not isinstance(value, bool)
            and math.isfinite(value)
            and (value > low if above else value >= low)
            and value <= high
            and (not integer or float(value).is_integer())
        )
        if not ok:
            raise self.refuse(key, f"{kind} {bound}")
        return int(value) if integer else float(value)  # type: ignore[arg-type]

    def choice(self, key: str, allowed: tuple[str, ...]) -> str:
        value = self.values.get(key)
        if value not in allowed:
            raise self.refuse(key, f"one of {list(allowed)}")
        return str(value)

    def flag(self, key: str) -> bool | None:
        value = self.values.get(key)
        if value is not None and not isinstance(value, bool):
            raise self.refuse(key, "true or false")
        return value


def _section(record: Mapping[str, Any], key: str, where: str) -> dict[str, Any]:
    value = record.get(key)
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise SourceError(f"{where}: {RECORD}.{key} is {type(value).__name__}, expected a mapping")
    return value


def _groups(record: Mapping[str, Any], where: str) -> list[_Fields]:
    value = record.get("param_groups")
    if value is None:
        return []
    if not isinstance(value, list) or not all(isinstance(g, dict) for g in value):
        raise SourceError(f"{where}: {RECORD}.param_groups is not a list of mappings")
    return [_Fields(g, f"param_groups[{i}]", where) for i, g in enumerate(value)]


def _agreed(groups: list[_Fields], key: str, read: Callable[[_Fields], Any]) -> Any:
    """The one value every param group that records ``key`` holds (None: none records it)."""
    seen = {}
    for group in groups:
        if key in group.values:
            seen.setdefault(repr(read(group)), (read(group), group.section))
    if len(seen) > 1:
        where = groups[0].where
        values = {section: value for value, section in seen.values()}
        raise RequestError(
            f"{where}: the param groups hold different {key} ({values}): a per-parameter "
            f"{key} is not one Recipe"
        )
    return next(iter(seen.values()))[0] if seen else None


# ----------------------------------------------------------------------------- the recipe


def megatron_recipe(
    source: Mapping[str, Any], saved: Mapping[Any, tuple[tuple[int, ...], Any]], where: str
) -> Recipe | None:
    """The Recipe of a run whose import recorded ``source.megatron_optimizer``, else None.

    Args:
        source: the manifest's ``source`` record.
        saved: the import's tensor keys -> (shape, dtype): which parameters are decayed is
            Megatron's rule on their names and per-layer shapes.
        where: the checkpoint, named in every refusal.

    Raises:
        SourceError: a field missing, wrong or contradicting another.
        RequestError: what the Recipe cannot hold (another optimizer, a batch-size ramp-up)."""
    if source.get(RECORD) is None:
        return None
    if torch_optimizer_record(dict(source)):  # no Megatron import records a torch optimizer
        raise SourceError(
            f"{where}: source records both {RECORD} (Megatron's optimizer and scheduler) and "
            f"optimizer (a torch optimizer's): which one stepped the run is not known"
        )
    file, args, scheduler, groups = _read_record(source, saved, where)
    if not scheduler.values:
        return _held_recipe(source, saved, groups, file)
    schedule = _schedule(scheduler, args, groups)
    gbs = _global_batch(args)
    step = _step(source[RECORD], source, scheduler, args, groups, gbs, file)
    notes, unrecovered = [], []
    _scheduler_facts(scheduler, args, groups, gbs, file, notes)
    if (
        not args.has("lr_warmup_init")
        and schedule.lr_warmup_steps > 0
        and step * gbs < schedule.lr_warmup_steps
    ):
        raise SourceError(
            f"{file}: args.lr_warmup_init is not recorded and the run is still warming up "
            f"({step * gbs} of {schedule.lr_warmup_steps} samples): its warm-up is unknown"
        )
    _check_groups_lr(groups, schedule, step * gbs, file)
    if not args.has("lr_warmup_init"):
        notes.append("lr_warmup_init not recorded: the warm-up had ended, its start is unused")
    betas, eps = _adam(args, groups, file)
    decoupled = _decoupled(args, groups, file)
    if decoupled is None:
        decoupled = True
        notes.append(
            "decoupled_weight_decay not recorded: Megatron's Adam decouples weight decay "
            "(FusedAdam adam_w_mode=True) unless decoupled_weight_decay=False"
        )
    decayed = _decayed(saved, args, groups, file, unrecovered)
    clip: float | None = None
    if args.has("clip_grad"):
        clip = args.number("clip_grad") or None  # Megatron clips only when clip_grad > 0
    else:
        unrecovered.append("clip_grad (not recorded; Megatron-LM's default is 1.0)")
    if clip is not None:
        notes.append(
            f"gradient norm clipped to {clip} (Megatron scales by clip_grad / (norm + 1e-6))"
        )
    if args.flag("fp16"):
        notes.append("fp16 dynamic loss scaling is not carried over")
    count_note = (
        f"optax count c -> Megatron's scheduler at c x {gbs} samples (global_batch_size); "
        f"the saved Adam step {step} is {step * gbs} samples"
    )
    lr_style = schedule.lr_decay_style + (
        f"/{schedule.lr_wsd_decay_style}" if schedule.lr_decay_style == "WSD" else ""
    )
    how = (
        f"megatron-core Adam{'W' if decoupled else ''} from {file}: "
        f"OptimizerParamScheduler {lr_style} lr, {schedule.wd_incr_style} weight decay"
    )

    def of_count(at_samples: Callable[[Any, Any], Any]) -> Callable[[Any], Any]:
        """``at_samples`` (``schedule.lr`` / ``.wd``) as a schedule of optax's step count."""
        import jax.numpy as jnp

        return lambda count: at_samples(jnp.asarray(count, jnp.float32) * gbs, jnp)

    return Recipe(
        optimizer="adamw" if decoupled else "adam",
        how=how,
        betas=betas,
        eps=eps,
        learning_rate=of_count(schedule.lr),
        weight_decay=schedule.end_wd
        if schedule.wd_incr_style == "constant"
        else of_count(schedule.wd),
        decayed=decayed,
        clip=clip,
        bias_correction=True,
        notes=(count_note, *notes),
        unrecovered=tuple(unrecovered),
        at_step=_step_check(step, gbs, file),
    )


#: the param-group fields megatron-core 0.13-0.19 saves and what each must hold where saved
#: ("number": a finite number >= 0); the groups must hold the same fields
_GROUP_FLAGS = ("amsgrad", "maximize", "capturable", "differentiable", "decoupled_weight_decay",
                "is_expert_parallel", "is_decoupled_lr", "default_config")  # fmt: skip
GROUP_FIELDS = {
    **dict.fromkeys(("lr", "max_lr", "weight_decay", "step", "wd_mult", "lr_mult"), "number"),
    "min_lr": "number or None",
    **dict.fromkeys(("foreach", "fused"), "true, false or None"),
    **dict.fromkeys(_GROUP_FLAGS, "true or false"),
}
#: the OptimizerParamScheduler fields a complete record holds (megatron-core 0.16's state_dict)
SCHEDULER_REQUIRED = SCHEDULER_KEYS[:10]


def check_megatron_record(
    source: Mapping[str, Any], saved: Mapping[Any, tuple[tuple[int, ...], Any]], where: str
) -> None:
    """The recorded Megatron run (``source.megatron_optimizer``) checked for a writer that
    passes it on (the megatron export writes it into common.pt, where Megatron-LM resumes
    from it): every param group holds the fields the others hold, each of its kind, and the
    record is read as :func:`megatron_recipe` reads it (every fact it states several times
    agreeing, the groups' rates the schedule's; with the Adam moments ``saved``). A scheduler
    state missing a field Megatron-LM's load reads is refused (a step count alone, as synthetic
    records hold, leaves the groups checked alone).

    Raises:
        SourceError: a field of the wrong kind, or records that disagree, each named.
        RequestError: what :func:`megatron_recipe` cannot read (another optimizer, a scaled
            learning rate...), so cannot check either."""
    record = source.get(RECORD)
    if record is None:
        return
    if not isinstance(record, dict):
        raise SourceError(f"{where}: source.{RECORD} is {type(record).__name__}, not a mapping")
    facts, args = Facts(where), _section(record, "args", where)
    for said, value in (
        (f"{RECORD}.iteration", record.get("iteration")),
        (f"{RECORD}.args.iteration", args.get("iteration")),
        ("source.iteration", source.get("iteration")),
    ):
        if value is not None:
            facts.state("iteration", said, value)
    facts.agree_all()
    _check_args(_Fields(args, "args", where))
    groups = _groups(record, where)
    for group in groups:
        _check_group(group)
        if set(group.values) != set(groups[0].values):
            odd = sorted(set(group.values) ^ set(groups[0].values))
            raise SourceError(
                f"{where}: {RECORD}.{group.section} and param_groups[0] hold other fields "
                f"({odd}): one optimizer saves the same fields in every group"
            )
    scheduler = _section(record, "opt_param_scheduler", where)
    unread = [names[0] for names in _LOADED if scheduler and not any(n in scheduler for n in names)]
    if unread and len(unread) < len(_LOADED) - 1:  # a state saved whole, less some (not a count)
        raise SourceError(
            f"{where}: {RECORD}.opt_param_scheduler has no {', '.join(unread)} (nor an older "
            f"name of it), which Megatron-LM's OptimizerParamScheduler.load_state_dict reads: "
            f"a resume from it would fail; nothing was written"
        )
    if scheduler and any(k not in scheduler for k in SCHEDULER_REQUIRED):
        record = {k: v for k, v in record.items() if k not in ("opt_param_scheduler", "args")}
        source = {**source, RECORD: record}
    if (groups or scheduler) and any(_path(k).startswith("opt_state/mu/") for k in saved):
        megatron_recipe(source, saved, where)  # (weights alone: its kinds checked only)


#: the scheduler fields Megatron-LM's load_state_dict reads, each with its older names (the
#: weight decay's only where ``start_wd`` is saved)
_LOADED = (("max_lr", "start_lr"), ("min_lr",), ("lr_warmup_steps", "warmup_iter", "warmup_steps"),
           ("lr_decay_steps", "end_iter", "decay_steps"), ("lr_decay_style", "decay_style"),
           ("num_steps", "num_iters"))  # fmt: skip


#: the kinds of Megatron-LM's run arguments the record keeps (the others: numbers >= 0)
_ARG_FLAGS = ("fp16", "bf16", "use_checkpoint_opt_param_scheduler", "optimizer_cpu_offload",
              "override_opt_param_scheduler", "use_distributed_optimizer",
              "decoupled_weight_decay", "apply_wd_to_qk_layernorm")  # fmt: skip
_ARG_TEXTS = ("optimizer", "lr_decay_style", "weight_decay_incr_style", "lr_wsd_decay_style",
              "no_weight_decay_cond_type")  # fmt: skip
_ARG_COUNTS = ("train_iters", "train_samples", "global_batch_size", "micro_batch_size",
               "data_parallel_size", "iteration", "consumed_train_samples",
               "skipped_train_samples")  # fmt: skip


def _check_args(args: _Fields) -> None:
    """Each recorded run argument of its kind (None: not set)."""
    for key, value in args.values.items():
        if value is None or key in ("rampup_batch_size", "step_batch_size_schedule"):
            continue
        if key in _ARG_FLAGS and not isinstance(value, bool):
            raise args.refuse(key, "true or false")
        if key in _ARG_TEXTS and not isinstance(value, str):
            raise args.refuse(key, "a name")
        if key in _ARG_COUNTS or key.endswith(("_iters", "_samples")):
            if type(value) is not int or value < 0:  # argparse's int: never a float
                raise args.refuse(key, "an integer >= 0")
        elif key not in _ARG_FLAGS + _ARG_TEXTS:
            high = 1.0 if key in ("lr_warmup_fraction", "adam_beta1", "adam_beta2") else math.inf
            args.number(key, high=high)


def _check_group(group: _Fields) -> None:
    for key, kind in GROUP_FIELDS.items():
        value = group.values.get(key)
        if key not in group.values or (value is None and "None" in kind):
            continue
        if kind.startswith("number"):
            group.number(key)
        elif not isinstance(value, bool):
            raise group.refuse(key, kind)
    if "betas" in group.values or "eps" in group.values:
        pair = group.values.get("betas")
        if not (isinstance(pair, list) and len(pair) == 2):
            raise group.refuse("betas", "two numbers")
        betas = _Fields({"b1": pair[0], "b2": pair[1]}, f"{group.section}.betas", group.where)
        for b in ("b1", "b2"):
            betas.number(b, high=1.0)
        group.number("eps", above=True, high=1.0)


def _scheduler_facts(
    scheduler: _Fields,
    args: _Fields,
    groups: list[_Fields],
    gbs: int,
    file: str,
    notes: list[str],
) -> None:
    """The scheduler's state against the args that made it (megatron's
    ``get_optimizer_param_scheduler``) and the param groups it sets (``max_lr``, ``min_lr``):
    every record of a value must agree (``facts.py``), else each is named. A run resumed with
    ``use_checkpoint_opt_param_scheduler`` kept the saved scheduler whatever its args said: its
    args are not compared (a note says so); without it Megatron asserts they agree on load."""
    facts = Facts(file)
    said = scheduler.values
    if args.flag("use_checkpoint_opt_param_scheduler"):
        notes.append(
            "use_checkpoint_opt_param_scheduler: the saved opt_param_scheduler is followed, "
            "not compared with the args (Megatron keeps the checkpoint's on resume)"
        )
        derived: dict[str, tuple[str, Any]] = {}
    else:
        derived = _args_schedule(args, gbs)
    for key in ("max_lr", "min_lr", *derived):
        if said.get(key) is None or key in facts.stated:
            continue
        facts.state(key, f"opt_param_scheduler.{key}", said[key])
        if key in derived:
            facts.state(key, *derived[key])
        for group in groups:
            if key in ("max_lr", "min_lr") and group.values.get(key) is not None:
                facts.state(key, f"{group.section}.{key}", group.values[key])
    facts.agree_all()


def _args_schedule(args: _Fields, gbs: int) -> dict[str, tuple[str, Any]]:
    """{scheduler field: (the args it was made from, its value)} as megatron-core 0.16's
    ``get_optimizer_param_scheduler`` computes them; a field whose args are not recorded (or
    not numbers) is left out."""
    a = args.values
    out: dict[str, tuple[str, Any]] = {}
    for key, arg in (
        ("max_lr", "lr"),
        ("min_lr", "min_lr"),
        ("init_lr", "lr_warmup_init"),
        ("lr_decay_style", "lr_decay_style"),
        ("wd_incr_style", "weight_decay_incr_style"),
        ("lr_wsd_decay_style", "lr_wsd_decay_style"),
        ("start_wd", "start_weight_decay"),
        ("end_wd", "end_weight_decay"),
    ):
        if a.get(arg) is not None:
            out[key] = (f"args.{arg}", a[arg])
    for key in ("start_wd", "end_wd"):  # validate_args sets both to weight_decay when constant
        if key not in out and a.get("weight_decay") is not None:
            out[key] = ("args.weight_decay", a["weight_decay"])

    def count(key: str) -> int | None:
        v = a.get(key)
        return v if isinstance(v, int) and not isinstance(v, bool) and v >= 0 else None

    if count("train_samples"):  # sample-based (its train_iters derived: not the test)
        per, scale, unit = "", 1, "samples"
    elif count("train_iters"):
        per, scale, unit = f" x global_batch_size {gbs}", gbs, "iters"
    else:
        return out
    decay_arg = f"lr_decay_{unit}" if count(f"lr_decay_{unit}") else f"train_{unit}"
    decay = count(decay_arg) * scale  # type: ignore[operator]
    if decay_arg.startswith("lr_decay_"):  # from train_*: a run may pass its own to the scheduler
        out["lr_decay_steps"] = (f"args.{decay_arg}{per}", decay)
    for key, arg in (
        ("wd_incr_steps", f"train_{unit}"),
        ("wsd_decay_steps", f"lr_wsd_decay_{unit}"),
        ("lr_warmup_steps", f"lr_warmup_{unit}"),
    ):
        if count(arg) is not None:
            out[key] = (f"args.{arg}{per}", count(arg) * scale)  # type: ignore[operator]
    fraction = a.get("lr_warmup_fraction")
    if isinstance(fraction, float | int) and not isinstance(fraction, bool):
        out["lr_warmup_steps"] = ("args.lr_warmup_fraction x lr_decay_steps", fraction * decay)
    fp16 = a.get("fp16") is True or a.get("skipped_train_samples")  # skipped: no scheduler step
    if not fp16 and count("consumed_train_samples") is not None:
        out["num_steps"] = ("args.consumed_train_samples", a["consumed_train_samples"])
    return {k: v for k, v in out.items() if v[1] is not None}


def _held_recipe(
    source: Mapping[str, Any], saved: Mapping[Any, Any], groups: list[_Fields], file: str
) -> Recipe:
    """A megatron-core run without Megatron-LM (no args, no opt_param_scheduler): Adam from
    its param groups, the rate they hold for the next step, constant until the caller gives
    ``schedule=`` and ``clip=`` (``optax_from_torch``), said as unrecovered."""
    args = _Fields({}, "args", file)
    betas, eps = _adam(args, groups, file)
    decoupled = _decoupled(args, groups, file)
    lr = _agreed(groups, "lr", lambda g: g.number("lr"))
    step = _agreed(groups, "step", lambda g: g.number("step", integer=True))
    if lr is None or step is None:
        raise SourceError(f"{file}: the param groups record no {'lr' if lr is None else 'step'}")
    decays = [g for g in groups if g.values.get("wd_mult", 1.0)]
    rate = _agreed(decays, "weight_decay", lambda g: g.number("weight_decay")) or 0.0
    decayed = _decayed(saved, args, groups, file, [])
    unrecovered = (
        "the learning-rate schedule (no opt_param_scheduler: a megatron-core run without "
        "Megatron-LM's; pass optax_from_torch(schedule=) the run's)",
        "clip_grad (not recorded: pass optax_from_torch(clip=) the run's, or clip=None)",
    )
    return Recipe(
        optimizer="adamw" if decoupled is not False else "adam",
        how=f"megatron-core Adam{'' if decoupled is False else 'W'} from {file}'s param groups",
        betas=betas,
        eps=eps,
        learning_rate=lambda count: lr,
        weight_decay=rate,
        decayed=decayed,
        clip=None,
        notes=(f"learning rate {lr}: the param groups' for step {int(step) + 1}",),
        unrecovered=unrecovered,
        schedule_recorded=False,
        clip_recorded=False,
    )


def _step_check(saved_step: int, gbs: int, file: str) -> Callable[[int], list[str]]:
    """Checks, once the step is restored, that the scheduler's ``num_steps`` maps to it."""

    def check(step: int) -> list[str]:
        if step != saved_step:
            raise SourceError(
                f"{file}: the optimizer's restored step is {step}, but the saved "
                f"opt_param_scheduler stands at {saved_step * gbs} samples = step {saved_step} x "
                f"global_batch_size {gbs}: cannot tell where the schedule stands"
            )
        return []

    return check


def _read_record(
    source: Mapping[str, Any], saved: Mapping[str, Any], where: str
) -> tuple[str, _Fields, _Fields, list[_Fields]]:
    """The record's file and sections, refused where it names no Adam or no schedule."""
    record = source[RECORD]
    if not isinstance(record, dict):
        raise SourceError(f"{where}: source.{RECORD} is {type(record).__name__}, not a mapping")
    read = (record.get("file") or "its common state", record.get("args_file"))
    read += (record.get("groups_file"),)  # torch_dist's per-rank optimizer objects
    file = f"{where} ({', '.join(str(f) for f in read if f)})"  # Bridge: and its run config
    args = _Fields(_section(record, "args", file), "args", file)
    state = _section(record, "opt_param_scheduler", file)
    groups = _groups(record, file)
    for group in groups:  # Adam's variants no chain here is
        flag = next((f for f in ("amsgrad", "maximize") if group.values.get(f)), None)
        if flag is not None:
            raise RequestError(f"{file}: {group.section}.{flag} = True: not translated to optax")
    name = args.values.get("optimizer")
    if name is not None and name != "adam":
        raise RequestError(
            f"{file}: args.optimizer = {name!r}: only Megatron's Adam is translated "
            f"({'SGD with momentum' if name == 'sgd' else name!r} is not)"
        )
    if name is None and not any("betas" in g.values for g in groups):
        raise SourceError(f"{file}: neither args.optimizer nor Adam's betas are recorded")
    if not state and not args.values and groups:
        return file, args, _Fields({}, "opt_param_scheduler", file), groups  # megatron-core only
    if not state:
        raise SourceError(
            f"{file}: no opt_param_scheduler saved: the learning-rate schedule of the run is "
            f"unknown (Megatron-LM saves it beside the args)"
        )
    if not any(_path(k).startswith("opt_state/mu/") for k in saved):
        raise RequestError(
            f"{where}: the import holds no Adam moments (opt_state/mu): imported weights_only, "
            f"or its optimizer state was not read (see source.skipped / source.notes)"
        )
    scheduler = _Fields(state, "opt_param_scheduler", file)
    old = [k for k in _OLD_KEYS if k in state]
    if old:
        raise SourceError(
            f"{file}: opt_param_scheduler holds {old}: an AnnealingLR record from before "
            f"megatron-core counted samples, not translated"
        )
    unknown = sorted(k for k in state if k not in SCHEDULER_KEYS)
    if unknown:
        raise RequestError(
            f"{file}: opt_param_scheduler holds {unknown}, which this reader does not know "
            f"(known: {list(SCHEDULER_KEYS)}): what they change in the schedule is not translated"
        )
    return file, args, scheduler, groups


def _schedule(scheduler: _Fields, args: _Fields, groups: list[_Fields]) -> MegatronSchedule:
    """The scheduler's values, checked against the param groups' max_lr / min_lr."""
    max_lr = scheduler.number("max_lr")
    min_lr = scheduler.number("min_lr", high=max_lr)
    style = scheduler.choice("lr_decay_style", LR_DECAY_STYLES)
    decay = scheduler.number("lr_decay_steps", above=True)
    warm = scheduler.number("lr_warmup_steps", high=decay)
    if warm >= decay:
        raise scheduler.refuse("lr_warmup_steps", f"fewer than lr_decay_steps ({decay})")
    start_wd = scheduler.number("start_wd")
    end_wd = scheduler.number("end_wd", low=start_wd)
    wd_style = scheduler.choice("wd_incr_style", WD_INCR_STYLES)
    if wd_style == "constant" and start_wd != end_wd:
        raise scheduler.refuse("end_wd", f"start_wd ({start_wd}) under a constant wd_incr_style")
    wd_steps = scheduler.number("wd_incr_steps", above=wd_style != "constant")
    for key in ("max_lr", "min_lr"):  # each compared with the scheduler's (_scheduler_facts)
        group_value = _agreed(groups, key, lambda g, key=key: _group_number(g, key))
        unset = any(g.values.get("min_lr", 0) is None for g in groups)
        if key == "min_lr" and group_value is None and style != "constant" and unset:
            raise groups[0].refuse("min_lr", f"a number (the {style} decay reaches it)")
    for key in ("start_wd", "end_wd", "lr_mult"):
        value = _agreed(groups, key, lambda g, key=key: _group_number(g, key))
        if key == "lr_mult" and value not in (None, 1.0):
            raise RequestError(
                f"{scheduler.where}: param groups with lr_mult {value}: a learning rate scaled "
                f"for some parameters (scale_lr_cond) is not one Recipe"
            )
        if key != "lr_mult" and value is not None and float(value) != scheduler.number(key):
            raise RequestError(
                f"{scheduler.where}: param groups override {key} ({value}): a per-group "
                f"weight-decay schedule is not one Recipe"
            )
    if args.values.get("decoupled_lr") is not None:
        raise RequestError(
            f"{args.where}: args.decoupled_lr = {args.values['decoupled_lr']!r}: the embedding "
            f"and output layer stepped at a learning rate of their own, which one Recipe "
            f"schedule cannot hold"
        )
    if any(g.values.get("is_decoupled_lr") for g in groups):
        raise RequestError(f"{args.where}: a param group has is_decoupled_lr: not one Recipe")
    wsd_steps, wsd_style = _wsd(scheduler, args) if style == "WSD" else (None, None)
    init = scheduler.values.get("init_lr", args.values.get("lr_warmup_init"))
    init_lr = (
        _Fields({"lr_warmup_init": init}, "args", args.where).number("lr_warmup_init", high=max_lr)
        if init is not None
        else 0.0
    )
    return MegatronSchedule(
        init_lr=init_lr,
        max_lr=max_lr,
        min_lr=min_lr,
        lr_warmup_steps=warm,
        lr_decay_steps=decay,
        lr_decay_style=style,
        start_wd=start_wd,
        end_wd=end_wd,
        wd_incr_steps=wd_steps,
        wd_incr_style=wd_style,
        wsd_decay_steps=wsd_steps,
        lr_wsd_decay_style=wsd_style,
    )


def _group_number(group: _Fields, key: str) -> float | None:
    return None if group.values.get(key) is None else group.number(key)


def _wsd(scheduler: _Fields, args: _Fields) -> tuple[float, str]:
    """WSD's anneal length (samples) and style: recorded, else as Megatron-LM derives them."""
    if scheduler.has("wsd_decay_steps"):
        steps = scheduler.number("wsd_decay_steps")
    elif args.has("train_iters") and args.number("train_iters", integer=True) > 0:
        if not args.has("lr_wsd_decay_iters"):
            raise args.refuse("lr_wsd_decay_iters", "the WSD anneal length in iterations")
        iters = args.number("lr_wsd_decay_iters", integer=True)
        steps = iters * args.number("global_batch_size", integer=True, above=True)
    elif args.has("train_samples") and args.has("lr_wsd_decay_samples"):
        steps = args.number("lr_wsd_decay_samples", integer=True)
    else:
        raise args.refuse("train_iters", "train_iters or train_samples with the WSD anneal length")
    section = scheduler if scheduler.has("lr_wsd_decay_style") else args
    return steps, section.choice("lr_wsd_decay_style", WSD_DECAY_STYLES)


def _global_batch(args: _Fields) -> int:
    for key in ("rampup_batch_size", "step_batch_size_schedule"):  # the latter: 0.19's
        if args.values.get(key) is not None:
            raise RequestError(
                f"{args.where}: args.{key} = {args.values[key]!r}: the batch size changed "
                f"during the run, so the scheduler's samples are no fixed multiple of the step"
            )
    if not args.has("global_batch_size"):
        raise args.refuse("global_batch_size", "the samples per iteration the scheduler steps by")
    gbs = int(args.number("global_batch_size", integer=True, above=True))
    if args.has("micro_batch_size") and args.has("data_parallel_size"):
        per_step = args.number("micro_batch_size", integer=True, above=True) * args.number(
            "data_parallel_size", integer=True, above=True
        )
        if gbs % per_step:
            raise args.refuse(
                "global_batch_size",
                f"a multiple of micro_batch_size x data_parallel_size ({int(per_step)})",
            )
    return gbs


def _step(
    record: Mapping[str, Any],
    source: Mapping[str, Any],
    scheduler: _Fields,
    args: _Fields,
    groups: list[_Fields],
    gbs: int,
    file: str,
) -> int:
    """The saved Adam step, checked against the scheduler's samples and the iteration."""
    num_steps = int(scheduler.number("num_steps", integer=True))
    recorded = {
        where: _Fields({"iteration": v}, where, file).number("iteration", integer=True)
        for where, v in (
            (f"{RECORD}.iteration", record.get("iteration")),
            ("args.iteration", args.values.get("iteration")),
            ("source.iteration", source.get("iteration")),
        )
        if v is not None
    }
    if len(set(recorded.values())) > 1:
        raise SourceError(f"{file}: the recorded iterations disagree: {recorded}")
    iteration = int(next(iter(recorded.values()))) if recorded else None
    step = _agreed(groups, "step", lambda g: g.number("step", integer=True))
    step = int(step) if step is not None else iteration
    if step is None:
        raise SourceError(f"{file}: neither the param groups' step nor the iteration is recorded")
    if num_steps != step * gbs:
        raise SourceError(
            f"{file}: opt_param_scheduler.num_steps {num_steps} is not the Adam step {step} x "
            f"global_batch_size {gbs} (the batch size changed during the run?): the schedule's "
            f"position cannot be mapped to optax's count"
        )
    if iteration is not None and iteration != step:
        skipped = step < iteration and args.flag("fp16") is True
        if not skipped:
            raise SourceError(
                f"{file}: iteration {iteration} but opt_param_scheduler.num_steps {num_steps} = "
                f"{step} x global_batch_size {gbs}: only an fp16 run skips iterations"
            )
    return step


def _check_groups_lr(groups: list[_Fields], schedule: MegatronSchedule, n: int, file: str):
    """The groups' lr / weight decay are the schedule's at the saved sample count."""
    lr = float(schedule.lr(n))
    wd = float(schedule.wd(n))
    for group in groups:
        if group.has("lr"):
            found = group.number("lr")
            if not math.isclose(found, lr, rel_tol=1e-9, abs_tol=1e-15):
                raise SourceError(
                    f"{file}: {group.section}.lr {found} is not the schedule's {lr} at "
                    f"{n} samples: the recorded schedule is not the one the run followed"
                )
        if group.has("weight_decay"):
            found = group.number("weight_decay")
            mult = group.number("wd_mult", high=1.0) if group.has("wd_mult") else 1.0
            if not math.isclose(found, wd * mult, rel_tol=1e-9, abs_tol=1e-15):
                raise SourceError(
                    f"{file}: {group.section}.weight_decay {found} is not the schedule's "
                    f"{wd} x wd_mult {mult} at {n} samples"
                )


def _adam(args: _Fields, groups: list[_Fields], file: str) -> tuple[tuple[float, float], float]:
    """Adam's betas and eps: the param groups' (the optimizer's own), checked against the args."""

    def group_betas(g: _Fields) -> tuple[float, float]:
        betas = g.values.get("betas")
        if not (isinstance(betas, list) and len(betas) == 2):
            raise g.refuse("betas", "two numbers")
        pair = _Fields({"b1": betas[0], "b2": betas[1]}, f"{g.section}.betas", file)
        return (pair.number("b1", high=1.0), pair.number("b2", high=1.0))

    betas = _agreed(groups, "betas", group_betas)
    eps = _agreed(groups, "eps", lambda g: g.number("eps", above=True))
    from_args = None
    if args.has("adam_beta1") and args.has("adam_beta2"):
        b1 = args.number("adam_beta1", high=1.0)
        from_args = (b1, args.number("adam_beta2", high=1.0))
        if betas is not None and tuple(betas) != from_args:
            raise SourceError(f"{file}: param groups' betas {betas} but args {from_args}")
    args_eps = args.number("adam_eps", above=True) if args.has("adam_eps") else None
    if eps is not None and args_eps is not None and eps != args_eps:
        raise SourceError(f"{file}: param groups' eps {eps} but args.adam_eps {args_eps}")
    betas = betas if betas is not None else from_args
    eps = eps if eps is not None else args_eps
    if betas is None:
        raise args.refuse("adam_beta1", "Adam's betas (in args or the param groups)")
    if eps is None:
        raise args.refuse("adam_eps", "Adam's eps (in args or the param groups)")
    if not (betas[0] < 1.0 and betas[1] < 1.0):
        raise SourceError(f"{file}: Adam's betas {betas}: expected each below 1")
    return (float(betas[0]), float(betas[1])), float(eps)


def _decoupled(args: _Fields, groups: list[_Fields], file: str) -> bool | None:
    in_groups = _agreed(
        groups, "decoupled_weight_decay", lambda g: g.flag("decoupled_weight_decay")
    )
    in_args = args.flag("decoupled_weight_decay")
    if in_groups is not None and in_args is not None and in_groups != in_args:
        raise SourceError(
            f"{file}: param groups' decoupled_weight_decay {in_groups} but args {in_args}"
        )
    return in_groups if in_groups is not None else in_args


def _path(key: str | tuple[str, ...]) -> str:
    """An import's tensor key as ``params/<name>`` (the import keys tensors by tuples)."""
    return key if isinstance(key, str) else "/".join(key)


_STACKED_LAYERS = re.compile(r"(?:^|\.)layers\.(?![0-9]+(?:\.|$))")
_STACKED_EXPERTS = re.compile(r"\.experts\.experts\.")


def _per_layer_ndim(name: str, shape: tuple[int, ...]) -> int:
    """The rank Megatron's module gave the parameter (torch_dist stacks ``[L, ...]``)."""
    stacked = len(_STACKED_LAYERS.findall(name)) + len(_STACKED_EXPERTS.findall(name))
    return len(shape) - stacked


def _decayed(
    saved: Mapping[Any, tuple[tuple[int, ...], Any]],
    args: _Fields,
    groups: list[_Fields],
    file: str,
    unrecovered: list[str],
) -> dict[str, bool]:
    """megatron-core's rule: no weight decay for ``*.bias`` and 1-D parameters."""
    qk = args.flag("apply_wd_to_qk_layernorm")
    if args.values.get("no_weight_decay_cond_type") is not None:
        raise RequestError(
            f"{file}: args.no_weight_decay_cond_type = "
            f"{args.values['no_weight_decay_cond_type']!r}: a no-weight-decay rule of its own, "
            f"not megatron-core's standard one, which is the only one translated"
        )
    decayed: dict[str, bool] = {}
    for key, (shape, _) in saved.items():
        path = _path(key)
        if not path.startswith("params/"):
            continue
        name = path[len("params/") :]
        ndim = _per_layer_ndim(name, tuple(shape))
        if ndim < 1:
            raise SourceError(
                f"{file}: params/{name} of shape {tuple(shape)}: its per-layer rank "
                f"({ndim}) cannot be told, so neither can its weight decay"
            )
        plain = ndim == 1 or fnmatch.fnmatchcase(name, "*.bias")
        qk_norm = "q_layernorm." in name or "k_layernorm." in name
        decayed[name] = not (plain and not (qk and qk_norm))
        if plain and qk_norm and qk is None:
            unrecovered.append(
                f"apply_wd_to_qk_layernorm (not recorded): {name} taken as not decayed"
            )
    if not decayed:
        raise SourceError(f"{file}: the import holds no params/ tensors")
    mults = {g.number("wd_mult", high=1.0) for g in groups if g.values.get("wd_mult") is not None}
    if mults - {0.0, 1.0}:
        raise RequestError(
            f"{file}: param groups with wd_mult {sorted(mults - {0.0, 1.0})}: a scaled weight "
            f"decay is not one Recipe"
        )
    if mults and (0.0 in mults) != (not all(decayed.values())):
        raise SourceError(
            f"{file}: the param groups' wd_mult {sorted(mults)} do not match megatron-core's "
            f"standard no-weight-decay rule (biases and 1-D parameters) on these parameters: "
            f"the run had its own no_weight_decay_cond"
        )
    return decayed
