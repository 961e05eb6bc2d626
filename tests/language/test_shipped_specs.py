"""The shipped specs on real megatron-core checkpoints (tests/fixtures/megatron, consolidated by
torch's own DCP loader), without the importer: the mixtral spec's split layout and optimizer
roots on stacked experts. (Spec restore vs the reference logits, per fixture, is
tests/importers/megatron/test_import.py::test_shipped_spec_restore_gives_reference_logits.)"""

import pathlib

import numpy as np
import pytest

from jax_ucp import language as L
from tests.ucp_testing import REPO

FIX = pathlib.Path(REPO) / "tests" / "fixtures" / "megatron"


def load(name):
    p = FIX / f"{name}.consolidated.npz"
    if not p.exists():
        pytest.skip(f"fixture {p} not present")
    z = np.load(p)
    return {k: z[k] for k in z.files if not k.startswith("__")}


def test_mixtral_spec_on_real_moe_checkpoint():
    w = load("moe_ep2")
    spec = L.load_spec("mixtral", mlp_layout="split")
    out = L.apply_spec_to_tree(spec, {"params": w, "opt_state": {"mu": w}})
    fc1 = w["decoder.layers.mlp.experts.experts.linear_fc1.weight"]  # [L, E, 2F, H]
    F, last = fc1.shape[2] // 2, fc1.shape[0] - 1
    np.testing.assert_array_equal(
        out["params"][f"layers_{last}"]["moe"]["up"]["kernel"], fc1[last, :, F:].transpose(0, 2, 1)
    )
    np.testing.assert_array_equal(
        out["opt_state"]["0"]["mu"]["layers_0"]["moe"]["router"]["kernel"],
        w["decoder.layers.mlp.router.weight"][0].T,
    )
    fc2 = w["decoder.layers.mlp.experts.experts.linear_fc2.weight"]  # [L, E, H, F]
    np.testing.assert_array_equal(
        out["params"]["layers_0"]["moe"]["fc2"]["kernel"], fc2[0].transpose(0, 2, 1)
    )  # [E, F, H]
