"""``commit.transaction``: the one commit of save, convert, export and manager steps.

A failure inside leaves the previous checkpoint whole and removes (and logs) the temporary; an
interrupted swap is recovered on entry; the lock refuses a second writer of the same path
(exports included); every writer stages under one temporary-name scheme.
"""

from __future__ import annotations

import logging
import os
import socket
import subprocess
import sys
import textwrap
import threading

import numpy as np
import pytest

import jax_ucp
from jax_ucp import exporters
from jax_ucp._src.exporters import OrbaxExport, SafetensorsExport, TorchDcpExport, options_for
from jax_ucp._src.orbax.manager_step import write_manager_step
from jax_ucp._src.store.storage import local
from jax_ucp._src.writer import HostItem, commit, write_host_checkpoint
from jax_ucp.errors import RequestError
from tests.ucp_testing import REPO, assert_bit_exact
from tests.ucp_testing import TREE_W as W
from tests.ucp_testing import save_small_tree as _save
from tests.ucp_testing import tree_digest as _digest

pytestmark = pytest.mark.timeout(120)


def _messages(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name.startswith("jax_ucp")]


def _items(value: float, n: int = 3):
    return iter([HostItem(("params", f"w{i}"), np.full(4, value, np.float32)) for i in range(n)])


def test_a_failure_inside_keeps_the_previous_checkpoint_and_logs_the_removal(tmp_path, caplog):
    dest = str(tmp_path / "ck")
    write_host_checkpoint(dest, _items(1.0))
    caplog.set_level(logging.INFO, logger="jax_ucp")
    with (
        pytest.raises(RuntimeError, match="writer broke"),
        commit.transaction(dest, force=True, kind="import") as tx,
    ):
        assert tx.replacing and tx.staged
        assert os.path.basename(tx.path).startswith(
            f"ck{local.TMP_MARK}{socket.gethostname()}.{os.getpid()}."
        )
        with open(os.path.join(tx.path, "half-written"), "w") as f:
            f.write("x")
        raise RuntimeError("writer broke")
    assert sorted(os.listdir(tmp_path)) == ["ck"]
    assert f"removing {tx.path} (temporary directory of a failed import)" in _messages(caplog)
    assert_bit_exact(jax_ucp.restore(dest)["params"]["w0"], np.full(4, 1.0, np.float32))


def test_a_failed_commit_is_discarded_and_an_explicit_commit_is_not_repeated(
    tmp_path, caplog, monkeypatch
):
    dest = str(tmp_path / "ck")
    write_host_checkpoint(dest, _items(1.0))

    def io_error(root):
        raise OSError(5, "Input/output error", root)

    monkeypatch.setattr(local, "make_durable", io_error)
    caplog.set_level(logging.INFO, logger="jax_ucp")
    with pytest.raises(OSError, match="Input/output error"):
        write_host_checkpoint(dest, _items(2.0), force=True)
    assert sorted(os.listdir(tmp_path)) == ["ck"]
    assert any(
        m.startswith(f"removing {dest}{local.TMP_MARK}")
        and m.endswith("(temporary directory of a failed import)")
        for m in _messages(caplog)
    )
    assert_bit_exact(jax_ucp.restore(dest)["params"]["w0"], np.full(4, 1.0, np.float32))
    monkeypatch.undo()
    with commit.transaction(dest, force=True) as tx:
        write_host_checkpoint(tx.path + "-x", _items(3.0))
        os.rmdir(tx.path)
        os.rename(tx.path + "-x", tx.path)  # a checkpoint written elsewhere, moved in (test only)
        tx.commit()
        assert tx.committed and not os.path.exists(tx.path)
        assert_bit_exact(jax_ucp.restore(dest)["params"]["w0"], np.full(4, 3.0, np.float32))
    assert sorted(os.listdir(tmp_path)) == ["ck"]  # the block's end did not commit again


def test_an_interrupted_swap_is_completed_on_entry(tmp_path, caplog):
    """Killed between the two renames of a forced save: the path is missing, the new checkpoint
    sits at ``.ucp-replacing``; the next transaction puts it in place before it checks ``force``."""
    dest = str(tmp_path / "ck")
    write_host_checkpoint(dest, _items(2.0))
    os.rename(dest, dest + local.REPLACING)
    caplog.set_level(logging.INFO, logger="jax_ucp")
    with (
        pytest.raises(FileExistsError, match="pass force=True"),
        commit.transaction(dest, force=False),
    ):
        pass
    assert sorted(os.listdir(tmp_path)) == ["ck"]
    assert f"completing an interrupted replacement: {dest}{local.REPLACING} -> {dest}" in (
        _messages(caplog)
    )
    assert_bit_exact(jax_ucp.restore(dest)["params"]["w1"], np.full(4, 2.0, np.float32))


