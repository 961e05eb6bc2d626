"""``convert`` records a certificate of the source's files (``source.certificate``: each file's
name, size and SHA-256); ``verify --against SRC`` checks it first: a changed byte, a removed or
an added file of the source fails naming the file, before any tensor is compared (so these run
without torch); an intact source then has its weights and optimizer moments compared (torch's
loaders: marked ``torch``); a checkpoint without one fails unless accepted."""

from __future__ import annotations

import hashlib
import json
import os
import shutil

import numpy as np
import pytest
from typer.testing import CliRunner

import jax_ucp
from jax_ucp._src import writer
from jax_ucp._src.format import certificate
from jax_ucp._src.importers import registry
from jax_ucp.cli import app
from jax_ucp.conversion import ImportOptions
from tests.ucp_testing import REPO

runner = CliRunner()
FIX = os.path.join(REPO, "tests", "fixtures")

# (fixture, the rank file a tampering changes, convert's keywords)
SOURCES = {
    "dcp": ("torch/fsdp2_fp32", "__1_0.distcp", {}),
    "deepspeed": (
        "deepspeed/z1_fp32_dp2/ckpt",
        "global_step2/zero_pp_rank_1_mp_rank_00_optim_states.pt",
        {},
    ),
    # megatron-core 0.19's fully_reshardable optimizer: its Adam moments are global tensors
    "megatron": ("megatron/mcore_versions/0.19.2/gpt_distopt_dp2_fully_reshardable", "__0_0.distcp", {}),
    # the Trainer's optimizer order needs transformers: its weights only, torch-free
    "hf_trainer": ("hf_trainer/trainer_fp32/checkpoint-3", "model.safetensors", {"importing": ImportOptions(weights_only=True)}),
}  # fmt: skip


# the Trainer's optimizer order rebuilt by transformers: its Adam moments imported too
WITH_TORCH = {"hf_trainer_moments": ("hf_trainer/trainer_fp32/checkpoint-3", "optimizer.pt", {})}


def _converted(tmp_path, kind):
    fixture, rank_file, keywords = {**SOURCES, **WITH_TORCH}[kind]
    src = str(tmp_path / "src")
    shutil.copytree(os.path.join(FIX, fixture), src)
    return src, jax_ucp.convert(src, tmp_path / "ucp", **keywords), rank_file


def _recorded(ckpt) -> dict:
    with open(os.path.join(ckpt, "ucp.json")) as f:
        return json.load(f)["source"]["certificate"]


