"""``force`` and object-store clean-up delete only what jax_ucp wrote.

Every hostile layout is built here: a project folder or a run folder holding checkpoints, a
checkpoint a user dropped a file into, a downloaded Hugging Face folder, an s3:// prefix of a
data set or of committed steps, stale and foreign save locks, and two processes saving to one
new prefix at the same instant. Each is refused untouched (the error names what was found) or,
for what jax_ucp wrote, replaced."""

from __future__ import annotations

import json
import multiprocessing
import os
import socket
import subprocess
import sys
import time
import urllib.request

import numpy as np
import orbax.checkpoint as ocp
import pytest
from safetensors.numpy import load_file, save_file
from typer.testing import CliRunner

import jax_ucp
from jax_ucp._src.exporters import OrbaxExport, SafetensorsExport, options_for
from jax_ucp._src.store.storage import object_store
from jax_ucp._src.writer import commit
from jax_ucp.cli import app
from jax_ucp.errors import RequestError

W = np.arange(12, dtype=np.float32).reshape(3, 4)


def _snapshot(root) -> dict[str, bytes | None]:
    """Every entry under ``root``: file contents, None for directories (links not followed)."""
    out: dict[str, bytes | None] = {}
    for parent, dirs, files in os.walk(root):
        for n in dirs:
            out[os.path.relpath(os.path.join(parent, n), root)] = None
        for n in files:
            with open(os.path.join(parent, n), "rb") as f:
                out[os.path.relpath(os.path.join(parent, n), root)] = f.read()
    return out


def _hf_folder(path) -> str:
    """A downloaded Hugging Face model folder: weights, config and tokenizer."""
    os.makedirs(path)
    save_file(
        {"model.norm.weight": np.ones(4, np.float32)}, os.path.join(path, "model.safetensors")
    )
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump({"model_type": "llama"}, f)
    with open(os.path.join(path, "tokenizer.json"), "w") as f:
        json.dump({"model": {"vocab": {"a": 0}}}, f)
    return str(path)


def _project(tmp_path):
    """A user's project folder: code, data and one checkpoint in a sub-folder."""
    project = tmp_path / "project"
    (project / "data").mkdir(parents=True)
    (project / "train.py").write_text("print('training')\n")
    (project / "data" / "corpus.bin").write_bytes(bytes(range(256)))
    jax_ucp.save(project / "ckpt_step_1", {"w": W})
    return project


@pytest.mark.timeout(120)
def test_force_refuses_a_project_folder_holding_a_checkpoint(tmp_path):
    project = _project(tmp_path)
    src = _hf_folder(tmp_path / "hf")
    before = _snapshot(project)
    refused = (
        r"not a jax_ucp checkpoint or an Orbax step of one \(found ckpt_step_1/, data/, "
        r"train\.py\).* It holds 1 checkpoint \(ckpt_step_1/\) and no Orbax step metadata"
    )
    with pytest.raises(commit.SaveConflictError, match=refused):
        jax_ucp.save(project, {"w": W + 1}, force=True)
    with pytest.raises(commit.SaveConflictError, match=refused):
        jax_ucp.convert(src, project, force=True)
    # Without force the same refusal: never the advice to pass a flag that would be refused.
    with pytest.raises(jax_ucp.SaveConflictError, match="even with force=True") as e:
        jax_ucp.save(project, {"w": W})
    assert "pass force=True" not in str(e.value)
    assert _snapshot(project) == before
    assert sorted(os.listdir(tmp_path)) == ["hf", "project"]  # no lock or temporary left


