"""The hostile-input harness in CI: a fixed-seed slice of mutations of every input kind through
the public entry points, each kind in one bounded child process; and the harness's own checks
(its mutations are reproducible, its oracle and its child catch what they are there to catch).

The long run: ``python3 -m tests.hostile --seed S --count N`` (docs/RELIABILITY.md)."""

from __future__ import annotations

import json
import os
import random
import shutil
import zipfile

import pytest

from tests.hostile import mutations, oracle
from tests.hostile.inputs import KINDS, Kind
from tests.hostile.runner import run_kind

#: the CI slice: seed and mutation indices per input kind, chosen to cover every kind and all
#: operators with mutations the code handles (``python3 -m tests.hostile --seed 0 --index I
#: --kind K`` prints what each one is); torch_checkpointing 2 and torch_save 9 (a zip member
#: twice), run_root 2 and 3 (one resume rule), orbax_manager_step 11 (a step folder linked
#: out) found issue 48's own holes
CI_SEED = 0
CI_SLICE: dict[str, list[int]] = {
    "accelerate": [0, 2, 3, 4, 5],
    "deepspeed": [0, 1, 2, 3, 4],
    "hf_cache": [0, 1, 2, 3, 5],
    "hf_trainer": [0, 1, 3, 4, 5],
    "megatron": [0, 1, 3, 4, 5],
    "megatron_bridge": [0, 1, 2, 3, 4],
    "olmo_core": [0, 1, 2, 4, 6],
    "orbax_manager_step": [0, 1, 2, 4, 6, 11],
    "orbax_pytree": [0, 1, 2, 3, 4],
    "orbax_v1_checkpoint": [0, 1, 2, 3, 6],
    "run_root": [0, 1, 2, 3, 4, 5, 6],
    "safetensors": [0, 1, 4, 5, 7],
    "torch_checkpointing": [0, 1, 2, 3, 4, 7],
    "torch_dcp": [0, 1, 3, 4, 7],
    "torch_dcp_zstd": [0, 1, 6, 7, 18, 25],
    "torch_save": [0, 1, 3, 4, 6, 9],
    "torchtune": [0, 1, 2, 3, 4],
    "ucp": [0, 1, 2, 3, 4],
    "ucp_imported": [0, 1, 3, 7, 9],
    # the semantic operators (issue 56): a path typed through a link's "..", a value given twice
    # in ucp.json, "."-separated chunk keys, a transpose codec added / a path with "/./", a key
    # twice in Orbax's _METADATA, Fortran order, a big-endian dtype; paths through symlinks
    # (issue 68): a link to the checkpoint (22), a linked parent folder (28)
    "ucp_semantic": [0, 3, 6, 10, 22, 28],
    "orbax_semantic": [0, 2, 3, 9],
    # issue 56's readers and operators: integrity.json (a flip it vouches against; 18, 49: a
    # consistent swap of two files and their digests), BF16_Optimizer / ZeRO-0 bf16 files, torch
    # 2.15's DCP; a consistent swap in ucp.json (1), an array's chunk linked out (9) or its
    # folder named through ".." (13); an Orbax array's chunk linked out (2): where TensorStore
    # would read natively, seen by spy.NativeOpens
    "megatron_integrity": [8, 18, 49],
    "deepspeed_bf16": [0, 1, 5],
    "torch_dcp_215": [0, 2, 11],
    # save_optimizer_distributed's folder beside rank-local safetensors: its .metadata renamed
    # (3), the folder renamed (24); deleted whole it is a model-only save, as the files say
    "torch_dcp_hf_optimizer": [0, 3, 24],
    # ucp_record: a consistent swap (6), a chunk linked out (9), ".." in a dir (13); a chunk
    # linked out of an input reached through a link to it (2), a folder linked out under a
    # linked parent folder (4): a path through links is no licence to follow one out (issue 68)
    "ucp_record": [2, 4, 6, 9, 13],
    "orbax_array_out": [2],
    "verl": [0, 1, 2, 4, 5],
    # Megatron-FSDP fsdp_dtensor (issue 57): a stray rank copy (read exactly), a truncated rank
    # file, a hostile pickle, .metadata truncated, a rank file gone, a zip member twice
    "megatron_fsdp_dtensor": [0, 1, 3, 8, 10, 11],
    # DeepSpeed AutoEP (issue 57): an expert file a FIFO, two expert files swapped (each master
    # checked against its file), one truncated, one gone (ZeRO-0), two ZeRO-3 ranks' optimizer
    # files swapped, their model states files swapped, a hostile pickle in one (ZeRO-3)
    "deepspeed_autoep": [4, 5, 6, 7, 11, 14, 22],
    # verl's Megatron backend (issue 57): metadata.json flipped, a zip member twice, the actor
    # folder linked out, a data byte flipped, common.pt gone
    "verl_megatron": [1, 2, 4, 10, 12],
    # one record of a run's settings disagreeing with the others (issue 68): a rank's betas, a
    # rank's ds_config optimizer, the model states' clipping, a rank's clip_grad, the model
    # states' scheduler; scheduler.pt's base_lrs, training_args.bin's schedule kind, a logged
    # learning rate, optimizer.pt's initial_lr (1, 14; 1, 7 continued silently before);
    # optimizer.pt's betas, not training_args.bin's (3: a client optimizer or an edit, continued
    # as the groups say and warned; silent before, probe 8)
    "run_records": [1, 4, 14, 16, 19],
    "run_records_trainer": [0, 1, 2, 3, 7],
    # the same for Megatron, torchtune and verl (issue 68, round 2): a legacy rank's scheduler
    # position and iteration, a path through a link to the input; torch_dist's iteration, betas,
    # args.lr, num_steps and a linked parent folder; torchtune's progress; verl's rank 1's
    # initial_lr and betas; a setting ucp.json records, verified against its source
    "run_records_megatron": [0, 10, 12],
    "run_records_megatron_dist": [1, 2, 5, 6, 9],
    # dp_reshardable's rank objects (issue 68, round 3): a group field a string, eps, max_lr,
    # weight decay (and 1e308), betas changed in the rank's object (their groups were not read)
    "run_records_megatron_distopt": [1, 2, 8, 9, 10, 11],
    "run_records_torchtune": [1, 2],
    # Accelerate's optimizer.bin rates doubled (0: continued at twice the rate before, probe
    # 9), scheduler.bin's base_lrs doubled (2): both refused naming both files
    "run_records_accelerate": [0, 2],
    # the megatron export of a Megatron import (issue 68, round 3): a chunk a FIFO, zarr.json
    # flipped, a chunk folder deleted, a chunk copied, zarr.json linked out, two arrays
    # swapped; ucp.json's run record edited (a group's field gone, wd_mult 2, the scheduler's
    # position, consumed samples, lr_warmup_init absurd, end_weight_decay, a flag a number):
    # all 7 of those written silently before, each file exactly the intact export's or refused
    # by name with nothing written
    "megatron_export": [0, 1, 3, 8, 13, 28],
    "megatron_export_record": [0, 4, 9, 16, 20, 33, 37],
    # the peft adapter export of torchtune LoRA / DoRA imports (issues 68, 70): a data byte
    # flipped, a key twice, a value odd, zarr.json linked out; source.lora's rank_pattern a
    # string rank, target_modules a regex matching nothing or a nested repetition, a module
    # excluded, r another rank, a magnitude's module renamed, a lora_A gone: all 7 written
    # silently before, each refused by name with nothing written
    "adapter_export": [1, 2, 4, 9],
    "adapter_export_record": [9, 11, 19, 22, 35, 66, 74],
    "run_records_verl": [0, 1, 3],
    # a converted checkpoint's recorded run (issue 68): the certificate removed (10: "no
    # certificate recorded", exit 1), a group's betas (17), a Trainer's max_grad_norm (105) and
    # its scheduler's position (201): verify --against the source, API and command line, must
    # report it naming the setting
    "ucp_settings": [10, 17, 105, 201],
    # the readers besides Adam (issue 68): a hostile pickle, a deleted file, a FIFO in place of
    # the file; a group's weight_decay made a string (a raw ValueError before) or removed
    # (continued undecayed before), eps 1e308 (continued before), a state tensor's shape
    # absurd / a row longer than its storage
    "optimizer_families": [0, 4, 10, 15],
    "optimizer_groups": [0, 3, 11, 32, 78],
}


