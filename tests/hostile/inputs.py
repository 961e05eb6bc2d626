"""Every kind of input the project reads, as the harness builds it, and the public entry points
each one goes through.

An input kind names its sources (the importers' real fixtures under ``tests/fixtures/``, or a
builder that saves one in the child: UCP checkpoints, CheckpointManager run roots, safetensors
folders, a Hugging Face cache), the entry points that read it, and whether its format carries
checksums over the tensor bytes (a flipped data byte must then be caught; without them it is
undetectable by design and counted apart). The entry points return a digest the oracle compares
with the intact copy's: tensors by name, shape, dtype and a hash of their bytes."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
from collections.abc import Callable
from typing import Any

from tests.hostile.mutations import OPS

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
FIXTURES = os.path.join(REPO, "tests", "fixtures")

IMPORT = ("convert", "restore-direct")
IMPORT_LONG = ("verify-against", "plan-direct", "optax-direct")
RESTORE = ("restore", "verify", "inspect", "cli-inspect-json", "plan", "cli-plan-json")
RESUME = ("latest-step", "latest-step-fallback", "restore-latest", "restore-latest-fallback",
          "restore-step")  # fmt: skip


@dataclasses.dataclass
class Kind:
    """One kind of input: where its copies come from and what reads them.

    Attributes:
        sources: fixture paths under tests/fixtures (a folder or one file), or builder names
            (``@ucp``...); mutation ``i`` takes ``sources[i % len(sources)]``.
        entries: the entry points every run calls, in order.
        long_entries: more entry points for the long run only (the CI slice stays short).
        checksummed: the format checks the tensor bytes (crc32c): a data flip must be caught.
        jax: the entry points need JAX (a child without it starts in ~0.3 s).
        ops: the mutation operators to draw from (default: all of them).
        remote: the copy is read from an object store (each one uploaded to the local S3
            server, ``upload``), not from its folder.
    """

    name: str
    sources: tuple[str, ...]
    entries: tuple[str, ...] = IMPORT
    long_entries: tuple[str, ...] = IMPORT_LONG
    checksummed: bool = False
    jax: bool = False
    ops: tuple[str, ...] | None = None
    remote: bool = False


#: what an object-store copy can be given: no links, FIFOs or pickles run through a file
_OBJECT_OPS = ("flip-data", "flip-meta", "truncate", "delete", "duplicate", "swap", "rename",
               "stray-copy", "json-value", "pickle-hostile")  # fmt: skip
_RECORD_OPS = (*OPS, "record-swap")  # every operator, and a consistent swap in a record

KINDS = {
    k.name: k
    for k in [
        Kind(
            "deepspeed",
            (
                "deepspeed/z2_bf16_dp2/ckpt",
                "deepspeed/z3_bf16_dp2/universal",
                "deepspeed/pipe_pp2_z1_bf16/ckpt",
            ),
        ),
        Kind("megatron", ("megatron/gpt_tp2", "megatron/legacy_gpt_distopt_pp2dp2_synthetic")),
        Kind("megatron_bridge", ("megatron_bridge/llama_tp1dp2",)),
        # megatron-core 0.19's integrity.json (SHA-256 of every file), checked before any read
        Kind(
            "megatron_integrity",
            ("megatron/mcore_versions/0.19.2/gpt_tp2_integrity",),
            ops=_RECORD_OPS,
        ),
        # Megatron-FSDP's fsdp_dtensor (plain DCP, per-parameter optimizer state), read with
        # format="megatron" as a user must (auto-detection says torch DCP and points there)
        Kind("megatron_fsdp_dtensor", ("megatron_fsdp_dtensor/gpt_dp2",)),
        # DeepSpeed's BF16_Optimizer (bf16_zero_* files) and ZeRO-0 bf16 (the model file alone)
        Kind("deepspeed_bf16", ("deepspeed/bf16opt_z1_dp2/ckpt", "deepspeed/z0_bf16_dp2/ckpt")),
        Kind("torch_dcp", ("torch/fsdp2_fp32", "torch/fsdp2_bf16")),
        # torch's ZStandard extension (every entry a zstd frame)
        Kind("torch_dcp_zstd", ("torch/dcp_zstd",)),
        # torch 2.15's DCP: several chunks per rank, TensorProperties with strides
        Kind("torch_dcp_215", ("torch/dcp_torch215_multishard",)),
        # transformers' rank-local safetensors with save_optimizer_distributed's optimizer/
        Kind("torch_dcp_hf_optimizer", ("torch/hf_dist_optimizer_tp2",)),
        # a DCP folder in an object store (moto's S3 server on 127.0.0.1), restored from there
        Kind(
            "torch_dcp_s3",
            ("torch/fsdp2_fp32",),
            ("restore-direct",),
            ("plan-direct",),
            ops=_OBJECT_OPS,
            remote=True,
        ),
        Kind(
            "torch_save",
            (
                "torch/plain_state_dict.pt",
                "torch/hf_bin",
                "torch/lightning.ckpt",
                "torch/hf_bin_sharded",
            ),
        ),
        Kind("hf_trainer", ("hf_trainer/trainer_fp32/checkpoint-3",)),
        Kind("accelerate", ("accelerate/accelerate_named", "torch/accelerate_full")),
        Kind("olmo_core", ("olmo_core/olmo_fp32",)),
        Kind("torch_checkpointing", ("torch_checkpointing/tc_fsdp2_synthetic_layout/step-3",)),
        Kind("torchtune", ("torchtune/tt_dist_fp32",)),
        Kind("verl", ("verl/fsdp2",)),
        # DeepSpeed AutoEP: ds_autoep_layers records, per-expert files, ZeRO-1 / ZeRO-2 bf16;
        # ZeRO-3 bf16 (every rank's records and partition groups), ZeRO-0 (expp_rank_* files)
        Kind(
            "deepspeed_autoep",
            ("deepspeed/autoep_ep2_z1_fp32/ckpt", "deepspeed/autoep_ep2_z2_bf16/ckpt")
            + ("deepspeed/autoep_ep2_edp2_z3_bf16/ckpt", "deepspeed/autoep_ep2_z0_fp32/ckpt"),
            ops=_RECORD_OPS,
        ),
        # verl's Megatron backend: its run layout around a folder megatron-core wrote itself
        Kind("verl_megatron", ("@verl_megatron",)),
        Kind("orbax_pytree", ("@orbax_ocdbt", "@orbax_zarr"), jax=True),
        Kind("safetensors", ("@safetensors",), ("convert", "restore"), (), jax=True),
        Kind("hf_cache", ("@hf_cache",), ("convert", "restore"), (), jax=True),
        Kind("ucp", ("@ucp",), RESTORE, (), checksummed=True, jax=True),
        Kind(
            "ucp_imported",
            ("@ucp_imported",),
            ("restore", "verify", "optax"),
            ("verify-against", "inspect"),
            checksummed=True,
            jax=True,
        ),
        Kind("run_root", ("@run_root",), RESUME, (), checksummed=True, jax=True),
        Kind(
            "orbax_manager_step",
            ("orbax_manager_step",),
            RESUME,
            (),
            checksummed=True,
            jax=True,
        ),
        # the semantic operators: zarr codecs edited, a JSON key twice, the path typed otherwise
        Kind(
            "ucp_semantic",
            ("@ucp",),
            RESTORE,
            (),
            checksummed=True,
            jax=True,
            ops=("zarr-codec", "json-duplicate-key", "path-form"),
        ),
        Kind(
            "orbax_semantic",
            ("@orbax_zarr",),
            ("convert", "restore"),
            (),
            jax=True,
            ops=("zarr-codec", "json-duplicate-key", "path-form"),
        ),
        # a consistent swap in ucp.json (two tensors' folders and digests traded), an array
        # reached outside the checkpoint (its folder or a chunk linked out, ".." in its dir)
        Kind(
            "ucp_record",
            ("@ucp",),
            ("restore", "verify", "plan"),
            (),
            checksummed=True,
            jax=True,
            ops=("record-swap", "array-out", "linked-path-out"),
        ),
        Kind(
            "orbax_array_out",
            ("@orbax_zarr",),
            ("convert", "restore"),
            (),
            jax=True,
            ops=("array-out",),
        ),
        # one record of a run's settings made to disagree with the others stating it (issue
        # 68): DeepSpeed's config copies, clip_grad, a rank's betas; a Trainer's initial_lr,
        # base_lrs, schedule kind, logged rates. The continuation refuses it or is unchanged.
        # One source a kind: the intact copy's continuation is the child's first, slow run
        Kind(
            "run_records",
            ("deepspeed/recipe_z1_fp32_adamw_cosine/ckpt",),
            ("optax-direct",),
            ("convert",),
            jax=True,
            ops=("record-disagree",),
        ),
        Kind(
            "run_records_trainer",
            ("hf_trainer/trainer_fp32/checkpoint-3",),
            ("optax-direct",),
            ("convert",),
            jax=True,
            ops=("record-disagree",),
        ),
        # Accelerate's save_state: scheduler.bin's base_lrs / _last_lr against optimizer.bin's
        Kind(
            "run_records_accelerate",
            ("accelerate/accelerate_named",),
            ("optax-direct",),
            ("convert",),
            jax=True,
            ops=("record-disagree",),
        ),
        # the same for Megatron (legacy rank files; torch_dist's common state with its
        # scheduler), torchtune's recipe state and verl's rank files; paths through links
        Kind(
            "run_records_megatron",
            ("megatron/legacy_gpt_distopt_pp2dp2_synthetic",),
            ("convert-settings",),
            (),
            jax=True,
            ops=("record-disagree", "path-form"),
        ),
        Kind(
            "run_records_megatron_dist",
            ("@megatron_scheduled",),
            ("optax-direct",),
            ("convert-settings",),
            jax=True,
            ops=("record-disagree", "path-form"),
        ),
        # dp_reshardable: the param groups in each rank's optimizer object, against
        # common.pt's args and scheduler (a record edited, a group field fuzzed)
        Kind(
            "run_records_megatron_distopt",
            ("@megatron_distopt",),
            ("optax-direct",),
            ("convert-settings",),
            jax=True,
            ops=("record-disagree", "group-fuzz"),
        ),
        Kind(
            "run_records_torchtune",
            ("torchtune/tt_dist_fp32",),
            ("convert-settings",),
            (),
            jax=True,
            ops=("record-disagree", "path-form"),
        ),
        Kind(
            "run_records_verl",
            ("verl/fsdp2",),
            ("optax-direct",),
            ("convert-settings",),
            jax=True,
            ops=("record-disagree", "path-form"),
        ),
        # the readers continued besides Adam (SGD, torch Muon beside AdamW, transformers'
        # Adafactor): their groups and state fuzzed (group-fuzz), and every other operator
        Kind(
            "optimizer_families",
            ("torch/muon_adamw_synthetic.pt", "torch/adafactor_synthetic.pt", "torch/sgd_single"),
            ("optax-direct",),
            ("convert",),
            jax=True,
        ),
        Kind(
            "optimizer_groups",
            ("torch/muon_adamw_synthetic.pt", "torch/adafactor_synthetic.pt"),
            ("optax-direct",),
            ("convert",),
            jax=True,
            ops=("group-fuzz",),
        ),
        # a run setting ucp.json records rewritten: verify --against its source reports it
        Kind(
            "ucp_settings",
            ("@ucp_imported", "@ucp_trainer"),
            ("cli-verify-against",),
            ("verify-against",),
            checksummed=True,
            jax=True,
            ops=("settings-rewrite",),
        ),
        # the megatron export of a Megatron import: the UCP checkpoint damaged, or the run its
        # ucp.json records (args, scheduler, groups, iteration) edited: every file exactly the
        # intact export's, or a refusal by name with nothing written (issue 68)
        Kind(
            "megatron_export",
            ("@ucp_megatron",),
            ("export-megatron",),
            (),
            checksummed=True,
            jax=True,
        ),
        Kind(
            "megatron_export_record",
            ("@ucp_megatron",),
            ("export-megatron",),
            (),
            checksummed=True,
            jax=True,
            ops=("run-record-edit",),
        ),
        # the peft adapter export of a LoRA / DoRA import (torchtune's recipe): the checkpoint
        # damaged, or the adapter_config.json it records (source.lora) and its LoRA tensors'
        # records edited: the intact export's files, or a refusal by name with nothing written
        Kind(
            "adapter_export",
            ("@ucp_tt_lora", "@ucp_tt_dora"),
            ("export-adapter",),
            (),
            checksummed=True,
            jax=True,
        ),
        Kind(
            "adapter_export_record",
            ("@ucp_tt_lora", "@ucp_tt_dora"),
            ("export-adapter",),
            (),
            checksummed=True,
            jax=True,
            ops=("lora-record-edit",),
        ),
        Kind(
            "orbax_v1_checkpoint",
            ("orbax_v1_checkpoint",),
            ("restore", "inspect"),
            ("verify",),
            checksummed=True,
            jax=True,
        ),
    ]
}

#: inputs read by a deliberately careless reader (``canary-read``: plain ``json.load``, links
#: followed, FIFOs opened, abort on a changed byte; ``canary-write``: a note left beside the
#: input): the harness's own test that it catches a raw exception, a read outside, a hang, a
#: signal and a write outside
CANARIES = {
    k.name: k
    for k in [
        Kind("canary-json", ("@canary",), ("canary-read",), (), ops=("json-value",)),
        Kind("canary-link", ("@canary",), ("canary-read",), (), ops=("symlink-out",)),
        Kind("canary-fifo", ("@canary",), ("canary-read",), (), ops=("fifo",)),
        Kind("canary-abort", ("@canary",), ("canary-read",), (), ops=("flip-meta",)),
        Kind("canary-write", ("@canary",), ("canary-write",), (), ops=("flip-meta",)),
        # TensorStore reading an array through a link out: native reads the spy cannot see
        Kind("canary-tensorstore", ("@canary_zarr",), ("canary-ts-read",), (), ops=("array-out",)),
    ]
}


@dataclasses.dataclass
class Input:
    """A copy to read. ``root``: the tree the mutations touch and reads may enter; ``path``:
    what the entry points are given (``root`` or a file or folder inside it); ``against``: an
    intact source the checkpoint was imported from; ``steps``: a run root's committed steps."""

    root: str
    path: str
    out: str
    options: dict = dataclasses.field(default_factory=dict)
    against: str | None = None
    steps: tuple[int, ...] = ()


