"""What ``export`` is asked to write: one typed options class per output format, so an option
a format cannot use cannot be expressed, and ``Exported``, what it wrote."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Mapping
from typing import Any, ClassVar, cast

import numpy as np

from jax_ucp._src.errors import RequestError
from jax_ucp._src.format.dtypes import CASTINGS
from jax_ucp._src.format.sizes import parse_size


@dataclasses.dataclass(frozen=True)
class Exported:
    """What ``export`` wrote: the destination, its files, the tensors, and what it left out."""

    path: str
    files: list[str]
    tensors: int
    bytes: int
    skipped: list[str]  # leaves outside ``select`` or not tensors (saved Python values)


@dataclasses.dataclass(frozen=True, kw_only=True)
class _Export:
    """What every export takes (checked on construction, a ``RequestError`` naming the option).

    Attributes:
        progress: ``progress(name, done, total)`` after each tensor.
        memory_budget: bytes of tensor data in flight (an int, or e.g. "256MiB"; None: the
            default, ``format.sizes.DEFAULT_MEMORY_BUDGET``)."""

    format: ClassVar[str]
    progress: Callable[[str, int, int], None] | None = None
    memory_budget: int | str | None = None

    def __post_init__(self):
        if self.memory_budget is not None:
            object.__setattr__(self, "memory_budget", parse_size(self.memory_budget))


@dataclasses.dataclass(frozen=True, kw_only=True)
class OrbaxExport(_Export):
    """The whole tree as saved, containers included, as an Orbax checkpoint restored bit-exact."""

    format: ClassVar[str] = "orbax"


@dataclasses.dataclass(frozen=True, kw_only=True)
class DeepSpeedUniversalExport(_Export):
    """DeepSpeed's universal checkpoint: fp32 masters, Adam moments and the step, found by
    their manifest roles; loadable at any DP size with ``"checkpoint": {"load_universal": true}``.

    Attributes:
        force: replace an earlier export at the destination.
        param_groups: the loading engine's optimizer param groups (DeepSpeed pairs them by
            position).
        spec: the spec the run was imported with (name, path or ``Spec``), run backwards so
            that the parameters get the torch model's names (None: the saved key paths)."""

    format: ClassVar[str] = "deepspeed-universal"
    force: bool = False
    param_groups: int = 1
    spec: Any = None

    def __post_init__(self):
        super().__post_init__()
        groups = self.param_groups
        if isinstance(groups, bool) or not isinstance(groups, int) or groups < 1:
            raise RequestError(f"param_groups={self.param_groups!r}: a positive int")


@dataclasses.dataclass(frozen=True, kw_only=True)
class MegatronExport(_Export):
    """megatron-core's ``torch_dist`` of a checkpoint under megatron-core names (one imported
    from Megatron, or continued from one): the weights, the distributed optimizer's fp32 masters
    and Adam moments (its ``fully_reshardable`` layout, which any TP / PP / DP loads), the
    iteration and the ``common.pt`` that ``dist_checkpointing.load`` and Megatron-LM read.

    Attributes:
        force: replace an earlier export at the destination.
        tp: the tensor-parallel size the loading run uses (its vocab padding and ``args``).
        pp: its pipeline-parallel size (recorded in ``args``).
        ep: its expert-parallel size: above 1 megatron-core keeps a MoE model's experts in a
            second optimizer, with the experts' own param groups (recorded by the import).
        etp: its expert-tensor-parallel size (None: ``tp``, megatron-core's default).
        vpp: its virtual-pipeline chunks per stage (None: none); the layers must split evenly
            over ``pp * vpp`` chunks.
        make_vocab_size_divisible_by: Megatron-LM's option: vocab rows are padded to a multiple
            of it times ``tp``.
        iteration: the iteration recorded (None: the optimizer step plus the iterations the
            recorded run skipped; without optimizer state the imported one); with optimizer
            state one that disagrees with the step is refused, as is ``args['iteration']``.
        run_record: a checkpoint imported from Megatron whose record of the run (param groups,
            scheduler state, args) is written back (None: this checkpoint's own, if any).
        args: Megatron-LM arguments to record beside those the export knows."""

    format: ClassVar[str] = "megatron"
    force: bool = False
    tp: int = 1
    pp: int = 1
    ep: int = 1
    etp: int | None = None
    vpp: int | None = None
    make_vocab_size_divisible_by: int = 128
    iteration: int | None = None
    run_record: str | os.PathLike | None = None
    args: Mapping[str, Any] | None = None

    def __post_init__(self):
        super().__post_init__()
        for name, low in (
            ("tp", 1),
            ("pp", 1),
            ("ep", 1),
            ("etp", 1),
            ("vpp", 1),
            ("make_vocab_size_divisible_by", 1),
            ("iteration", 0),
        ):
            value = getattr(self, name)
            if value is None and name in ("iteration", "etp", "vpp"):
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise RequestError(f"{name}={value!r}: an int >= {low}")
        if self.args is not None and not isinstance(self.args, Mapping):
            raise RequestError(f"args={self.args!r}: a mapping of Megatron-LM argument names")


