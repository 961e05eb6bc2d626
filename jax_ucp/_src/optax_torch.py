"""Continue a PyTorch run in JAX: its recorded Adam/AdamW hyper-parameters as an optax chain whose
state is the imported moments and step, built only from what the files positively identify; what
could not be recovered is listed and warned."""

from __future__ import annotations

import contextlib
import dataclasses
import math
import re
import warnings
from collections.abc import Callable
from typing import Any

import numpy as np

from jax_ucp._src import language, store
from jax_ucp._src.continuation import families, frozen
from jax_ucp._src.continuation.deepspeed import deepspeed_recipe, names_lion, recorded_config
from jax_ucp._src.continuation.megatron import megatron_recipe
from jax_ucp._src.continuation.recipe import Recipe, agreed, group_decay
from jax_ucp._src.continuation.trainer import check_logged_rates, trainer_rates, trainer_total
from jax_ucp._src.errors import RequestError
from jax_ucp._src.format import to_numpy_dtype
from jax_ucp._src.format.files import strict_loads
from jax_ucp._src.format.manifest import torch_optimizer_record
from jax_ucp._src.language.recorded import spec_with_recorded_settings
from jax_ucp._src.options import user_stacklevel
from jax_ucp._src.restoring import restore_entry, sources
from jax_ucp._src.restoring.options import RestoreOptions
from jax_ucp._src.restoring.sources import import_open

__all__ = ["TorchOptimizer", "hf_schedule", "optax_from_torch", "run_arguments"]


@dataclasses.dataclass
class TorchOptimizer:
    """What continues the run: ``tx``, its ``params`` and ``opt_state``, ``schedule``, ``notes``."""

    tx: Any  # optax.GradientTransformation
    opt_state: Any
    params: Any
    schedule: Callable[[Any], Any]
    step: int
    notes: list[str]
    #: what the run may have had that the files do not record (a schedule, clipping): the
    #: translation goes on without it, and says so here and in a warning
    unrecovered: list[str] = dataclasses.field(default_factory=list)
    #: "adam" (L2 decay added to the gradient) or "adamw" (decoupled decay), and why
    optimizer: str = "adamw"
    #: the recorded ``param_groups`` and each one's optimizer (``torch_state_dicts``)
    groups: list = dataclasses.field(default_factory=list)
    kinds: list = dataclasses.field(default_factory=list)

    def torch_state_dicts(self, opt_state: Any) -> list[dict]:
        """``opt_state`` (this chain's, continued) as the torch optimizers' ``state_dict()`` dicts,
        one per optimizer of the run in its order (torch's Muon, then its AdamW), numpy arrays
        keyed by index, for ``load_state_dict`` after ``torch.from_numpy``; params restored
        without a spec (torch's names).

        Args:
            opt_state: the state ``tx.update`` returned."""
        if not self.groups:
            raise RequestError("torch_state_dicts: the run records no torch param_groups")
        return families.torch_state_dicts(opt_state, self.groups, self.kinds)


#: ``optax_from_torch(clip=)`` not given (None says the run did not clip)
_UNSET = object()
#: the optimizer choices :func:`optax_from_torch` translates exactly
OPTIMIZERS = ("adam", "adamw")
#: Trainer ``optim`` values that are torch's AdamW (``transformers.training_args.OptimizerNames``)
TRAINER_ADAMW = ("adamw_torch", "adamw_torch_fused", "adamw_hf")
#: group keys every torch optimizer may carry that say nothing of which one it is
_NEUTRAL_KEYS = frozenset(
    {
        "params",
        "param_names",
        "initial_lr",
        "lr",
        "weight_decay",
        "foreach",
        "maximize",
        "capturable",
        "differentiable",
        "fused",
        "name",
        "moe",
    }
)
#: the keys of DeepSpeed's FusedAdam and DeepSpeedCPUAdam groups (Adam or AdamW is not recorded)
DS_ADAM_KEYS = frozenset({"betas", "eps", "bias_correction", "step", "amsgrad"})
#: (a key only that optimizer writes, its name): what a group that is not Adam/AdamW looks like
_LOOKALIKES = (
    # its Muon and Adam halves both carry use_muon; which rows a Muon step orthogonalises
    # together (per head, per expert) is set on the parameters, never saved
    ("use_muon", "DeepSpeed's (or Keller Jordan's) MuonWithAuxAdam"),
    ("relative_step", "transformers' Adafactor"),
    ("scale_parameter", "transformers' Adafactor"),
    ("warmup_init", "transformers' Adafactor"),
    ("clip_threshold", "transformers' Adafactor"),
    ("momentum_decay", "torch's NAdam"),
    ("nesterov", "torch's SGD"),
    ("dampening", "torch's SGD"),
    ("lr_decay", "torch's Adagrad"),
    ("initial_accumulator_value", "torch's Adagrad"),
    ("rho", "torch's Adadelta"),
    ("centered", "torch's RMSprop"),
    ("lambd", "torch's ASGD"),
    ("etas", "torch's Rprop"),
    ("beta2_decay", "torch's Adafactor"),
    ("history_size", "torch's LBFGS"),
    ("decoupled_weight_decay", "torch's RAdam"),  # betas + decoupled_weight_decay, no amsgrad
    # betas without amsgrad: not Adam/AdamW (lion-pytorch's Lion: lr, betas, weight_decay)
    ("betas", "torch's RAdam, Adamax or SparseAdam, or a Lion"),
)
#: transformers' scheduler arguments (``lr_scheduler_kwargs``) reproduced, per schedule, with
#: transformers' default (``REQUIRED``: the schedule cannot be built without it)
REQUIRED = object()
#: the shapes of the warm-up-stable-decay schedule's two ramps (transformers' ``get_wsd_schedule``)
WSD_SHAPES = ("linear", "cosine", "1-sqrt")
SCHEDULE_KWARGS: dict[str, dict[str, Any]] = {
    "cosine": {"num_cycles": 0.5},
    "cosine_with_restarts": {"num_cycles": 1},
    "polynomial": {"lr_end": 1e-7, "power": 1.0},
    "inverse_sqrt": {"timescale": None},
    "warmup_stable_decay": {
        "num_decay_steps": REQUIRED,
        "num_stable_steps": None,
        "warmup_type": "linear",
        "decay_type": "cosine",
        "min_lr_ratio": 0.0,
        "num_cycles": 0.5,
    },
}
#: Hugging Face's schedules (transformers.optimization) this module reproduces
SCHEDULES = ("linear", "constant", "constant_with_warmup", *SCHEDULE_KWARGS)


def _ramp(shape: str, progress):
    """A warm-up-stable-decay ramp rising from 0 to 1 over ``progress`` in [0, 1]."""
    import jax.numpy as jnp

    p = jnp.clip(progress, 0.0, 1.0)
    return {
        "linear": p,
        "cosine": 0.5 * (1.0 - jnp.cos(math.pi * p)),
        "1-sqrt": 1.0 - jnp.sqrt(1.0 - p),
    }[shape]


def _wsd(s, warmup: int, total: int, kw: dict[str, Any]):
    """transformers' ``get_wsd_schedule`` factor: warm-up, stable, decay, then the floor."""
    import jax.numpy as jnp

    decay_steps = int(kw["num_decay_steps"])
    stable = kw["num_stable_steps"]
    stable = total - warmup - decay_steps if stable is None else int(stable)
    floor = float(kw["min_lr_ratio"])
    up = _ramp(kw["warmup_type"], s / max(1, warmup))
    progress = jnp.clip((s - warmup - stable) / max(1, decay_steps), 0.0, 1.0)
    down = {
        "linear": 1.0 - progress,
        "cosine": 0.5 * (1.0 + jnp.cos(math.pi * float(kw["num_cycles"]) * 2.0 * progress)),
        "1-sqrt": 1.0 - jnp.sqrt(progress),
    }[kw["decay_type"]]
    return jnp.where(
        s < warmup,
        jnp.maximum(0.0, up * (1.0 - floor) + floor),
        jnp.where(
            s < warmup + stable,
            1.0,
            jnp.where(
                s < warmup + stable + decay_steps,
                jnp.maximum(0.0, down * (1.0 - floor) + floor),
                floor,
            ),
        ),
    )