@pytest.mark.timeout(240)
@pytest.mark.parametrize("kind", sorted(CI_SLICE))
def test_the_ci_slice_of_hostile_copies_is_handled(kind):
    results = run_kind(kind, CI_SEED, CI_SLICE[kind], fork=True)
    assert len(results) == len(CI_SLICE[kind])
    bad = [r.report() for r in results if r.failed]
    assert not bad, "\n" + "\n".join(bad)


#: kinds in the long run only: DCP from S3 starts moto's S3 server (6 s more on the loaded host)
LONG_ONLY = {"torch_dcp_s3"}


def test_every_input_kind_is_in_the_ci_slice():
    assert set(CI_SLICE) | LONG_ONLY == set(KINDS) and not set(CI_SLICE) & LONG_ONLY
    assert all(CI_SLICE.values())


# ------------------------------------------------------------------ the harness's own checks


def _tree(root) -> None:
    """A small input with something for every operator: numbered files and folders, JSON, a
    torch-like zip with a pickle, a raw pickle, two files of one size."""
    import pickle

    os.makedirs(root / "rank_0")
    os.makedirs(root / "rank_1")
    (root / "rank_0" / "shard_00.bin").write_bytes(bytes(range(64)))
    (root / "rank_1" / "shard_00.bin").write_bytes(bytes(range(64, 128)))
    (root / "meta.json").write_text(json.dumps({"step": 3, "shapes": [[2, 3]], "name": "w"}))
    (root / "state.pkl").write_bytes(pickle.dumps({"step": 3}, protocol=2))
    with zipfile.ZipFile(root / "model_7.pt", "w") as z:  # fixed times: runs a and b equal
        z.writestr(zipfile.ZipInfo("archive/data.pkl"), pickle.dumps({"w": 1}, protocol=2))
        z.writestr(zipfile.ZipInfo("archive/data/0"), b"\0" * 16)


