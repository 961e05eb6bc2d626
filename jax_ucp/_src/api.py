"""The public functions: ``save``, ``restore``, ``inspect``."""

from __future__ import annotations

import concurrent.futures
import os
from typing import TYPE_CHECKING, Any

from jax_ucp._src import format as fmt
from jax_ucp._src import store
from jax_ucp._src import tree as tree_lib
from jax_ucp._src.errors import RequestError, SourceError
from jax_ucp._src.format.sizes import DEFAULT_MEMORY_BUDGET, parse_size
from jax_ucp._src.options import keywords_of
from jax_ucp._src.saving.options import SaveOptions

if TYPE_CHECKING:  # the restoring modules load where used: a save never needs them
    from jax_ucp._src.restoring import steps
    from jax_ucp._src.store.storage import Storage

# JAX-free at import: ``verify`` and ``latest_step`` (``jax-ucp verify``/``latest``) never load
# JAX (1-4 s); ``save`` imports the save engine and ``restore`` its module when first used.


def __getattr__(name: str):
    if name == "restore":  # without Orbax: defined there
        from jax_ucp._src.restoring.restore_entry import restore

        return restore
    if name == "inspect":  # JAX-free: defined there
        from jax_ucp._src.restoring.inspecting import inspect

        return inspect
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


@keywords_of(SaveOptions)
def save(path: str | os.PathLike, options: SaveOptions) -> str:
    """Saves ``item`` (a pytree) as a UCP checkpoint at ``path``; returns once it is committed.

    Every process calls it; each writes only the replica-0 shards it holds, no gather, and
    the primary commits once (``saving.engine.save``): a failed or killed save leaves ``path``
    as it was, a failure in any process is raised in every one.

    Args:
        path: the checkpoint directory, or an ``s3://`` / ``gs://`` prefix.
        options: built from the other arguments, ``SaveOptions``' fields: ``item`` (leaves:
            ``jax.Array`` of any sharding, numpy arrays, Python scalars / strings / None),
            the layout options of ``SaveArgs`` (``UCPSave``'s) and ``force``.

    Returns:
        The checkpoint path, once it is committed.
    """
    from jax_ucp._src.saving import engine  # JAX: here, so verify starts without it

    storage = store.storage_for(path)
    engine.save(storage, options, force=options.force)
    return storage.absolute()


def latest_step(run_root: str | os.PathLike | Any, *, fallback: bool = False) -> int:
    """The step ``restore(run_root, step="latest", fallback=fallback)`` restores — the newest
    committed step of a CheckpointManager root that can be read (``restoring.resume``) — for
    ``mngr.restore(step, ...)``: the same step, so the same state. A torch trainer's run root
    (a Trainer's ``output_dir``, torchtitan's ``checkpoint/``, a DeepSpeed ``save_dir``, a
    Megatron or verl save root) gives its newest complete checkpoint's step, each newer one
    passed over with a ``ResumeWarning`` saying why (no ``trainer_state.json``, newer than the
    run's tracker, no DCP ``.metadata``).

    Without ``fallback`` its manifest parses and every shard file it lists is there (the data is
    checked as it is restored); with ``fallback`` every tensor is read back intact (as
    ``verify``: one read of the step) and unreadable steps are passed over to older ones, each
    with a ``ResumeWarning``.

    Args:
      run_root: the CheckpointManager's directory, or the ``ocp.CheckpointManager`` itself (its
        step names are then its own ``step_prefix`` / ``step_format_fixed_length``).
      fallback: pass over unreadable steps to older ones (default: the error, naming the newest
        step and why).
    """
    from jax_ucp._src.restoring import resume

    root, step_format = _run_root(run_root)
    found = resume.latest_readable(root, fallback=fallback, step_format=step_format)
    found.warn(stacklevel=2)
    return found.step.step