def _after_warmup(kind: str, s, base_lr: float, warmup: int, total: int, kw: dict[str, Any]):
    """The factor on ``base_lr`` once the linear warm-up is over, as transformers computes it."""
    import jax.numpy as jnp

    span = max(1, total - warmup)
    progress = (s - warmup) / span
    if kind == "linear":
        return jnp.maximum(0.0, (total - s) / span)
    if kind == "cosine":
        return jnp.maximum(
            0.0, 0.5 * (1.0 + jnp.cos(math.pi * float(kw["num_cycles"]) * 2.0 * progress))
        )
    if kind == "cosine_with_restarts":
        turn = jnp.mod(float(kw["num_cycles"]) * progress, 1.0)
        return jnp.where(
            progress >= 1.0, 0.0, jnp.maximum(0.0, 0.5 * (1.0 + jnp.cos(math.pi * turn)))
        )
    if kind == "polynomial":  # transformers' lr_init is the optimizer's lr: base_lr
        end = float(kw["lr_end"])
        left = jnp.clip(1.0 - (s - warmup) / max(1, total - warmup), 0.0, 1.0)
        decayed = ((base_lr - end) * left ** float(kw["power"]) + end) / base_lr
        return jnp.where(s > total, end / base_lr, decayed)
    if kind == "inverse_sqrt":
        timescale = kw["timescale"]
        timescale = int(timescale) if timescale is not None else (warmup or 10_000)
        return 1.0 / jnp.sqrt(jnp.maximum(s + (timescale - warmup), 1e-30) / timescale)
    return jnp.ones_like(s)  # constant_with_warmup


def hf_schedule(
    kind: str, base_lr: float, warmup: int, total: int, **kwargs
) -> Callable[[Any], Any]:
    """transformers' ``get_scheduler(kind)`` learning rate at optimizer step count ``s``.

    Args:
        kind: transformers' scheduler name (one of ``SCHEDULES``).
        base_lr: the groups' learning rate.
        warmup: warm-up steps.
        total: the run's total optimizer steps.
        **kwargs: the schedule's ``lr_scheduler_kwargs`` (``SCHEDULE_KWARGS[kind]``; missing ones
            take transformers' defaults)."""
    import jax.numpy as jnp
    import optax

    if kind not in SCHEDULES:
        raise RequestError(
            f"learning-rate schedule {kind!r}: reproduced are {', '.join(SCHEDULES)}"
        )
    kw = {**SCHEDULE_KWARGS.get(kind, {}), **kwargs}
    missing = [k for k, v in kw.items() if v is REQUIRED]
    if missing:
        raise RequestError(f"learning-rate schedule {kind!r} needs lr_scheduler_kwargs {missing}")
    if kind == "constant":  # the one optax schedule equal to transformers' to the bit in float32
        return optax.constant_schedule(base_lr)

    def schedule(count):
        s = jnp.asarray(count, jnp.float32)
        if kind == "warmup_stable_decay":
            return base_lr * _wsd(s, warmup, total, kw)
        after = _after_warmup(kind, s, base_lr, warmup, total, kw)
        return base_lr * jnp.where(s < warmup, s / max(1, warmup), after)

    return schedule


def _number(value: Any, field: str, where: str, *, below: float | None = None) -> float:
    """``value`` as a finite float >= 0 (and < ``below``), else refused naming the field."""
    ok = isinstance(value, int | float) and not isinstance(value, bool)
    number = float(value) if ok else math.nan
    if not ok or not math.isfinite(number) or number < 0 or (below is not None and number >= below):
        bound = f"in [0, {below})" if below is not None else ">= 0"
        raise RequestError(
            f"{where}: {field} = {value!r}: expected a finite number {bound} (torch refuses "
            f"anything else when the optimizer is built)"
        )
    return number


def check_groups(groups: list, where: str, lion: bool = False) -> None:
    """Each group's ``lr``, ``betas``, ``eps`` (a Lion has none), ``weight_decay`` as torch takes
    them, or refused."""
    if not isinstance(groups, list) or not all(isinstance(g, dict) for g in groups):
        raise RequestError(f"{where}: param_groups is not a list of groups")
    for i, g in enumerate(groups):
        at = f"param_groups[{i}]"
        if "betas" not in g and "bias_correction" not in g:  # not Adam's: named by its keys
            _refuse_lookalike(set(g) - _NEUTRAL_KEYS, i, where)
        for key in ("lr", "betas") if lion else ("lr", "betas", "eps"):
            if key not in g:
                raise RequestError(f"{where}: {at} has no {key!r}")
        for key in ("lr", "eps", "weight_decay"):
            _number(g.get(key, 0.0), f"{at}.{key}", where)
        if not lion and g["eps"] >= 1.0:  # torch takes it, no run does: it would be damaged
            raise RequestError(
                f"{where}: {at}.eps = {g['eps']!r}: 1 or more swamps every update (Adam's "
                f"default is 1e-8): not continued"
            )
        betas = g["betas"]
        if not isinstance(betas, list | tuple) or len(betas) != 2:
            raise RequestError(
                f"{where}: {at}.betas = {betas!r}: expected two numbers (beta1, beta2)"
            )
        for j, b in enumerate(betas):
            _number(b, f"{at}.betas[{j}]", where, below=1.0)


def _refuse_lookalike(keys: set, i: int, where: str) -> None:
    """Group ``i`` is not Adam/AdamW's: refused naming the optimizer its keys are of."""
    like = next((name for key, name in _LOOKALIKES if key in keys), None)
    raise RequestError(
        f"{where}: param_groups[{i}] holds the keys of {like or 'an unknown optimizer'} "
        f"({', '.join(sorted(keys))}): optax_from_torch translates torch's Adam, AdamW, SGD and "
        f"Muon and transformers' Adafactor; restore the weights (select=r'params/.*') and start "
        f"a new optimizer"
    )


def _recorded_mode(groups: list[dict], where: str) -> bool | None:
    """The groups' ``decoupled_weight_decay`` (None: not recorded), each group refused unless it
    is torch's (or DeepSpeed's) Adam/AdamW without amsgrad, maximize, nesterov."""
    modes = set()
    for i, g in enumerate(groups):
        keys = set(g) - _NEUTRAL_KEYS
        # DeepSpeed's FusedAdam / DeepSpeedCPUAdam, made by the client (decoupled decay unsaid)
        client = "bias_correction" in keys and keys <= DS_ADAM_KEYS
        if not client and (
            not {"amsgrad", "betas"} <= keys or keys & {"momentum_decay", "use_muon"}
        ):
            _refuse_lookalike(keys, i, where)
        flag = next((f for f in ("amsgrad", "maximize", "nesterov") if g.get(f)), None)
        if flag is not None:
            raise RequestError(
                f"{where}: param_groups[{i}]: torch {flag}=True is not translated to optax"
            )
        if not client:
            modes.add(g.get("decoupled_weight_decay"))
    if len(modes) > 1:
        raise RequestError(
            f"{where}: the parameter groups disagree on decoupled_weight_decay: {modes}"
        )
    return modes.pop() if modes else None


