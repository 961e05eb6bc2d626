"""A reader racing a forced replace gets the old or the new checkpoint, or
``CheckpointReplacedError`` ("being replaced, retry") — never "corrupt".

Two real processes: one converts three safetensors sources into one destination in turn
(``force=True``), the other restores it. In lockstep the reader is held (by its own ``select``
predicate, user code that runs after the manifest is read) while the writer replaces the
checkpoint twice, so the old directory's inode is freed and usually given to the newest one; a
free-running loop follows. Counted iterations, no clocks."""

from __future__ import annotations

import multiprocessing
import os

import numpy as np
import pytest
from safetensors.numpy import save_file

import jax_ucp
from jax_ucp import store
from jax_ucp.errors import CheckpointReplacedError
from jax_ucp.restoring import reader
from jax_ucp.writer import commit

_TENSORS = 6
_BASES = (1.0, 100.0, 10000.0)  # one per source: which source a restore came from


def _source(path: str, base: float) -> str:
    os.makedirs(path)
    save_file(
        {f"layer{i}.w": np.full((64, 256), base + i, np.float32) for i in range(_TENSORS)},
        os.path.join(path, "model.safetensors"),
    )
    return path


def _which(tree) -> float | None:
    """The source base a restored tree is whole of, None for a mix."""
    params = tree["params"]
    for base in _BASES:
        if all(
            np.array_equal(params[f"layer{i}.w"], np.full((64, 256), base + i, np.float32))
            for i in range(_TENSORS)
        ):
            return base
    return None


def _writer(sources, out, rounds, per_round, reading, replaced):
    import jax_ucp

    n = 0
    for _ in range(rounds):
        if reading is not None and not reading.wait(timeout=120):
            return
        if reading is not None:
            reading.clear()
        for _ in range(per_round):
            n += 1
            jax_ucp.convert(sources[n % len(sources)], out, force=True)
        if replaced is not None:
            replaced.set()


def _reader(out, rounds, reading, replaced, results, stop):
    import jax_ucp

    for _ in range(rounds):
        if stop is not None and stop.is_set():
            break
        held = []

        def hold(name):
            if reading is not None and not held:  # once per restore, after the manifest is read
                held.append(name)
                replaced.clear()
                reading.set()
                replaced.wait(timeout=120)
            return True

        try:
            tree = jax_ucp.restore(out, select=hold)
            results.put(("ok", _which(tree)))
        except Exception as e:  # every outcome is reported, the test judges it
            results.put((type(e).__name__, str(e)))
    results.put(("done", None))


def _outcomes(results) -> list:
    got = []
    while True:
        kind, value = results.get(timeout=300)
        if kind == "done":
            return got
        got.append((kind, value))


def _run(tmp_path, *, lockstep: bool, rounds: int):
    sources = [_source(str(tmp_path / f"src{i}"), b) for i, b in enumerate(_BASES)]
    out = str(tmp_path / "out")
    jax_ucp.convert(sources[0], out)
    ctx = multiprocessing.get_context("spawn")
    results = ctx.Queue()
    reading = ctx.Event() if lockstep else None
    replaced = ctx.Event() if lockstep else None
    stop = None if lockstep else ctx.Event()
    writer = ctx.Process(
        target=_writer, args=(sources, out, rounds, 2 if lockstep else 1, reading, replaced)
    )
    reader = ctx.Process(
        target=_reader,
        args=(out, rounds * (1 if lockstep else 20), reading, replaced, results, stop),
    )
    reader.start()
    writer.start()
    try:
        if not lockstep:
            writer.join(timeout=600)
            stop.set()
        got = _outcomes(results)
    finally:
        for p in (writer, reader):
            p.join(timeout=120)
            if p.is_alive():
                p.kill()
    assert writer.exitcode == 0 and reader.exitcode == 0
    return got, out


@pytest.mark.timeout(600)
def test_a_reader_held_across_two_replaces_gets_a_whole_checkpoint_or_the_retry_error(tmp_path):
    """Each restore reads the manifest, then waits while the checkpoint is replaced twice: on
    the code before the fix most of them called the intact checkpoint corrupt ("swapped with
    another shard": the newest directory had the first one's inode)."""
    rounds = 6
    got, out = _run(tmp_path, lockstep=True, rounds=rounds)
    # round r ends after the writer's conversions 2r+1 and 2r+2 (of source n % 3): the restore
    # started on the checkpoint before them and must give back the one after them, whole
    assert got == [("ok", _BASES[(2 * r + 2) % 3]) for r in range(rounds)], got
    assert _which(jax_ucp.restore(out)) == _BASES[(2 * rounds) % 3]