@pytest.mark.timeout(120)
def test_force_refuses_a_run_folder_of_steps_and_a_step_with_other_items(tmp_path):
    run = tmp_path / "run"
    options = ocp.CheckpointManagerOptions(enable_async_checkpointing=False)
    with ocp.CheckpointManager(run, options=options) as mngr:
        for step in (1, 2):
            mngr.save(step, args=ocp.args.Composite(state=jax_ucp.UCPSave({"w": W + step})))
        mngr.save(
            3,
            args=ocp.args.Composite(
                state=jax_ucp.UCPSave({"w": W + 3}), meta=ocp.args.JsonSave({"lr": 0.1})
            ),
        )
    src = _hf_folder(tmp_path / "hf")
    before = _snapshot(run)
    with pytest.raises(commit.SaveConflictError, match=r"\(found 1/, 2/, 3/\)"):
        jax_ucp.save(run, {"w": W}, force=True)
    with pytest.raises(commit.SaveConflictError, match=r"\(found 1/, 2/, 3/\)"):
        jax_ucp.convert(src, run, force=True)
    # step 3 holds another handler's item: replacing the step would delete it
    with pytest.raises(commit.SaveConflictError, match=r"3: already exists .*\(found meta/\)"):
        jax_ucp.convert(src, run, step=3, force=True)
    with pytest.raises(commit.SaveConflictError, match=r"\(found meta/\)"):
        jax_ucp.save(run / "3", {"w": W}, force=True)
    assert _snapshot(run) == before
    # a step of UCP items only is jax_ucp's to replace
    out = jax_ucp.convert(src, run, step=2, force=True)
    assert out == str(run / "2" / "state")
    assert list(jax_ucp.restore(out)["params"]) == ["model.norm.weight"]
    jax_ucp.save(run / "1", {"w": W * 5}, force=True)
    assert np.array_equal(jax_ucp.restore(run / "1")["w"], W * 5)
    assert _snapshot(run / "3") == {k[2:]: v for k, v in before.items() if k.startswith("3/")}


@pytest.mark.timeout(120)
def test_force_refuses_a_run_folder_of_step_checkpoints_without_orbax_step_metadata(tmp_path):
    """``run/step_1..3``, each a jax_ucp checkpoint, no ``_CHECKPOINT_METADATA`` at ``run``:
    once taken for "an Orbax step of only such items" and deleted whole by force. An Orbax step
    is known by Orbax's own step metadata only; a copied one naming other items does not make
    the folder a step either."""
    run = tmp_path / "run"
    for step in (1, 2, 3):
        jax_ucp.save(run / f"step_{step}", {"w": W + step})
    src = _hf_folder(tmp_path / "hf")
    before = _snapshot(run)
    found = (
        r"\(found step_1/, step_2/, step_3/\); refusing to replace it even with force=True "
        r"\(nothing was changed\)\. It holds 3 checkpoints \(step_1/, step_2/, step_3/\) and no "
        r"Orbax step metadata \(_CHECKPOINT_METADATA\): a folder of checkpoints"
    )
    with pytest.raises(commit.SaveConflictError, match=found):
        jax_ucp.save(run, {"w": W}, force=True)
    with pytest.raises(commit.SaveConflictError, match=found):
        jax_ucp.convert(src, run, force=True)
    r = CliRunner().invoke(app, ["convert", src, str(run), "--from", "safetensors", "--force"])
    assert r.exit_code == 1 and "a folder of checkpoints" in " ".join(r.output.split()), r.output
    assert _snapshot(run) == before
    # Orbax's step metadata copied in from a real step: it names that step's item, not these
    options = ocp.CheckpointManagerOptions(enable_async_checkpointing=False)
    with ocp.CheckpointManager(tmp_path / "mngr", options=options) as mngr:
        mngr.save(1, args=ocp.args.Composite(state=jax_ucp.UCPSave({"w": W})))
    metadata = (tmp_path / "mngr" / "1" / commit.ORBAX_STEP_METADATA).read_bytes()
    assert list(json.loads(metadata)["item_handlers"]) == ["state"]
    (run / commit.ORBAX_STEP_METADATA).write_bytes(metadata)
    before = _snapshot(run)
    with pytest.raises(
        commit.SaveConflictError,
        match=r"\(found step_1/, step_2/, step_3/\).* Its Orbax step metadata "
        r"\(_CHECKPOINT_METADATA\) does not name step_1/, step_2/, step_3/ as items",
    ):
        jax_ucp.save(run, {"w": W}, force=True)
    # not JSON, or not Orbax's object: no step metadata at all
    for bad in (b"", b"[1, 2]", b'{"item_handlers": "state"}'):
        (run / commit.ORBAX_STEP_METADATA).write_bytes(bad)
        with pytest.raises(
            commit.SaveConflictError, match="a _CHECKPOINT_METADATA that is not Orbax's step"
        ):
            jax_ucp.save(run, {"w": W}, force=True)
    (run / commit.ORBAX_STEP_METADATA).write_bytes(metadata)
    assert _snapshot(run) == before
    # one checkpoint in a folder is no step either
    alone = tmp_path / "alone"
    jax_ucp.save(alone / "step_1", {"w": W})
    with pytest.raises(commit.SaveConflictError, match=r"It holds 1 checkpoint \(step_1/\)"):
        jax_ucp.save(alone, {"w": W}, force=True)
    for step in (1, 2, 3):
        assert np.array_equal(jax_ucp.restore(run / f"step_{step}")["w"], W + step)
    # the real step (Orbax's metadata names its item) is replaced, as before
    jax_ucp.save(tmp_path / "mngr" / "1", {"w": W * 7}, force=True)
    assert np.array_equal(jax_ucp.restore(tmp_path / "mngr" / "1")["w"], W * 7)