def identify(
    groups: list[dict], trainer_args: dict, where: str, choice: str | None = None
) -> tuple[str, str]:
    """Which optimizer wrote ``groups``: ``("adam" | "adamw", how it was told)``, or refused naming
    what it looks like (or the amsgrad, maximize, nesterov it sets); a non-zero decay of older
    torch needs a record or ``choice``.

    Args:
        groups: the recorded ``param_groups``.
        trainer_args: the Trainer's recorded training arguments ({} without them).
        where: the checkpoint, for errors.
        choice: the caller's ``optimizer=`` ("adam" or "adamw"), for what the files cannot tell."""
    if choice is not None and choice not in OPTIMIZERS:
        raise RequestError(f"optimizer={choice!r}: expected one of {OPTIMIZERS}")
    recorded = _recorded_mode(groups, where)
    optim = trainer_args.get("optim")  # when recorded, one of torch's AdamW
    if optim is not None and optim not in TRAINER_ADAMW:
        raise RequestError(
            f"{where}: the Trainer ran optim={optim!r}; translated are "
            f"{', '.join(TRAINER_ADAMW)} (torch's AdamW)"
        )
    found, how = None, ""
    if recorded is not None:
        found = "adamw" if recorded else "adam"
        how = f"param_groups' decoupled_weight_decay={recorded}"
        if optim is not None and found != "adamw":
            raise RequestError(
                f"{where}: {how} (torch {found}) but the Trainer recorded optim={optim!r}"
            )
    elif optim is not None:
        found, how = "adamw", f"the Trainer's optim={optim!r}"
    if choice is not None and found is not None and choice != found:
        raise RequestError(f"{where}: optimizer={choice!r}, but {how} says {found!r}")
    if found is not None:
        return found, how
    if choice is not None:
        return choice, f"optimizer={choice!r} (the files cannot tell Adam from AdamW)"
    rates = sorted({float(g.get("weight_decay") or 0.0) for g in groups} - {0.0})
    if not rates:  # no decay: Adam and AdamW are the same update
        return "adamw", "Adam/AdamW without weight decay (the same update)"
    if all("bias_correction" in g for g in groups):
        raise RequestError(
            f"{where}: the groups are DeepSpeed's FusedAdam / DeepSpeedCPUAdam (bias_correction) "
            f"with weight_decay {rates}, made by the client: their adam_w_mode (decoupled AdamW "
            f"decay, their default, or L2 added to the gradient) is not recorded. Pass "
            f"optimizer='adamw' (adam_w_mode=True) or optimizer='adam'"
        )
    raise RequestError(
        f"{where}: the optimizer records weight_decay {rates} without decoupled_weight_decay "
        f"(torch releases before that key write the same keys for Adam and AdamW) and no Trainer record: it "
        f"may be Adam with L2 decay added to the gradient or AdamW's decoupled decay. Pass "
        f"optimizer='adam' or optimizer='adamw'"
    )


def _schedule(source: dict, groups: list[dict], step: int, notes: list[str]):
    """(The Trainer's schedule when recorded (checked against the held rate), else the held rate;
    whether it was recorded)."""
    where = source.get("path", "checkpoint")
    lr = float(agreed(groups, "lr", where))
    trainer = source.get("trainer") or {}
    args = trainer.get("training_args") or {}
    kind = args.get("lr_scheduler_type")
    notes.extend(trainer_rates(source, groups, where))  # every record of them agreed
    if "training_args_unread" in trainer:
        note = (
            f"the Trainer's training_args.bin was not read ({trainer['training_args_unread']}): "
            f"no schedule and no clipping are known"
        )
        notes.append(note)
        warnings.warn(f"{where}: {note}", UserWarning, stacklevel=4)  # _from_run, optax_from_torch
    if kind is None:
        notes.append(f"learning rate {lr}: the optimizer's for the next step; no schedule recorded")
        return (lambda count: lr), False
    total = trainer_total(trainer, args, where)
    if not isinstance(total, int) or total <= 0:
        raise RequestError(f"{where}: the Trainer's schedule needs max_steps, found {total!r}")
    warmup = args.get("warmup_steps") or 0
    warmup = int(warmup) if warmup >= 1 else math.ceil(total * float(args.get("warmup_ratio") or 0))
    base = agreed(groups, "initial_lr", where)
    base = float(base if base is not None else args["learning_rate"])
    last = (trainer.get("scheduler") or {}).get("last_epoch")
    if last is not None and last != step:
        raise RequestError(
            f"{where}: the scheduler stepped {last} times, the optimizer {step}: cannot tell "
            f"where the schedule stands"
        )
    schedule = hf_schedule(kind, base, warmup, total, **schedule_kwargs(args, kind, where))
    want = float(schedule(step))
    if not math.isclose(want, lr, rel_tol=1e-6, abs_tol=1e-12):
        raise RequestError(
            f"{where}: the Trainer's {kind} schedule (lr {base}, warm-up {warmup}, {total} "
            f"steps) gives {want} at step {step}, the optimizer holds {lr}"
        )
    check_logged_rates(trainer, schedule, kind, where)
    notes.append(f"{kind} schedule: lr {base}, warm-up {warmup} steps, {total} steps")
    return schedule, True


def schedule_kwargs(args: dict, kind: str, where: str) -> dict[str, Any]:
    """The Trainer's ``lr_scheduler_kwargs``, each used or refused by name.

    Args:
        args: the Trainer's recorded arguments.
        kind: the scheduler the kwargs are for.
        where: the checkpoint, for the errors."""
    kwargs = args.get("lr_scheduler_kwargs") or {}
    if isinstance(kwargs, str):
        try:
            kwargs = strict_loads(kwargs)
        except ValueError as e:  # a key named twice, or no JSON
            raise RequestError(f"{where}: lr_scheduler_kwargs {kwargs[:200]!r}: {e}") from None
    if not isinstance(kwargs, dict):
        raise RequestError(f"{where}: lr_scheduler_kwargs {kwargs!r} is not a dict")
    allowed = SCHEDULE_KWARGS.get(kind, {})
    out: dict[str, Any] = {}
    for key, value in kwargs.items():
        if key not in allowed:
            raise RequestError(
                f"{where}: the Trainer's {kind} schedule has lr_scheduler_kwargs {key!r}="
                f"{value!r}, which is not reproduced (reproduced: {list(allowed) or 'none'})"
            )
        out[key] = _schedule_argument(key, value, f"{where}: lr_scheduler_kwargs[{key!r}]")
    missing = [k for k, default in allowed.items() if default is REQUIRED and k not in out]
    if missing:
        raise RequestError(
            f"{where}: the Trainer's {kind} schedule needs lr_scheduler_kwargs {missing}, "
            f"found {sorted(kwargs)}"
        )
    if kind == "polynomial" and not float(out.get("lr_end", 1e-7)) < float(
        args.get("learning_rate") or math.inf
    ):
        raise RequestError(
            f"{where}: lr_scheduler_kwargs['lr_end'] = {out.get('lr_end', 1e-7)!r} is not below "
            f"the learning rate {args.get('learning_rate')!r} (transformers refuses it too)"
        )
    return out


def _schedule_argument(key: str, value: Any, where: str) -> Any:
    """One ``lr_scheduler_kwargs`` value checked for what transformers does with it."""
    if key in ("warmup_type", "decay_type"):
        if value not in WSD_SHAPES:
            raise RequestError(f"{where} = {value!r}: expected one of {', '.join(WSD_SHAPES)}")
        return value
    if key in ("num_decay_steps", "num_stable_steps", "timescale"):
        if value is None and key != "num_decay_steps":
            return None
        if isinstance(value, bool) or not isinstance(value, int) or value < (key == "timescale"):
            raise RequestError(f"{where} = {value!r}: expected a whole number of steps")
        return value
    number = float(value) if isinstance(value, int | float) and not isinstance(value, bool) else -1
    top = 1.0 if key == "min_lr_ratio" else math.inf
    if not (math.isfinite(number) and 0 <= number <= top):
        raise RequestError(f"{where} = {value!r}: expected a finite number in [0, {top}]")
    return value