def _run_root(run_root) -> tuple[str, steps.StepFormat | None]:
    """A CheckpointManager root as a path, with the manager's step names when it is one."""
    from jax_ucp._src.restoring import steps

    if isinstance(run_root, (str, os.PathLike)):
        return os.fspath(run_root), None
    directory = getattr(run_root, "directory", None)
    # Orbax keeps the NameFormat a manager lists its steps by in this attribute.
    names = getattr(run_root, "_step_name_format", None)
    if directory is None or names is None:
        raise RequestError(
            f"latest_step(run_root=): expected a CheckpointManager directory or an "
            f"ocp.CheckpointManager, got {type(run_root).__name__}"
        )
    if hasattr(names, "step_prefix") and hasattr(names, "step_format_fixed_length"):
        step_format = steps.StepFormat(names.step_prefix, names.step_format_fixed_length)
    else:
        step_format = steps.StepFormat(build=names.build_name)
    return os.fspath(directory), step_format


class VerifyResult(list):
    """``[(tensor name, error message)]``, empty when the data is intact; ``notices`` lists
    ``(tree node, message)`` for what a restore gives back differently without being an error
    (a container class outside the allow-list comes back as a dict)."""

    def __init__(
        self, problems=(), notices=(), logits=None, against=None, source=None, exported=None
    ):
        super().__init__(problems)
        #: an export verified against its checkpoint: ``export_check.ExportComparison``
        self.exported = exported
        self.notices: list[tuple[str, str]] = list(notices)
        #: with ``logits=True``: the ``jax_ucp._src.logits.LogitsComparison`` of one batch
        self.logits = logits
        #: with ``against=``: what was compared (``equal``, ``different``, ``not_compared``,
        #: ``missing``: the tensors of each, for the counts ``jax-ucp verify`` prints)
        self.against = against
        #: a torch source verified itself (``verify(SRC)`` of no jax_ucp checkpoint): what was
        #: checked and what could not be (``importers.source_checks.SourceCheck``)
        self.source = source


def _verify_export(
    exported: Storage, against: str, spec: Any, progress, logits: bool, tolerance: float | None
) -> VerifyResult:
    """``verify(EXPORTED, against=CKPT)``: every exported tensor against the checkpoint's; with
    ``logits``, the export's model's logits against the checkpoint's."""
    from jax_ucp._src.export_check import verify_export

    found, compared = verify_export(exported, against, spec, progress, logits, tolerance)
    problems = [
        (n, f"{n}: exported, not the checkpoint's: {w}") for n, w in found.different.items()
    ]
    notices = [(n, f"{n}: not in the export") for n in found.not_exported]
    if compared is not None and not compared.ok:
        problems.append(("logits", compared.describe()))
    return VerifyResult(problems, notices, compared, exported=found)


