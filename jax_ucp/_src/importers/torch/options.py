"""The torch layouts' options: ``ImportOptions`` and the order of an index-keyed optimizer's
parameters, and which layouts refuse that order."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Sequence

from jax_ucp._src.errors import RequestError
from jax_ucp._src.importers.plan import ImportOptions

__all__ = ["TorchOptions", "refuse_model_config"]


@dataclasses.dataclass(frozen=True)
class TorchOptions(ImportOptions):
    """``ImportOptions`` and the order of an index-keyed optimizer's parameters.

    Attributes:
        parameter_order: the names of the parameters an optimizer keys by index, in the order
            torch numbered them (torch.save files, torchtune; None: from the files).
        model_config: a Hugging Face ``config.json`` (a path) to rebuild that order from, as
            from a Trainer checkpoint's own (an Accelerate ``save_state`` folder, a Trainer
            checkpoint without its ``config.json``).
        base_model: for a peft adapter checkpoint, the folder of the base model's weights it
            trains over (its ``save_pretrained`` folder): imported beside the adapter under
            its own names, frozen (no optimizer state), so a continuation holds them.
    """

    parameter_order: Sequence[str] | None = None
    model_config: str | os.PathLike | None = None
    base_model: str | os.PathLike | None = None

    def __post_init__(self):
        if self.parameter_order is not None and self.model_config is not None:
            raise RequestError(
                "parameter_order= and model_config= both say the optimizer's parameter order; "
                "give one"
            )


def refuse_model_config(src: os.PathLike | str, options: TorchOptions) -> None:
    """``model_config=`` given for a torchtune or torch DCP checkpoint, which names its own
    optimizer's parameters (or takes ``parameter_order=``): refused."""
    if options.base_model is not None:
        raise RequestError(f"{src}: base_model= is for a peft adapter checkpoint's folder")
    if options.model_config is not None:
        raise RequestError(
            f"{src}: model_config= orders an index-keyed optimizer (torch.save files, "
            f"safetensors weights beside optimizer.bin / optimizer.pt); this torchtune or torch "
            f"DCP checkpoint does not take it"
        )
