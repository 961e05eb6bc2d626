"""Layer 4: slices for a mesh (target shardings, per-device reads, assembly)."""

from jax_ucp.sharding.assemble import PendingArray, shards_to_write
from jax_ucp.sharding.specs import (
    LogicalRules,
    ShardingMismatchError,
    check_divisible,
    describe,
    sharding_for,
    spec_from_logical,
    spec_from_saved,
)
