"""``jax-ucp verify SRC`` / ``jax_ucp.verify(SRC)`` on a torch source itself (no jax_ucp
checkpoint): every tensor read through its import, the readers' checks run (zip CRC-32s, DCP
chunk coverage, megatron-core's integrity.json, ZeRO ranks), what the files record no check of
said; ``--against`` says how many tensors it compared. Real fixtures."""

from __future__ import annotations

import os
import shutil
import struct
import zipfile

import pytest

import jax_ucp
from tests.ucp_testing import FIXTURES, run_cli

SOURCES = {
    "dcp": os.path.join(FIXTURES, "torch", "fsdp2_fp32"),
    "trainer": os.path.join(FIXTURES, "hf_trainer", "llama_z2_dp2", "checkpoint-2"),
    "deepspeed": os.path.join(FIXTURES, "deepspeed", "z2_bf16_dp2", "ckpt"),
    "megatron": os.path.join(FIXTURES, "megatron", "gpt_tp2"),
    "megatron_legacy": os.path.join(FIXTURES, "megatron", "legacy_llama_tp2_synthetic"),
    "torch_save": os.path.join(FIXTURES, "torch", "plain_state_dict.pt"),
    "verl": os.path.join(FIXTURES, "verl", "fsdp2"),
}
INTEGRITY = os.path.join(FIXTURES, "megatron", "mcore_versions", "0.19.2", "gpt_tp2_integrity")


def _checked(src):
    found = jax_ucp.verify(src)
    assert list(found) == [] and found.source is not None, found
    return found.source


def _one_line(text: str) -> str:
    return " ".join(text.split())


@pytest.mark.parametrize("kind", sorted(SOURCES))
def test_an_intact_source(kind):
    src = SOURCES[kind]
    check = _checked(src)
    n = len(jax_ucp.inspect(src).tensors)
    assert check.tensors == n and f"every tensor read whole: {n} tensors" in check.checked
    assert any("the values are the run's" in u for u in check.unchecked)
    r = run_cli("verify", src)
    assert r.returncode == 0, r.stdout + r.stderr
    out = _one_line(r.stdout)
    assert f"✓ {n} tensors of the {check.format} source read back intact" in out
    assert "not a jax_ucp checkpoint" not in out and "not checked:" in out


def test_what_each_kind_checks():
    assert any("CRC-32" in c for c in _checked(SOURCES["torch_save"]).checked)
    dcp = _checked(SOURCES["dcp"])
    assert any("cover its global shape" in c for c in dcp.checked)
    assert any("written raw" in u for u in dcp.unchecked)
    assert any("source.skipped" in u for u in dcp.unchecked)  # the optimizer's param_groups
    ds = _checked(SOURCES["deepspeed"])
    assert "the ZeRO optimizer files of all 2 data-parallel ranks" in ds.checked
    mcore = _checked(SOURCES["megatron"])
    assert any("no integrity.json" in u for u in mcore.unchecked)
    vouched = _checked(INTEGRITY)
    assert "integrity.json: 4 files equal to integrity.json's SHA-256" in vouched.checked
    assert not any("integrity" in u for u in vouched.unchecked)


def _flip_storage_byte(path: str) -> str:
    """One byte of a storage of the torch zip at ``path`` flipped (its recorded CRC-32 kept);
    the member's name."""
    with zipfile.ZipFile(path) as z:
        info = next(i for i in z.infolist() if "/data/" in i.filename and i.file_size > 8)
    with open(path, "r+b") as f:
        f.seek(info.header_offset)
        header = f.read(30)
        name_len, extra_len = struct.unpack("<HH", header[26:30])
        at = info.header_offset + 30 + name_len + extra_len + 4
        f.seek(at)
        byte = f.read(1)[0]
        f.seek(at)
        f.write(bytes([byte ^ 0x01]))
    return info.filename


def test_a_flipped_storage_byte_is_named(tmp_path):
    src = tmp_path / "state.pt"
    shutil.copy(SOURCES["torch_save"], src)
    member = _flip_storage_byte(str(src))
    found = jax_ucp.verify(src)
    assert len(found) == 1 and "CRC-32" in found[0][1], found
    r = run_cli("verify", str(src))
    assert r.returncode == 1
    out = _one_line(r.stdout)
    assert "CRC-32" in out and "1 problem in the torch source" in out, out
    assert member.rsplit("/", 1)[-1] in out or found[0][0] in out


def test_a_missing_rank_is_the_problem(tmp_path):
    """A ZeRO rank's optimizer file gone: the import is refused, naming the rank."""
    src = tmp_path / "ckpt"
    shutil.copytree(SOURCES["deepspeed"], src)
    os.remove(src / "global_step2" / "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt")
    found = jax_ucp.verify(src)
    assert len(found) == 1 and found[0][0] == str(src)
    assert "missing optimizer file for DP rank 1" in found[0][1], found
    assert run_cli("verify", str(src)).returncode == 1


def test_dcp_chunks_not_covering_a_tensor(tmp_path):
    """A rank's DCP file gone: its chunks no longer cover the tensors, refused naming it."""
    src = tmp_path / "dcp"
    shutil.copytree(SOURCES["dcp"], src)
    os.remove(src / "__1_0.distcp")
    found = jax_ucp.verify(src)
    assert len(found) == 1 and "__1_0.distcp" in found[0][1], found


def test_integrity_json_vouching_against_a_file(tmp_path):
    src = tmp_path / "ckpt"
    shutil.copytree(INTEGRITY, src)
    path = src / "__1_0.distcp"
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))
    found = jax_ucp.verify(src)
    assert len(found) == 1 and "SHA-256" in found[0][1], found


def test_against_a_source_is_refused_naming_it():
    with pytest.raises(jax_ucp.RequestError, match="is itself a torch source"):
        jax_ucp.verify(SOURCES["torch_save"], against=SOURCES["torch_save"])


@pytest.mark.torch
def test_against_prints_the_counts(tmp_path):
    """``verify CKPT --against SRC``: compared / not compared / missing, counted."""
    src = SOURCES["dcp"]
    ckpt = jax_ucp.convert(src, tmp_path / "ucp")
    found = jax_ucp.verify(ckpt, against=src)
    assert list(found) == [] and found.against is not None
    equal, skipped = len(found.against.equal), len(found.against.not_compared)
    assert equal > 0
    r = run_cli("verify", ckpt, "--against", src)
    assert r.returncode == 0, r.stdout + r.stderr
    out = _one_line(r.stdout)
    assert (
        f"against {src}: {equal} tensors compared ({equal} equal, 0 different), "
        f"{skipped} not compared (built by the import), 0 missing from the checkpoint"
    ) in out
