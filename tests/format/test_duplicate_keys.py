"""A JSON object naming a key twice is refused in every file the project reads (issue 56): msgspec
and Python's json keep the last silently, another reader the first, so ``ucp.json`` with
``"value":7,"value":8`` restored 8 and verified clean, and a megatron ``integrity.json`` listing
one file twice (the old hash, then the tampered file's) was accepted. The manifest's fast path
finds a key named twice by two counts in C (``manifest.no_duplicate_keys``); these hostile copies
of real checkpoints check that nothing slips past it, masking attempts included, and that what
is not a duplicate still takes it."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

import numpy as np
import orbax.checkpoint as ocp
import pytest

import jax_ucp
from jax_ucp._src.format import manifest
from jax_ucp._src.importers.megatron import integrity
from jax_ucp._src.store.storage import LocalDirectory
from jax_ucp.errors import CheckpointError, RequestError, SourceError

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def good(tmp_path_factory) -> str:
    path = str(tmp_path_factory.mktemp("dup") / "good")
    tree = {"params": {"w": np.arange(6, dtype=np.float32), "ü:b": np.ones(2, np.int8)}, "step": 7}
    jax_ucp.save(path, tree)
    return path


def _copy_with(good: str, dest: Path, edit) -> str:
    shutil.copytree(good, dest)
    text = (dest / "ucp.json").read_text()
    changed = edit(text)
    assert changed != text, "the edit changed nothing"
    (dest / "ucp.json").write_text(changed)
    return str(dest)


# edit of ucp.json's text -> the key the error names
HOSTILE = {
    "a value given twice": (lambda t: t.replace('"value":7', '"value":7,"value":8'), "value"),
    "a shape given twice": (
        lambda t: t.replace('"shape":[6]', '"shape":[3],"shape":[6]'),
        "shape",
    ),
    "a header field twice": (
        lambda t: t.replace(' "format": "jax_ucp",', ' "format": "jax_ucp", "format": "jax_ucp",'),
        "format",
    ),
    "a shard digest twice": (
        lambda t: t.replace('"shard_digests":{"c/0":', '"shard_digests":{"c/0":"00000000","c/0":'),
        "c/0",
    ),
    "a dropped member hides a second role": (  # one ":" fewer, one more: the counts still differ
        lambda t: t.replace(',"sub_role":null', ',"role":"other"', 1),
        "role",
    ),
    "an escaped colon hides a second role": (  # "\u003a" is one ":" more once re-encoded
        lambda t: t.replace(',"sub_role":null', ',"role":"other","sub_role":"\\u003a"', 1),
        "role",
    ),
    "the tree's class twice": (
        lambda t: t.replace(
            '{"type":"dict","children"', '{"type":"dict","type":"dict","children"', 1
        ),
        "type",
    ),
}


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_a_key_named_twice_in_the_manifest_is_refused(good, tmp_path, case):
    edit, key = HOSTILE[case]
    bad = _copy_with(good, tmp_path / "bad", edit)
    message = rf"ucp.json: names '{key}' twice"
    with pytest.raises(CheckpointError, match=message):
        jax_ucp.restore(bad)
    with pytest.raises(CheckpointError, match=message):
        jax_ucp.verify(bad)
    with pytest.raises(CheckpointError, match=message):
        jax_ucp.inspect(bad)


def _fast(raw: bytes) -> bool:
    """Whether msgspec's decoding of ``raw`` alone is taken (no key named twice)."""
    manifest.COUNTS.absent = 0
    decoded = manifest.DECODER.decode(raw)
    return manifest.no_duplicate_keys(raw, decoded, manifest.COUNTS.absent)


def test_what_is_no_duplicate_takes_the_fast_path(good, tmp_path):
    """A ':' in a name, a non-ASCII name (escaped by the writer), every optional member left
    out: read by msgspec alone, as the whole document says."""
    raw = open(os.path.join(good, "ucp.json"), "rb").read()
    assert b"\\u00fc:b" in raw  # the writer's escapes, a ':' inside a string
    assert _fast(raw)
    lean = _copy_with(
        good,
        tmp_path / "lean",
        lambda t: t.replace(',"sub_role":null', "").replace(',"provenance":null', ""),
    )
    raw = open(os.path.join(lean, "ucp.json"), "rb").read()
    assert _fast(raw)
    out = jax_ucp.restore(lean)
    assert out["step"] == 7 and out["params"]["ü:b"].tolist() == [1, 1]