@pytest.mark.parametrize("kind", sorted(SOURCES))
def test_convert_records_every_source_file(tmp_path, kind):
    """Every file under the source, its size and SHA-256 (hashlib's of the whole file)."""
    src, ckpt, _ = _converted(tmp_path, kind)
    found = _recorded(ckpt)
    want = {}
    for folder, _, names in os.walk(src):
        for name in names:
            path = os.path.join(folder, name)
            with open(path, "rb") as f:
                data = f.read()
            rel = os.path.relpath(path, src).replace(os.sep, "/")
            want[rel] = {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    assert found["algorithm"] == "sha256"
    assert found["files"] == want
    if kind == "deepspeed":  # torch.save's zip files: their CRC-32s checked by the reader
        assert "zip files" in found["checked_by_import"][0]
        assert "global_step2/mp_rank_00_model_states.pt" in found["checked_by_import"][0]


def _flip_one_byte(path: str) -> None:
    with open(path, "r+b") as f:
        f.seek(os.path.getsize(path) // 2)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 1]))


@pytest.mark.parametrize("kind", sorted(SOURCES))
def test_a_tampered_source_fails_naming_the_file(tmp_path, kind):
    """One byte of one rank file changed, a file removed, a file added: each is named by
    ``verify(against=)`` and by ``jax-ucp verify --against`` (exit 1), before any tensor."""
    src, ckpt, rank_file = _converted(tmp_path, kind)
    _flip_one_byte(os.path.join(src, rank_file))
    bad = jax_ucp.verify(ckpt, against=src)
    assert bad[0][0] == rank_file, bad  # first: the file, then any tensor found different
    assert "same size" in bad[0][1] and "another sha256" in bad[0][1]
    assert bad.against is not None and list(bad.against.files) == [rank_file]
    assert not bad.against.ok
    r = runner.invoke(app, ["verify", ckpt, "--against", src])
    assert r.exit_code == 1, r.output
    assert rank_file in r.output and "1 source file not as certified" in r.output

    removed = sorted(_recorded(ckpt)["files"])[0]
    os.remove(os.path.join(src, removed))
    with open(os.path.join(src, "extra.txt"), "w") as f:
        f.write("added")
    found = jax_ucp.verify(ckpt, against=src)
    assert found.against is not None
    bad = found.against.files
    assert set(bad) == {rank_file, removed, "extra.txt"}, bad
    assert [n for n, _ in found][:3] == list(bad)  # the files first
    assert "missing from" in bad[removed] and "not in the certificate" in bad["extra.txt"]


def test_a_truncated_file_is_named_with_its_sizes(tmp_path):
    src, ckpt, rank_file = _converted(tmp_path, "megatron")
    path = os.path.join(src, rank_file)
    size = os.path.getsize(path)
    os.truncate(path, size - 1)
    found = jax_ucp.verify(ckpt, against=src)
    assert found.against is not None
    assert found[0] == (rank_file, found.against.files[rank_file]), found
    assert found.against.files == {
        rank_file: f"{rank_file}: the source differs from the certificate convert recorded: "
        f"changed: {size} bytes certified, {size - 1} found"
    }


def test_a_malformed_certificate_is_refused_not_ignored(tmp_path):
    src = tmp_path / "a.txt"
    src.write_text("x")
    assert certificate.check(str(src), {"algorithm": "md5", "files": {}})[0].keys() == {
        "certificate"
    }
    problems, equal = certificate.check(str(src), {"algorithm": "sha256", "files": {"a.txt": 3}})
    assert equal == 0 and "malformed" in problems["a.txt"]
    # a recorded name leading out of the source is reported, never opened
    problems, _ = certificate.check(
        str(tmp_path),
        {"algorithm": "sha256", "files": {"../etc/passwd": {"size": 1, "sha256": ""}}},
    )
    assert "missing from" in problems["../etc/passwd"]


def test_digest_streams_in_chunks(tmp_path, monkeypatch):
    """A file larger than a chunk: the same digest as hashlib's of the whole."""
    monkeypatch.setattr(certificate, "CHUNK", 1000)
    data = np.random.default_rng(0).integers(0, 256, 4567, np.uint8).tobytes()
    (tmp_path / "f.pt").write_bytes(b"PK\x03\x04" + data)
    size, digest, is_zip = certificate.file_digest(str(tmp_path / "f.pt"))
    assert (size, digest, is_zip) == (
        4571,
        hashlib.sha256(b"PK\x03\x04" + data).hexdigest(),
        True,
    )


def _safetensors_source(tmp_path):
    from safetensors.numpy import save_file

    src = tmp_path / "model.safetensors"
    save_file({"a": np.arange(12, dtype=np.float32).reshape(3, 4)}, str(src))
    return str(src)


def test_a_single_file_source_is_certified_and_verified(tmp_path):
    src = _safetensors_source(tmp_path)
    ckpt = jax_ucp.convert(src, tmp_path / "ucp")
    assert list(_recorded(ckpt)["files"]) == ["model.safetensors"]
    found = jax_ucp.verify(ckpt, against=src)
    assert found == [] and found.against is not None
    assert found.against.certificate.startswith("1 certified files equal (sha256)")
    r = runner.invoke(app, ["verify", ckpt, "--against", src])
    assert r.exit_code == 0, r.output
    assert "certificate: 1 certified files equal" in " ".join(r.output.split())


def test_a_checkpoint_without_a_certificate_fails_unless_accepted(tmp_path):
    """A checkpoint converted before certificates were recorded (or whose certificate was
    deleted): ``verify --against`` fails saying so (before: "no certificate recorded", exit 0,
    so deleting it passed any source); ``accept_uncertified`` / ``--accept-uncertified``
    compares the tensors without it."""
    src = _safetensors_source(tmp_path)
    plan = registry.plan_import(src)  # as convert wrote before it recorded a certificate
    ckpt = writer.write_host_checkpoint(str(tmp_path / "ucp"), plan.items, source=plan.source)
    with open(os.path.join(ckpt, "ucp.json")) as f:
        assert "certificate" not in json.load(f)["source"]
    found = jax_ucp.verify(ckpt, against=src)
    assert [n for n, _ in found] == ["source.certificate"], found
    assert "records no certificate" in found[0][1] and "--accept-uncertified" in found[0][1]
    assert found.against is not None and found.against.equal == ["params/a"]
    r = runner.invoke(app, ["verify", ckpt, "--against", src], env={"COLUMNS": "300"})
    assert r.exit_code == 1 and "records no certificate" in r.output, r.output
    found = jax_ucp.verify(ckpt, against=src, accept_uncertified=True)
    assert found == [] and found.against.certificate.startswith("no certificate recorded")
    r = runner.invoke(app, ["verify", ckpt, "--against", src, "--accept-uncertified"])
    assert r.exit_code == 0 and "no certificate recorded" in r.output, r.output


def test_a_run_setting_edited_in_ucp_json_fails_against_the_source(tmp_path):
    """The source record ``ucp.json`` keeps (what a continuation reads) against the import of
    the source planned again: one field edited is named with both values, exit 1 (before:
    tensors alone were compared, exit 0)."""
    src = _safetensors_source(tmp_path)
    ckpt = jax_ucp.convert(src, tmp_path / "ucp")
    path = os.path.join(ckpt, "ucp.json")
    with open(path) as f:
        manifest = json.load(f)
    manifest["source"]["framework"] = "deepspeed"
    with open(path, "w") as f:
        json.dump(manifest, f)
    found = jax_ucp.verify(ckpt, against=src)
    assert [n for n, _ in found] == ["source.framework"], found
    assert "records deepspeed" in found[0][1] and "records safetensors" in found[0][1]


@pytest.mark.torch
@pytest.mark.parametrize("kind", ["dcp", "deepspeed", "megatron", "hf_trainer_moments"])
def test_an_intact_source_passes_moments_included(tmp_path, kind):
    """The certificate holds, then every weight and Adam moment the import copied is compared
    with the source framework's own loader: one command says "exactly that run"."""
    src, ckpt, _ = _converted(tmp_path, kind)
    found = jax_ucp.verify(ckpt, against=src)
    assert list(found) == [] and found.against is not None and found.against.ok
    files = len(_recorded(ckpt)["files"])
    assert found.against.certificate.startswith(f"{files} certified files equal (sha256)")
    moments = [n for n in found.against.equal if n.startswith("opt_state/")]
    assert any(".mu" in n or "/mu/" in n for n in moments), found.against.equal
    assert any(".nu" in n or "/nu/" in n for n in moments), found.against.equal
    r = runner.invoke(app, ["verify", ckpt, "--against", src])
    assert r.exit_code == 0, r.output
    out = " ".join(r.output.split())
    assert f"certificate: {files} certified files equal" in out
    assert f"{len(moments)} optimizer state" in out


def test_a_file_that_cannot_be_read_is_said_not_a_failed_convert(tmp_path, monkeypatch):
    """A file of the source no one may read (a lock file of another user): the import did not
    read it either, so the convert goes on; the certificate says so, and a verify passes over
    it (never counted as added)."""
    src = tmp_path / "src"
    made = _safetensors_source(tmp_path)
    src.mkdir()
    shutil.move(made, src / "model.safetensors")
    (src / "run.lock").write_text("held")
    real = certificate.file_digest

    def refusing(path):
        if path.endswith("run.lock"):
            raise PermissionError(13, "Permission denied", path)
        return real(path)

    monkeypatch.setattr(certificate, "file_digest", refusing)
    ckpt = jax_ucp.convert(src, tmp_path / "ucp")
    recorded = _recorded(ckpt)
    assert list(recorded["files"]) == ["model.safetensors"]
    assert recorded["unread"] == {
        "run.lock": f"cannot be read: PermissionError: [Errno 13] Permission denied: "
        f"'{src / 'run.lock'}'"
    }
    assert certificate.check(str(src), recorded) == ({}, 1)
    found = jax_ucp.verify(ckpt, against=src)
    assert found == [] and found.against is not None and found.against.equal == ["params/a"]


def test_a_link_leading_out_of_the_source_is_never_read(tmp_path):
    """A file linked out of the source (another user's file) is listed as not read, never
    hashed; a link that stays inside is read as the file it names; one made out later is a
    problem named by the check."""
    src = tmp_path / "src"
    src.mkdir()
    (src / "a.bin").write_bytes(b"x" * 10)
    (tmp_path / "secret").write_bytes(b"s" * 5)
    os.symlink(tmp_path / "secret", src / "out.bin")
    os.symlink("a.bin", src / "in.bin")
    cert = certificate.certify(src)
    assert set(cert["files"]) == {"a.bin", "in.bin"}
    assert "outside the checkpoint" in cert["unread"]["out.bin"]
    assert certificate.check(src, cert) == ({}, 2)
    os.remove(src / "in.bin")
    os.symlink(tmp_path / "secret", src / "in.bin")  # swapped for a link out
    problems, equal = certificate.check(src, cert)
    assert equal == 1 and "outside the checkpoint" in problems["in.bin"], problems


def _cache_snapshot(tmp_path) -> str:
    """A Hugging Face cache snapshot (``models--org--m/snapshots/<rev>/``) whose files are links
    into the repo's ``blobs/``, each named by its SHA-256, as huggingface_hub lays them out."""
    repo = tmp_path / "models--org--m"
    snapshot = repo / "snapshots" / "0123abcd"
    (repo / "blobs").mkdir(parents=True)
    snapshot.mkdir(parents=True)
    plain = tmp_path / "plain"
    plain.mkdir()
    shutil.move(_safetensors_source(tmp_path), plain / "model.safetensors")
    (plain / "config.json").write_text('{"model_type": "llama"}')
    for name in sorted(os.listdir(plain)):
        data = (plain / name).read_bytes()
        blob = hashlib.sha256(data).hexdigest()
        (repo / "blobs" / blob).write_bytes(data)
        os.symlink(f"../../blobs/{blob}", snapshot / name)
    return str(snapshot)


def test_a_hub_cache_snapshot_is_certified_and_compared_through_its_links(tmp_path):
    """Files that are links into the cache repo's ``blobs/``: certified through the link (before:
    0 files, each "not read") and read by their format (before: a blob without the
    ``.safetensors`` name went to torch.load, "mmap can only be used with ..."); a blob changed
    since is named by its snapshot name."""
    src = _cache_snapshot(tmp_path)
    ckpt = jax_ucp.convert(src, tmp_path / "ucp")
    assert sorted(_recorded(ckpt)["files"]) == ["config.json", "model.safetensors"]
    found = jax_ucp.verify(ckpt, against=src)
    assert found == [] and found.against is not None and found.against.equal == ["params/a"]
    blob = os.path.realpath(os.path.join(src, "model.safetensors"))
    os.chmod(blob, 0o644)
    with open(blob, "r+b") as f:  # one element's high byte
        f.seek(-1, os.SEEK_END)
        last = f.read(1)
        f.seek(-1, os.SEEK_END)
        f.write(bytes([last[0] ^ 0x40]))
    bad = jax_ucp.verify(ckpt, against=src)
    assert [n for n, _ in bad] == ["model.safetensors", "params/a"], bad