# ------------------------------------------------------------------ building the pristine copy


def build(source: str, pristine: str, work: str) -> Input:
    """The intact input of ``source`` laid out under ``pristine`` (a folder to copy from for
    every mutation; the copy is read at ``<work>/in/src``)."""
    root = os.path.join(work, "in", "src")
    out = os.path.join(work, "outarea", "out")
    if not source.startswith("@"):
        full = os.path.join(FIXTURES, source)
        if os.path.isdir(full):
            shutil.copytree(full, pristine, symlinks=True)
            path = root
        else:
            os.makedirs(pristine)
            shutil.copy2(full, pristine)
            path = os.path.join(root, os.path.basename(full))
        inp = Input(root, path, out, options=_options(source))
        if source == "orbax_manager_step":
            inp.steps = (3,)
        return inp
    return BUILDERS[source](pristine, root, out, work)


def _options(source: str) -> dict:
    """A Trainer checkpoint's optimizer order as the Trainer built it (decayed, then the norms),
    so the import needs no transformers (as tests/importers/test_reads_inside.py gives it); a
    megatron-core 0.19 checkpoint's vocabulary (as tests/importers/megatron/test_integrity.py)."""
    if source.startswith("megatron/mcore_versions/"):
        return {"vocab_size": 61}
    if source.startswith("megatron_fsdp_dtensor/"):
        return {"format": "megatron"}
    if not source.startswith("hf_trainer/"):
        return {}
    import numpy as np

    kind = source.split("/")[1]
    with np.load(os.path.join(FIXTURES, "hf_trainer", f"{kind}.truth.npz")) as z:
        names = [k.split("/", 1)[1] for k in z.files if k.startswith("param/")]
    norms = [n for n in names if n.endswith("norm.weight")]
    return {"parameter_order": [n for n in names if n not in norms] + norms}


