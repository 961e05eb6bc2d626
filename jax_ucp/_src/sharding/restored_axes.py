"""The restored arrays' logical axis names, kept for the next save of the run (a
``NamedSharding`` names mesh axes only): by identity, or for an array at the same path of the
same shape and sharding."""

from __future__ import annotations

import threading
import weakref
from collections.abc import Iterable, Sequence
from typing import Any

#: how many places are remembered at most (the oldest forgotten first)
MAX_PLACES = 1 << 16

_lock = threading.Lock()
_by_id: dict[int, tuple[weakref.ref, tuple]] = {}
# (shape, sharding) -> {restored path: names}
_by_place: dict[tuple, dict[tuple[str, ...], tuple]] = {}
_places = 0


def remember(restored: Iterable[tuple[Sequence[str], Any, Sequence[str | None] | None]]) -> None:
    """Notes each ``(path, array, logical names)`` a restore placed on a mesh."""
    import jax

    global _places
    with _lock:  # the arrays gone since (a weakref callback would run inside any later code)
        for key in [k for k, (ref, _) in _by_id.items() if ref() is None]:
            del _by_id[key]
    for path, leaf, names in restored:
        if not names or all(n is None for n in names) or not isinstance(leaf, jax.Array):
            continue
        sharding = leaf.sharding
        if not isinstance(sharding, jax.sharding.NamedSharding) or not _sharded(sharding):
            continue
        names = tuple(names)
        with _lock:
            key = id(leaf)
            _by_id[key] = (weakref.ref(leaf), names)
            place = _by_place.setdefault((tuple(leaf.shape), sharding), {})
            if tuple(map(str, path)) not in place:
                _places += 1
            place[tuple(map(str, path))] = names
            if _places > MAX_PLACES:
                _by_place.clear()
                _places = 0


def names_of(key: Sequence[str], leaf: Any) -> tuple | None:
    """The logical names remembered for the leaf at path ``key`` of a tree being saved, or None."""
    import jax

    if not isinstance(leaf, jax.Array):
        return None
    with _lock:
        found = _by_id.get(id(leaf))
        if found is not None and found[0]() is leaf:
            return found[1]
        if not isinstance(leaf.sharding, jax.sharding.NamedSharding):
            return None
        place = _by_place.get((tuple(leaf.shape), leaf.sharding))
        if not place:
            return None
        key = tuple(map(str, key))
        matches = {
            names
            for path, names in place.items()
            if len(path) > 1 and key[max(0, len(key) - len(path) + 1) :] == path[1:]
        }
    return matches.pop() if len(matches) == 1 else None


def _sharded(sharding) -> bool:
    """The sharding splits the array over a mesh axis of more than one device."""
    sizes = dict(sharding.mesh.shape)
    for entry in sharding.spec:
        for axis in entry if isinstance(entry, tuple) else (entry,):
            if axis is not None and sizes.get(axis, 1) > 1:
                return True
    return False