#: a tied model's output layer and the embeddings it may be, as their torch state dict names them
_HEAD, _EMBEDDINGS = "lm_head.weight", ("model.embed_tokens.weight", "transformer.wte.weight")


def _mask_tree(sources: Any, params, decayed: dict[str, bool], where: str):
    """Per leaf of ``params``: decayed or not, from the torch parameters it is made of
    (``sources``: ``_leaf_sources``, None without a spec)."""
    import jax

    def of(names: list[str], leaf: str) -> bool:
        flags = {decayed.get(n) for n in names}
        if None in flags or len(flags) != 1:
            raise RequestError(
                f"{where}: {leaf} is made of torch parameters {names} whose weight decay "
                f"differs or is unknown"
            )
        return bool(flags.pop())  # one flag, not None (checked above)

    if sources is None:  # a frozen leaf (optax.MaskedNode) has no flag
        return {n: of([n], n) if jax.tree.leaves(v) else v for n, v in params.items()}
    return jax.tree_util.tree_map_with_path(
        lambda path, _: of(
            sources[tuple(str(getattr(k, "key", k)) for k in path)], jax.tree_util.keystr(path)
        ),
        params,
    )


def _leaf_sources(run: _Run, spec: Any, notes: list[str]) -> dict[tuple, list[str]] | None:
    """{a params leaf's path: the torch parameters the spec makes it of}, None without a spec;
    the restore plan compiled once, and a layout no shape shows noted as the restore warns it."""
    if spec is None:
        return None
    saved = {k: language.TensorInfo(shape, dtype) for k, (shape, dtype) in run.saved.items()}
    plans = language.compile_restore_plan(spec, saved)
    notes += language.layout_assumed(plans, spec, run.source)
    return {
        key[1:]: [s[1] for s in plan.sources] for key, plan in plans.items() if key[0] == "params"
    }


def _ties(run: _Run, spec: Any, recorded: dict) -> tuple[dict[str, str], str]:
    """({tied name: the parameter it is}, why a head without state can be taken neither as tied
    nor as frozen: refused). In torch a tied weight is its parameter (one optimizer state; a
    Trainer's files hold it alone): the import's record where the files say so (one storage in a
    .pt, one entry in a jax_ucp DCP export); where nothing records it (torch DCP),
    ``lm_head.weight`` without state is the embedding only with the model's
    ``tie_word_embeddings`` and the embedding's bytes. Without the setting, a head whose bytes
    differ from the embedding's is not it (a frozen head, held as such); one whose bytes equal
    them may be either."""
    tied = dict(recorded.get("tied") or {})
    trained = {n for g in recorded.get("param_groups") or [] for n in g.get("params") or []}
    embedding = next((n for n in _EMBEDDINGS if n in trained), None)
    if _HEAD in tied or _HEAD not in (recorded.get("no_state") or []) or embedding is None:
        return tied, ""
    config = (run.source.get("trainer") or {}).get("model_config") or run.source.get("config")
    settings = {**getattr(spec, "settings", {}), **(config if isinstance(config, dict) else {})}
    pick = "params/(" + "|".join(re.escape(n) for n in (_HEAD, embedding)) + ")"
    read = run.restore({"select": pick})["params"]
    head, embed = (np.asarray(read[n]) for n in (_HEAD, embedding))
    same = head.dtype == embed.dtype and head.tobytes() == embed.tobytes()
    if settings.get("tie_word_embeddings") is not True:
        return tied, "" if not same else (
            f"{_HEAD} has no optimizer state, its bytes are {embedding}'s and no file records "
            f"a tie: tied or frozen? If the model ties them, save its config.json "
            f"(tie_word_embeddings true) in the weights' folder, or give the spec "
            f"tie_word_embeddings=True"
        )
    if not same:
        return tied, (
            f"{_HEAD} has no optimizer state and tie_word_embeddings is set, but its bytes "
            f"differ from {embedding}'s: not the same parameter"
        )
    return {**tied, _HEAD: embedding}, ""


def _untied(params: Any, sources: Any, tied: dict[str, str]) -> Any:
    """``params`` without the leaves made of tied names alone, nor the modules they empty (the
    tied model's tree)."""
    leaves = {(k,): [k] for k in params} if sources is None else sources
    for path, names in leaves.items():
        if names and set(names) <= set(tied):
            nodes = [params]
            for k in path[:-1]:
                nodes.append(nodes[-1][k])
            nodes[-1].pop(path[-1])
            for parent, k, node in reversed(list(zip(nodes, path, nodes[1:]))):
                if not node:
                    parent.pop(k)
    return params


def optax_from_torch(
    ckpt,
    *,
    spec: Any = None,
    optimizer: str | None = None,
    options: Any = None,
    schedule: Any = None,
    clip: Any = _UNSET,
) -> TorchOptimizer:
    """The optax optimizer and state that continue the torch run at ``ckpt``, read from what its
    trainer wrote (nothing written) or from its converted checkpoint. On a mesh the params and
    Adam's moments come back as ``jax.Array``s placed alike, each process reading only its slices.

    Args:
        ckpt: a torch run's checkpoint with its Adam/AdamW state as ``convert`` reads it (its
            import options as ``options.importing``), or the UCP checkpoint made of it.
        spec: the spec the parameters are restored with (e.g. ``hf_llama``), or None for
            torch's names; the moments and the weight-decay mask follow it.
        optimizer: "adam" or "adamw", only where the files cannot tell (a non-zero weight decay
            from a torch that records both alike, no Trainer record); a contradiction is refused.
        options: a :class:`jax_ucp.RestoreOptions` (mesh, rules, target, memory_budget, ...),
            its ``spec`` unset.
        schedule: the learning rate as a function of optax's step count, or a number, for a run
            whose files record no schedule; it must match the rate held for the next step.
        clip: the global gradient norm the run clipped to (None or 0: none), for a run whose
            files do not record it; refused when it contradicts them.

    Returns:
        A :class:`TorchOptimizer`: ``tx.update(grads, opt_state, params)`` is torch's next step."""
    given: dict[str, Any] = {} if schedule is None else {"schedule": schedule}
    if clip is not _UNSET:
        given["clip"] = clip
    with _opened_run(ckpt, options) as run:
        return _from_run(run, ckpt, spec, optimizer, options, given)


@dataclasses.dataclass(frozen=True)
class _Run:
    """What the translation reads of a run: its record, tensor shapes, how to restore."""

    source: dict
    saved: dict
    restore: Callable[[dict], Any]


@contextlib.contextmanager
def _opened_run(ckpt, options: Any):
    """``ckpt`` opened once: a converted checkpoint, or a torch source read in place."""
    importing, given = getattr(options, "importing", None), getattr(options, "format", None)
    found = sources.opening(store.storage_for(ckpt), importing, given)  # detected once
    if found.importer is None:
        from jax_ucp._src.api import inspect, restore

        manifest = inspect(ckpt)
        saved = {e.key: (e.shape, to_numpy_dtype(e.dtype)) for e in manifest.tensors}
        yield _Run(manifest.source or {}, saved, lambda keywords: restore(ckpt, **keywords))
        return
    budget = options.read_budget if isinstance(options, RestoreOptions) else None
    with import_open.opened_import(
        found.storage, found.importer, importing, memory_budget=budget
    ) as imported:

        def restore_imported(keywords: dict):
            wanted = RestoreOptions(**keywords)
            return restore_entry.restore_from(imported.with_spec(wanted.spec), wanted)

        yield _Run(imported.source, imported.saved, restore_imported)


