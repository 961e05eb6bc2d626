"""Layer 2b: the JAX-free write + commit engine.

Streams host tensors into store arrays with a bounded pipeline, makes them durable and commits
the directory atomically (temporary sibling + rename). Importers and the Orbax handler both
write through it; it knows nothing of Orbax, JAX or torch.
"""

from jax_ucp._src.store.host_memory import one_malloc_arena
from jax_ucp._src.writer.checkpoint import (
    write_host_checkpoint,
    write_shared_checkpoint,
)
from jax_ucp._src.writer.layout import (
    ArrayOptions,
    PreparedTensor,
    array_layout,
    prepare_host_tensor,
    tensor_entry,
    value_entry,
)
from jax_ucp._src.writer.shards import PipelinedWriter, write_tensor
from jax_ucp._src.writer.stream import (
    DEFAULT_MEMORY_BUDGET,
    Deferred,
    HostItem,
    mapped_deferred,
    memory_budget,
    memory_budget_scope,
    unpooled_empty,
    with_digests,
    with_progress,
    write_stream,
)