@pytest.mark.timeout(120)
def test_force_refuses_a_checkpoint_holding_a_users_file(tmp_path):
    ckpt = tmp_path / "ck"
    jax_ucp.save(ckpt, {"w": W})
    (ckpt / "notes.txt").write_text("results of run 7")
    with pytest.raises(commit.SaveConflictError, match=r"\(found notes\.txt\)"):
        jax_ucp.save(ckpt, {"w": W + 1}, force=True)
    os.remove(ckpt / "notes.txt")
    (ckpt / "arrays" / "README").write_text("mine")
    with pytest.raises(commit.SaveConflictError, match=r"\(found arrays/README\)"):
        jax_ucp.save(ckpt, {"w": W + 1}, force=True)
    os.remove(ckpt / "arrays" / "README")
    assert np.array_equal(jax_ucp.restore(ckpt)["w"], W)
    jax_ucp.save(ckpt, {"w": W + 1}, force=True)  # exactly a checkpoint again: replaced
    assert np.array_equal(jax_ucp.restore(ckpt)["w"], W + 1)


@pytest.mark.timeout(120)
def test_an_empty_directory_is_used_without_force(tmp_path):
    for name in ("save", "convert", "export"):
        (tmp_path / name).mkdir()
    jax_ucp.save(tmp_path / "save", {"w": W})
    assert np.array_equal(jax_ucp.restore(tmp_path / "save")["w"], W)
    src = _hf_folder(tmp_path / "hf")
    jax_ucp.convert(src, tmp_path / "convert")
    assert list(jax_ucp.restore(tmp_path / "convert")["params"]) == ["model.norm.weight"]
    jax_ucp.export(tmp_path / "convert", tmp_path / "export")
    assert list(load_file(str(tmp_path / "export" / "model.safetensors"))) == ["model.norm.weight"]


