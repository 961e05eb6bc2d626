"""``transformers`` imported without DeepSpeed's accelerator warning.

With DeepSpeed installed, transformers (and Accelerate) import ``deepspeed`` on first use; its
accelerator detection logs "Setting accelerator to CPU. If you have GPU or other accelerator, we
were unable to detect it." on the ``DeepSpeed`` logger on every CPU-only machine. Where jax_ucp
imports transformers, the detection runs inside a filter scoped to that one message: it is cached
by DeepSpeed, so it does not print later either, and every other DeepSpeed record still does.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import logging
from collections.abc import Iterator
from types import ModuleType

ACCELERATOR_MESSAGE = "Setting accelerator to CPU."


class _DropAcceleratorMessage(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(ACCELERATOR_MESSAGE)


@contextlib.contextmanager
def quiet_deepspeed_accelerator() -> Iterator[None]:
    """Drops DeepSpeed's CPU-accelerator message while the block runs (nothing else)."""
    drop = _DropAcceleratorMessage()
    log = logging.getLogger("DeepSpeed")
    log.addFilter(drop)
    try:
        yield
    finally:
        log.removeFilter(drop)


def import_transformers() -> ModuleType:
    """``transformers``, with DeepSpeed's accelerator detected quietly first when installed."""
    with quiet_deepspeed_accelerator():
        if importlib.util.find_spec("deepspeed") is not None:
            accelerator = importlib.import_module("deepspeed.accelerator")
            accelerator.get_accelerator()
        return importlib.import_module("transformers")
