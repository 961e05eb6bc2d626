"""The ZeRO reader: rank files renamed or swapped, and an fp32 master that disagrees with the saved
model weights, are refused naming the parameter and the files."""

from __future__ import annotations

import os

import pytest

import jax_ucp
from jax_ucp._src.store.storage import LocalDirectory
from jax_ucp.conversion import ImportOptions
from tests.ucp_testing import FIXTURES as FIXTURES
from tests.ucp_testing import copy_fixture as _copy

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


@pytest.mark.timeout(60)
@pytest.mark.parametrize("rel", ZERO_FIXTURES)
def test_renamed_rank_files_are_refused(tmp_path, rel):
    src = _copy(tmp_path, rel)
    _swap_rank_files(src / "global_step2", 0, 1, keep_saved_names=False)
    with pytest.raises(jax_ucp.UCPError, match=r"rank_0_.*this file was saved as '.*rank_1_"):
        jax_ucp.convert(src, tmp_path / "out")
    assert not os.path.exists(tmp_path / "out")


@pytest.mark.timeout(60)
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


@pytest.mark.timeout(60)
@pytest.mark.parametrize("rel", ["deepspeed/z1_bf16_dp3/ckpt", "deepspeed/z2_fp32_dp2/ckpt"])
def test_module_weights_catch_a_wrong_master(rel):
    """Stage 1/2: an fp32 master that does not round to the saved model weight at the ends of
    its rank pieces (a stale or foreign partition) is refused, naming parameter and files."""
    from jax_ucp._src.importers.deepspeed import zero as deepspeed_zero

    checkpoint = deepspeed_zero.open_zero_checkpoint(
        LocalDirectory(os.path.join(FIXTURES, rel, "global_step2"))
    )
    name = next(n for n, f in checkpoint.fragment_plan.items() if len(f.pieces) > 1)
    fp32 = deepspeed_zero.gather_parameter(checkpoint, name, "fp32", {}).copy()
    deepspeed_zero.check_against_module(checkpoint, name, fp32)  # as saved: agrees
    first_piece = checkpoint.fragment_plan[name].pieces[0].numel
    fp32.reshape(-1)[first_piece] += 1.0  # the first element of the second rank's piece
    with pytest.raises(jax_ucp.UCPError, match=rf"parameter '{name}'.*flat index {first_piece}"):
        deepspeed_zero.check_against_module(checkpoint, name, fp32)


def _moments(x, at=""):
    """The Adam moments (``exp_avg``, ``exp_avg_sq`` tensors) of a loaded rank file."""
    import numpy as np

    if isinstance(x, dict):
        for k, v in x.items():
            if k in ("exp_avg", "exp_avg_sq") and isinstance(v, np.ndarray):
                yield f"{at}.{k}", v
            else:
                yield from _moments(v, f"{at}.{k}")
    elif isinstance(x, (list, tuple)):
        for k, v in enumerate(x):
            yield from _moments(v, f"{at}.{k}")


def _masters(x):
    """The fp32 master partitions (ZeRO-3 ``fp32_flat_groups``, ZeRO-1/2
    ``single_partition_of_fp32_groups``) of a loaded rank file."""
    import numpy as np

    if isinstance(x, dict):
        for k, v in x.items():
            if k in ("fp32_flat_groups", "single_partition_of_fp32_groups"):
                yield from (t for t in v if isinstance(t, np.ndarray))
            else:
                yield from _masters(v)
    elif isinstance(x, (list, tuple)):
        for v in x:
            yield from _masters(v)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("name", ["z3_bf16_dp2", "z2_fp32_dp2"])
def test_weights_only_checks_the_masters_it_reads(tmp_path, name):
    """The CRC-32 a weights-only import defers to the first read still guards what it does
    read: a byte of an fp32 master damaged is refused, naming the rank file, not imported."""
    from jax_ucp._src.format import mapped_file
    from jax_ucp._src.importers.deepspeed.files import load_deepspeed_file
    from tests.ucp_testing import assert_convert_refused

    src = _copy(tmp_path, f"deepspeed/{name}/ckpt")
    path = sorted((src / "global_step2").glob("*optim_states.pt"))[0]
    raw = bytearray(path.read_bytes())
    master = next(
        _masters(load_deepspeed_file(LocalDirectory(str(path.parent)), path.name, lazy_crc=True))
    )
    _, offset = mapped_file.mapped_at(master)
    raw[offset + master.nbytes // 2] ^= 0x40
    path.write_bytes(bytes(raw))
    assert_convert_refused(
        src,
        tmp_path / "out",
        rf"{path.name}: member .*CRC-32 mismatch",
        importing=ImportOptions(weights_only=True),
    )


@pytest.mark.timeout(120)
@pytest.mark.parametrize("name", ["z3_bf16_dp2", "z2_bf16_dp2"])
def test_weights_only_never_reads_the_moments(tmp_path, name):
    """A weights-only import reads the fp32 masters, not the Adam moments beside them in the
    rank files (two thirds of their bytes): with a byte of every moment damaged (its CRC-32
    no longer matches) it imports exactly what it imports from the intact files, while a full
    import refuses the damaged bytes."""
    import numpy as np

    from jax_ucp._src.format import mapped_file
    from jax_ucp._src.importers.deepspeed.files import load_deepspeed_file
    from tests.ucp_testing import assert_bit_exact, assert_convert_refused

    rel = f"deepspeed/{name}/ckpt"
    src = _copy(tmp_path, rel)
    damaged = 0
    for path in sorted((src / "global_step2").glob("*optim_states.pt")):
        raw = bytearray(path.read_bytes())
        for _, moment in _moments(
            load_deepspeed_file(LocalDirectory(str(path.parent)), path.name, lazy_crc=True)
        ):
            _, offset = mapped_file.mapped_at(moment)
            raw[offset + moment.nbytes // 2] ^= 0x40
            damaged += 1
        path.write_bytes(bytes(raw))
    assert damaged >= 4  # two moments on each of the (at least two) ranks
    assert_convert_refused(src, tmp_path / "full", r"optim_states\.pt: member .*CRC-32 mismatch")
    want = jax_ucp.restore(
        jax_ucp.convert(
            os.path.join(FIXTURES, rel), tmp_path / "a", importing=ImportOptions(weights_only=True)
        )
    )
    got = jax_ucp.restore(
        jax_ucp.convert(src, tmp_path / "b", importing=ImportOptions(weights_only=True))
    )
    assert sorted(got) == sorted(want) == ["model_params", "params"]
    for tree in want:
        assert sorted(got[tree]) == sorted(want[tree])
        for n in want[tree]:
            assert_bit_exact(np.asarray(got[tree][n]), np.asarray(want[tree][n]), f"{tree}/{n}")