@pytest.mark.timeout(120)
def test_export_force_replaces_only_the_files_an_export_recorded(tmp_path):
    ckpt = str(tmp_path / "ck")
    jax_ucp.save(ckpt, {"params": {"w": W}})
    hf = _hf_folder(tmp_path / "hf")
    before = _snapshot(hf)
    with pytest.raises(
        RequestError,
        match=r"not an export written by jax_ucp \(found no \.jax_ucp_export\.json: "
        r"config\.json, model\.safetensors, tokenizer\.json\)",
    ):
        jax_ucp.export(ckpt, hf, SafetensorsExport(force=True))
    assert _snapshot(hf) == before
    # what the old check took for a DeepSpeed universal export: a tracker and a *_universal dir
    uni = tmp_path / "uni"
    (uni / "mine_universal").mkdir(parents=True)
    (uni / "latest_universal").write_text("mine_universal")
    (uni / "mine_universal" / "results.csv").write_text("step,loss\n")
    before = _snapshot(uni)
    r = CliRunner().invoke(app, ["export", ckpt, str(uni), "--force"])
    assert r.exit_code == 1 and "no .jax_ucp_export.json" in r.output, r.output
    assert _snapshot(uni) == before
    # an export is replaced while it holds exactly its recorded files
    out = tmp_path / "out"
    jax_ucp.export(ckpt, out)
    record = json.loads((out / commit.EXPORT_RECORD).read_text())
    assert list(record["files"]) == ["model.safetensors"]
    assert (
        record["files"]["model.safetensors"]["size"] == (out / "model.safetensors").stat().st_size
    )
    r = CliRunner().invoke(app, ["export", ckpt, str(out)])
    assert r.exit_code == 1 and "pass --force to replace it" in " ".join(r.output.split())
    assert "--force / --force" not in r.output
    jax_ucp.export(ckpt, out, SafetensorsExport(force=True, dtype="float16"))
    assert load_file(str(out / "model.safetensors"))["w"].dtype == np.float16
    (out / "tokenizer.json").write_text("{}")
    with pytest.raises(RequestError, match=r"\(found tokenizer\.json\)"):
        jax_ucp.export(ckpt, out, SafetensorsExport(force=True))
    os.remove(out / "tokenizer.json")
    with open(out / "model.safetensors", "ab") as f:
        f.write(b" ")
    with pytest.raises(
        RequestError, match=r"model\.safetensors \(changed since the export: size\)"
    ):
        jax_ucp.export(ckpt, out, SafetensorsExport(force=True))
    assert (out / "model.safetensors").read_bytes().endswith(b" ")


@pytest.fixture
def s3(s3_server, monkeypatch):
    env, root = s3_server
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    return root


def _objects(url) -> dict[str, bytes]:
    return {n: object_store.read(url, n, 1 << 20) for n in object_store.list_names(url)}


@pytest.mark.timeout(120)
def test_object_store_save_refuses_a_prefix_of_other_objects(s3, tmp_path):
    datasets = f"{s3}/datasets-{os.getpid()}"
    object_store.write(datasets, "README.md", b"# corpus\n")
    object_store.write(datasets, "corpus/part-0000.bin", bytes(range(256)))
    object_store.write(datasets, "arrays/not-a-zarr.txt", b"mine")  # under arrays/, not an array's
    before = _objects(datasets)
    found = r"\(README\.md, arrays/not-a-zarr\.txt, corpus/part-0000\.bin\)"
    with pytest.raises(commit.SaveConflictError, match=found):
        jax_ucp.save(datasets, {"w": W})
    with pytest.raises(commit.SaveConflictError, match=found):
        jax_ucp.convert(_hf_folder(tmp_path / "hf"), datasets)
    assert _objects(datasets) == before
    run = f"{s3}/run-{os.getpid()}"
    jax_ucp.save(f"{run}/step_1", {"w": W + 1})
    jax_ucp.save(f"{run}/step_2", {"w": W + 2})
    before = _objects(run)
    with pytest.raises(commit.SaveConflictError, match=r"\(step_1/.*and \d+ more\)"):
        jax_ucp.save(run, {"w": W}, force=True)
    assert _objects(run) == before
    assert np.array_equal(jax_ucp.restore(f"{run}/step_2")["w"], W + 2)