def verify(
    path: str | os.PathLike,
    *,
    progress=None,
    memory_budget: int | str | None = None,
    against: str | os.PathLike | None = None,
    logits: bool = False,
    logits_tolerance: float | None = None,
    accept_uncertified: bool = False,
    spec: Any = None,
) -> VerifyResult:
    """Reads every byte of the checkpoint at ``path`` through the paths a restore takes; of a
    source ``convert`` reads (torch DCP, a Trainer checkpoint, DeepSpeed, Megatron, torch.save
    files, ...), every tensor through its import, each reader's checks run (zip CRC-32s, DCP
    chunk coverage, ``integrity.json``, ZeRO ranks), ``.source`` saying what was checked and
    what its files record no check of.

    Every shard file is checked against its digest in the manifest (it is the file this save
    wrote there, for this tensor and position) and every tensor is read in full (crc32c of each
    inner chunk). Returns ``[(tensor name, error message)]`` in manifest order, empty when the
    checkpoint is intact, with ``.notices``: ``[(tree node, message)]`` for each container
    class of the manifest a restore without a target will not rebuild (not in the allow-list:
    it comes back as a dict of its fields). ``progress(name, done, total)`` is called after
    each tensor.

    Tensors are checked several at a time, as many as fit in ``memory_budget`` (one at least),
    so an object store's latency is paid once per batch, not once per tensor.

    Args:
      path: the checkpoint directory, or an Orbax step directory holding one UCP item.
      progress: called as ``progress(name, done, total)`` after each tensor (None: not called).
      memory_budget: bytes of tensors checked at once, as ``RestoreOptions.memory_budget``.
      against: the source checkpoint ``path`` was imported from: every tensor the import
        copied one for one is also compared bit for bit with what the source framework's own
        loader reads (``jax_ucp._src.against``); a difference is a problem, a tensor that cannot be
        compared so (built by the import) a notice saying why. Which source tensor each is
        compared with is found by planning the import of ``against`` again, never from the
        checkpoint's records: a tensor the source does not make, or a source tensor the
        checkpoint lacks (not in its ``source.skipped``), is a problem too.
      logits: with ``against``, also run one fixed batch through the source loaded by
        transformers' ``from_pretrained`` (a source without the weight files it reads, e.g. a
        torch DCP folder or DeepSpeed beside the config.json: the model its config.json names,
        given the weights the source framework's own loader reads) and through the
        checkpoint's weights in
        ``jax_ucp._src.models.TransformerLM`` (the families docs/HF.md lists; ``jax_ucp._src.logits``): a largest
        absolute difference above ``logits_tolerance`` is a problem; ``.logits`` holds the
        comparison. Needs transformers (``pip install 'jax_ucp[hf]'``). With ``path`` an export:
        the export's weights read by its import against the checkpoint's, both in
        ``TransformerLM`` (no torch), the model its ``config.json`` (else the checkpoint's
        recorded one) names; an export and checkpoint without one are refused.
      logits_tolerance: the largest absolute difference of the logits accepted (None:
        ``jax_ucp._src.logits.DEFAULT_TOLERANCE``, 1e-4): a finite number >= 0; text, a bool,
        NaN or infinity is refused before anything is read.
      accept_uncertified: with ``against``, compare a checkpoint whose ``ucp.json`` records no
        certificate of the source's files (converted before jax_ucp recorded one, from an object
        store, or with it removed); without it that is a problem, never a silent pass. The run
        settings ``ucp.json`` records (clipping, betas, eps, weight decay, the schedule and its
        position, the optimizer, the step: its whole ``source`` record but the path) are compared
        with what planning the import of ``against`` again records either way.
      spec: with ``path`` an export (safetensors, DeepSpeed universal, Megatron, torch DCP) and
        ``against`` the jax_ucp checkpoint it was written from: the spec it was exported by;
        every exported tensor (weights, masters, moments, the step) is compared with the
        checkpoint's (``jax_ucp._src.export_check``).
    """
    if logits and against is None:
        raise RequestError("verify(logits=True) compares with the source: give against=SRC")
    if spec is not None and against is None:
        raise RequestError("verify(spec=) compares an export with its checkpoint: give against=")
    if logits_tolerance is not None or logits:  # refused before the checkpoint is read
        from jax_ucp._src.logits import checked_tolerance

        logits_tolerance = checked_tolerance(logits_tolerance)
    budget = parse_size(
        DEFAULT_MEMORY_BUDGET if memory_budget is None else memory_budget, "verify(memory_budget=)"
    )
    source = None if against is None else store.storage_for(against)
    if source is not None:  # refused before the checkpoint is read: the URL named
        source.local_folder(  # the frameworks' own loaders read local files only
            f"verify(against={source.root!r}): --against reads the source with its framework's "
            f"own loaders (safetensors' safe_open, torch.load, torch DCP's dcp.load, DeepSpeed's "
            f"zero_to_fp32), which read local files only, and its certificate is of local "
            f"files: copy {source.root} to a local folder (aws s3 sync, gcloud storage cp -r, "
            f"hf download) and give that folder"
        )
    from jax_ucp._src.restoring import sources

    storage = store.storage_for(path)  # the export's too, with against=
    found = sources.opening(storage)  # its importer, detected once
    if found.importer is not None:  # a torch source itself, no jax_ucp checkpoint
        if source is not None:
            if sources.opening(source, warn=False).importer is None:
                export = (storage, source.root, spec, progress)
                return _verify_export(*export, logits, logits_tolerance)
            raise RequestError(
                f"verify(against=) compares a converted checkpoint with its source; "
                f"{os.fspath(path)} is itself a {found.importer.format} source: verify it alone"
            )
        from jax_ucp._src.restoring import verify_source  # the importers: for a source only

        problems, check = verify_source.verify_source(
            os.fspath(path), found.storage, found.importer, progress, budget
        )
        return VerifyResult(problems, source=check)
    # A concurrent forced save is read again, not reported as damage (locate.read_consistently).
    from jax_ucp._src.restoring import locate

    result = locate.read_consistently(
        found.storage, lambda root: _verify(root, progress, budget), manifest=found.manifest
    )
    if against is None or result:
        return result
    from jax_ucp._src.against import compare_with_source, source_weights

    found = compare_with_source(
        os.fspath(path), os.fspath(against), progress, accept_uncertified=accept_uncertified
    )
    if not found.files and not found.equal and not found.different and not found.missing:
        raise SourceError(
            f"{os.fspath(against)}: no tensor of {os.fspath(path)} could be compared with it: "
            + "; ".join(f"{k}: {v}" for k, v in list(found.not_compared.items())[:3])
        )
    problems = list(found.files.items())  # the source's certificate, checked first
    problems += list(found.records.items())  # the run's settings as the source records them
    problems += [(n, f"{n}: differs from the source: {why}") for n, why in found.different.items()]
    problems += [
        (n, f"{n}: in the source, missing from the checkpoint: {why}")
        for n, why in found.missing.items()
    ]
    compared = None
    if logits:  # after the tensors, even when some differ: how much the model's output moves
        from jax_ucp._src.logits import compare_logits

        try:
            compared = compare_logits(
                path,
                against,
                tolerance=logits_tolerance,
                source_weights=lambda tree: source_weights(
                    os.fspath(path), os.fspath(against), tree, found.planned
                ),
            )
        except SourceError:
            if not found.files:
                raise
            # the source's files already differ from the certificate (named): no logits
        if compared is not None and not compared.ok:
            problems.append(("logits", compared.describe()))
    unread = [(n, f"{n}: not compared with the source: {w}") for n, w in found.not_compared.items()]
    return VerifyResult(problems, [*result.notices, *unread], compared, against=found)


