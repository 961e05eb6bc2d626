"""Layer 4: slices for a mesh (target shardings, per-device reads, assembly)."""

from jax_ucp.sharding.assemble import PendingArray, RegionReader, host_memory_limit
from jax_ucp.sharding.mesh_layout import (
    LogicalRules,
    ReplicationWarning,
    ShardingMismatchError,
    check_divisible,
    check_names,
    check_rules,
    describe,
    partition_spec_from_logical,
    partition_spec_from_saved,
    replicated_unasked,
    replication_warning,
    sharding_for,
    unmatched_rules,
    unmatched_rules_message,
)
