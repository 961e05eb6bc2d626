"""Resume a preempted job from the last good step: ``restore(run_root, step="latest")`` and
``jax_ucp.latest_step`` take the newest committed, readable step of a CheckpointManager root;
``fallback=True`` moves on to older steps, each with a warning naming it and why; a step still
being written, or killed mid-save, is never taken."""

from __future__ import annotations

import glob
import json
import os
import shutil
import warnings

import numpy as np
import orbax.checkpoint as ocp
import pytest

import jax_ucp


def _run(root, steps=(1, 2, 3)) -> None:
    with ocp.CheckpointManager(root) as mngr:
        for s in steps:
            state = {"w": np.full((4, 4), float(s), np.float32), "step": s}
            mngr.save(s, args=ocp.args.Composite(state=jax_ucp.UCPSave(state)))
        mngr.wait_until_finished()


def _flip_a_shard_byte(step_dir) -> None:
    shard = next(
        f
        for f in glob.glob(os.path.join(step_dir, "state", "arrays", "**"), recursive=True)
        if os.path.isfile(f) and not f.endswith("zarr.json")
    )
    raw = bytearray(open(shard, "rb").read())
    raw[len(raw) // 3] ^= 0x10
    open(shard, "wb").write(bytes(raw))


def test_latest_is_the_newest_committed_step(tmp_path):
    root = str(tmp_path / "run")
    _run(root)
    assert jax_ucp.latest_step(root) == 3
    got = jax_ucp.restore(root, step="latest")
    assert got["step"] == 3 and float(got["w"][0, 0]) == 3.0
    assert jax_ucp.restore(root, step=2)["step"] == 2
    with pytest.raises(jax_ucp.UCPError, match=r"no committed step 7 .*committed: 3, 2, 1"):
        jax_ucp.restore(root, step=7)


def test_a_step_killed_mid_save_or_still_being_written_is_never_taken(tmp_path):
    """Orbax's temporary step folder (a save in progress, or one SIGKILLed), and a step folder
    whose commit was never recorded: skipped without a word, they are not checkpoints yet."""
    root = str(tmp_path / "run")
    _run(root)
    # a live (or killed) save of step 4: Orbax writes it under a temporary name
    shutil.copytree(os.path.join(root, "3"), os.path.join(root, "4.orbax-checkpoint-tmp-1234"))
    # a step 5 folder whose commit Orbax never recorded
    shutil.copytree(os.path.join(root, "3"), os.path.join(root, "5"))
    os.remove(os.path.join(root, "5", "commit_success.txt"))
    meta = os.path.join(root, "5", "_CHECKPOINT_METADATA")
    text = open(meta).read()
    d = json.loads(text)
    d["commit_timestamp_nsecs"] = None
    open(meta, "w").write(json.dumps(d))
    assert jax_ucp.latest_step(root) == 3
    assert jax_ucp.restore(root, step="latest")["step"] == 3


def test_a_damaged_latest_step_is_an_error_unless_fallback_then_warned(tmp_path):
    root = str(tmp_path / "run")
    _run(root)
    _flip_a_shard_byte(os.path.join(root, "3"))
    with pytest.raises(jax_ucp.UCPError, match=r"latest committed step 3 cannot be read.*fallback"):
        jax_ucp.restore(root, step="latest")
    with pytest.warns(jax_ucp.ResumeWarning, match=r"step 3 skipped"):
        got = jax_ucp.restore(root, step="latest", fallback=True)
    assert got["step"] == 2 and float(got["w"][0, 0]) == 2.0


def test_a_step_missing_a_shard_file_is_passed_over_by_latest_step(tmp_path):
    root = str(tmp_path / "run")
    _run(root)
    shard = next(
        f
        for f in glob.glob(os.path.join(root, "3", "state", "arrays", "**"), recursive=True)
        if os.path.isfile(f) and not f.endswith("zarr.json")
    )
    os.remove(shard)
    with pytest.raises(jax_ucp.UCPError, match=r"step 3 cannot be read.*missing"):
        jax_ucp.latest_step(root)
    with pytest.warns(jax_ucp.ResumeWarning, match=r"step 3 skipped"):
        assert jax_ucp.latest_step(root, fallback=True) == 2


def test_fallback_goes_with_latest_only():
    with pytest.raises(jax_ucp.UCPError, match=r"fallback.*step='latest'"):
        jax_ucp.restore("/nonexistent", step=3, fallback=True)


def test_inside_a_manager_the_latest_good_step_goes_to_mngr_restore(tmp_path):
    root = str(tmp_path / "run")
    _run(root)
    _flip_a_shard_byte(os.path.join(root, "3"))
    os.remove(  # step 3 now also lacks a shard: latest_step sees it without reading data
        next(
            f
            for f in glob.glob(os.path.join(root, "3", "state", "arrays", "**"), recursive=True)
            if os.path.isfile(f) and not f.endswith("zarr.json")
        )
    )
    with pytest.warns(jax_ucp.ResumeWarning):
        step = jax_ucp.latest_step(root, fallback=True)
    with ocp.CheckpointManager(root) as mngr:
        got = mngr.restore(step, args=ocp.args.Composite(state=jax_ucp.UCPRestore()))
    assert step == 2 and got["state"]["step"] == 2
    with pytest.raises(jax_ucp.UCPError, match=r"mngr.restore's first argument"):
        jax_ucp.UCPRestore(step="latest")


def _copy_step(root, src, dst, value) -> None:
    """A copy of step ``src`` named ``dst`` (committed, as Orbax left it) holding ``value``."""
    shutil.copytree(os.path.join(root, src), os.path.join(root, dst))
    jax_ucp.save(
        os.path.join(root, dst, "state"),
        {"w": np.full((4, 4), float(value), np.float32), "step": value},
        force=True,
    )


def test_a_step_folder_linked_to_another_run_is_never_restored(tmp_path):
    """``run/4 -> other/4``: the other run's values were restored by step="latest" and step=4;
    now a link step is refused, and passed over (warned) only with fallback."""
    root, other = str(tmp_path / "run"), str(tmp_path / "other")
    _run(root)
    _run(other, steps=(4,))
    os.symlink(os.path.join(other, "4"), os.path.join(root, "4"))
    with pytest.raises(jax_ucp.CheckpointError, match=r"step 4 cannot be read.*is a link"):
        jax_ucp.restore(root, step="latest")
    with pytest.raises(jax_ucp.CheckpointError, match=r"step 4 cannot be read.*is a link"):
        jax_ucp.restore(root, step=4)
    with pytest.raises(jax_ucp.CheckpointError, match=r"step 4 cannot be read.*is a link"):
        jax_ucp.latest_step(root)
    with pytest.warns(jax_ucp.ResumeWarning, match=r"step 4 skipped.*is a link"):
        assert jax_ucp.restore(root, step="latest", fallback=True)["step"] == 3


def test_a_link_named_like_a_step_is_refused_without_a_read_through_it(tmp_path):
    """Listing a run's steps opened ``_CHECKPOINT_METADATA`` through a step folder that is a
    link (to ask whether it was committed), before refusing the link: a read outside the root
    (harness ``megatron`` seed 11 #15: a Megatron ``iter_0000002`` linked out, read by a
    direct restore's question "is this a run root?"). Now the link is refused unread."""
    from tests.hostile.spy import watch_opens

    root, other = str(tmp_path / "run"), str(tmp_path / "other")
    _run(root)
    _run(other, steps=(4,))
    marker = os.path.join(other, "4", "commit_success.txt")  # committed by its metadata alone
    if os.path.exists(marker):
        os.remove(marker)
    os.symlink(os.path.join(other, "4"), os.path.join(root, "4"))
    opened = []
    with watch_opens(lambda path, writing: opened.append(os.path.realpath(str(path)))):
        with pytest.raises(jax_ucp.CheckpointError, match=r"step 4 cannot be read.*is a link"):
            jax_ucp.latest_step(root)
        with pytest.raises(jax_ucp.CheckpointError, match=r"step 4 cannot be read.*is a link"):
            jax_ucp.restore(root, step="latest")
    assert not [p for p in opened if p.startswith(os.path.realpath(other))], opened


def test_a_step_metadata_linked_out_is_refused_unread(tmp_path):
    """Step 3's ``_CHECKPOINT_METADATA`` moved out and linked back was read through the link
    (is the step committed? which handlers?) by latest_step and every restore of the root
    (harness ``orbax_manager_step`` seed 31 #30). Now the step is refused naming the link, never
    read; fallback=True passes over it with a warning."""
    from tests.hostile.spy import watch_opens

    root, outside = str(tmp_path / "run"), str(tmp_path / "outside")
    _run(root)
    os.makedirs(outside)
    meta = os.path.join(root, "3", "_CHECKPOINT_METADATA")
    shutil.move(meta, os.path.join(outside, "meta"))
    os.symlink(os.path.join("..", "..", "outside", "meta"), meta)
    opened = []
    said = r"step 3 cannot be read.*_CHECKPOINT_METADATA is a link"
    with watch_opens(lambda path, writing: opened.append(os.path.realpath(str(path)))):
        with pytest.raises(jax_ucp.CheckpointError, match=said):
            jax_ucp.latest_step(root)
        with pytest.raises(jax_ucp.CheckpointError, match=said):
            jax_ucp.restore(root, step="latest")
        with pytest.warns(jax_ucp.ResumeWarning, match=r"step 3 skipped.*is a link"):
            assert jax_ucp.restore(root, step="latest", fallback=True)["step"] == 2
    assert not [p for p in opened if p.startswith(os.path.realpath(outside))], opened


def test_step_metadata_nested_past_the_parsers_depth_is_no_raw_error(tmp_path):
    """``item_handlers`` nested 100 000 deep in step 3's ``_CHECKPOINT_METADATA`` raised a raw
    RecursionError from every resume (harness ``run_root`` seed 31 #24); now it is metadata that
    cannot be read, as any other JSON that does not parse."""
    root = str(tmp_path / "run")
    _run(root)
    meta = os.path.join(root, "3", "_CHECKPOINT_METADATA")
    record = json.load(open(meta))
    text = json.dumps({**record, "item_handlers": None})
    open(meta, "w").write(text.replace("null", "[" * 100_000 + "]" * 100_000))
    assert jax_ucp.latest_step(root) == 3  # committed by Orbax's commit_success.txt
    assert jax_ucp.restore(root, step="latest")["step"] == 3


def test_two_steps_items_swapped_are_never_restored_as_each_other(tmp_path):
    """Step 2's and step 3's ``state/`` folders traded places (each a complete, intact
    checkpoint): step="latest" restored step 2's values as step 3 (harness ``run_root`` seed 37
    #33). The handler records which step's item it wrote (``source.orbax_item``); every resume
    and Orbax's own restore refuse an item found under another step, fallback passes over both
    to step 1, and an item copied out of its run still restores by its path."""
    root = str(tmp_path / "run")
    _run(root)
    assert jax_ucp.inspect(os.path.join(root, "3", "state")).source["orbax_item"] == "3/state"
    a, b, tmp = (os.path.join(root, n, "state") for n in ("2", "3", "2"))
    os.rename(a, tmp + ".x")
    os.rename(b, a)
    os.rename(tmp + ".x", b)
    item_said = r"3/state: saved as '2/state' of its run"
    said = r"step 3 cannot be read: .*" + item_said
    with pytest.raises(jax_ucp.CheckpointError, match=said):
        jax_ucp.latest_step(root)
    with pytest.raises(jax_ucp.CheckpointError, match=said):
        jax_ucp.restore(root, step="latest")
    with pytest.raises(jax_ucp.CheckpointError, match=said):
        jax_ucp.restore(root, step=3)
    with (
        ocp.CheckpointManager(root) as mngr,
        pytest.raises(jax_ucp.CheckpointError, match=item_said),
    ):
        mngr.restore(3, args=ocp.args.Composite(state=jax_ucp.UCPRestore()))
    with pytest.warns(jax_ucp.ResumeWarning, match=r"step 3 skipped"):
        assert jax_ucp.restore(root, step="latest", fallback=True)["step"] == 1
    with pytest.warns(jax_ucp.ResumeWarning, match=r"step 2 skipped"):
        assert jax_ucp.latest_step(root, fallback=True) == 1
    copied = shutil.copytree(b, tmp_path / "kept")  # out of its run: its path says what it is
    assert jax_ucp.restore(copied)["step"] == 2


def test_a_step_copied_over_is_refused_but_a_step_renamed_or_moved_is_its_new_name(tmp_path):
    """Step 3 copied as step 4 (Orbax lists 4 as the newest) is step 3's item: refused, by the
    resume and by Orbax's restore. A step folder renamed (nothing else of the run named so) and
    an item moved out of its run with its step folder are the user's names: restored."""
    root = str(tmp_path / "run")
    _run(root)
    shutil.copytree(os.path.join(root, "3"), os.path.join(root, "4"))
    with pytest.raises(jax_ucp.CheckpointError, match=r"4/state: saved as '3/state'") as e:
        jax_ucp.restore(root, step="latest")
    item = os.path.join(root, "4", "state")  # the way the refusal names, to restore it on purpose
    assert f"jax_ucp.restore({item!r})" in str(e.value)
    assert jax_ucp.restore(item)["step"] == 3
    copied_over = r"4/state: saved as '3/state'"
    with (
        ocp.CheckpointManager(root) as mngr,
        pytest.raises(jax_ucp.CheckpointError, match=copied_over),
    ):
        mngr.restore(4, args=ocp.args.Composite(state=jax_ucp.UCPRestore()))
    shutil.rmtree(os.path.join(root, "3"))  # now 4 is a rename of 3
    assert jax_ucp.restore(root, step="latest")["step"] == 3
    with ocp.CheckpointManager(root) as mngr:
        got = mngr.restore(4, args=ocp.args.Composite(state=jax_ucp.UCPRestore()))
    assert got["state"]["step"] == 3
    moved = shutil.move(os.path.join(root, "2"), tmp_path / "best")
    handler = jax_ucp.UCPCheckpointHandler()
    assert handler.restore(os.path.join(moved, "state"), args=jax_ucp.UCPRestore())["step"] == 2


@pytest.mark.parametrize("recorded", [5, "", "../3/state", "2\x00/state"])
def test_a_hostile_orbax_item_record_is_refused_never_followed(tmp_path, recorded):
    """``source.orbax_item`` is read from the item's own manifest: a value that is no step
    folder's name (a number, empty, a ``..`` or NUL part) is another step's claim, refused;
    it never becomes a path looked up outside the run."""
    root = str(tmp_path / "run")
    _run(root)
    manifest = os.path.join(root, "3", "state", "ucp.json")
    record = json.load(open(manifest))
    record["source"]["orbax_item"] = recorded
    open(manifest, "w").write(json.dumps(record))
    with pytest.raises(jax_ucp.CheckpointError, match=r"step 3 cannot be read: .*saved as"):
        jax_ucp.restore(root, step="latest")


def test_a_step_written_by_convert_records_its_item(tmp_path):
    """convert(step=N) writes through the same handler: its item records ``N/state``."""
    src = os.path.join(os.path.dirname(__file__), "..", "fixtures", "torch", "plain_state_dict.pt")
    out = jax_ucp.convert(src, tmp_path / "run", step=5)
    assert jax_ucp.inspect(out).source["orbax_item"] == "5/state"
    assert jax_ucp.latest_step(tmp_path / "run") == 5


def test_an_item_folder_linked_out_of_its_step_is_never_restored(tmp_path):
    root, other = str(tmp_path / "run"), str(tmp_path / "other")
    _run(root)
    _run(other, steps=(9,))
    shutil.rmtree(os.path.join(root, "3", "state"))
    os.symlink(os.path.join(other, "9", "state"), os.path.join(root, "3", "state"))
    with pytest.raises(jax_ucp.CheckpointError, match=r"latest committed step 3 .*state"):
        jax_ucp.restore(root, step="latest")
    with pytest.raises(jax_ucp.CheckpointError, match=r"step 3 cannot be read"):
        jax_ucp.restore(root, step=3)
    with pytest.warns(jax_ucp.ResumeWarning, match=r"step 3 skipped"):
        assert jax_ucp.restore(root, step="latest", fallback=True)["step"] == 2


@pytest.mark.parametrize("name", ["١٢", "１３", "²", "step_٤"])
def test_a_step_name_in_other_digits_is_never_a_step(tmp_path, name):
    """``str.isdigit`` took ``١٢`` (Arabic-Indic) as step 12 and ``１３`` (fullwidth) as 13:
    "latest" restored the planted folder while Orbax's manager lists [1, 2, 3]; ``²`` was a raw
    ValueError for every resume. Now they are named in a ResumeWarning and ignored."""
    root = str(tmp_path / "run")
    _run(root)
    _copy_step(root, "3", name, 99)
    with pytest.warns(jax_ucp.ResumeWarning, match=r"not a step \(a step number is written in"):
        got = jax_ucp.restore(root, step="latest")
    assert got["step"] == 3
    with pytest.warns(jax_ucp.ResumeWarning, match=name):
        assert jax_ucp.latest_step(root) == 3
    with ocp.CheckpointManager(root) as mngr:
        assert mngr.latest_step() == 3


def test_fixed_length_step_names_and_a_stray_are_reported_not_chosen(tmp_path):
    """A run saved with ``step_format_fixed_length=4`` (0005, 0012) plus a stray ``12`` holding
    other values: "latest" returned the stray while Orbax restores 0012. The root alone cannot
    say which format the manager uses: an error naming both; the manager's own format (passed
    as the manager) takes 0012 and names the stray."""
    root = str(tmp_path / "run")
    options = ocp.CheckpointManagerOptions(step_format_fixed_length=4)
    with ocp.CheckpointManager(root, options=options) as mngr:
        for s in (5, 12):
            state = {"w": np.full((4, 4), float(s), np.float32), "step": s}
            mngr.save(s, args=ocp.args.Composite(state=jax_ucp.UCPSave(state)))
        mngr.wait_until_finished()
    assert jax_ucp.restore(root, step="latest")["step"] == 12  # 0012, no stray yet
    _copy_step(root, "0012", "12", 99)
    with pytest.raises(jax_ucp.CheckpointError, match=r"two formats \(0005, 0012 zero-padded; 12"):
        jax_ucp.restore(root, step="latest")
    with pytest.raises(jax_ucp.CheckpointError, match=r"step_format_fixed_length"):
        jax_ucp.latest_step(root)
    with ocp.CheckpointManager(root, options=options) as mngr:
        with pytest.warns(jax_ucp.ResumeWarning, match=r"/12: not a step of this run.*'1234'"):
            step = jax_ucp.latest_step(mngr)
        got = mngr.restore(step, args=ocp.args.Composite(state=jax_ucp.UCPRestore()))
    assert step == 12 and got["state"]["step"] == 12


def test_a_step_prefix_is_the_managers_own(tmp_path):
    """Steps named ``ckpt_0005`` (``step_prefix`` and a fixed length) were no steps at all
    ("no committed step"); they resume like any run."""
    root = str(tmp_path / "run")
    options = ocp.CheckpointManagerOptions(step_prefix="ckpt", step_format_fixed_length=4)
    with ocp.CheckpointManager(root, options=options) as mngr:
        for s in (5, 7):
            state = {"w": np.full((4, 4), float(s), np.float32), "step": s}
            mngr.save(s, args=ocp.args.Composite(state=jax_ucp.UCPSave(state)))
        mngr.wait_until_finished()
        assert jax_ucp.latest_step(mngr) == 7
    assert jax_ucp.latest_step(root) == 7
    assert jax_ucp.restore(root, step="latest")["step"] == 7
    assert jax_ucp.restore(root, step=5)["step"] == 5


def test_a_committed_step_without_its_manifest_is_damage_not_skipped(tmp_path):
    """Orbax committed step 3 (commit timestamp in ``_CHECKPOINT_METADATA``, its item recorded
    with jax_ucp's handler) but its ucp.json is gone: step="latest" silently restored step 2."""
    root = str(tmp_path / "run")
    _run(root)
    os.remove(os.path.join(root, "3", "state", "ucp.json"))
    with pytest.raises(
        jax_ucp.CheckpointError, match=r"step 3 cannot be read.*ucp.json is missing"
    ):
        jax_ucp.restore(root, step="latest")
    with pytest.raises(jax_ucp.CheckpointError, match=r"step 3 cannot be read.*ucp.json"):
        jax_ucp.latest_step(root)
    with pytest.warns(jax_ucp.ResumeWarning, match=r"step 3 skipped.*ucp.json is missing"):
        assert jax_ucp.restore(root, step="latest", fallback=True)["step"] == 2


def test_latest_step_and_restore_latest_take_the_same_step(tmp_path):
    """A flipped byte in the newest step: ``latest_step(fallback=True)`` checked sizes only and
    returned it, while ``restore(step="latest", fallback=True)`` skipped it; a job restarting
    through ``mngr.restore(latest_step(...))`` crashed on every restart."""
    root = str(tmp_path / "run")
    _run(root)
    _flip_a_shard_byte(os.path.join(root, "3"))
    with pytest.warns(jax_ucp.ResumeWarning, match=r"step 3 skipped"):
        restored = jax_ucp.restore(root, step="latest", fallback=True)
    with pytest.warns(jax_ucp.ResumeWarning, match=r"step 3 skipped"):
        step = jax_ucp.latest_step(root, fallback=True)
    assert step == restored["step"] == 2
    with ocp.CheckpointManager(root) as mngr:
        with pytest.warns(jax_ucp.ResumeWarning, match=r"step 3 skipped"):
            step = jax_ucp.latest_step(mngr, fallback=True)
        got = mngr.restore(step, args=ocp.args.Composite(state=jax_ucp.UCPRestore()))
    assert step == 2 and float(got["state"]["w"][0, 0]) == 2.0


def test_a_step_deleted_by_retention_while_read_is_not_damage(tmp_path):
    """A live manager (``max_to_keep``) saves steps 4 and 5 and deletes step 3 while a resume
    reads step 3: that was "cannot be read" (or, with fallback, a warning calling step 3
    unreadable and the older step 2). Now the steps are listed again: step 5, no warning."""
    root = str(tmp_path / "run")
    _run(root)
    calls = []

    def retention_meanwhile(name: str) -> bool:
        if not calls:
            _copy_step(root, "3", "5", 5)
            shutil.rmtree(os.path.join(root, "3"))
        calls.append(name)
        return True

    for fallback in (False, True):
        calls.clear()
        if not os.path.exists(os.path.join(root, "3")):
            _copy_step(root, "2", "3", 3)
        with warnings.catch_warnings():
            warnings.simplefilter("error", jax_ucp.ResumeWarning)
            got = jax_ucp.restore(
                root, step="latest", fallback=fallback, select=retention_meanwhile
            )
        assert got["step"] == 5 and float(got["w"][0, 0]) == 5.0
        shutil.rmtree(os.path.join(root, "5"))


def test_a_step_holding_two_ucp_items_is_not_restored_by_its_first(tmp_path):
    root = str(tmp_path / "run")
    with ocp.CheckpointManager(root) as mngr:
        mngr.save(
            1,
            args=ocp.args.Composite(
                ema=jax_ucp.UCPSave({"w": np.zeros(2)}), state=jax_ucp.UCPSave({"w": np.ones(2)})
            ),
        )
        mngr.wait_until_finished()
    with pytest.raises(jax_ucp.CheckpointError, match=r"several UCP items \['ema', 'state'\]"):
        jax_ucp.restore(root, step="latest")
    assert jax_ucp.latest_step(root) == 1


def test_latest_step_of_something_else_is_a_request_error():
    with pytest.raises(jax_ucp.RequestError, match=r"run_root=.*got int"):
        jax_ucp.latest_step(123)