@dataclasses.dataclass(frozen=True, kw_only=True)
class _TensorsExport(_Export):
    """Named tensors under ``select`` (torch DCP and safetensors).

    Attributes:
        force: replace an earlier export at the destination.
        select: the key-path prefix to export (None: the format's default, see ``prefix``).
        spec: a UCP-language spec (name, path or ``Spec``): an import's is run backwards (the
            names the run was imported with), an export spec (``inverts``) as it is.
        dtype: write every tensor in this dtype (None: as saved).
        casting: numpy casting rule for ``dtype``."""

    force: bool = False
    select: str | None = None
    spec: Any = None
    dtype: Any = None
    casting: str = "same_kind"
    default_select: ClassVar[str] = ""
    #: a family spec writes the names transformers' model holds, not its files' (``by_spec``)
    state_dict_names: ClassVar[bool] = False

    def __post_init__(self):
        super().__post_init__()
        if self.casting not in CASTINGS:
            raise RequestError(f"casting={self.casting!r}: choose from {CASTINGS}")
        if self.select is not None and not isinstance(self.select, str):
            raise RequestError(f"select={self.select!r}: a key-path prefix such as 'params'")
        if self.dtype is not None:
            try:
                object.__setattr__(self, "dtype", np.dtype(self.dtype))
            except TypeError as e:
                raise RequestError(f"dtype={self.dtype!r}: not a dtype ({e})") from None

    @property
    def prefix(self) -> str:
        """``select``, or the format's default (``"params"`` for safetensors, all for DCP)."""
        return self.default_select if self.select is None else self.select