def test_leftovers_of_a_swap_beside_a_whole_checkpoint_are_removed(tmp_path):
    dest = str(tmp_path / "ck")
    write_host_checkpoint(dest, _items(3.0))
    write_host_checkpoint(dest + local.REPLACED, _items(0.0))
    write_host_checkpoint(dest, _items(4.0), force=True)
    assert sorted(os.listdir(tmp_path)) == ["ck"]
    assert_bit_exact(jax_ucp.restore(dest)["params"]["w2"], np.full(4, 4.0, np.float32))


def test_a_second_writer_of_the_path_is_refused_export_included(tmp_path):
    ck = str(tmp_path / "ck")
    jax_ucp.save(ck, {"params": {"w": np.ones(4, np.float32)}})
    out = str(tmp_path / "out")
    with local.save_lock(out):
        with pytest.raises(RequestError, match=r"another save.*in progress"):
            jax_ucp.export(ck, out)
        with pytest.raises(RequestError, match=r"another save.*in progress"):
            jax_ucp.export(ck, out, OrbaxExport())
        with pytest.raises(commit.SaveConflictError, match=r"another save.*path"):
            write_host_checkpoint(out, _items(1.0))
    assert sorted(os.listdir(tmp_path)) == ["ck"]
    jax_ucp.export(ck, out)  # the lock released: the same export goes through
    assert sorted(os.listdir(out)) == [commit.EXPORT_RECORD, "model.safetensors"]


def test_a_manager_step_is_staged_under_the_same_temporary_name(tmp_path):
    root = str(tmp_path / "run")
    seen = []

    def items(value):
        for i in range(2):
            seen.append(sorted(os.listdir(root)))
            yield HostItem(("params", f"w{i}"), np.full(3, value, np.float32))

    write_manager_step(root, items(1.0), step=7)
    prefix = f"7{local.TMP_MARK}{socket.gethostname()}.{os.getpid()}."
    lock = f".7{local.LOCK_SUFFIX}"  # held while the step is written
    assert len(seen[0]) == 2 and seen[0][0] == lock and seen[0][1].startswith(prefix)
    assert sorted(os.listdir(root)) == ["7"]
    seen.clear()
    write_manager_step(root, items(2.0), step=7, force=True)  # replaced: swapped in
    assert seen[0][:2] == [lock, "7"] and seen[0][2].startswith(prefix)
    assert sorted(os.listdir(root)) == ["7"]
    back = jax_ucp.restore(os.path.join(root, "7", "state"))
    assert_bit_exact(back["params"]["w1"], np.full(3, 2.0, np.float32))


def test_export_options_are_checked_once(tmp_path):
    with pytest.raises(RequestError, match=r"casting='sometimes': choose from"):
        TorchDcpExport(casting="sometimes")
    with pytest.raises(RequestError, match=r"max_file_bytes.*positive.*got 0"):
        SafetensorsExport(max_file_bytes=0)
    with pytest.raises(jax_ucp.UCPError, match=r"memory_budget.*positive"):
        SafetensorsExport(memory_budget=-1)
    with pytest.raises(TypeError, match="config"):
        TorchDcpExport(config={"a": 1})  # type: ignore[call-arg]  # not a DCP option
    options = SafetensorsExport(dtype="float16", memory_budget="64MiB")
    assert options.dtype == np.dtype(np.float16) and options.prefix == "params"
    assert options.memory_budget == 64 << 20
    assert TorchDcpExport().prefix == ""
    with pytest.raises(AttributeError):
        options.force = True  # type: ignore[misc]  # frozen
    assert options_for("torch-dcp", select="params") == TorchDcpExport(select="params")
    with pytest.raises(RequestError, match=r"^config=.*'torch-dcp'"):
        options_for("torch-dcp", config={"a": 1})
    ck = str(tmp_path / "ck")
    jax_ucp.save(ck, {"params": {"w": np.arange(4, dtype=np.float32)}})
    out = exporters.export(ck, tmp_path / "out", options)
    assert out.files == ["model.safetensors"] and out.bytes == 8
    with pytest.raises(TypeError):  # the options travel whole: no keyword beside them
        jax_ucp.export(ck, tmp_path / "o2", options, dtype="float32")  # type: ignore[call-arg]
    with pytest.raises(RequestError, match=r"RestoreOptions is not an export's options"):
        jax_ucp.export(ck, tmp_path / "o2", jax_ucp.RestoreOptions())  # type: ignore[arg-type]
    out = jax_ucp.export(ck, tmp_path / "o3", TorchDcpExport(select="params"))
    assert out.files == [".metadata", "__0_0.distcp"] and out.bytes == 16