@pytest.mark.timeout(120)
def test_object_store_locks_left_by_killed_saves(s3):
    url = f"{s3}/killed-{os.getpid()}"
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    leftovers = {
        "arrays/old/zarr.json": b"{}",
        "arrays/old/c/0/0": b"x" * 10,
        "ucp.digests.1.json": b"{}",
    }
    for name, data in leftovers.items():
        object_store.write(url, name, data)
    owner = {"host": "other-host", "pid": 4242, "time": 0, "token": "t"}
    object_store.write(url, object_store.LOCK_OBJECT, json.dumps(owner).encode())
    with pytest.raises(
        commit.SaveConflictError,
        match=r"another save.*\(host other-host, process 4242",
    ):
        jax_ucp.save(url, {"w": W})
    assert _objects(url) == {**leftovers, object_store.LOCK_OBJECT: json.dumps(owner).encode()}
    # a lock of this host whose process is gone: taken over, the killed save's objects deleted
    owner = {"host": socket.gethostname(), "pid": dead.pid, "time": 0, "token": "t"}
    object_store.write(url, object_store.LOCK_OBJECT, json.dumps(owner).encode())
    jax_ucp.save(url, {"w": W})
    assert sorted(object_store.list_names(url)) == [
        "arrays/w/c/0/0",
        "arrays/w/zarr.json",
        "ucp.json",
    ]
    assert np.array_equal(jax_ucp.restore(url)["w"], W)


def _race_worker(index, barrier, results, base, trials):
    """One of two processes saving to the same new prefix in every trial, started together."""
    import jax_ucp
    from jax_ucp._src import writer

    for t in range(trials):
        url = f"{base}/t{t}"
        value = np.full((64, 64), 100 * t + index, np.float32)
        barrier.wait(timeout=120)
        try:
            if t % 2:  # the host writer (convert's path) and jax_ucp.save's, alternately
                writer.write_host_checkpoint(url, iter([writer.HostItem(("w",), value)]))
            else:
                jax_ucp.save(url, {"w": value})
            results.put((t, index, "ok", ""))
        except Exception as e:
            results.put((t, index, type(e).__name__, str(e)))


_SERIAL_MOTO = """
import sys
from moto.moto_server.werkzeug_app import DomainDispatcherApplication, create_backend_app
from werkzeug.serving import run_simple
run_simple("127.0.0.1", int(sys.argv[1]), DomainDispatcherApplication(create_backend_app),
           threaded=False)
"""


@pytest.fixture(scope="module")
def serial_s3(tmp_path_factory):
    """An S3 server answering one request at a time: moto checks a conditional PUT's
    ``If-None-Match: *`` and then stores the object, two steps its default threaded server
    interleaves for concurrent requests, so under load both racing saves' lock objects were
    "created" (S3 itself makes it one step). Served serially the lock's conditional PUT is
    atomic, as on S3, and the race below is deterministic."""
    from tests.ucp_testing import free_port

    port = free_port()
    log = open(tmp_path_factory.mktemp("moto") / "log", "w+")
    proc = subprocess.Popen(
        [sys.executable, "-c", _SERIAL_MOTO, str(port)], stdout=log, stderr=subprocess.STDOUT
    )
    endpoint = f"http://127.0.0.1:{port}"
    try:
        for _ in range(600):  # up to 30 s for it to listen
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                assert proc.poll() is None, "the serial moto server exited"
                time.sleep(0.05)
        urllib.request.urlopen(urllib.request.Request(f"{endpoint}/ucp-race", method="PUT"))
        yield (
            {
                "AWS_ACCESS_KEY_ID": "testing",
                "AWS_SECRET_ACCESS_KEY": "testing",
                "AWS_REGION": "us-east-1",
                "AWS_ENDPOINT_URL": endpoint,
            },
            "s3://ucp-race",
        )
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        log.close()


