"""``steps``: the one step-name rule of a CheckpointManager root (``StepFormat``, ``run_steps``),
on hostile names."""

from __future__ import annotations

import os
import re

import numpy as np
import pytest
from etils import epath
from orbax.checkpoint._src.path import step as orbax_step

import jax_ucp
from jax_ucp._src.restoring import steps

NAMES = ["12", "0012", "012", "0", "00", "ckpt_12", "ckpt_0012", "x_ckpt_12", "12345", "1_2"]
NAMES += ["١٢", "１３", "²", "1٢", "ckpt_١٢", "+12", " 12", "12 ", "0x12", "1e3"]


@pytest.mark.parametrize("prefix", [None, "ckpt"])
@pytest.mark.parametrize("fixed", [None, 4])
def test_a_step_name_is_what_orbax_builds_in_ascii_digits(tmp_path, prefix, fixed):
    """The step of a folder name is exactly Orbax's standard name format's (its regex), but in
    ASCII digits only (Orbax's ``\\d`` takes ``1٢`` as 12)."""
    step_format = steps.StepFormat(prefix, fixed)
    orbax = orbax_step.standard_name_format(step_prefix=prefix, step_format_fixed_length=fixed)
    for name in NAMES:
        (tmp_path / name).mkdir()
        theirs = orbax._build_metadata(epath.Path(tmp_path / name))  # pyright: ignore[reportAttributeAccessIssue]
        expected = None if theirs is None or not name.isascii() else theirs.step
        assert step_format.step_of(name) == expected, name
        (tmp_path / name).rmdir()
    assert step_format.name(12) == orbax.build_name(12)


def _manager_root(tmp_path, names) -> str:
    root = tmp_path / "run"
    for name in names:
        item = root / name / "state"
        jax_ucp.save(str(item), {"w": np.zeros(2, np.float32)})
        (root / name / "_CHECKPOINT_METADATA").write_text(
            '{"item_handlers": {"state": "jax_ucp.orbax.handler.UCPCheckpointHandler"}, '
            '"commit_timestamp_nsecs": 1}'
        )
    return str(root)


def test_run_steps_never_takes_other_digits_and_never_raises_a_raw_value_error(tmp_path):
    root = _manager_root(tmp_path, ["5", "10", "١٢", "１３", "²"])
    listed = steps.run_steps(root)
    assert [s.step for s in listed.steps] == [10, 5]
    assert sorted(re.sub(r".*/", "", n.split(":")[0]) for n in listed.notices) == sorted(
        ["١٢", "１３", "²"]
    )


def test_two_names_for_one_step_are_an_error_naming_them(tmp_path):
    root = _manager_root(tmp_path, ["0005", "0012", "12"])
    with pytest.raises(jax_ucp.CheckpointError, match=r"0005, 0012 zero-padded; 12 not"):
        steps.run_steps(root)
    listed = steps.run_steps(root, steps.StepFormat(fixed_length=4))
    assert [s.step for s in listed.steps] == [12, 5]
    assert [n.split(":")[0] for n in listed.notices] == [os.path.join(root, "12")]
    root = _manager_root(tmp_path / "b", ["ckpt_5", "5"])
    with pytest.raises(jax_ucp.CheckpointError, match=r"named in 2 ways \(5, ckpt_5\)"):
        steps.run_steps(root)
