"""megatron-core 0.19's ``integrity.json`` (SHA-256 of every file, written by megatron-core
itself: mcore_versions/0.19.2/gpt_tp2_integrity, ``MCORE_VERIFY_INTEGRITY=1`` in
tools/fixtures/make_megatron_fixtures.py): checked before the import reads anything; damage
the record vouches against, and records that are not megatron-core's, are errors naming the
file."""

from __future__ import annotations

import json
import os
import shutil

import numpy as np
import pytest

import jax_ucp
from jax_ucp.conversion import MegatronOptions
from jax_ucp.errors import SourceError, UnsafeFileError
from tests.ucp_testing import REPO

ROOT = os.path.join(REPO, "tests", "fixtures", "megatron", "mcore_versions", "0.19.2")
FIX = os.path.join(ROOT, "gpt_tp2_integrity")
VOCAB = 61


@pytest.fixture
def src(tmp_path):
    path = tmp_path / "ckpt"
    shutil.copytree(FIX, path)
    return path


def _record(src) -> dict:
    with open(src / "integrity.json") as f:
        return json.load(f)


def _write(src, record) -> None:
    (src / "integrity.json").write_text(json.dumps(record))


def test_a_checkpoint_with_its_record_imports_bit_exact_and_says_it_was_checked(tmp_path):
    """Same seed as 0.19.2/gpt_tp2 (no record): the same weights bit for bit."""
    got = jax_ucp.restore(
        jax_ucp.convert(FIX, tmp_path / "a", importing=MegatronOptions(vocab_size=VOCAB))
    )
    plain = jax_ucp.convert(
        os.path.join(ROOT, "gpt_tp2"), tmp_path / "b", importing=MegatronOptions(vocab_size=VOCAB)
    )
    want = jax_ucp.restore(plain)
    assert sorted(got["params"]) == sorted(want["params"])
    for key, value in want["params"].items():
        assert np.asarray(got["params"][key]).tobytes() == np.asarray(value).tobytes(), key
    source = jax_ucp.inspect(tmp_path / "a").source
    assert source["integrity"] == "4 files equal to integrity.json's SHA-256"
    assert "integrity" not in jax_ucp.inspect(plain).source


def test_a_flipped_byte_the_record_vouches_against_is_an_error_naming_the_file(src, tmp_path):
    path = src / "__1_0.distcp"
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))
    with pytest.raises(SourceError, match=r"__1_0\.distcp: SHA-256 .*integrity\.json records"):
        jax_ucp.convert(src, tmp_path / "out", importing=MegatronOptions(vocab_size=VOCAB))
    assert not os.path.exists(tmp_path / "out")


def test_a_file_the_import_reads_but_the_record_does_not_list_is_refused(src, tmp_path):
    record = _record(src)
    del record["files"]["__0_0.distcp"]
    _write(src, record)
    with pytest.raises(SourceError, match=r"integrity\.json: does not list __0_0\.distcp"):
        jax_ucp.convert(src, tmp_path / "out", importing=MegatronOptions(vocab_size=VOCAB))


def test_a_listed_file_that_is_gone_is_an_error_naming_it(src, tmp_path):
    record = _record(src)
    record["files"]["common.pt"] = "0" * 64
    _write(src, record)
    with pytest.raises(SourceError, match=r"common\.pt: listed in integrity\.json but missing"):
        jax_ucp.convert(src, tmp_path / "out", importing=MegatronOptions(vocab_size=VOCAB))


@pytest.mark.parametrize(
    "edit, says",
    [
        (lambda r: r.update(algorithm="md5"), r"found algorithm 'md5'"),
        (lambda r: r.update(files=["__0_0.distcp"]), r"files of type list"),
        (lambda r: r["files"].update({"__0_0.distcp": "ABC"}), r"'__0_0\.distcp': 'ABC'"),
        (lambda r: r["files"].update({"__0_0.distcp": None}), r"'__0_0\.distcp': None"),
    ],
)
def test_a_record_that_is_not_megatron_cores_is_refused_naming_what(src, tmp_path, edit, says):
    record = _record(src)
    edit(record)
    _write(src, record)
    with pytest.raises(SourceError, match=rf"integrity\.json: .*{says}"):
        jax_ucp.convert(src, tmp_path / "out", importing=MegatronOptions(vocab_size=VOCAB))


def test_a_record_naming_a_file_outside_the_folder_is_refused(src, tmp_path):
    (tmp_path / "decoy").write_bytes(b"x")
    record = _record(src)
    record["files"]["../decoy"] = "0" * 64
    _write(src, record)
    with pytest.raises(UnsafeFileError, match=r"\.\./decoy"):
        jax_ucp.convert(src, tmp_path / "out", importing=MegatronOptions(vocab_size=VOCAB))


@pytest.mark.parametrize("kind", ["nan", "fifo", "link"])
def test_a_record_that_is_no_json_file_is_refused(src, tmp_path, kind):
    path = src / "integrity.json"
    if kind == "nan":
        path.write_text('{"algorithm": "sha256", "files": {"x": NaN}}')
    else:
        path.unlink()
        if kind == "fifo":
            os.mkfifo(path)
        else:
            (tmp_path / "elsewhere.json").write_text(json.dumps(_record(FIX_PATH)))
            os.symlink(tmp_path / "elsewhere.json", path)
    with pytest.raises((SourceError, UnsafeFileError), match=r"integrity\.json"):
        jax_ucp.convert(src, tmp_path / "out", importing=MegatronOptions(vocab_size=VOCAB))


FIX_PATH = __import__("pathlib").Path(FIX)


@pytest.mark.parametrize("entry", ["convert", "restore"])
def test_a_deleted_metadata_json_never_makes_it_a_plain_dcp_that_skips_the_record(
    src, tmp_path, entry
):
    """Without megatron's ``metadata.json`` the folder is still megatron-core's (its
    ``integrity.json`` says so): never read as a plain torch DCP, which would skip the record
    and let a flipped byte through (found by the hostile harness)."""
    (src / "metadata.json").unlink()
    path = src / "__1_0.distcp"
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))
    call = {
        "convert": lambda: jax_ucp.convert(src, tmp_path / "out"),
        "restore": lambda: jax_ucp.restore(src),
    }
    with pytest.raises(SourceError, match=r"(__1_0\.distcp|metadata\.json): .*integrity\.json"):
        call[entry]()
    assert not (tmp_path / "out").exists()