def _snapshot(root) -> dict:
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            p = os.path.join(dirpath, name)
            rel = os.path.relpath(p, root)
            if os.path.islink(p):
                out[rel] = "-> " + os.readlink(p).replace(str(root.parent), "")
            elif os.path.isfile(p):
                out[rel] = open(p, "rb").read()
            else:
                out[rel] = "dir"
    return out


@pytest.mark.parametrize("op", sorted(mutations.OPS))
def test_each_operator_applies_and_replays_the_same_from_its_seed(tmp_path, op):
    """An operator changes the tree, and the same seed makes the same change again (the
    reproducer a failure prints is exact)."""
    done = []
    for run in ("a", "b"):
        root = tmp_path / run / "src"
        _tree(root)
        before = _snapshot(root)
        m = mutations.mutate(
            str(root), random.Random("7/test/3"), str(tmp_path / run / "out"), [op]
        )
        assert m.op == op, m.describe()
        after = _snapshot(root)
        assert after != before, m.describe()
        done.append((m.describe(), after))
    assert done[0] == done[1]


def _ok(value, warnings=()):
    return ("ok", value, list(warnings))


BASE = _ok({"params/w": ["tensor", [2], "float32", "aa"], "step": ["value", "3"]})
NAMES = {"/work/in/src", "model.safetensors", "params"}
PLAIN = Kind("plain", ("x",))
SUMMED = Kind("summed", ("x",), checksummed=True)