def _from_run(
    run: _Run, ckpt, spec: Any, optimizer: str | None, options: Any, given: dict[str, Any]
) -> TorchOptimizer:
    """``optax_from_torch`` of the opened run: its Recipe, the state restored, the chain built."""
    import jax

    source = run.source
    where = str(source.get("path") or ckpt)
    recorded = torch_optimizer_record(source)
    groups = recorded.get("param_groups") or []
    if groups and isinstance(groups, list) and all(isinstance(g, dict) for g in groups):
        kinds = [families.kind_of(g) for g in groups]
        if set(kinds) != {"adam"}:
            return _other_run(run, spec, optimizer, options, given, groups, kinds, where)
    if groups:
        check_groups(groups, where, lion=names_lion(source))
    recipe = _framework_recipe(source, run.saved, where, optimizer)
    deepspeed = recipe is not None and recorded_config(source) is not None
    if recipe is None and not groups:
        raise RequestError(_no_optimizer(source, where))
    spec = spec_with_recorded_settings(spec, source, notes := [])
    lion = recipe is not None and recipe.optimizer == "lion"
    sources = _leaf_sources(run, spec, notes)
    params, mu, nu, step = _restored_adam(run, options, spec, where, lion)
    tied, why = _ties(run, spec, recorded)
    if why:
        raise RequestError(f"{where}: {why}")
    params = _untied(params, sources, tied)
    held = frozen.find(params, mu)
    trained, mu = (params, mu) if held is None else map(held.only, (params, mu))
    nu = nu if held is None or nu is None else held.only(nu)
    if recipe is None:
        recipe = torch_recipe(source, groups, step, optimizer, where)
    elif recipe.at_step is not None:
        notes.extend(recipe.at_step(step))
    if deepspeed and not recipe.schedule_recorded:  # the client's (the Trainer's) scheduler
        recipe = _client_schedule(recipe, source, groups, step)
    recipe = _with_given(recipe, given, step, where)
    notes[:0] = [recipe.how]
    notes.extend(recipe.notes)
    _recorded_steps(source, step, notes, where)
    mask = None
    if _decays(recipe):
        mask = _mask_tree(sources, trained, dict(recipe.decayed), where)
        leaves = jax.tree.leaves(mask)
        style = {"adamw": "decoupled (AdamW)", "lion": "decoupled (Lion)"}.get(
            recipe.optimizer, "L2, added to the gradient (Adam)"
        )
        rate = recipe.weight_decay
        said = f"scheduled, {float(rate(step))} at step {step}" if callable(rate) else rate
        notes.append(f"weight decay {said} on {sum(leaves)} of {len(leaves)} leaves, {style}")
    unrecovered = _say_unrecovered(recipe.unrecovered, notes, where)
    tx = chain_of(recipe, mask)
    state = _state_of(tx, trained, mu, nu, step)
    if held is not None:
        tx, state = held.holding(tx, state, params)
        notes.append(held.note)
        _say_trainable_held(source, recorded, groups, notes, where)
    schedule = recipe.learning_rate
    kinds = ["lion" if lion else "adam"] * len(groups)
    return TorchOptimizer(
        tx, state, params, schedule, step, notes, unrecovered, recipe.optimizer, groups, kinds
    )


def _say_trainable_held(
    source: dict, recorded: dict, groups: list, notes: list[str], where: str
) -> None:
    """Warns of parameters held frozen that a Trainer's optimizer groups list (it gives its
    optimizer only those with ``requires_grad``): torch skips them while they get no gradient,
    but starts their moments at their first; with their state lost or never made, the
    continuation holds them (probe 9: an embedding's state removed, only a note said so).
    Elsewhere a frozen parameter may be in the groups (``AdamW(model.parameters())``)."""
    if not source.get("trainer"):
        return
    listed = {n for g in groups for n in g.get("params") or () if isinstance(n, str)}
    trainable = sorted(set(recorded.get("no_state") or ()) & listed)
    if trainable:
        shown = ", ".join(trainable[:4]) + (", ..." if len(trainable) > 4 else "")
        note = (
            f"{len(trainable)} parameter(s) in the optimizer's param groups have no optimizer "
            f"state ({shown}): held frozen, as torch steps them only once they get a gradient "
            f"(then from fresh moments); a state lost from the file looks the same"
        )
        notes.append(note)
        warnings.warn(f"{where}: {note}", UserWarning, stacklevel=4)


def _other_run(
    run: _Run,
    spec: Any,
    choice: str | None,
    options: Any,
    given: dict[str, Any],
    groups: list[dict],
    kinds: list[str],
    where: str,
) -> TorchOptimizer:
    """A run of torch's SGD or Muon (with its AdamW groups) or transformers' Adafactor: one
    chain per optimizer over the parameters its groups hold, behind the run's clipping; the
    parameters it kept no state for held (``frozen``)."""
    import optax

    source = run.source
    spec = spec_with_recorded_settings(spec, source, notes := [])
    sources = _leaf_sources(run, spec, notes)
    tree = run.restore(_restore_keywords(options, spec, where))
    params, opt = tree["params"], tree.get("opt_state") or {}
    tied, why = _ties(run, spec, torch_optimizer_record(source))
    if why:
        raise RequestError(f"{where}: {why}")
    params = _untied(params, sources, tied)
    step = _step_of(opt, source, notes, where)
    held = frozen.find(params, *(v for v in opt.values() if isinstance(v, dict)))
    trained = params if held is None else held.only(params)
    by_kind = {k: [g for g, kk in zip(groups, kinds) if kk == k] for k in dict.fromkeys(kinds)}
    if len(by_kind) > 1 and set(by_kind) != {"muon", "adam"}:
        raise RequestError(
            f"{where}: the parameter groups are of {', '.join(families.NAMES[k] for k in by_kind)}:"
            f" continued together are torch Muon and its AdamW groups only"
        )
    owner = {n: k for g, k in zip(groups, kinds) for n in g["params"]}
    if choice is not None and "adam" not in by_kind:
        raise RequestError(
            f"{where}: optimizer={choice!r}, but the groups are {families.NAMES[kinds[0]]}'s"
        )
    chains, recipes = {}, []
    for kind, mine in by_kind.items():
        if kind == "adam":
            check_groups(mine, where)
            recipe = torch_recipe(source, mine, step, choice, where)
        else:
            recipe = _held_recipe(source, mine, step, kind, where)
        recipe = _with_given(
            recipe,
            given if kind in ("adam", "sgd") else _no_schedule(given, kind, where),
            step,
            where,
        )
        recipes.append(recipe)
        notes.append(recipe.how)
        notes.extend(recipe.notes)
        inside = {n: k == kind for n, k in owner.items()}
        part = _mask_tree(sources, trained, inside, where) if len(by_kind) > 1 else None
        chains[kind] = _kind_chain(kind, recipe, mine, run, sources, trained, part, owner, notes)
    clip = recipes[0].clip
    if any(r.clip != clip for r in recipes):
        raise RequestError(f"{where}: the optimizers' recipes disagree on clipping")
    if len(chains) == 1:
        inner = next(iter(chains.values()))
    else:
        labels = _labels(sources, trained, owner, where)
        inner = optax.partition(chains, labels)
    tx = optax.chain(clip_like_torch(clip), inner)
    if held is not None:
        tx = held.partition(tx)
        notes.append(held.note)
    state, said = families.filled_state(tx, params, opt, step, where)
    notes.extend(said)
    unrecovered = _say_unrecovered([u for r in recipes for u in r.unrecovered], notes, where)
    kind = "+".join(r.optimizer for r in recipes)
    return TorchOptimizer(
        tx, state, params, recipes[0].learning_rate, step, notes, unrecovered, kind, groups, kinds
    )