@pytest.mark.timeout(300)
def test_two_processes_saving_to_one_new_prefix(serial_s3, monkeypatch):
    """Started together (a Barrier) 20 times: one save wins whole, the other gets an error at
    once (the prefix lock) or sees the winner's commit; never two successes or a mix. (It
    once got ``OSError ... ALREADY_EXISTS: Error opening "zarr3" driver`` under load: moto's
    threaded server let both conditional PUTs of the lock object succeed; ``serial_s3``.)"""
    env, root = serial_s3
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    trials = 20
    base = f"{root}/race-{os.getpid()}"
    ctx = multiprocessing.get_context("spawn")
    barrier, results = ctx.Barrier(2), ctx.Queue()
    procs = [
        ctx.Process(target=_race_worker, args=(i, barrier, results, base, trials)) for i in range(2)
    ]
    for p in procs:
        p.start()
    try:
        got = [results.get(timeout=240) for _ in range(2 * trials)]
    finally:
        for p in procs:
            p.join(timeout=60)
            if p.is_alive():
                p.kill()
    for t in range(trials):
        outcome = {i: (kind, msg) for tt, i, kind, msg in got if tt == t}
        winners = [i for i, (kind, _) in outcome.items() if kind == "ok"]
        assert len(winners) == 1, (t, outcome)
        (loser,) = set(outcome) - set(winners)
        kind, msg = outcome[loser]
        assert kind in ("SaveConflictError", "FileExistsError"), (t, kind, msg)
        url = f"{base}/t{t}"
        want = np.full((64, 64), 100 * t + winners[0], np.float32)
        assert np.array_equal(jax_ucp.restore(url)["w"], want), t
        assert jax_ucp.verify(url) == []
        assert object_store.LOCK_OBJECT not in object_store.list_names(url)


def _train_state(tmp_path) -> str:
    """A checkpoint every export format takes: params with Adam moments and a count, one
    tensor over 1 MiB (files of several digest blocks)."""
    import optax

    params = {
        "big": np.arange(600 * 1000, dtype=np.float32).reshape(600, 1000),
        "w": W,
    }
    ckpt = str(tmp_path / "train")
    jax_ucp.save(ckpt, {"params": params, "opt_state": optax.adam(1e-3).init(params)})
    return ckpt


def _flip_a_byte(path, at: int | None = None) -> None:
    """An in-place edit keeping the size (as an editor or a bad disk would)."""
    size = os.path.getsize(path)
    at = size // 2 if at is None else at
    with open(path, "r+b") as f:
        f.seek(at)
        byte = f.read(1)
        f.seek(at)
        f.write(bytes([byte[0] ^ 0x5A]))


@pytest.mark.timeout(300)
@pytest.mark.parametrize("to", ["safetensors", "torch-dcp", "deepspeed-universal"])
def test_export_force_refuses_an_export_edited_in_place(tmp_path, to, monkeypatch):
    """Every file of an export is recorded with a digest taken while it was written (no file
    is read back: reading one here fails the export); a file edited in place, its size kept,
    is named and nothing is replaced; once it is as written, force replaces the export."""
    from jax_ucp._src.writer import file_digest

    ckpt = _train_state(tmp_path)
    out = tmp_path / "out"

    def no_second_read(path):
        raise AssertionError(f"{path} read back to digest it")

    with monkeypatch.context() as m:
        m.setattr(file_digest, "digest_file", no_second_read)
        jax_ucp.export(ckpt, out, options_for(to))
    record = json.loads((out / commit.EXPORT_RECORD).read_text())
    assert record["version"] == 2 and record["digest"] == file_digest.KIND
    files = sorted(str(p.relative_to(out)) for p in out.rglob("*") if p.is_file())
    assert sorted(record["files"]) == [f for f in files if f != commit.EXPORT_RECORD]
    for rel, entry in record["files"].items():  # what was digested while written is the file
        now = file_digest.digest_file(str(out / rel))
        assert {"size": now.size, "crc32c": now.crc32c} == entry, rel
    assert any(e["size"] > 2 * file_digest.BLOCK for e in record["files"].values())
    for rel in sorted(record["files"]):
        _flip_a_byte(out / rel)
        edited = _snapshot(out)
        with pytest.raises(
            RequestError, match=rf"\(found {rel} \(changed since the export: content\)\)"
        ):
            jax_ucp.export(ckpt, out, options_for(to, force=True))
        r = CliRunner().invoke(app, ["export", ckpt, str(out), "--to", to, "--force"])
        assert r.exit_code == 1 and "changed since the export: content" in r.output, r.output
        assert _snapshot(out) == edited  # the edit kept, nothing else there
        _flip_a_byte(out / rel)  # undone: the export as written
    jax_ucp.export(ckpt, out, options_for(to, force=True))
    assert sorted(os.listdir(tmp_path)) == ["out", "train"]