@pytest.mark.parametrize(
    "got, kind, op, label",
    [
        (BASE, PLAIN, "flip-data", "same"),
        (("error", "SourceError", "model.safetensors: truncated", True), PLAIN, "truncate", "refused"),
        (("error", "SourceError", "truncated", True), PLAIN, "truncate", "unnamed-error"),
        (("error", "KeyError", "'w'", False), PLAIN, "flip-meta", "raw-exception"),
        (_ok({"params/w": ["tensor", [2], "float32", "bb"], "step": ["value", "3"]}), PLAIN,
         "flip-data", "undetectable"),
        (_ok({"params/w": ["tensor", [2], "float32", "bb"], "step": ["value", "3"]}), SUMMED,
         "flip-data", "silent-wrong"),
        (_ok({"params/w": ["tensor", [2], "float32", "bb"], "step": ["value", "3"]}), PLAIN,
         "json-value", "silent-wrong"),
        (_ok({"params/w": ["tensor", [2], "float32", "aa"], "step": ["value", "4"]}), PLAIN,
         "flip-data", "silent-wrong"),
        (_ok({"params/w": ["tensor", [2], "float32", "aa"]}), PLAIN, "delete", "dropped"),
        (_ok({"params/w": ["tensor", [2], "float32", "aa"]}, ["UserWarning: ck: optimizer.bin.bak "
         "here, no optimizer state: the weights are imported alone"]), PLAIN, "rename", "said"),
        (("error", "NotStrictJson", "NaN", False), PLAIN, "json-value", "not-strict-json"),
    ],
)  # fmt: skip
def test_the_oracle_passes_only_the_same_value_or_a_named_error(got, kind, op, label):
    got_label, _ = oracle.judge_entry("convert", BASE, got, kind=kind, mutation_op=op, names=NAMES)
    assert got_label == label
    assert (label in oracle.PASS) == (label in {"same", "refused", "undetectable", "said"})


def test_a_fallback_to_an_older_step_passes_only_with_its_warning():
    older = {"w": ["tensor", [2], "float32", "01"]}
    base = _ok({"w": ["tensor", [2], "float32", "03"]})
    warned = _ok(older, ["ResumeWarning: step 3 skipped"])
    judge = oracle.judge_entry
    args = {"kind": SUMMED, "mutation_op": "flip-data", "names": NAMES, "alt": {1: older}}
    assert judge("restore-latest-fallback", base, warned, **args)[0] == "fell-back"
    assert judge("restore-latest-fallback", base, _ok(older), **args)[0] == "silent-wrong"
    assert judge("restore-latest", base, warned, **args)[0] == "silent-wrong"


def test_an_optimizer_built_without_a_lost_file_passes_only_when_said():
    """optax_from_torch without what a renamed file held (the Trainer's training_args.bin: the
    schedule, the clipping) passes when its ``unrecovered`` names more than the intact copy's
    and a warning said so; unwarned, with other params, or in another entry it is a failure."""
    params = {"w": ["tensor", [2], "float32", "aa"]}
    base = _ok({"params": params, "opt_state": "A", "unrecovered": []})
    other = {"params": params, "opt_state": "B", "unrecovered": ["the learning-rate schedule"]}
    warned = _ok(other, ["UserWarning: the translation goes on without ..."])
    args = {"kind": PLAIN, "mutation_op": "rename", "names": NAMES}
    judge = oracle.judge_entry
    assert judge("optax-direct", base, warned, **args)[0] == "said"
    assert judge("optax-direct", base, _ok(other), **args)[0] == "silent-wrong"
    assert judge("convert", base, warned, **args)[0] == "silent-wrong"
    moved = _ok({**other, "params": {"w": ["tensor", [2], "float32", "bb"]}}, warned[2])
    assert judge("optax", base, moved, **args)[0] == "silent-wrong"
    said_before = _ok({**other, "opt_state": "A"}, warned[2])  # nothing more went unrecovered
    assert judge("optax", said_before, warned, **args)[0] == "silent-wrong"