def _say_unrecovered(unrecovered: Any, notes: list[str], where: str) -> list[str]:
    """What the files do not record (once each), noted and warned at the user's call: the
    translation goes on without it rather than guess."""
    unrecovered = list(dict.fromkeys(unrecovered))
    if unrecovered:
        notes.extend(f"not recovered: {u}" for u in unrecovered)
        warnings.warn(
            f"{where}: the translation goes on without what the files do not record: "
            + "; ".join(unrecovered),
            UserWarning,
            stacklevel=user_stacklevel(),
        )
    return unrecovered


def _labels(sources: Any, params: Any, owner: dict[str, str], where: str) -> Any:
    """Per leaf of ``params``: the optimizer its torch parameters belong to."""
    import jax

    kinds = sorted(set(owner.values()))
    masks = [
        _mask_tree(sources, params, {n: o == k for n, o in owner.items()}, where) for k in kinds
    ]
    return jax.tree.map(lambda *flags: kinds[list(flags).index(True)], *masks)


def _no_schedule(given: dict[str, Any], kind: str, where: str) -> dict[str, Any]:
    if "schedule" in given:
        raise RequestError(
            f"{where}: optax_from_torch(schedule=) over {families.NAMES[kind]}: its learning "
            f"rate is continued as held (Adafactor: as it steps it)"
        )
    return given


def _step_of(opt: dict, source: dict, notes: list[str], where: str) -> int:
    """The imported step count, else the Trainer's global step, else 0 (torch's SGD and Muon
    keep none), said."""
    import jax

    counts = [
        v
        for p, v in jax.tree_util.tree_leaves_with_path(opt)
        if getattr(p[-1], "key", None) == "count"
    ]
    if len(counts) > 1:
        raise RequestError(f"{where}: expected one step count in opt_state, found {counts}")
    if counts:
        return int(counts[0])
    global_step = (source.get("trainer") or {}).get("global_step")
    if type(global_step) is int:
        notes.append(f"step {global_step}: the Trainer's global_step (the optimizer keeps none)")
        return global_step
    notes.append("step 0: the optimizer keeps no step count (a schedule= is read from 0)")
    return 0


def _held_recipe(source: dict, groups: list[dict], step: int, kind: str, where: str) -> Recipe:
    """The run's learning rate (the Trainer's schedule, else held), clipping and decay for
    torch's SGD, Muon or transformers' Adafactor."""
    trainer_args = run_arguments(source, where)
    notes: list[str] = []
    unrecovered = _unrecovered(source)
    if kind == "adafactor":
        schedule, recorded = (lambda count: 0.0), True
        unrecovered = [u for u in unrecovered if "schedule" not in u]
    else:
        schedule, recorded = _schedule(source, groups, step, notes)
        if recorded and kind == "muon":
            raise RequestError(f"{where}: a Trainer schedule over torch Muon is not translated")
    max_norm = trainer_args.get("max_grad_norm")
    clip = _number(max_norm, "max_grad_norm", where) if max_norm else None
    rate, decayed = group_decay(groups, where)
    return Recipe(
        optimizer=kind,
        how=families.NAMES[kind],
        learning_rate=schedule,
        weight_decay=rate,
        decayed=decayed,
        clip=clip,
        notes=tuple(notes),
        unrecovered=tuple(unrecovered),
        schedule_recorded=recorded,
        clip_recorded="max_grad_norm" in trainer_args,
    )


def _kind_chain(
    kind: str,
    recipe: Recipe,
    groups: list[dict],
    run: _Run,
    sources: Any,
    params: Any,
    part: Any,
    owner: dict[str, str],
    notes: list[str],
) -> Any:
    """One optimizer's chain (no clipping) over its part of the parameters (``part``: its
    leaves, or None for all), weight decay on the leaves its groups decay."""
    import jax
    import optax

    where = str(run.source.get("path"))
    mask = None
    if _decays(recipe):
        decayed = {**dict.fromkeys(owner, False), **recipe.decayed}  # the others': no decay
        mask = _mask_tree(sources, params, decayed, where)
    if part is not None and mask is not None:  # a partition passes only this part's leaves
        mask = jax.tree.map(lambda m, mine: m if mine else optax.MaskedNode(), mask, part)
    if kind == "adam":
        return chain_of(dataclasses.replace(recipe, clip=None), mask)
    lr = float(recipe.learning_rate(0)) if kind != "sgd" else 0.0
    tx, said = families.core(kind, groups, lr, where)
    notes.extend(said)
    if kind != "sgd":  # Muon decays each of its parameters; Adafactor every one decayed
        return tx
    return optax.chain(
        decay_at(recipe.weight_decay, mask), tx, optax.scale_by_learning_rate(recipe.learning_rate)
    )


def _framework_recipe(source: dict, saved: dict, where: str, choice: str | None) -> Recipe | None:
    """The Recipe a framework's own record gives (DeepSpeed, Megatron), or None for torch's record."""
    ds = recorded_config(source) or {}
    if ds.get("optimizer") is None and ds.get("scheduler") is not None:
        groups = torch_optimizer_record(source).get("param_groups") or []
        check_groups(groups, where)
        client = identify(groups, run_arguments(source, where), where, choice)
        return deepspeed_recipe(source, where, client)
    recipe = deepspeed_recipe(source, where)
    if recipe is None:
        recipe = megatron_recipe(source, saved, where)  # Megatron's arguments and scheduler
        if recipe is None:
            return None
        unrecorded = [u for u in recipe.unrecovered if u.startswith("clip_grad")]
        recipe = dataclasses.replace(recipe, clip_recorded=not unrecorded)
    if choice is not None and choice != recipe.optimizer:
        raise RequestError(
            f"{where}: optimizer={choice!r}, but {recipe.how} is {recipe.optimizer!r}"
        )
    return recipe


def _client_schedule(recipe: Recipe, source: dict, groups: list[dict], step: int) -> Recipe:
    """A DeepSpeed recipe's schedule without its scheduler: the Trainer's, else the held rate."""
    notes: list[str] = []
    schedule, recorded = _schedule(source, groups, step, notes)
    return dataclasses.replace(
        recipe,
        learning_rate=schedule,
        schedule_recorded=recorded,
        notes=(*recipe.notes, *notes),
        unrecovered=tuple(u for u in _unrecovered(source) if "schedule" in u),
    )


def torch_recipe(
    source: dict, groups: list[dict], step: int, choice: str | None, where: str
) -> Recipe:
    """Torch's recorded Adam/AdamW (and the Trainer's arguments, schedule and clipping)."""
    trainer_args = run_arguments(source, where)
    kind, how = identify(groups, trainer_args, where, choice)
    notes: list[str] = []
    b1, b2 = (float(b) for b in agreed(groups, "betas", where))
    eps = float(agreed(groups, "eps", where))
    rate, decayed = group_decay(groups, where)
    schedule, has_schedule = _schedule(source, groups, step, notes)
    max_norm = trainer_args.get("max_grad_norm")
    clip = None
    if max_norm:
        clip = _number(max_norm, "max_grad_norm", where)
        notes.append(f"gradients clipped to global norm {max_norm}")
    unrecovered = _unrecovered(source)
    clip_recorded = "max_grad_norm" in trainer_args
    bias_correction = agreed(groups, "bias_correction", where)  # DeepSpeed's Adams record it
    if bias_correction is not None and not isinstance(bias_correction, bool):
        raise RequestError(f"{where}: param_groups' bias_correction = {bias_correction!r}")
    return Recipe(
        optimizer=kind,
        how=f"torch {'AdamW' if kind == 'adamw' else 'Adam'}: {how}",
        betas=(b1, b2),
        eps=eps,
        learning_rate=schedule,
        weight_decay=rate,
        decayed=decayed,
        clip=clip,
        bias_correction=bias_correction is not False,
        notes=tuple(notes),
        unrecovered=tuple(unrecovered),
        schedule_recorded=has_schedule,
        clip_recorded=clip_recorded,
    )


