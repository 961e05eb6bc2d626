"""How a torch run stepped, as its files record it: the one record ``optax_from_torch`` builds its
chain from, whatever framework wrote the run; each reader turns only what its files positively
identify into a :class:`Recipe`."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping
from typing import Any

from jax_ucp._src.errors import RequestError, SourceError

__all__ = ["Recipe", "agreed", "group_decay"]

#: a value of optax's step count (the number of updates already applied)
Schedule = Callable[[Any], Any]


@dataclasses.dataclass(frozen=True)
class Recipe:
    """What a run's files say of how its optimizer stepped (schedules of optax's step count)."""

    #: "adam" (L2 decay added to the gradient), "adamw" (decoupled decay), DeepSpeed's "lion"
    #: (``betas``, decoupled decay), or torch's "sgd", "muon", transformers' "adafactor" (their
    #: other settings: ``continuation.families``)
    optimizer: str
    #: how the optimizer was identified, in words (the first of the notes)
    how: str
    learning_rate: Schedule
    #: the decay rate, or its schedule of the step count (Megatron's weight-decay increments)
    weight_decay: float | Schedule
    #: per source parameter name (the import's ``params/<name>``): decayed or not
    decayed: Mapping[str, bool]
    #: the global gradient norm clipped to; None: no clipping (or unknown: see ``unrecovered``)
    clip: float | None
    #: Adam's (Lion's betas too; unused by the other optimizers)
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    bias_correction: bool = True
    notes: tuple[str, ...] = ()
    #: what the run may have had that its files do not record (said, and warned)
    unrecovered: tuple[str, ...] = ()
    #: Adam's beta1 as a function of the step count when scheduled (DeepSpeed's OneCycle)
    beta1: Schedule | None = None
    #: called with the restored step: raises when the saved schedule position contradicts it
    at_step: Callable[[int], list[str]] | None = None
    #: whether the files record the schedule / the clipping (else the caller may supply them)
    schedule_recorded: bool = True
    clip_recorded: bool = True


def agreed(groups: list[dict], key: str, where: str) -> Any:
    """The value every torch param group records for ``key``, else refused naming it."""
    values = {repr(g.get(key)) for g in groups}
    if len(values) != 1:
        raise RequestError(f"{where}: the parameter groups disagree on {key!r}: {values}")
    return groups[0].get(key)


def group_decay(groups: list[dict], where: str) -> tuple[float, dict[str, bool]]:
    """The one non-zero weight decay and, per torch parameter name, whether it is decayed. Every
    torch optimizer writes ``weight_decay`` in every group: one without it, or not a finite
    number >= 0, is refused (read as 0 it would continue undecayed)."""
    each = []
    for i, g in enumerate(groups):
        value = g.get("weight_decay", "<missing>")
        number = isinstance(value, int | float) and not isinstance(value, bool)
        if not (number and math.isfinite(value) and value >= 0):
            raise SourceError(
                f"{where}: param_groups[{i}].weight_decay = {value!r}: expected a number >= 0 "
                f"(torch's optimizers write it in every group)"
            )
        each.append(float(value))
    rates = set(each) - {0.0}
    if len(rates) > 1:
        raise RequestError(f"{where}: several weight decay rates {sorted(rates)}")
    decayed = {n: rate != 0.0 for g, rate in zip(groups, each) for n in g["params"]}
    return (rates.pop() if rates else 0.0), decayed