def test_a_continuation_as_the_files_say_passes_only_with_a_new_warning_naming_them():
    """Records that cannot be told edited from chosen (a Trainer's groups that are not its
    arguments': a client optimizer) continue as the files say: 'said' only with a warning the
    intact copy did not give, naming a file of the input, and the same params."""
    params = {"w": ["tensor", [2], "float32", "aa"]}
    base = _ok({"params": params, "opt_state": "A", "unrecovered": []})
    other = {"params": params, "opt_state": "A", "unrecovered": [], "update": "B"}
    name = sorted(NAMES)[0]
    warned = _ok(other, [f"UserWarning: {name} param_groups' betas 0.8 (training_args.bin 0.9)"])
    args = {"kind": PLAIN, "mutation_op": "record-disagree", "names": NAMES}
    judge = oracle.judge_entry
    assert judge("optax-direct", base, warned, **args)[0] == "said"
    assert judge("optax-direct", base, _ok(other, ["UserWarning: odd"]), **args)[0] != "said"
    assert judge("optax-direct", _ok(base[1], warned[2]), warned, **args)[0] == "silent-wrong"
    moved = _ok({**other, "params": {"w": ["tensor", [2], "float32", "bb"]}}, warned[2])
    assert judge("optax-direct", base, moved, **args)[0] == "silent-wrong"


def test_a_step_renamed_to_a_new_number_is_that_step_only_for_a_rename():
    """latest_step naming a step no intact copy had passes only when a step folder was renamed
    (Orbax's manager lists it so); the same answer after a byte flip is a different value."""
    base = _ok(3)
    args = {"kind": SUMMED, "names": NAMES, "alt": {1: {}, 2: {}}}
    judge = oracle.judge_entry
    assert judge("latest-step", base, _ok(99), mutation_op="rename", **args)[0] == "step-renamed"
    assert judge("latest-step", base, _ok(99), mutation_op="flip-data", **args)[0] not in (
        oracle.PASS
    )
    assert judge("restore-latest", base, _ok(99), mutation_op="rename", **args)[0] not in (
        oracle.PASS
    )


def test_a_plan_may_say_what_swapped_metadata_says_only_where_nothing_checks_it():
    """A plan reads metadata alone: two tensors' .zarray swapped in an Orbax zarr checkpoint
    plans the swapped shapes (the restore is judged on its own); in a checksummed format, or
    with a tensor gone, it is a failure."""
    base = _ok({"a": ["plan", [6, 8], "float32", "P()", None], "b": ["plan", [8, 8], "float32",
                "P()", None]})  # fmt: skip
    swapped = _ok({"a": base[1]["b"], "b": base[1]["a"]})
    args = {"mutation_op": "swap", "names": NAMES}
    assert oracle.judge_entry("plan-direct", base, swapped, kind=PLAIN, **args)[0] == "plan-only"
    assert oracle.judge_entry("plan-direct", base, swapped, kind=SUMMED, **args)[0] != "plan-only"
    fewer = _ok({"a": base[1]["a"]})
    assert oracle.judge_entry("plan-direct", base, fewer, kind=PLAIN, **args)[0] not in oracle.PASS


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    "canary, finding",
    [
        ("canary-json", None),  # a raw exception or a different value: some failure
        ("canary-link", "read-outside"),
        ("canary-fifo", "hang"),
        ("canary-abort", "crash"),
        ("canary-write", "baseline-write-outside"),
        ("canary-tensorstore", "read-outside"),  # native reads, seen by spy.NativeOpens
    ],
)
def test_the_harness_catches_a_careless_reader(canary, finding):
    """A reader that parses JSON loosely, follows links (in Python, or TensorStore's native
    reads), opens FIFOs, aborts on a changed byte or leaves a note beside its input: the
    harness reports each, naming the mutation and how to replay it."""
    indices = [0] if canary == "canary-fifo" else [0, 1, 2, 3]  # a hang costs its timeout
    results = run_kind(canary, 0, indices, timeout=3, fork=True)  # as the CI slice runs
    assert len(results) == len(indices)
    failed = [r for r in results if r.failed]
    assert failed, [r.labels for r in results]
    if finding is not None:
        assert any(f[0].startswith(finding) for r in failed for f in r.findings), [
            r.findings for r in results
        ]
    report = failed[0].report()
    assert f"--kind {canary} --seed 0 --index {failed[0].index}" in report
    assert failed[0].mutation in report