def _with_given(recipe: Recipe, given: dict[str, Any], step: int, where: str) -> Recipe:
    """``recipe`` with the caller's ``schedule=`` / ``clip=``; a contradicted one is refused."""
    changes: dict[str, Any] = {}
    unrecovered = list(recipe.unrecovered)
    notes = list(recipe.notes)
    schedule = given.get("schedule")
    if schedule is not None:
        if recipe.schedule_recorded:
            raise RequestError(
                f"{where}: optax_from_torch(schedule=) given, but the files record the run's "
                f"schedule ({recipe.how}; see the notes): it is continued as recorded"
            )
        fn: Callable[[Any], Any] = schedule if callable(schedule) else _constant(schedule)
        held, want = float(recipe.learning_rate(step)), float(fn(step))
        if not math.isclose(want, held, rel_tol=1e-5, abs_tol=1e-12):
            raise RequestError(
                f"{where}: optax_from_torch(schedule=) gives lr {want} at step {step}; the "
                f"optimizer holds {held} for its next step"
            )
        changes["learning_rate"] = fn
        unrecovered = [u for u in unrecovered if "schedule" not in u]
        notes.append(f"learning-rate schedule: given (schedule=), {held} at step {step}")
    clip = given.get("clip", _UNSET)
    if clip is not _UNSET:
        norm = None if clip is None else _number(clip, "optax_from_torch(clip=)", where)
        norm = norm or None
        if recipe.clip_recorded and norm != recipe.clip:
            raise RequestError(
                f"{where}: optax_from_torch(clip={clip!r}), but the files record "
                f"{'no clipping' if recipe.clip is None else f'clipping to {recipe.clip}'}"
            )
        if not recipe.clip_recorded:
            changes["clip"] = norm
            unrecovered = [u for u in unrecovered if "clipping" not in u and "clip_grad" not in u]
            said = f"to global norm {norm}" if norm else "none"
            notes.append(f"gradient clipping: given (clip=), {said}")
    if not changes and notes == list(recipe.notes):
        return recipe
    return dataclasses.replace(
        recipe, **changes, unrecovered=tuple(unrecovered), notes=tuple(notes)
    )


def _constant(value: Any) -> Callable[[Any], Any]:
    rate = _number(value, "optax_from_torch(schedule=)", "schedule")
    return lambda count: rate


def _decays(recipe: Recipe) -> bool:
    rate = recipe.weight_decay
    return callable(rate) or bool(rate)


def clip_like_torch(max_norm: float | None) -> Any:
    """torch's ``clip_grad_norm_``: the gradients times ``min(1, max_norm / (norm + 1e-6))``
    (optax's has no 1e-6); None: unchanged."""
    import jax
    import jax.numpy as jnp
    import optax

    def update(updates, state, params=None):
        del params
        if max_norm is None:
            return updates, state
        norm = optax.tree.norm(updates)
        scale = jnp.minimum(1.0, max_norm / (norm + 1e-6))
        return jax.tree.map(lambda g: (g * scale).astype(g.dtype), updates), state

    return optax.GradientTransformation(lambda params: optax.EmptyState(), update)


def decay_at(rate: Any, mask: Any) -> Any:
    """``rate * param`` added on the masked leaves; its state is the step count, decayed or not."""
    import jax
    import jax.numpy as jnp
    import optax

    def init(params):
        del params
        return optax.ScaleByScheduleState(count=jnp.zeros([], jnp.int32))

    def update(updates, state, params=None):
        count = optax.safe_increment(state.count)
        if not (callable(rate) or rate):
            return updates, optax.ScaleByScheduleState(count=count)
        if params is None:
            raise ValueError("weight decay needs the params: tx.update(grads, state, params)")
        r = rate(state.count) if callable(rate) else rate
        flags = mask if mask is not None else jax.tree.map(lambda _: True, params)
        out = jax.tree.map(
            lambda g, p, m: (g + r * p).astype(g.dtype) if m else g, updates, params, flags
        )
        return out, optax.ScaleByScheduleState(count=count)

    return optax.GradientTransformation(init, update)


def scale_by_torch_adam(b1: Any, b2: float, eps: float, bias_correction: bool = True) -> Any:
    """Adam's ``m_hat / (sqrt(v_hat) + eps)`` as torch and DeepSpeed step it."""
    import jax
    import jax.numpy as jnp
    import optax

    if not callable(b1) and bias_correction:
        return optax.scale_by_adam(b1, b2, eps)

    def init(params):
        zeros = jax.tree.map(jnp.zeros_like, params)
        return optax.ScaleByAdamState(jnp.zeros([], jnp.int32), zeros, zeros)

    def update(updates, state, params=None):
        del params
        beta1: Any = b1(state.count) if callable(b1) else b1
        mu = jax.tree.map(lambda g, m: (1 - beta1) * g + beta1 * m, updates, state.mu)
        nu = jax.tree.map(lambda g, v: (1 - b2) * g * g + b2 * v, updates, state.nu)
        count = optax.safe_increment(state.count)
        steps = jnp.asarray(count, jnp.float32)
        c1 = 1 - jnp.power(beta1, steps) if bias_correction else 1.0
        c2 = 1 - jnp.power(b2, steps) if bias_correction else 1.0
        out = jax.tree.map(
            lambda m, v, g: ((m / c1) / (jnp.sqrt(v / c2) + eps)).astype(g.dtype), mu, nu, updates
        )
        return out, optax.ScaleByAdamState(count=count, mu=mu, nu=nu)

    return optax.GradientTransformation(init, update)


def chain_of(recipe: Recipe, mask: Any) -> Any:
    """The one chain every Adam source continues with: ``clip, L2 decay, Adam, decoupled decay,
    learning rate`` (absent pieces pass through), one state structure for every run; a Lion's is
    ``clip, optax.lion`` (its ``b1`` / ``b2`` torch's ``betas``, its decay decoupled as
    DeepSpeed's ``p * (1 - lr * wd)``)."""
    import optax

    b1, b2 = recipe.betas
    rate = recipe.weight_decay
    if recipe.optimizer == "lion":
        lion = optax.lion(recipe.learning_rate, b1, b2, weight_decay=rate, mask=mask)
        return optax.chain(clip_like_torch(recipe.clip), lion)
    l2 = rate if recipe.optimizer == "adam" else 0.0
    decoupled = rate if recipe.optimizer == "adamw" else 0.0
    return optax.chain(
        clip_like_torch(recipe.clip),
        decay_at(l2, mask),
        scale_by_torch_adam(recipe.beta1 or b1, b2, recipe.eps, recipe.bias_correction),
        decay_at(decoupled, mask),
        optax.scale_by_learning_rate(recipe.learning_rate),
    )


