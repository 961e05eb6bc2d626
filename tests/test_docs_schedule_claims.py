"""README.md and docs/TORCH.md say per source what it records of the schedule and clipping
(issue 60: README claimed "schedule, clipping" for every Trainer / Accelerate / PEFT folder), and
what they say holds: a source said to record none continues with both in ``run.unrecovered``."""

from __future__ import annotations

import os
import re
import warnings

import pytest

import jax_ucp
from tests.ucp_testing import REPO


def _rows(path: str) -> dict[str, str]:
    """{a table row's first cell: the row} of a Markdown file."""
    with open(os.path.join(REPO, path), encoding="utf-8") as f:
        rows = [line for line in f if line.startswith("| ") and not line.startswith("|---")]
    return {row.split("|")[1].strip(): row for row in rows}


def test_readme_states_schedule_and_clipping_per_source():
    rows = _rows("README.md")
    trainer = rows["Hugging Face Trainer / Accelerate / PEFT folders"]
    assert "schedule and clipping where `training_args.bin` records them" in trainer
    assert "FSDP-sharded" in trainer and "save_state" in trainer
    dcp = next(r for k, r in rows.items() if k.startswith("torch DCP"))
    assert "no schedule or clipping recorded" in dcp and "`schedule=` / `clip=`" in dcp
    assert "no schedule or clipping recorded" in next(
        r for k, r in rows.items() if k.startswith("torchtune")
    )
    ds = next(r for k, r in rows.items() if k.startswith("DeepSpeed ZeRO"))
    assert "`scheduler` and `gradient_clipping`" in ds
    mg = next(r for k, r in rows.items() if k.startswith("Megatron-LM"))
    assert "`OptimizerParamScheduler` and `clip_grad`" in mg


def test_torch_md_tables_the_schedule_and_clipping_of_each_source():
    rows = _rows(os.path.join("docs", "TORCH.md"))
    none = [k for k, r in rows.items() if re.search(r"none: pass `schedule=` \| none: pass", r)]
    assert any("FSDP-sharded" in k for k in none)
    assert any("plain torch DCP" in k for k in none)
    with open(os.path.join(REPO, "docs", "TORCH.md"), encoding="utf-8") as f:
        assert "refused for FusedAdam" not in f.read()  # translated now (continuation.deepspeed)


@pytest.mark.timeout(300)
def test_a_source_said_to_record_neither_continues_saying_both_are_missing():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        run = jax_ucp.optax_from_torch(
            os.path.join(REPO, "tests", "fixtures", "torch", "fsdp2_fp32")
        )
    said = " ".join(run.unrecovered)
    assert "learning-rate schedule (none recorded" in said
    assert "gradient clipping (none recorded" in said