@pytest.mark.timeout(600)
def test_restores_racing_forced_converts_are_whole_or_the_retry_error(tmp_path):
    """Free-running, as a user would hit it: 12 forced conversions while the other process
    restores in a loop; each restore is one whole source or ``CheckpointReplacedError``."""
    got, out = _run(tmp_path, lockstep=False, rounds=12)
    assert got
    unexpected = [
        (kind, value)
        for kind, value in got
        if not (kind == "ok" and value in _BASES) and kind != CheckpointReplacedError.__name__
    ]
    assert unexpected == [], unexpected
    assert _which(jax_ucp.restore(out)) == _BASES[12 % 3]


def test_a_reader_between_the_two_renames_of_a_swap(tmp_path, monkeypatch):
    """The instant between a swap's renames: ``out`` missing, the new checkpoint at
    ``out.ucp-replacing``; the reader finds that, and the second rename (made here, as the
    writer would) moves it before the reader opens it. Before the fix: "no manifest" there."""
    sources = [_source(str(tmp_path / f"src{i}"), b) for i, b in enumerate(_BASES[:2])]
    out = str(tmp_path / "out")
    jax_ucp.convert(sources[0], out)
    jax_ucp.convert(sources[1], out + commit.REPLACING)
    os.rename(out, out + commit.REPLACED)
    found = reader.find_checkpoint_dir

    def then_the_second_rename(path):
        root = found(path)
        if os.path.isdir(out + commit.REPLACING):
            os.rename(out + commit.REPLACING, out)
        return root

    monkeypatch.setattr(reader, "find_checkpoint_dir", then_the_second_rename)
    assert _which(jax_ucp.restore(out)) == _BASES[1]
    assert jax_ucp.inspect(out).save_id == store.read_manifest(out).save_id


def test_verify_racing_two_replaces_reports_no_damage(tmp_path):
    """``verify``'s progress callback (user code, after the first tensor) replaces the
    checkpoint twice, in this process: the checkpoint is verified again, not reported as
    damaged; a real damage is still reported."""
    sources = [_source(str(tmp_path / f"src{i}"), b) for i, b in enumerate(_BASES)]
    out = str(tmp_path / "out")
    jax_ucp.convert(sources[0], out)
    replaced = []

    def replace_twice(name, done, total):
        if not replaced:
            replaced.append(name)
            jax_ucp.convert(sources[1], out, force=True)
            jax_ucp.convert(sources[2], out, force=True)

    assert jax_ucp.verify(out, progress=replace_twice, max_read_bytes=1) == []
    assert replaced and _which(jax_ucp.restore(out)) == _BASES[2]
    shard = os.path.join(out, "arrays", "params.layer0%2Ew", "c", "0", "0")
    data = bytearray(open(shard, "rb").read())
    data[0] ^= 0xFF
    with open(shard, "wb") as f:
        f.write(data)
    problems = jax_ucp.verify(out)
    assert [name for name, _ in problems] == ["params/layer0.w"], problems
    with pytest.raises(jax_ucp.CheckpointError, match="crc32c"):
        jax_ucp.restore(out)


def test_an_export_racing_two_replaces_of_its_source_starts_over(tmp_path):
    """``export``'s progress callback (after the first tensor) replaces the source checkpoint
    twice: the export starts over and holds the newest checkpoint whole, no temporary left."""
    from safetensors.numpy import load_file

    sources = [_source(str(tmp_path / f"src{i}"), b) for i, b in enumerate(_BASES)]
    ckpt = str(tmp_path / "ckpt")
    jax_ucp.convert(sources[0], ckpt)
    replaced = []

    def replace_twice(name, done, total):
        if not replaced:
            replaced.append(name)
            jax_ucp.convert(sources[1], ckpt, force=True)
            jax_ucp.convert(sources[2], ckpt, force=True)

    out = tmp_path / "out"
    jax_ucp.export(ckpt, out, progress=replace_twice)
    assert replaced
    assert _which({"params": load_file(str(out / "model.safetensors"))}) == _BASES[2]
    assert sorted(os.listdir(tmp_path)) == ["ckpt", "out", "src0", "src1", "src2"]