def _recorded_steps(source: dict, step: int, notes: list[str], where: str) -> None:
    """The run's other step counts against the optimizer's; a difference is warned."""
    trainer = source.get("trainer") or {}
    folder = str(source.get("trainer_path") or source.get("path") or where)
    counts = {
        f"{folder}/trainer_state.json's global_step": trainer.get("global_step"),
        f"{source.get('path')}'s DeepSpeed global_steps": source.get("global_steps"),
    }
    optimizer = source.get("optimizer_file") or "the optimizer state"
    for what, count in counts.items():
        if type(count) is int and count != step:
            note = (
                f"{what} is {count}, the optimizer's step ({optimizer}) {step}: the run "
                f"continues at the optimizer's step {step}"
            )
            notes.append(note)
            warnings.warn(note, UserWarning, stacklevel=4)  # _from_run, optax_from_torch


def _restored_adam(
    run: _Run, options: Any, spec: Any, where: str, lion: bool = False
) -> tuple[Any, Any, Any, int]:
    """(params, mu, nu, step) restored as ``options`` asks; the step is the opt_state's count.
    A Lion's state is ``mu`` (its ``exp_avg``): ``nu`` is None, or DeepSpeedCPULion's
    ``exp_avg_sq``, which it makes and never steps (zeros, checked)."""
    import jax
    import jax.numpy as jnp

    tree = run.restore(_restore_keywords(options, spec, where))
    if "opt_state" not in tree:
        raise RequestError(f"{where}: the checkpoint holds no optimizer state")
    opt = tree["opt_state"]  # mu and nu at opt_state/mu, or a spec's opt_state/0/mu
    want = {"mu"} if lion else {"mu", "nu"}
    nodes = [n for n in (opt, *opt.values()) if isinstance(n, dict) and want <= set(n)]
    if not nodes:
        what = "Lion momentum (mu)" if lion else "Adam moments (mu, nu)"
        raise RequestError(f"{where}: no {what} in the checkpoint's opt_state")
    mu, nu = nodes[0]["mu"], nodes[0].get("nu")
    if lion and any(bool(jnp.any(v != 0)) for v in jax.tree.leaves(nu)):
        raise RequestError(
            f"{where}: the config names Lion, but opt_state/nu (exp_avg_sq) holds non-zero "
            f"values: DeepSpeedCPULion keeps it at zeros; not a Lion's state"
        )
    nu = None if lion else nu
    leaves = jax.tree_util.tree_leaves_with_path(opt)
    counts = [v for path, v in leaves if getattr(path[-1], "key", None) == "count"]
    if len(counts) != 1:
        raise RequestError(f"{where}: expected one step count in opt_state, found {counts}")
    return tree["params"], mu, nu, int(counts[0])


def _state_of(tx: Any, params: Any, mu: Any, nu: Any, step: int, shaped: Any = None) -> tuple:
    """The chain's state around the restored moments, from shapes (no ``tx.init`` zeros);
    ``shaped``: a chain's inside (optax.lion's), its shapes."""
    import jax
    import jax.numpy as jnp
    import optax

    if shaped is None:
        shaped = jax.eval_shape(tx.init, params)
    state = list(shaped)  # pyright: ignore[reportArgumentType]  # a chain's state is a tuple
    count = jnp.asarray(step, jnp.int32)  # on the params' mesh, as a jitted step returns it
    on = [a.sharding for a in jax.tree.leaves(params) if isinstance(a, jax.Array)]
    if on and isinstance(on[0], jax.sharding.NamedSharding):  # (else step 2 compiles again)
        count = jax.device_put(count, jax.sharding.NamedSharding(on[0].mesh, jax.P()))
    for i, s in enumerate(state):
        if isinstance(s, optax.ScaleByAdamState):
            state[i] = optax.ScaleByAdamState(count=count, mu=_like(mu, s.mu), nu=_like(nu, s.nu))
        elif isinstance(s, optax.ScaleByLionState):
            state[i] = optax.ScaleByLionState(count=count, mu=_like(mu, s.mu))
        elif isinstance(s, optax.ScaleByScheduleState):  # the learning rate's, the decays'
            state[i] = optax.ScaleByScheduleState(count=count)
        elif type(s) is tuple:
            state[i] = _state_of(tx, params, mu, nu, step, s)
        else:  # clipping and weight decay keep no arrays; anything else starts at zeros
            state[i] = jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), s)
    return tuple(state)


def _no_optimizer(source: dict, where: str) -> str:
    """Why the import recorded no torch optimizer, as the source record tells."""
    skipped = (source.get("skipped") or {}).values()
    if any(str(why).startswith("weights_only") for why in skipped):
        return (
            f"{where}: no torch optimizer recorded: imported with weights_only=True (its "
            f"optimizer state is listed in source.skipped); convert without weights_only"
        )
    if source.get("optimizer_layout"):  # Megatron: its Adam state, not a torch record
        return (
            f"{where}: the {source.get('framework')} import holds the Adam moments "
            f"(opt_state/mu, opt_state/nu, saved {source['optimizer_layout']}) but no torch "
            f"optimizer record to translate (optax_from_torch reads torch's param_groups); "
            f"restore them with jax_ucp.restore and build the optax optimizer from the run's "
            f"settings (source.settings)"
        )
    return (
        f"{where}: no torch optimizer recorded in this {source.get('framework') or 'unknown'} "
        f"import (no torch param_groups were found in its files, or it is not from torch)"
    )


def run_arguments(source: dict, where: str) -> dict:
    """The Trainer's recorded arguments as the run stepped with them."""
    del where
    args = dict((source.get("trainer") or {}).get("training_args") or {})
    ds = recorded_config(source)
    if ds is None:
        return args
    args["max_grad_norm"] = ds.get("gradient_clipping", 0.0)
    if ds.get("optimizer") is not None:
        args.pop("optim", None)  # the Trainer's choice, unused: DeepSpeed made the optimizer
    return args


def _restore_keywords(options: Any, spec: Any, where: str) -> dict[str, Any]:
    """``restore``'s keywords: those ``options`` (a RestoreOptions) sets, with ``spec``."""
    if options is None:
        return {"spec": spec}
    if not isinstance(options, RestoreOptions):
        raise TypeError(
            f"optax_from_torch(options=): a jax_ucp.RestoreOptions, not {type(options).__name__}"
        )
    if options.spec is not None:
        raise RequestError(
            f"{where}: optax_from_torch(options=) with a spec; give the spec as "
            f"optax_from_torch(spec=) (it also finds which torch parameters each leaf holds)"
        )
    given = {
        f.name: getattr(options, f.name)
        for f in dataclasses.fields(options)
        if f.init and getattr(options, f.name) is not f.default
    }
    return {**given, "spec": spec}


def _unrecovered(source: dict) -> list[str]:
    """What the import found no record of: without the Trainer's arguments, schedule and clipping."""
    trainer = source.get("trainer") or {}
    args = trainer.get("training_args")
    if args is not None:
        return [] if args.get("lr_scheduler_type") is not None else ["the learning-rate schedule"]
    out = [
        "the learning-rate schedule (none recorded: the optimizer's learning rate for the "
        "next step, held constant; pass optax_from_torch(schedule=) the run's)"
    ]
    if recorded_config(source) is None:
        out.append(
            "gradient clipping (none recorded: pass optax_from_torch(clip=) the run's max_norm, "
            "or clip=None if it did not clip)"
        )
    return out


def _like(moment, init):
    """The restored moment in the structure optax made (shapes checked leaf by leaf)."""
    import jax
    import jax.numpy as jnp

    def one(got, want):
        if np.shape(got) != np.shape(want):
            raise RequestError(
                f"moment of shape {np.shape(got)} for a parameter of {np.shape(want)}"
            )
        return got if isinstance(got, jax.Array) else jnp.asarray(got)  # placed as restored

    return jax.tree.map(one, moment, init)
