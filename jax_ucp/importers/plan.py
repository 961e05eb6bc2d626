"""What every importer hands to :mod:`jax_ucp.conversion`: an :class:`ImportPlan`.

The importers only read; the writer only writes. Between them flows one record,
``writer.HostItem``, whose manifest role the importer states (the writer does not guess roles
from key names): :func:`host_item` is that contract, written once for every importer.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Mapping
from typing import Any

from jax_ucp import writer


@dataclasses.dataclass(frozen=True)
class ImportPlan:
    """A checkpoint import, validated and ready to stream into the writer.

    Returned only after every check that needs no tensor bytes, so a bad checkpoint fails before
    the destination is touched. ``items`` is lazy: it reads one parameter at a time (errors met
    while reading are the importer's own, naming the file). ``source`` is recorded in the
    manifest; ``total_params`` is what progress counts to.
    """

    items: Iterator[writer.HostItem]
    source: dict[str, Any]
    total_params: int


# The importer contract (docs/FORMAT.md, section 2.6): the output tree of every importer, and the manifest role of each part.
_ROLES: dict[tuple[str, ...], tuple[str, str | None]] = {
    ("params",): ("param", None),
    ("model_params",): ("param", "model"),
    ("opt_state", "mu"): ("opt_state", "mu"),
    ("opt_state", "nu"): ("opt_state", "nu"),
    ("opt_state", "count"): ("opt_state", "count"),
}


@dataclasses.dataclass(frozen=True)
class Share:
    """This process's part of an import run by several processes (``convert(...,
    distributed=True)``, ``jax-ucp convert --processes N``): every ``count``-th parameter from
    ``index`` on, in the importer's own order; items that are not per parameter (the step) go to
    index 0. Each process reads only its parameters' bytes."""

    index: int = 0
    count: int = 1

    def __post_init__(self):
        if not 0 <= self.index < self.count:
            raise ValueError(f"Share index {self.index} is not in [0, {self.count})")

    def pick(self, names):
        """This process's parameters of ``names`` (round-robin over their order)."""
        return list(names)[self.index :: self.count]

    @property
    def primary(self) -> bool:
        return self.index == 0


WHOLE = Share()


def host_item(key: tuple[str, ...], value: Any, provenance: dict) -> writer.HostItem:
    """``value`` at ``key`` with the role its place in the output tree means.

    ``params/<name>`` is a parameter (fp32 master), ``model_params/<name>`` its model-precision
    copy (sub-role "model"), ``opt_state/mu|nu/<name>`` Adam's moments, ``opt_state/count`` the
    step; anything else is "other".
    """
    role, sub_role = _ROLES.get(tuple(key[:2])) or _ROLES.get(tuple(key[:1]), ("other", None))
    return writer.HostItem(key, value, role=role, sub_role=sub_role, provenance=provenance)


def agreed_step(
    found: Mapping[float, str], where: str, *, recorded_by: str, error: type[Exception]
) -> int:
    """The optimizer step every rank and parameter group recorded, as an int32 count.

    ``found`` maps each step seen to where it was first seen, phrased to follow the number
    ("in rank_0.pt group 0", "(group 1)"). Two steps mean files of different runs or saves were
    mixed; ``recorded_by`` says who disagrees ("ranks", "parameter groups").
    """
    if not found:
        raise error(f"{where}: no optimizer step recorded in any group")
    if len(found) > 1:
        raise error(
            f"{where}: {recorded_by} disagree on the optimizer step: "
            + ", ".join(f"{step:g} {place}" for step, place in found.items())
        )
    (step,) = found
    if step != int(step) or not 0 <= step < 2**31:
        raise error(f"{where}: optimizer step {step} is not a valid int32 count")
    return int(step)