@dataclasses.dataclass(frozen=True, kw_only=True)
class TorchDcpExport(_TensorsExport):
    """A single-file torch DCP checkpoint: the tensors and the saved Python values; with
    ``optimizer``, a torch model's weights and its Adam state as ``dcp.load`` into
    ``get_state_dict(model, optim, options=StateDictOptions(flatten_optimizer_state_dict=True))``
    reads them (``set_state_dict`` then loads model and optimizer).

    Attributes:
        optimizer: the key of the optimizer's state dict (``"optim"``; torchtitan's
            ``"optimizer"``): ``<optimizer>.state.<name>.{exp_avg,exp_avg_sq,step}`` and
            ``<optimizer>.param_groups.<name>.<hyper-parameter>``; None: the tensors alone.
        model: with ``optimizer``, the key of the model's weights (``""``: top-level, as
            torchtitan saves them).
        param_groups: the loading optimizer's hyper-parameters: a mapping set on every group, or
            the groups (each with ``params``: the torch names); None: the imported run's.
        run_record: the checkpoint imported from torch whose param groups a continued run
            writes (None: this checkpoint's own record).
        tied: {name: the parameter it is}: the names the torch model's state dict has beside
            its parameters (``{"lm_head.weight": "model.embed_tokens.weight"}`` with
            ``tie_word_embeddings``), written with that parameter's weight and no optimizer
            state of their own; None: the import's record of them.
        flatten_optimizer_state_dict: ``StateDictOptions``' option the loading run passes to
            ``get_state_dict``: True, each parameter's groups under its name; False, torch's
            nested ``{"state": {name: ...}, "param_groups": [{..., "params": [names]}]}``."""

    format: ClassVar[str] = "torch-dcp"
    state_dict_names: ClassVar[bool] = True
    optimizer: str | None = None
    model: str = "model"
    param_groups: Mapping[str, Any] | list[Mapping[str, Any]] | None = None
    run_record: str | os.PathLike | None = None
    tied: Mapping[str, str] | None = None
    flatten_optimizer_state_dict: bool = True

    def __post_init__(self):
        super().__post_init__()
        for name in ("optimizer", "model"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or "." in value):
                raise RequestError(f"{name}={value!r}: a state-dict key without dots")
        flat = self.flatten_optimizer_state_dict
        if not isinstance(flat, bool):
            raise RequestError(f"flatten_optimizer_state_dict={flat!r}: True or False")
        if self.optimizer is None and (
            self.param_groups or self.run_record or self.tied or not flat
        ):
            raise RequestError(
                "param_groups=, run_record=, tied= and flatten_optimizer_state_dict= need "
                "optimizer= (e.g. 'optim')"
            )
        if self.tied is not None and not (
            isinstance(self.tied, Mapping)
            and all(isinstance(x, str) for kv in self.tied.items() for x in kv)
        ):
            raise RequestError(f"tied={self.tied!r}: a mapping of torch names to parameter names")
        groups = self.param_groups
        if not (groups is None or isinstance(groups, Mapping)) and (
            not isinstance(groups, list) or not all(isinstance(g, Mapping) for g in groups)
        ):
            raise RequestError(f"param_groups={groups!r}: a mapping or a list of groups")


@dataclasses.dataclass(frozen=True, kw_only=True)
class SafetensorsExport(_TensorsExport):
    """Hugging Face safetensors of the tensors under ``select`` (default: ``"params"``).

    Attributes:
        max_file_bytes: data per file before the output is split: bytes or e.g. "5GB".
        config: a ``config.json`` (dict or JSON file path) to write beside the weights; with
            ``adapter``, the ``adapter_config.json``.
        adapter: a peft adapter folder of a checkpoint imported from one (``source.lora``):
            ``adapter_model.safetensors`` (one file) and ``adapter_config.json`` as recorded,
            which ``PeftModel.from_pretrained`` loads."""

    format: ClassVar[str] = "safetensors"
    default_select: ClassVar[str] = "params"
    max_file_bytes: int | str = 5 * 10**9
    config: Mapping[str, Any] | str | os.PathLike | None = None
    adapter: bool = False

    def __post_init__(self):
        super().__post_init__()
        size = parse_size(self.max_file_bytes, "max_file_bytes")  # refused: a RequestError
        object.__setattr__(self, "max_file_bytes", size)


Options = (
    OrbaxExport | DeepSpeedUniversalExport | TorchDcpExport | SafetensorsExport | MegatronExport
)
OPTIONS_TYPES = (
    SafetensorsExport,
    TorchDcpExport,
    DeepSpeedUniversalExport,
    OrbaxExport,
    MegatronExport,
)
BY_FORMAT: dict[str, type[_Export]] = {c.format: c for c in OPTIONS_TYPES}
FORMATS = tuple(BY_FORMAT)


def options_for(to: str, **given: Any) -> Options:
    """The options of the format named ``to``; a field it does not take is a ``RequestError``."""
    cls = BY_FORMAT.get(to)
    if cls is None:
        raise RequestError(f"export format {to!r} is not supported (choose from {FORMATS})")
    fields = {f.name for f in dataclasses.fields(cls)}
    for name, value in given.items():
        if name not in fields and value is not None and value is not False:
            raise RequestError(
                f"{name}= does not apply to {to!r} exports (they take: {', '.join(sorted(fields))})"
            )
    return cast(Options, cls(**{k: v for k, v in given.items() if k in fields and v is not None}))
