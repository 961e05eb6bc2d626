"""convert refuses what it must not read or write: hostile sources (FIFOs, links leading out,
swapped or damaged files) are one clear error naming the file with nothing written, and the
destination never lies in, over or inside the source."""

from __future__ import annotations

import os
import shutil

import pytest

import jax_ucp
from tests.ucp_testing import REPO
from tests.ucp_testing import copy_fixture as _copy


@pytest.mark.timeout(120)
def test_convert_never_writes_into_or_over_its_source(tmp_path):
    src = tmp_path / "ds"
    shutil.copytree(os.path.join(REPO, "tests/fixtures/deepspeed/z2_bf16_dp2/ckpt"), src)
    before = sorted(p for p, _, _ in os.walk(src))
    for dest in (src, src / "global_step2" / "out", tmp_path):
        with pytest.raises(jax_ucp.UCPError, match="is, contains or lies inside the source"):
            jax_ucp.convert(src, dest, force=True)
    assert sorted(p for p, _, _ in os.walk(src)) == before


def _fifo(path):
    path.unlink()
    os.mkfifo(path)


def _write(path, text):
    path.write_text(text)


CASES = {
    "DeepSpeed rank file is a FIFO": (
        "deepspeed/z2_bf16_dp2/ckpt",
        lambda src, tmp: _fifo(src / "global_step2/bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt"),
        r"bf16_zero_pp_rank_1_mp_rank_00_optim_states\.pt.*not a regular file \(a FIFO\)",
    ),
    "DeepSpeed model states file is a FIFO": (
        "deepspeed/z2_bf16_dp2/ckpt",
        lambda src, tmp: _fifo(src / "global_step2/mp_rank_00_model_states.pt"),
        r"mp_rank_00_model_states\.pt: not a regular file \(a FIFO\)",
    ),
    "DeepSpeed latest is a FIFO": (
        "deepspeed/z2_bf16_dp2/ckpt",
        lambda src, tmp: _fifo(src / "latest"),
        r"latest: not a regular file \(a FIFO\)",
    ),
    "DeepSpeed latest leads outside": (
        "deepspeed/z2_bf16_dp2/ckpt",
        lambda src, tmp: (
            shutil.copytree(src / "global_step2", tmp / "other"),
            _write(src / "latest", "../other"),
        ),
        r"latest names tag '\.\./other', which is not a folder inside",
    ),
    "DeepSpeed latest names an absolute path outside": (
        "deepspeed/z2_bf16_dp2/ckpt",
        lambda src, tmp: (
            shutil.copytree(src / "global_step2", tmp / "other"),
            _write(src / "latest", str(tmp / "other")),
        ),
        r"which is not a folder inside",
    ),
    "DeepSpeed tag folder is a symlink outside": (
        "deepspeed/z2_bf16_dp2/ckpt",
        lambda src, tmp: (
            shutil.move(src / "global_step2", tmp / "moved"),
            (src / "global_step2").symlink_to(tmp / "moved"),
        ),
        r"not a folder inside",
    ),
    "distcp shard is a FIFO": (
        "megatron/gpt_tp2",
        lambda src, tmp: _fifo(src / "__1_0.distcp"),
        r"__1_0\.distcp: not a regular file \(a FIFO\)",  # never opened, so no hang
    ),
    "DeepSpeed stage-3 model states file is a FIFO": (
        "deepspeed/z3_fp32_dp2/ckpt",
        lambda src, tmp: _fifo(src / "global_step2/zero_pp_rank_1_mp_rank_00_model_states.pt"),
        r"zero_pp_rank_1_mp_rank_00_model_states\.pt: not a regular file \(a FIFO\)",
    ),
    "Megatron common.pt is a FIFO": (
        "megatron/gpt_tp2",
        lambda src, tmp: _fifo(src / "common.pt"),
        r"common\.pt: not a regular file \(a FIFO\)",
    ),
    "Megatron .metadata is a FIFO": (
        "megatron/gpt_tp2",
        lambda src, tmp: _fifo(src / ".metadata"),
        r"\.metadata: not a regular file \(a FIFO\)",
    ),
    "Megatron tracker file is a FIFO": (
        "megatron/gpt_tp2",
        lambda src, tmp: _as_iteration(src, lambda root: os.mkfifo(root / TRACKER)),
        r"latest_checkpointed_iteration\.txt: not a regular file \(a FIFO\)",
    ),
    "Megatron tracker file is absurdly large": (
        "megatron/gpt_tp2",
        lambda src, tmp: _as_iteration(src, lambda root: _write(root / TRACKER, "2" * 100_000)),
        r"latest_checkpointed_iteration\.txt: 100000 bytes, more than the 4096",
    ),
    "DeepSpeed rank file with a flipped byte (zip CRC-32)": (
        "deepspeed/z3_bf16_dp2/ckpt",
        lambda src, tmp: _flip(src / "global_step2/bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt"),
        r"bf16_zero_pp_rank_1_mp_rank_00_optim_states\.pt: member '.*': CRC-32 mismatch",
    ),
    "distcp shard with a flipped byte (zip CRC-32)": (
        "megatron/gpt_tp2",
        lambda src, tmp: _flip(src / "__0_1.distcp"),
        # a small chunk is read whole, its archive's member checked (``torch_zip``)
        r"tensor '.*' chunk at offsets \[.*\] in .*__0_1\.distcp: (.*distcp@[0-9]+: member '.*': )?"
        r"CRC-32 mismatch \(the (chunk's )?archive records [0-9a-f]{8}, its bytes give [0-9a-f]{8}\)",
    ),
}


TRACKER = "latest_checkpointed_iteration.txt"


def _as_iteration(src, damage_root):
    """Moves the torch_dist folder ``src`` to ``src/iter_0000002`` (a Megatron-LM root with a
    tracker file), then damages the root."""
    inner = src.parent / "inner"
    src.rename(inner)
    src.mkdir()
    inner.rename(src / "iter_0000002")
    damage_root(src)


def _flip(path, at: int = 400):
    """Flips one bit in the first tensor storage of a torch archive (after ``data/0``'s name)."""
    raw = bytearray(path.read_bytes())
    raw[raw.index(b"data/0") + at] ^= 0x01
    path.write_bytes(bytes(raw))


@pytest.mark.timeout(60)
@pytest.mark.parametrize("case", sorted(CASES))
def test_hostile_source_is_a_clear_error(tmp_path, case):
    rel, damage, message = CASES[case]
    src = _copy(tmp_path, rel)
    damage(src, tmp_path)
    with pytest.raises(jax_ucp.UCPError, match=message):
        jax_ucp.convert(src, tmp_path / "out")
    assert not os.path.exists(tmp_path / "out")


@pytest.mark.parametrize("keywords", [{"step": 3}, {"distributed": True}])
def test_step_and_distributed_to_an_object_store_are_refused_before_reading(tmp_path, keywords):
    """``step=`` and ``distributed=True`` write local (or shared) folders: an ``s3://``
    destination is refused by its Storage (``local_folder``), naming it, before the source is
    read (none here) or a server asked (none runs)."""
    with pytest.raises(jax_ucp.RequestError, match="step= and distributed=True") as e:
        jax_ucp.convert(tmp_path / "absent", "s3://bucket/ckpt", **keywords)
    assert "s3://bucket/ckpt" in str(e.value)