def test_convert_options_are_checked_once(tmp_path):
    from jax_ucp._src.conversion import ConvertOptions
    from jax_ucp._src.importers.plan import ImportOptions

    with pytest.raises(ValueError, match=r"convert: step=-1: a non-negative int, or None"):
        ConvertOptions(step=-1)
    with pytest.raises(ValueError, match=r"distributed=True.*standalone"):
        ConvertOptions(distributed=True, step=3)
    with pytest.raises(jax_ucp.UCPError, match=r"memory_budget: cannot read 'lots' as a size"):
        ConvertOptions(memory_budget="lots")
    options = ConvertOptions(
        step=np.int64(2), memory_budget="1MiB", importing=ImportOptions(weights_only=True)
    )
    assert options.step == 2 and type(options.step) is int and options.memory_budget == 1 << 20
    assert options.importing == ImportOptions(weights_only=True)
    src = tmp_path / "hf"
    src.mkdir()
    from safetensors.numpy import save_file

    save_file({"w": np.arange(6, dtype=np.float32)}, str(src / "model.safetensors"))
    out = jax_ucp.convert(src, tmp_path / "run", step=5, memory_budget="1MiB")
    assert out == str(tmp_path / "run" / "5" / "state")
    assert_bit_exact(jax_ucp.restore(out)["params"]["w"], np.arange(6, dtype=np.float32))


def test_existing_destination_is_refused_and_untouched(ckpt):
    before = _digest(ckpt)
    with pytest.raises(FileExistsError, match="already exists"):
        jax_ucp.save(ckpt, {"x": np.zeros(2)})
    assert _digest(ckpt) == before


def test_failed_save_leaves_previous_checkpoint(ckpt):
    before = _digest(ckpt)
    with pytest.raises(RequestError, match=r"'bad'.*cannot save"):
        jax_ucp.save(ckpt, {"bad": object()}, force=True)
    assert _digest(ckpt) == before
    assert sorted(os.listdir(ckpt.parent)) == ["c"]


def test_force_never_replaces_a_users_folder_or_file(tmp_path):
    folder = tmp_path / "mine"
    folder.mkdir()
    (folder / "notes.txt").write_text("precious")
    with pytest.raises(jax_ucp.UCPError, match=r"mine.*not a jax_ucp checkpoint"):
        jax_ucp.save(folder, {"x": W}, force=True)
    assert (folder / "notes.txt").read_text() == "precious"
    (tmp_path / "file").write_text("precious")
    with pytest.raises(jax_ucp.UCPError, match=r"file\b.*not a checkpoint"):
        jax_ucp.save(tmp_path / "file", {"x": W}, force=True)
    assert (tmp_path / "file").read_text() == "precious"
    with pytest.raises(jax_ucp.SaveConflictError, match="force=True"):
        jax_ucp.save(folder, {"x": W})


def test_force_replaces_a_checkpoint(tmp_path):
    path = tmp_path / "c"
    _save(path)
    jax_ucp.save(path, {"x": W + 1}, force=True)
    assert_bit_exact(jax_ucp.restore(path)["x"], W + 1)
    assert sorted(os.listdir(tmp_path)) == ["c"]


FILL_DISK = textwrap.dedent(
    """
    import os, resource, signal, sys
    import numpy as np
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # EFBIG instead of being killed
    import jax_ucp
    resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, 1 << 20))
    try:
        jax_ucp.save(sys.argv[1], {f"t{i}": np.full((512, 1024), i, np.float32) for i in range(8)},
                     force=True)
    except Exception as e:
        print("FAILED", type(e).__name__, str(e)[:300])
    """
)


