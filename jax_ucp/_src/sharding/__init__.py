"""Layer 4: slices for a mesh; names load on first use (``assemble`` imports JAX)."""

from typing import TYPE_CHECKING

from jax_ucp._src.lazy_names import lazy_attributes

_ASSEMBLE = "jax_ucp._src.sharding.assemble"
_MESH_LAYOUT = "jax_ucp._src.sharding.mesh_layout"
_LAZY = {
    "PendingArray": _ASSEMBLE,
    "RegionReader": _ASSEMBLE,
    "ReplicationWarning": _MESH_LAYOUT,
    "check_divisible": _MESH_LAYOUT,
    "check_names": _MESH_LAYOUT,
    "check_rules": _MESH_LAYOUT,
    "describe": _MESH_LAYOUT,
    "replicated_unasked": _MESH_LAYOUT,
    "replication_warning": _MESH_LAYOUT,
    "sharding_for": _MESH_LAYOUT,
    "unmatched_rules": _MESH_LAYOUT,
    "unmatched_rules_message": _MESH_LAYOUT,
}

if TYPE_CHECKING:  # what _LAZY loads at run time, named for type checkers
    from jax_ucp._src.sharding.assemble import PendingArray, RegionReader
    from jax_ucp._src.sharding.mesh_layout import (
        ReplicationWarning,
        check_divisible,
        check_names,
        check_rules,
        describe,
        replicated_unasked,
        replication_warning,
        sharding_for,
        unmatched_rules,
        unmatched_rules_message,
    )

__getattr__, __dir__ = lazy_attributes(globals(), _LAZY)
