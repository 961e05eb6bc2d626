"""Hostile source checkpoints: a clear jax_ucp error naming the file, nothing written, no hang.

Each case copies a committed fixture (written by DeepSpeed / megatron-core themselves, or labelled
synthetic) to a temporary folder, damages it, and converts it.
"""

from __future__ import annotations

import os
import shutil

import pytest

import jax_ucp
from tests.ucp_testing import REPO

pytestmark = pytest.mark.timeout(60)

FIXTURES = os.path.join(REPO, "tests", "fixtures")


def _copy(tmp_path, rel):
    dst = tmp_path / "src"
    shutil.copytree(os.path.join(FIXTURES, rel), dst, symlinks=True)
    return dst


def _fifo(path):
    path.unlink()
    os.mkfifo(path)


def _write(path, text):
    path.write_text(text)


def _outside_link(tmp_path, link, target_name="elsewhere"):
    outside = tmp_path / target_name
    outside.mkdir()
    link.symlink_to(outside, target_is_directory=True)


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
        r"tensor '.*' chunk at offsets \[.*\] in .*__0_1\.distcp: CRC-32 mismatch \(the chunk's "
        r"archive records [0-9a-f]{8}, its bytes give [0-9a-f]{8}\)",
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


@pytest.mark.parametrize("case", sorted(CASES))
def test_hostile_source_is_a_clear_error(tmp_path, case):
    rel, damage, message = CASES[case]
    src = _copy(tmp_path, rel)
    damage(src, tmp_path)
    with pytest.raises(jax_ucp.UCPError, match=message):
        jax_ucp.convert(src, tmp_path / "out")
    assert not os.path.exists(tmp_path / "out")


ZERO_FIXTURES = [
    f"deepspeed/{name}/ckpt"
    for name in ("z1_fp32_dp2", "z1_bf16_dp3", "z2_fp32_dp3", "z2_bf16_dp2", "z3_fp32_dp2")
    + ("z3_bf16_dp3",)
]


def _swap_rank_files(tag, a: int, b: int, *, keep_saved_names: bool):
    """Renames DP rank ``a``'s files to rank ``b``'s and back. With ``keep_saved_names`` the
    name inside each zip archive is rewritten too (same length, CRCs unchanged): what a tool
    that re-saves files under new names would leave, so only the data can tell."""
    for path in sorted(tag.glob(f"*zero_pp_rank_{a}_*")):
        other = tag / path.name.replace(f"zero_pp_rank_{a}_", f"zero_pp_rank_{b}_")
        tmp = tag / (path.name + ".tmp")
        path.rename(tmp)
        other.rename(path)
        tmp.rename(other)
    if keep_saved_names:
        for path in tag.glob("*zero_pp_rank_*"):
            raw = path.read_bytes()
            mine = path.name[: -len(".pt")].encode()
            theirs = mine.replace(f"rank_{a}_".encode(), f"rank_{b}_".encode())
            if theirs == mine:
                theirs = mine.replace(f"rank_{b}_".encode(), f"rank_{a}_".encode())
            path.write_bytes(raw.replace(theirs + b"/", mine + b"/"))


@pytest.mark.parametrize("rel", ZERO_FIXTURES)
def test_renamed_rank_files_are_refused(tmp_path, rel):
    src = _copy(tmp_path, rel)
    _swap_rank_files(src / "global_step2", 0, 1, keep_saved_names=False)
    with pytest.raises(jax_ucp.UCPError, match=r"rank_0_.*this file was saved as '.*rank_1_"):
        jax_ucp.convert(src, tmp_path / "out")
    assert not os.path.exists(tmp_path / "out")


@pytest.mark.parametrize("rel", [r for r in ZERO_FIXTURES if "/z3_" not in r])
def test_swapped_partitions_with_matching_names_are_refused(tmp_path, rel):
    """ZeRO-1/2: even with the saved names rewritten, the partitions' layout (a parameter split
    across ranks continues on the next rank) and the model weights saved beside them tell."""
    src = _copy(tmp_path, rel)
    _swap_rank_files(src / "global_step2", 0, 1, keep_saved_names=True)
    with pytest.raises(
        jax_ucp.UCPError, match=r"rank files (out of order, )?renamed|renamed, swapped"
    ):
        jax_ucp.convert(src, tmp_path / "out")
    assert not os.path.exists(tmp_path / "out")


@pytest.mark.parametrize("rel", ["deepspeed/z1_bf16_dp3/ckpt", "deepspeed/z2_fp32_dp2/ckpt"])
def test_module_weights_catch_a_wrong_master(rel):
    """Stage 1/2: an fp32 master that does not round to the saved model weight at the ends of
    its rank pieces (a stale or foreign partition) is refused, naming parameter and files."""
    from jax_ucp.importers.deepspeed import zero as deepspeed_zero

    checkpoint = deepspeed_zero.open_zero_checkpoint(os.path.join(FIXTURES, rel, "global_step2"))
    name = next(n for n, f in checkpoint.fragment_plan.items() if len(f.pieces) > 1)
    fp32 = deepspeed_zero.gather_parameter(checkpoint, name, "fp32", {}).copy()
    deepspeed_zero.check_against_module(checkpoint, name, fp32)  # as saved: agrees
    first_piece = checkpoint.fragment_plan[name].pieces[0].numel
    fp32.reshape(-1)[first_piece] += 1.0  # the first element of the second rank's piece
    with pytest.raises(jax_ucp.UCPError, match=rf"parameter '{name}'.*flat index {first_piece}"):
        deepspeed_zero.check_against_module(checkpoint, name, fp32)
