"""megatron-core's ``fsdp_dtensor`` layout (Megatron-LM ``--ckpt-format fsdp_dtensor``,
Megatron-FSDP) is refused by name, whichever importer reaches it: real ones cannot be written on
CPU (tools/fixtures/try_megatron_fsdp_dtensor.py), so the fixture is labelled synthetic
(tools/fixtures/make_megatron_fsdp_dtensor_synthetic.py: torch's own dcp.save of the key scheme
megatron-core 0.17-0.19 give that save)."""

from __future__ import annotations

import os

import pytest

import jax_ucp
from jax_ucp._src.torchfiles import dcp as torch_dcp
from jax_ucp.errors import SourceError
from tests.ucp_testing import REPO

ROOT = os.path.join(REPO, "tests", "fixtures", "megatron_fsdp_dtensor_synthetic")
ITER = os.path.join(ROOT, "iter_0000002")
WHY = (
    r"iter_0000002/\.metadata: a megatron-core fsdp_dtensor checkpoint \(Megatron-FSDP, "
    r"--ckpt-format fsdp_dtensor; key 'optimizer\.param_to_group_meta\.module\.module\."
    r"embedding\.word_embeddings\.weight\.lr'\): fsdp_dtensor is not supported"
)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("weights_only", [False, True])
@pytest.mark.parametrize(
    "src, fmt",
    [(ROOT, None), (ROOT, "megatron"), (ITER, None), (ITER, "torch"), (ITER, "megatron")],
)
def test_fsdp_dtensor_is_refused_by_name(tmp_path, src, fmt, weights_only):
    """Detected from .metadata's keys before any chunk is read, as a Megatron-LM checkpoint
    root, its iter_N folder, or forced through the torch DCP importer; nothing is written."""
    with pytest.raises(jax_ucp.UCPError, match=WHY + r".*weights_only=True does not avoid it"):
        jax_ucp.convert(src, str(tmp_path / "ucp"), format=fmt, weights_only=weights_only)
    assert not (tmp_path / "ucp").exists()


@pytest.mark.timeout(30)
def test_only_the_fsdp_dtensor_optimizer_key_is_refused():
    """The marker is megatron-core's fsdp_dtensor optimizer key, not a wrapped module name
    (``model.module.*`` is also what a DDP- or Float16Module-wrapped torch DCP save holds)."""
    torch_dcp.refuse_fsdp_dtensor(["model.module.x.weight", "checkpoint_version"], "f")
    torch_dcp.refuse_fsdp_dtensor(["optimizer.state.exp_avg.x", "optimizer.param_groups"], "f")
    with pytest.raises(SourceError, match=r"^f: a megatron-core fsdp_dtensor"):
        torch_dcp.refuse_fsdp_dtensor(["optimizer.param_to_group_meta.m.x.lr"], "f")
