"""A run's facts as every record of its save states them. One fact (the gradient clipping, a
group's betas, the schedule's length) is written in several places: a DeepSpeed save keeps its
config in the model states file and again in every rank's optimizer file, each rank its own
param groups; a Trainer save the base learning rate in ``optimizer.pt``, ``scheduler.pt`` and
``training_args.bin``. A continuation reads one value per fact, so it takes the fact only when
every record that states it says the same: records that disagree are refused, each named with
its value (which one the run followed cannot be told from the files)."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from jax_ucp._src.errors import SourceError

__all__ = ["Facts", "Statement"]

#: what a record that does not hold the field states (so a field in one copy only disagrees)
ABSENT = "<absent>"


@dataclasses.dataclass(frozen=True)
class Statement:
    """One record's value of a fact: ``record`` names the file and the field in it."""

    record: str
    value: Any


def canonical(value: Any) -> Any:
    """``value`` as equal records write it alike: tuples as lists, whole floats as ints (a
    ``1.0`` in one file, ``1`` in another), dicts with sorted keys."""
    if isinstance(value, dict):
        return {str(k): canonical(value[k]) for k in sorted(value, key=str)}
    if isinstance(value, list | tuple):
        return [canonical(v) for v in value]
    if isinstance(value, float) and math.isfinite(value) and value.is_integer():
        return int(value)
    return value


@dataclasses.dataclass
class Facts:
    """Each fact of one save -> what every record states of it; :meth:`agree` takes them."""

    #: the save, named first in every refusal
    where: str
    stated: dict[str, list[Statement]] = dataclasses.field(default_factory=dict)

    def state(self, fact: str, record: str, value: Any) -> None:
        """``record`` (its file and field) says ``fact`` is ``value``."""
        self.stated.setdefault(fact, []).append(Statement(record, value))

    def agree(self, fact: str) -> Any:
        """The one value every record states of ``fact`` (None: no record states it), else a
        ``SourceError`` naming each record and its value."""
        said = self.stated.get(fact) or []
        if len({repr(canonical(s.value)) for s in said}) > 1:
            each = "; ".join(f"{s.record} = {s.value!r}" for s in said)
            raise SourceError(
                f"{self.where}: the records of this save disagree on {fact}: {each}. One run "
                f"writes one value in all of them, so which one it followed cannot be told; "
                f"restore the copy that was not edited (or import weights_only=True)"
            )
        return said[0].value if said else None

    def agree_all(self) -> dict[str, Any]:
        """:meth:`agree` of every fact stated, in the order they were first stated."""
        return {fact: self.agree(fact) for fact in self.stated}