@pytest.mark.timeout(120)
def test_export_force_refuses_a_copied_or_forged_export_record(tmp_path):
    """A user's folder with an export record copied from a real export, or forged from the
    names and sizes ``ls -l`` shows (the old record's whole content): nothing is deleted."""
    ckpt = str(tmp_path / "ck")
    jax_ucp.save(ckpt, {"params": {"w": W}})
    user = tmp_path / "user"
    _hf_folder(user)
    (user / "sub").mkdir()
    (user / "sub" / "notes.txt").write_text("results of run 7\n")
    real = tmp_path / "real"
    jax_ucp.export(ckpt, real)
    files = sorted(str(p.relative_to(user)) for p in user.rglob("*") if p.is_file())
    sizes = {rel: (user / rel).stat().st_size for rel in files}
    forged_v1 = {"format": "jax_ucp export", "version": 1, "files": sizes}
    copied = json.loads((real / commit.EXPORT_RECORD).read_text())
    entry = copied["files"]["model.safetensors"]
    forged_v2 = dict(copied, files={rel: dict(entry, size=n) for rel, n in sizes.items()})
    for record, found in (
        (forged_v1, r"\.jax_ucp_export\.json without content digests \(version 1"),
        (
            forged_v2,
            r"found config\.json \(changed since the export: content\), model\.safetensors "
            r"\(changed since the export: content\), tokenizer\.json \(changed since the export: "
            r"content\), sub/notes\.txt \(changed since the export: content\)\)",
        ),
    ):
        (user / commit.EXPORT_RECORD).write_text(json.dumps(record))
        before = _snapshot(user)
        with pytest.raises(RequestError, match=found):
            jax_ucp.export(ckpt, user, SafetensorsExport(force=True))
        r = CliRunner().invoke(app, ["export", ckpt, str(user), "--force"])
        assert r.exit_code == 1 and "refusing to replace it" in " ".join(r.output.split())
        assert _snapshot(user) == before
    # the copied record as it is (another export's files): the user's files are not in it
    (user / commit.EXPORT_RECORD).write_text(json.dumps(copied))
    with pytest.raises(
        RequestError,
        match=r"found config\.json, model\.safetensors \(changed since the export: size\), "
        r"tokenizer\.json, sub/notes\.txt\)",
    ):
        jax_ucp.export(ckpt, user, SafetensorsExport(force=True))
    assert (user / "sub" / "notes.txt").read_text() == "results of run 7\n"


@pytest.mark.timeout(120)
def test_orbax_exports_are_never_forced(tmp_path):
    """An Orbax export takes no force (Orbax writes and commits it itself: nothing is recorded
    to replace it by), and a forced export of another format does not replace one."""
    ckpt = str(tmp_path / "ck")
    jax_ucp.save(ckpt, {"params": {"w": W}})
    out = tmp_path / "orbax"
    jax_ucp.export(ckpt, out, OrbaxExport())
    before = _snapshot(out)
    with pytest.raises(RequestError, match=r"^force=.*'orbax'"):
        jax_ucp.export(ckpt, out, options_for("orbax", force=True))
    with pytest.raises(RequestError, match=r"no .jax_ucp_export.json"):
        jax_ucp.export(ckpt, out, SafetensorsExport(force=True))
    assert _snapshot(out) == before
