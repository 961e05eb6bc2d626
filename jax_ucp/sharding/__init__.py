"""Layer 4: slices for a mesh (target shardings, per-device reads, assembly)."""

from jax_ucp.sharding.assemble import PendingArray, RegionReader, host_memory_limit
from jax_ucp.sharding.mesh_layout import (
    ReplicationWarning,
    ShardingMismatchError,
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

__all__ = [
    "PendingArray",
    "ReplicationWarning",
    "ShardingMismatchError",
    "check_divisible",
    "check_names",
    "check_rules",
    "describe",
    "host_memory_limit",
    "replicated_unasked",
    "replication_warning",
    "sharding_for",
    "unmatched_rules",
    "unmatched_rules_message",
]