def _verify(root: store.storage.Storage, progress, budget: int) -> VerifyResult:
    from jax_ucp._src.restoring import model
    from jax_ucp._src.restoring.sources import ucp_source

    manifest = store.read_manifest(root)

    def check(entry: fmt.TensorEntry) -> str | None:
        try:  # the read checks every shard's digest, as a restore does
            ucp_source.read(root, manifest, [model.Request(key=entry.key)])
        except fmt.UCPError as e:
            return str(e)
        return None

    problems: list[tuple[str, str]] = []
    window = store.InFlightBytes(budget, max_items=_VERIFY_THREADS)
    total, done = len(manifest.tensors), 0

    def retire(item) -> None:
        nonlocal done
        future, entry = item
        error = future.result()
        done += 1
        if error is not None:
            problems.append((entry.name, error))
        if progress is not None:
            progress(entry.name, done, total)

    with concurrent.futures.ThreadPoolExecutor(_VERIFY_THREADS, "ucp-verify") as pool:
        for entry in manifest.tensors:
            for item in window.make_room(entry.nbytes):
                retire(item)
            window.add((pool.submit(check, entry), entry), entry.nbytes)
        for item in window.drain():
            retire(item)
    return VerifyResult(problems, tree_lib.class_notices(manifest.tree))


# Tensors ``verify`` checks at once (each waits mostly on I/O: object-store round trips).
_VERIFY_THREADS = 16