def test_an_escaped_colon_alone_is_read_by_the_slow_path(good, tmp_path):
    bad = _copy_with(
        good,
        tmp_path / "esc",
        lambda t: t.replace('"sub_role":null', '"sub_role":"a\\u003ab"', 1),
    )
    raw = open(os.path.join(bad, "ucp.json"), "rb").read()
    assert not _fast(raw)
    assert "a:b" in [e.sub_role for e in jax_ucp.inspect(bad).tensors]


def test_orbax_metadata_naming_a_key_twice_is_refused(tmp_path):
    src = tmp_path / "orb"
    with ocp.StandardCheckpointer() as ckptr:
        ckptr.save(src, {"params": {"w": np.arange(4, dtype=np.float32)}})
    meta = src / "_METADATA"
    text = meta.read_text()
    assert '"tree_metadata": {' in text
    meta.write_text(
        text.replace('"tree_metadata": {', '"tree_metadata": {}, "tree_metadata": {', 1)
    )
    with pytest.raises(SourceError, match=r"_METADATA.*names 'tree_metadata' twice"):
        jax_ucp.convert(src, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_a_megatron_integrity_record_listing_a_file_twice_is_refused(tmp_path):
    """The old hash first, the tampered file's last: Python's json kept the last, so the
    tampered file passed."""
    (tmp_path / ".metadata").write_bytes(b"tampered")
    old = hashlib.sha256(b"original").hexdigest()
    new = hashlib.sha256(b"tampered").hexdigest()
    record = '{"algorithm": "sha256", "files": {".metadata": "%s", ".metadata": "%s"}}'
    (tmp_path / integrity.INTEGRITY_FILE).write_text(record % (old, new))
    with pytest.raises(SourceError, match=r"integrity.json.*names '.metadata' twice"):
        integrity.verify_integrity(LocalDirectory(str(tmp_path)), os.listdir(tmp_path))
    (tmp_path / integrity.INTEGRITY_FILE).write_text(
        json.dumps({"algorithm": "sha256", "files": {".metadata": new}})
    )
    assert (
        integrity.verify_integrity(LocalDirectory(str(tmp_path)), os.listdir(tmp_path)) is not None
    )


def test_every_other_json_a_user_hands_us_refuses_a_key_named_twice(good, tmp_path):
    """An export's record, an Orbax step's metadata, a model config, a Trainer's scheduler
    arguments: hostile copies of each, one key named twice."""
    from jax_ucp._src.exporters.by_spec import read_config
    from jax_ucp._src.importers.verl.side_files import hf_config
    from jax_ucp._src.optax_torch import schedule_kwargs
    from jax_ucp._src.store.storage.local import ORBAX_STEP_METADATA
    from jax_ucp._src.writer import commit
    from jax_ucp.exporters import SafetensorsExport

    out = tmp_path / "out"
    jax_ucp.export(good, out)
    record = out / commit.EXPORT_RECORD
    text = record.read_text()
    record.write_text(text.replace('"files":', '"files": {}, "files":', 1))
    before = sorted(os.listdir(out))
    with pytest.raises(RequestError, match=r"export\.json, which names 'files' twice"):
        jax_ucp.export(good, out, SafetensorsExport(force=True))
    assert sorted(os.listdir(out)) == before
    record.write_text(text)  # the record as written: the export is replaced
    jax_ucp.export(good, out, SafetensorsExport(force=True))

    step = tmp_path / "step"
    step.mkdir()
    meta = '{"item_handlers": {"a": "h"}, "item_handlers": {"a": "h", "b": "h"}}'
    (step / ORBAX_STEP_METADATA).write_text(meta)
    assert commit.orbax_step_items(str(step)) is None  # not a step whose items can be told
    (step / ORBAX_STEP_METADATA).write_text('{"item_handlers": {"a": "h", "b": "h"}}')
    assert commit.orbax_step_items(str(step)) == {"a", "b"}

    config = tmp_path / "config.json"
    config.write_text('{"hidden_size": 8, "hidden_size": 16}')
    with pytest.raises(RequestError, match="names 'hidden_size' twice"):
        read_config(config)
    (tmp_path / "huggingface").mkdir()
    config.rename(tmp_path / "huggingface" / "config.json")
    with pytest.raises(SourceError, match=r"config\.json.*names 'hidden_size' twice"):
        hf_config(LocalDirectory(str(tmp_path)))

    args = {"lr_scheduler_kwargs": '{"num_cycles": 0.5, "num_cycles": 3}'}
    with pytest.raises(RequestError, match="names 'num_cycles' twice"):
        schedule_kwargs(args, "cosine", "trainer_state.json")
    assert schedule_kwargs({"lr_scheduler_kwargs": '{"num_cycles": 3}'}, "cosine", "t") == {
        "num_cycles": 3
    }