def test_the_semantic_operators_change_meaning_not_bytes_checksums(tmp_path):
    """``zarr-codec`` edits one array's metadata (its JSON still valid, nothing else touched) and
    names what it did; ``path-form`` touches no file; both the same for one seed every time."""
    import numpy as np

    import jax_ucp

    src = tmp_path / "ck"
    jax_ucp.save(src, {"w": np.arange(12, dtype=np.float32).reshape(3, 4)}, compression="zstd")

    def files(root):
        return {
            os.path.relpath(os.path.join(d, f), root): open(os.path.join(d, f), "rb").read()
            for d, _, fs in os.walk(root)
            for f in fs
        }

    before = files(src)
    described = []
    for attempt in range(2):
        work = tmp_path / f"w{attempt}"
        shutil.copytree(src, work)
        m = mutations.mutate(
            str(work), random.Random("s/1"), str(tmp_path / "out"), ops=["zarr-codec"]
        )
        after = files(work)
        changed = [k for k in before if before[k] != after[k]]
        assert changed == ["arrays/w/zarr.json"] and m.target == changed[0], (m, changed)
        json.loads(after[changed[0]])
        described.append(m.describe())
        p = mutations.mutate(
            str(work), random.Random("s/2"), str(tmp_path / "out"), ops=["path-form"]
        )
        assert p.op == "path-form" and p.detail in mutations.PATH_FORMS and files(work) == after
    assert described[0] == described[1]


def test_record_swap_keeps_every_digest_and_array_out_every_byte(tmp_path):
    """``record-swap`` trades two listed files and their digests (integrity.json: each digest
    still the file's), or two same-shape tensors' folders and digests in ucp.json (nothing else
    touched); ``array-out`` leaves every array readable with the same bytes, from outside."""
    import hashlib

    import numpy as np

    import jax_ucp

    src = tmp_path / "mc"
    os.makedirs(src)
    for name, data in (("__0_0.distcp", b"rank zero"), ("__1_0.distcp", b"rank one!")):
        (src / name).write_bytes(data)
    files = {n: hashlib.sha256((src / n).read_bytes()).hexdigest() for n in os.listdir(src)}
    (src / "integrity.json").write_text(json.dumps({"algorithm": "sha256", "files": files}))
    m = mutations.mutate(str(src), random.Random("r/1"), str(tmp_path / "o"), ["record-swap"])
    record = json.loads((src / "integrity.json").read_text())["files"]
    assert m.op == "record-swap" and (src / "__0_0.distcp").read_bytes() == b"rank one!"
    assert all(hashlib.sha256((src / n).read_bytes()).hexdigest() == d for n, d in record.items())

    ck = tmp_path / "ck"
    w = np.arange(16, dtype=np.float32).reshape(4, 4)
    jax_ucp.save(ck, {"a": w, "b": -w, "c": np.ones(3, np.float32)})
    before = json.loads((ck / "ucp.json").read_text())
    m = mutations.mutate(str(ck), random.Random("r/2"), str(tmp_path / "o"), ["record-swap"])
    after = json.loads((ck / "ucp.json").read_text())
    dirs = {e["key"][0]: (e["dir"], e["shard_digests"]) for e in after["entries"]}
    old = {e["key"][0]: (e["dir"], e["shard_digests"]) for e in before["entries"]}
    assert m.target == "ucp.json" and dirs == {"a": old["b"], "b": old["a"], "c": old["c"]}
    for seed in range(6):  # every way: a folder or a chunk linked out, ".." in the dir
        copy = tmp_path / f"ck{seed}"
        shutil.copytree(ck, copy)
        m = mutations.mutate(str(copy), random.Random(seed), str(tmp_path / f"o{seed}"),
                             ["array-out"])  # fmt: skip
        assert m.op == "array-out", m.describe()
        assert os.path.islink(copy / m.target) or ".." in (copy / "ucp.json").read_text()
        outside = {os.path.relpath(os.path.join(d, f), tmp_path / f"o{seed}")
                   for d, _, fs in os.walk(tmp_path / f"o{seed}") for f in fs}  # fmt: skip
        assert outside, m.describe()