def _tensors() -> dict:
    """A few small tensors, two of one shape (so swaps have partners), one bfloat16."""
    import ml_dtypes
    import numpy as np

    return {
        "embed.weight": np.arange(48, dtype=np.float32).reshape(6, 8) / 7,
        "layers.0.q.weight": np.linspace(-1, 1, 64, dtype=np.float32).reshape(8, 8),
        "layers.0.o.weight": np.linspace(2, 3, 64, dtype=np.float32).reshape(8, 8),
        "norm.weight": (np.arange(8) / 3).astype(ml_dtypes.bfloat16),
    }


def _build_ucp(pristine, root, out, work) -> Input:
    import jax_ucp

    t = _tensors()
    tree = {"params": {k.replace(".", "_"): v for k, v in t.items()}, "step": 7, "lr": 0.5}
    jax_ucp.save(pristine, tree)
    return Input(root, root, out)


def _build_ucp_imported(pristine, root, out, work) -> Input:
    import jax_ucp

    against = os.path.join(work, "against")
    shutil.copytree(os.path.join(FIXTURES, "torch", "fsdp2_fp32"), against)
    jax_ucp.convert(against, pristine)
    return Input(root, root, out, against=against)


def _build_ucp_trainer(pristine, root, out, work) -> Input:
    """A Trainer checkpoint imported: ucp.json records its run (training_args' clipping and
    rates, the schedule's length, the logged rates, the optimizer's groups) beside the
    certificate of its files."""
    import jax_ucp
    from jax_ucp.conversion import TorchOptions

    source = "hf_trainer/trainer_fp32/checkpoint-3"
    against = os.path.join(work, "against-trainer")
    shutil.copytree(os.path.join(FIXTURES, source), against)
    jax_ucp.convert(against, pristine, importing=TorchOptions(**_options(source)))
    return Input(root, root, out, against=against)


