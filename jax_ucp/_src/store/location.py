"""The object-store client's former home, now ``store.storage.object_store``: these names are
forwarded for the modules and tests that still import them from here."""

from jax_ucp._src.store.storage.object_store import (
    delete,
    exists,
    join,
    kvstore_root,
    list_names,
    read,
    set_object_store_options,
    write,
)

__all__ = [
    "delete",
    "exists",
    "join",
    "kvstore_root",
    "list_names",
    "read",
    "set_object_store_options",
    "write",
]