def test_a_consistent_record_swap_is_counted_apart_only_when_tensor_bytes_alone_differ():
    other = {"params/w": ["tensor", [2], "float32", "bb"], "step": ["value", "3"]}
    args = {"kind": SUMMED, "mutation_op": "record-swap", "names": NAMES}
    assert oracle.judge_entry("restore", BASE, _ok(other), **args)[0] == "record-consistent"
    moved = {**other, "step": ["value", "4"]}
    assert oracle.judge_entry("restore", BASE, _ok(moved), **args)[0] == "silent-wrong"
    assert oracle.judge_entry("verify", BASE, _ok(other), **args)[0] == "silent-wrong"


def test_a_disagreement_passes_only_refused_naming_both_records_or_said():
    """``record-disagree`` (one record of a fact edited): the continuation as the intact copy's,
    nothing said, is a reader that read only the other records (*disagreement-unseen*); a
    refusal must name the record edited and another file; a new warning naming the edited one
    is *said*. ``settings-rewrite``: ``verify --against`` must name the setting it changed."""
    from tests.hostile.mutations import Mutation

    base = _ok({"params": {}, "update": "A"})
    edited = Mutation("record-disagree", "global_step3/mp_rank_00_model_states.pt", "clip")
    names = NAMES | {"mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_optim_states.pt"}
    args = {"kind": PLAIN, "mutation_op": "record-disagree", "names": names, "mutation": edited}
    judge = oracle.judge_entry
    assert judge("optax-direct", base, base, **args)[0] == "disagreement-unseen"
    assert judge("convert", base, base, **args)[0] == "same"  # holds no settings
    warned = _ok(base[1], ["UserWarning: mp_rank_00_model_states.pt says 0, its ranks 1.0"])
    assert judge("optax-direct", base, warned, **args)[0] == "said"
    one = ("error", "SourceError", "mp_rank_00_model_states.pt: clipping 0", True)
    assert judge("optax-direct", base, one, **args)[0] == "unnamed-record"
    both = ("error", "SourceError", one[2] + ", zero_pp_rank_0_mp_rank_00_optim_states.pt 1.0",
            True)  # fmt: skip
    assert judge("optax-direct", base, both, **args)[0] == "refused"
    rewrite = Mutation("settings-rewrite", "ucp.json", "source.trainer.max_steps changed")
    args = {"kind": SUMMED, "mutation_op": "settings-rewrite", "names": NAMES, "mutation": rewrite}
    intact = _ok("intact")
    said = _ok("reported: source.trainer.max_steps")
    assert judge("verify-against", intact, said, **args)[0] == "reported"
    assert judge("verify-against", intact, _ok("reported: w"), **args)[0] == "unnamed-setting"
    cli = ("error", "CLI exit", "/work/in/src: ucp.json records source.optimizer ...", True)
    assert judge("cli-verify-against", _ok("exit 0"), cli, **args)[0] == "unnamed-setting"
    gone = Mutation("settings-rewrite", "ucp.json", "source.certificate removed")
    cli = ("error", "CLI exit", "/work/in/src: certificate: no\ncertificate recorded", True)
    args["mutation"] = gone
    assert judge("cli-verify-against", _ok("exit 0"), cli, **args)[0] == "refused"


def test_linked_path_out_links_an_array_out_and_names_a_path_through_links(tmp_path):
    """``linked-path-out``: one array's folder or chunk moved out of the input (same bytes) and
    linked back; the detail starts with the path form (a linked parent or a link to the input)
    the child hands the entry points."""
    import numpy as np

    import jax_ucp

    ck = tmp_path / "ck"
    jax_ucp.save(ck, {"a": np.arange(4, dtype=np.float32), "b": np.ones(3, np.float32)})
    for seed in range(4):
        copy = tmp_path / f"ck{seed}"
        shutil.copytree(ck, copy)
        m = mutations.mutate(str(copy), random.Random(seed), str(tmp_path / f"o{seed}"),
                             ["linked-path-out"])  # fmt: skip
        assert m.op == "linked-path-out" and os.path.islink(copy / m.target), m.describe()
        assert m.detail.split(";")[0] in mutations.PATH_FORMS[-2:]
        assert os.listdir(tmp_path / f"o{seed}")