def _build_run_root(pristine, root, out, work) -> Input:
    import numpy as np
    import orbax.checkpoint as ocp

    import jax_ucp

    with ocp.CheckpointManager(pristine) as mngr:
        for s in (1, 2, 3):
            state = {
                "w": np.full((4, 4), float(s), np.float32),
                "b": np.arange(4, dtype=np.float32) + s,
                "step": s,
            }
            mngr.save(s, args=ocp.args.Composite(state=jax_ucp.UCPSave(state)))
        mngr.wait_until_finished()
    return Input(root, root, out, steps=(1, 2, 3))


def _build_orbax(ocdbt: bool):
    def build(pristine, root, out, work) -> Input:
        """An Orbax PyTree checkpoint (OCDBT, or one zarr folder per array), to import."""
        import orbax.checkpoint as ocp

        t = _tensors()
        tree = {"params": {k.replace(".", "_"): v for k, v in t.items() if v.dtype.kind == "f"}}
        with ocp.Checkpointer(ocp.PyTreeCheckpointHandler(use_ocdbt=ocdbt)) as c:
            c.save(pristine, args=ocp.args.PyTreeSave(tree))
        return Input(root, root, out)

    return build


def _build_safetensors(pristine, root, out, work) -> Input:
    from safetensors.numpy import save_file

    os.makedirs(pristine)
    t = _tensors()
    names = sorted(t)
    weight_map = {}
    for i, part in enumerate((names[:2], names[2:])):
        shard = f"model-{i + 1:05d}-of-00002.safetensors"
        save_file({n: t[n] for n in part}, os.path.join(pristine, shard))
        weight_map.update(dict.fromkeys(part, shard))
    with open(os.path.join(pristine, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": 0}, "weight_map": weight_map}, f)
    return Input(root, root, out)


def _build_hf_cache(pristine, root, out, work) -> Input:
    """A Hugging Face cache repo as ``huggingface_hub`` lays it out: files in
    ``blobs/<sha256>``, ``snapshots/<rev>/`` holding relative links to them."""
    staging = os.path.join(work, "staging")
    _build_safetensors(staging, "", "", work)
    blobs = os.path.join(pristine, "blobs")
    rev = "c0ffee" * 6 + "beef"
    snap = os.path.join(pristine, "snapshots", rev)
    os.makedirs(blobs)
    os.makedirs(snap)
    os.makedirs(os.path.join(pristine, "refs"))
    with open(os.path.join(pristine, "refs", "main"), "w") as f:
        f.write(rev)
    for name in sorted(os.listdir(staging)):
        with open(os.path.join(staging, name), "rb") as f:
            sha = hashlib.sha256(f.read()).hexdigest()
        shutil.move(os.path.join(staging, name), os.path.join(blobs, sha))
        os.symlink(f"../../blobs/{sha}", os.path.join(snap, name))
    return Input(root, os.path.join(root, "snapshots", rev), out)


def _build_verl_megatron(pristine, root, out, work) -> Input:
    """A verl run root as its MegatronCheckpointManager lays it out (as
    tests/importers/verl/test_megatron_backend.py builds it) around megatron-core's own folder."""
    actor = os.path.join(pristine, "global_step_2", "actor")
    dist_ckpt = os.path.join(FIXTURES, "megatron", "mcore_versions", "0.17.1")
    shutil.copytree(os.path.join(dist_ckpt, "gpt_distopt_dp2_fully_reshardable"),
                    os.path.join(actor, "dist_ckpt"))  # fmt: skip
    os.makedirs(os.path.join(actor, "huggingface"))
    for name, text in (("transformer_config.json", '{"num_layers": 2}'),
                       ("huggingface/config.json", '{"vocab_size": 61}'),
                       ("../../latest_checkpointed_iteration.txt", "2")):  # fmt: skip
        with open(os.path.join(actor, name), "w") as f:
            f.write(text)
    return Input(root, root, out)


def _build_megatron_scheduled(pristine, root, out, work) -> Input:
    """gpt_distopt_dp2 with the common state of megatron-core's scheduler run (as
    tests/test_continuation_megatron.py lays it out): every record of its schedule."""
    shutil.copytree(os.path.join(FIXTURES, "megatron", "gpt_distopt_dp2"), pristine)
    common = os.path.join(FIXTURES, "megatron", "gpt_distopt_dp2_scheduler_synthetic.common.pt")
    shutil.copyfile(common, os.path.join(pristine, "common.pt"))
    return Input(root, root, out)


def _build_megatron_distopt(pristine, root, out, work) -> Input:
    """megatron-core's dp_reshardable save (its param groups in its rank's optimizer object)
    with the scheduler run's common state, every record of one run
    (``megatron_testing.scheduled_distopt``)."""
    from tests.megatron_testing import scheduled_distopt

    scheduled_distopt(pristine)
    return Input(root, root, out)


def _build_ucp_megatron(pristine, root, out, work) -> Input:
    """The scheduler run (``@megatron_scheduled``) imported: a UCP checkpoint whose ucp.json
    records the Megatron run (args, scheduler, param groups, iteration) the megatron export
    writes into common.pt."""
    import jax_ucp

    src = os.path.join(work, "megatron_run")
    _build_megatron_scheduled(src, root, out, work)
    jax_ucp.convert(src, pristine)
    return Input(root, root, out)


def _build_ucp_tt(kind: str):
    def build(pristine, root, out, work) -> Input:
        """torchtune's LoRA (or DoRA) recipe imported: the adapter and source.lora."""
        import jax_ucp

        jax_ucp.convert(os.path.join(FIXTURES, "torchtune", kind), pristine)
        return Input(root, root, out)

    return build


def _build_canary(pristine, root, out, work) -> Input:
    os.makedirs(pristine)
    with open(os.path.join(pristine, "record.json"), "w") as f:
        json.dump({"step": 3, "names": ["a", "b"]}, f)
    with open(os.path.join(pristine, "x.bin"), "wb") as f:
        f.write(b"intact")
    return Input(root, root, out)


def _build_canary_zarr(pristine, root, out, work) -> Input:
    import numpy as np
    import tensorstore as ts

    for name in ("a", "b"):
        spec = {"driver": "zarr3", "kvstore": {"driver": "file", "path": f"{pristine}/{name}"}}
        meta = {"shape": [4], "data_type": "float32", "chunk_grid": {"name": "regular",
                "configuration": {"chunk_shape": [2]}}}  # fmt: skip
        t = ts.open({**spec, "metadata": meta}, create=True).result()
        t.write(np.arange(4, dtype=np.float32)).result()
    return Input(root, root, out)


def _canary_ts_read(root: str) -> dict:
    """Every array under ``root`` read by TensorStore, links followed, nothing checked."""
    import tensorstore as ts

    out = {}
    for name in sorted(os.listdir(root)):
        spec = {"driver": "zarr3", "kvstore": {"driver": "file", "path": f"{root}/{name}"}}
        out[name] = ts.open(spec).result().read().result().tolist()
    return out


def _canary_read(root: str) -> dict:
    """Everything under ``root`` read the careless way."""
    out = {}
    for name in sorted(os.listdir(root)):
        with open(os.path.join(root, name), "rb") as f:
            data = f.read()
        if name == "x.bin" and data != b"intact":
            os.abort()
        if name.endswith(".json"):
            out[name] = json.loads(data, parse_constant=lambda t: int(t))
        else:
            out[name] = data.hex()
    return out


BUILDERS: dict[str, Callable[..., Input]] = {
    "@canary": _build_canary,
    "@canary_zarr": _build_canary_zarr,
    "@ucp": _build_ucp,
    "@ucp_imported": _build_ucp_imported,
    "@ucp_trainer": _build_ucp_trainer,
    "@run_root": _build_run_root,
    "@safetensors": _build_safetensors,
    "@orbax_ocdbt": _build_orbax(ocdbt=True),
    "@orbax_zarr": _build_orbax(ocdbt=False),
    "@hf_cache": _build_hf_cache,
    "@verl_megatron": _build_verl_megatron,
    "@megatron_scheduled": _build_megatron_scheduled,
    "@megatron_distopt": _build_megatron_distopt,
    "@ucp_megatron": _build_ucp_megatron,
    "@ucp_tt_lora": _build_ucp_tt("tt_lora"),
    "@ucp_tt_dora": _build_ucp_tt("tt_dora"),
}


# ------------------------------------------------------------------ an object store


_S3: list = []  # the child's moto server, started by the first upload


def upload(inp: Input, tag: str) -> Input:
    """``inp`` with its path an ``s3://`` prefix holding every regular file under its root (a
    new prefix per ``tag``), on moto's S3 server on 127.0.0.1 (started once per child, stopped
    when it exits; tests/object_servers.py starts the tests' own alike)."""
    import atexit
    import subprocess
    import tempfile
    import urllib.request

    from jax_ucp._src.store.storage import object_store
    from tests.object_servers import _wait_for
    from tests.ucp_testing import free_port

    if not _S3:
        port = free_port()
        log = tempfile.TemporaryFile("w+")
        proc = subprocess.Popen(["moto_server", "-H", "127.0.0.1", "-p", str(port)], stdout=log,
                                stderr=subprocess.STDOUT, text=True)  # fmt: skip
        proc.stdout = log
        atexit.register(proc.kill)
        _wait_for(port, proc, "moto_server")
        endpoint = f"http://127.0.0.1:{port}"
        os.environ.update(AWS_ACCESS_KEY_ID="testing", AWS_SECRET_ACCESS_KEY="testing",
                          AWS_REGION="us-east-1", AWS_ENDPOINT_URL=endpoint)  # fmt: skip
        urllib.request.urlopen(urllib.request.Request(f"{endpoint}/hostile", method="PUT"))
        _S3.append(proc)
    url = f"s3://hostile/{tag}"
    for dirpath, dirnames, filenames in os.walk(inp.root):
        dirnames.sort()
        for name in sorted(n for n in filenames if n.isprintable()):  # moto refuses the rest
            with open(os.path.join(dirpath, name), "rb") as f:
                rel = os.path.relpath(os.path.join(dirpath, name), inp.root)
                object_store.write(url, rel, f.read())
    return dataclasses.replace(inp, path=url)


# ------------------------------------------------------------------ digests


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()[:16]


def ucp_digest(path: str) -> dict:
    """A written UCP checkpoint's tensors (name, shape, dtype, a hash of every chunk file) and
    values, read from its files (no JAX): what a convert produced."""
    with open(os.path.join(path, "ucp.json")) as f:
        manifest = json.load(f)
    out = {}
    for e in manifest["entries"]:
        name = "/".join(map(str, e["key"]))
        if e["entry"] == "tensor":
            h = hashlib.sha256()
            top = os.path.join(path, e["dir"])
            for dirpath, dirnames, filenames in os.walk(top):
                dirnames.sort()
                for fn in sorted(filenames):
                    if fn != "zarr.json":
                        p = os.path.join(dirpath, fn)
                        h.update(os.path.relpath(p, top).encode())
                        with open(p, "rb") as f:
                            h.update(f.read())
            out[name] = ["tensor", e["shape"], e["dtype"], h.hexdigest()[:16]]
        else:
            out[name] = [e["entry"], repr(e.get("value"))]
    return out


def tree_digest(tree: Any) -> dict:
    """A restored pytree's leaves by path: shape, dtype and a hash of the bytes (NaN payloads
    and -0.0 compare exactly), or the repr of a non-array leaf."""
    import jax
    import numpy as np

    out = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        name = jax.tree_util.keystr(path)
        if hasattr(leaf, "shape") and hasattr(leaf, "dtype"):
            a = np.ascontiguousarray(np.asarray(leaf))
            out[name] = ["tensor", list(a.shape), str(a.dtype), _sha(a.tobytes())]
        else:
            out[name] = ["value", repr(leaf)]
    return out


# ------------------------------------------------------------------ the entry points


class Displays:
    """What a notebook or a terminal shows of an object: repr, str, HTML, Markdown, pretty."""

    @staticmethod
    def all(obj) -> dict:
        shown = {"repr": repr(obj), "str": str(obj)}
        for name in ("_repr_html_", "_repr_markdown_"):
            if hasattr(obj, name):
                shown[name] = getattr(obj, name)()
        if hasattr(obj, "_repr_pretty_"):
            parts: list[str] = []

            class Printer:
                def text(self, s):
                    parts.append(str(s))

                def pretty(self, o):
                    parts.append(repr(o))

                def breakable(self, sep=" "):
                    parts.append(sep)

            obj._repr_pretty_(Printer(), False)
            shown["_repr_pretty_"] = "".join(parts)
        return shown


def _mesh():
    import jax_ucp

    return jax_ucp.abstract_mesh([("x", 2)])


def run_entry(name: str, inp: Input, state: dict) -> Any:
    """Calls the entry point ``name`` on ``inp``; returns its digest (``state`` carries what an
    earlier entry made, e.g. a convert's output for verify --against)."""
    import jax_ucp

    p = inp.path
    if name == "convert":
        shutil.rmtree(inp.out, ignore_errors=True)
        jax_ucp.convert(p, inp.out, importing=_importing(inp), format=_format(inp))
        state["converted"] = True
        return ucp_digest(inp.out)
    if name == "convert-settings":  # and the run settings the manifest records
        digest = run_entry("convert", inp, state)
        with open(os.path.join(inp.out, "ucp.json")) as f:
            source = json.load(f).get("source") or {}
        for key in ("optimizer", "megatron_optimizer", "lr_scheduler", "recipe", "iteration"):
            digest[f"source.{key}"] = json.dumps(source.get(key), sort_keys=True)
        return digest
    if name in ("export-megatron", "export-adapter"):  # every file, or a refusal leaving none
        from jax_ucp.exporters import MegatronExport, SafetensorsExport

        shutil.rmtree(inp.out, ignore_errors=True)
        megatron = name == "export-megatron"
        try:
            jax_ucp.export(
                p, inp.out, MegatronExport(tp=2) if megatron else SafetensorsExport(adapter=True)
            )
        except Exception:
            _nothing_written(inp.out)
            raise
        return {
            os.path.relpath(os.path.join(d, f), inp.out): _sha(_read(os.path.join(d, f)))
            for d, _, files in os.walk(inp.out)
            for f in files
        }
    if name == "verify-against":
        if inp.against is None:  # an import: the output proven against its (mutated) source
            if not state.get("converted"):
                return "skipped (nothing converted)"
            return _verdict(jax_ucp.verify(inp.out, against=p))
        return _verdict(jax_ucp.verify(p, against=inp.against))
    if name == "cli-verify-against":  # the command line: its exit status and what it says
        return _cli(["verify", p, "--against", str(inp.against)]) and "exit 0"
    if name == "restore":
        return tree_digest(jax_ucp.restore(p))
    if name == "restore-direct":  # straight from the source, nothing written
        return tree_digest(jax_ucp.restore(p, importing=_importing(inp), format=_format(inp)))
    if name == "plan-direct":  # by tensor, so a file's tensors gone are told from others
        result = jax_ucp.plan(p, mesh=_mesh(), importing=_importing(inp), format=_format(inp))
        state["displays"] = Displays.all(result)
        return {
            t.name: ["plan", list(t.shape), str(t.dtype), str(t.partition_spec), t.error]
            for t in result.tensors
        }
    if name == "optax-direct":
        options = jax_ucp.RestoreOptions(importing=_importing(inp), format=_format(inp))
        return _run_digest(jax_ucp.optax_from_torch(p, options=options))
    if name == "restore-latest":
        return tree_digest(jax_ucp.restore(p, step="latest"))
    if name == "restore-latest-fallback":
        return tree_digest(jax_ucp.restore(p, step="latest", fallback=True))
    if name == "restore-step":
        return tree_digest(jax_ucp.restore(p, step=inp.steps[0]))
    if name == "latest-step":
        return jax_ucp.latest_step(p)
    if name == "latest-step-fallback":
        return jax_ucp.latest_step(p, fallback=True)
    if name == "verify":
        return _verdict(jax_ucp.verify(p))
    if name == "inspect":
        m = jax_ucp.inspect(p)
        state["displays"] = Displays.all(m)
        return sorted(
            ("/".join(map(str, e.key)), str(getattr(e, "shape", "")), str(getattr(e, "dtype", "")))
            for e in m.entries
        )
    if name == "plan":
        result = jax_ucp.plan(p, mesh=_mesh())
        state["displays"] = Displays.all(result)
        return repr(result)
    if name == "cli-inspect-json":
        return _cli_json(["inspect", p, "--json"])
    if name == "cli-plan-json":
        return _cli_json(["plan", p, "--mesh", "x=2", "--json"])
    if name == "optax":
        return _run_digest(jax_ucp.optax_from_torch(p))
    if name == "canary-read":
        return _canary_read(p)
    if name == "canary-ts-read":
        return _canary_ts_read(p)
    if name == "canary-write":
        with open(os.path.join(os.path.dirname(p), "seen.txt"), "w") as f:
            f.write("read")
        return "written"
    raise AssertionError(f"no entry point {name!r}")


class HalfWritten(AssertionError):
    """A refused export left files at (or beside) its target."""


def _nothing_written(out: str) -> None:
    parent, name = os.path.split(out)
    left = [n for n in os.listdir(parent) if n == name or n.startswith(name + ".")]
    if left:
        raise HalfWritten(f"the refused export left {left} in {parent}")


def _read(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def _importing(inp: Input):
    """The import options ``convert`` is given, as a direct restore takes them."""
    fields = {k: v for k, v in inp.options.items() if k != "format"}
    if not fields:
        return None
    from jax_ucp.conversion import MegatronOptions, TorchOptions

    return (MegatronOptions if "vocab_size" in fields else TorchOptions)(**fields)


def _format(inp: Input) -> str | None:
    """The format ``convert`` is given by name, as a direct restore and a plan take it."""
    return inp.options.get("format")


def _run_digest(run) -> dict:
    """What ``optax_from_torch`` gives: both trees, the step and the optimizer it found, and how
    it continues: the schedule's next rates and one update of the params as their own gradient
    (the betas, eps, clipping, weight decay and learning rate all shape it)."""
    import jax

    grads = jax.tree.map(lambda p: p * 10.0, run.params)  # a norm the clipping acts on
    updates, _ = run.tx.update(grads, run.opt_state, run.params)
    return {
        "params": tree_digest(run.params),
        "opt_state": tree_digest(run.opt_state),
        "step": run.step,
        "optimizer": run.optimizer,
        "unrecovered": sorted(run.unrecovered),  # what it says it went on without
        "schedule": [repr(float(run.schedule(run.step + k))) for k in (0, 1, 2, 5)],
        "update": tree_digest(updates),
    }


def _verdict(problems) -> str:
    """verify's answer: intact, or which tensors it reports (the messages vary by file)."""
    if not problems:
        return "intact"
    return "reported: " + ", ".join(sorted({str(n) for n, _ in problems}))


class CliFailure(Exception):
    """The command line refused (exit status != 0) with ``message``; ``raw`` when it was not
    one of the project's errors."""

    def __init__(self, message: str, raw: BaseException | None):
        super().__init__(message)
        self.raw = raw


class NotStrictJson(Exception):
    """``--json`` printed what a strict JSON parser rejects."""


def _cli_json(args: list[str]) -> Any:
    """The command line's ``--json`` output, parsed strictly (no NaN/Infinity tokens, as jq and
    JSON.parse read it); a refusal raises ``CliFailure``."""

    def strict(token):
        raise NotStrictJson(f"--json printed the non-JSON token {token}")

    return json.loads(_cli(args), parse_constant=strict)


def _cli(args: list[str]) -> str:
    """What the command line prints (exit status 0); a refusal raises ``CliFailure``."""
    from typer.testing import CliRunner

    from jax_ucp.cli import app

    result = CliRunner().invoke(app, args, terminal_width=400)
    if result.exit_code != 0:
        exc = result.exception
        raw = None if exc is None or isinstance(exc, SystemExit) else exc
        raise CliFailure(result.output[-2000:], raw)
    return result.stdout