def test_a_failed_save_leaves_no_temporary_directory_and_the_old_checkpoint(tmp_path):
    """File-size limit hit mid-save (like a full disk): clean failure, previous checkpoint whole."""
    path = tmp_path / "c"
    _save(path)
    out = subprocess.run(
        [sys.executable, "-c", FILL_DISK, str(path)],
        capture_output=True,
        text=True,
        env=dict(os.environ, PYTHONPATH=REPO),
        timeout=120,
    )
    assert "FAILED" in out.stdout, out.stdout + out.stderr[-3000:]
    assert sorted(os.listdir(tmp_path)) == ["c"]
    assert_bit_exact(jax_ucp.restore(path)["params"]["w"], W)


# --- concurrency -----------------------------------------------------------------------------------
SAVER = textwrap.dedent(
    """
    import sys, numpy as np, jax_ucp
    path, values, force = sys.argv[1], sys.argv[2].split(","), sys.argv[3] == "1"
    for value in map(float, values):  # one save per value, in turn (one start-up for all)
        try:
            jax_ucp.save(path, {f"t{i}": np.full((256, 256), value, np.float32) for i in range(16)},
                         force=force)
            print("SAVED", flush=True)
        except jax_ucp.UCPError as e:
            print("REFUSED", e, flush=True)
        except FileExistsError as e:
            print("EXISTS", e, flush=True)
    """
)


def _joined(v) -> str:
    return ",".join(map(str, v if isinstance(v, tuple) else (v,)))


def _savers(path, values, force):
    """One saver process per item of ``values``, all at once; an item that is a tuple is saved
    value after value by its one process."""
    env = dict(os.environ, PYTHONPATH=REPO)
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", SAVER, str(path), _joined(v), "1" if force else "0"],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        for v in values
    ]
    return [p.communicate(timeout=120)[0] for p in procs]


def _whole(path) -> float:
    """The single value every tensor of the checkpoint holds (asserts it is not a mix)."""
    got = jax_ucp.restore(path)
    assert len(got) == 16, sorted(got)
    values = {float(np.unique(a)[0]) for a in got.values()}
    assert len(values) == 1, values
    return values.pop()


@pytest.mark.parametrize("force", [False, True], ids=["new path", "force"])
def test_two_savers_of_one_path_never_commit_a_mix(tmp_path, force):
    path = tmp_path / "c"
    if force:
        _save(path)
    outs = _savers(path, [1.0, 2.0], force)
    saved = [o for o in outs if o.startswith("SAVED")]
    assert saved, outs
    for o in outs:
        assert o.startswith(("SAVED", "REFUSED", "EXISTS")), outs
        if o.startswith("REFUSED"):
            assert "another save to this path is in progress" in o
    assert _whole(path) in (1.0, 2.0)
    assert [n for n in os.listdir(tmp_path) if not n.startswith(".")] == ["c"]


def test_restores_during_forced_saves_are_whole_old_or_whole_new(tmp_path):
    path = tmp_path / "c"
    jax_ucp.save(path, {f"t{i}": np.full((256, 256), 0.0, np.float32) for i in range(16)})
    seen, errors = set(), []
    stop = threading.Event()

    def restore_loop():
        while not stop.is_set():
            try:
                seen.add(_whole(path))
            except jax_ucp.UCPError as e:  # allowed: a clear error, never a mix
                errors.append(str(e))

    reader = threading.Thread(target=restore_loop)
    reader.start()
    try:
        # four forced saves in turn by one other process (one start-up, not four)
        outs = _savers(path, [(1.0, 2.0, 3.0, 4.0)], force=True)
    finally:
        stop.set()
        reader.join()
    assert outs[0].splitlines() == ["SAVED"] * 4, outs
    assert seen, errors
    assert seen <= {0.0, 1.0, 2.0, 3.0, 4.0}


def test_an_interrupted_swap_is_readable_and_the_next_save_recovers_it(tmp_path):
    """Killed between the two renames of a forced save: both whole checkpoints sit beside path."""
    path = tmp_path / "c"
    jax_ucp.save(path, {"x": W})
    jax_ucp.save(tmp_path / "c.ucp-replacing", {"x": W + 1})
    os.rename(path, tmp_path / "c.ucp-replaced")
    assert_bit_exact(jax_ucp.restore(path)["x"], W + 1)  # the newer one, read in place
    jax_ucp.save(path, {"x": W + 2}, force=True)
    assert_bit_exact(jax_ucp.restore(path)["x"], W + 2)
    assert sorted(os.listdir(tmp_path)) == ["c"]
