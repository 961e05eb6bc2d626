"""A Trainer (or verl) save's records of its learning rate, gathered (:mod:`jax_ucp._src.facts`): each
group's base rate is its ``initial_lr`` in the optimizer's file and its ``base_lrs`` entry in the
scheduler's (a torch scheduler copies the one into the other when it is made), its rate for the
next step its ``lr`` and the scheduler's ``_last_lr``; ``trainer_state.json``'s ``log_history``
holds the rates the schedule gave. A record that disagrees is refused; arguments that differ
from the groups (a client optimizer, made by the user) are said."""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable
from typing import Any

import numpy as np

from jax_ucp._src.errors import SourceError
from jax_ucp._src.facts import Facts, canonical

__all__ = ["check_logged_rates", "trainer_rates", "trainer_total"]


def trainer_rates(source: dict, groups: list[dict], where: str) -> list[str]:
    """Each group's base and held learning rate as every record states it, agreed or refused;
    the notes to say (training arguments the groups override)."""
    trainer = source.get("trainer") or {}
    saved = trainer.get("scheduler") or {}
    opt = source.get("optimizer_file") or "rank 0's optimizer state"
    sched = "scheduler.pt" if source.get("optimizer_file") else "the saved lr_scheduler"
    verl = source.get("lr_scheduler")  # verl's extra state: the same torch scheduler's
    if not saved and isinstance(verl, dict):
        saved = {"base_lrs": verl.get("base_lrs"), "last_lr": verl.get("_last_lr")}
        sched = "extra_state_world_size_*_rank_0.pt lr_scheduler"
    facts = Facts(where)
    for key, field, what in (("base_lrs", "initial_lr", "base"), ("last_lr", "lr", "held")):
        rates = saved.get(key)
        if not isinstance(rates, list) or not any(field in g for g in groups):
            continue
        facts.state("the number of param groups", f"{opt} param_groups", len(groups))
        facts.state("the number of param groups", f"{sched} {key}", len(rates))
        for i, (group, rate) in enumerate(zip(groups, rates)):
            fact = f"the {what} learning rate of param_groups[{i}]"
            facts.state(fact, f"{opt} param_groups[{i}].{field}", group.get(field))
            facts.state(fact, f"{sched} {key}[{i}]", rate)
    facts.agree_all()
    return _built_from_args(trainer.get("training_args") or {}, groups, opt, where)


#: a group's field -> the TrainingArguments the Trainer's own optimizer took it from
#: (``Trainer.get_optimizer_cls_and_kwargs``); betas and eps only for its AdamW and Lion
BUILT_FROM = {"initial_lr": ("learning_rate",), "betas": ("adam_beta1", "adam_beta2"),
              "eps": ("adam_epsilon",)}  # fmt: skip


def _built_from_args(args: dict, groups: list[dict], opt: str, where: str) -> list[str]:
    """The param groups against the arguments the Trainer builds its optimizer from: where they
    differ, the optimizer was the client's (``Trainer(optimizers=...)``), or a file was edited;
    nothing tells which, so the groups' values are continued, said and warned."""
    adam = any(k in str(args.get("optim", "adamw")) for k in ("adamw", "lion"))
    differ = []
    for field, names in BUILT_FROM.items():
        given = [args.get(n) for n in names]
        if (field != "initial_lr" and not adam) or not all(_number(v) for v in given):
            continue
        want = canonical(given if len(given) > 1 else given[0])
        held = [canonical(g[field]) for g in groups if field in g]
        if any(h != want for h in held):
            shown = sorted({repr(h) for h in held})
            differ.append(f"{field} {', '.join(shown)} (training_args.bin {want})")
    decay = args.get("weight_decay")
    rates = {repr(canonical(g.get("weight_decay"))) for g in groups}
    if adam and _number(decay) and not rates <= {repr(canonical(decay)), "0"}:
        differ.append(f"weight_decay {', '.join(sorted(rates))} (training_args.bin {decay})")
    if not differ:
        return []
    note = (
        f"{opt} param_groups' {'; '.join(differ)}: not the optimizer the Trainer builds from its "
        f"arguments (a client optimizer, Trainer(optimizers=...), or an edited file); the "
        f"groups' values are continued"
    )
    warnings.warn(f"{where}: {note}", UserWarning, stacklevel=3)
    return [note]


def _number(x: Any) -> bool:
    return type(x) in (int, float) and math.isfinite(x)


def trainer_total(trainer: dict, args: dict, where: str) -> Any:
    """The schedule's length, ``trainer_state.json``'s ``max_steps`` and ``training_args.bin``'s
    (when set: above 0, the Trainer copies it), agreed or refused naming both; a save in its
    warm-up holds a rate that does not depend on it, so the held-rate check cannot tell."""
    facts = Facts(where)
    if trainer.get("max_steps") is not None:
        facts.state("max_steps", "trainer_state.json max_steps", trainer["max_steps"])
    given = args.get("max_steps")
    if given is not None and not (type(given) is int and given <= 0):
        facts.state("max_steps", "training_args.bin max_steps", given)
    return facts.agree("max_steps")


def check_logged_rates(
    trainer: dict, schedule: Callable[[Any], Any], kind: str, where: str
) -> None:
    """``trainer_state.json``'s logged learning rates are the recorded ``kind`` schedule's, else
    refused naming both. transformers 5 logs the rate a step used (the schedule at ``step - 1``),
    4.x the next step's (at ``step``): one of the two, for every entry."""
    logged = trainer.get("logged_lr") or []
    if not logged:
        return
    steps = np.asarray([s for s, _ in logged], np.float32)
    rates = np.asarray([r for _, r in logged], np.float64)
    gave = {}
    for shift in (1, 0):
        gave[shift] = np.broadcast_to(np.asarray(schedule(steps - shift), np.float64), rates.shape)
        if np.allclose(gave[shift], rates, rtol=1e-5, atol=1e-12):
            return
    shown = ", ".join(f"step {s}: {r}" for s, r in logged[:4])
    want = ", ".join(f"{v:.6g}" for v in gave[1][:4])
    raise SourceError(
        f"{where}: trainer_state.json's log_history holds the learning rates {shown}"
        f"{', ...' if len(logged) > 4 else ''}; training_args.bin's {kind} schedule gives "
        f"{want} there: the run followed another schedule than its arguments record"
    )
