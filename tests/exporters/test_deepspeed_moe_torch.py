"""DeepSpeed universal of a transformers 5 MoE model: a Qwen3-MoE flax tree with Adam moments
exported with the family's spec (``hf_names`` left at its files' default) writes the names the
model holds, its experts fused (``mlp.experts.gate_up_proj`` [E, 2F, H], ``down_proj``), which is
what DeepSpeed's ``load_universal`` opens (``zero/<parameter>/``): DeepSpeed loads it into the
transformers model, every fp32 master and moment the export's bit for bit, and the export
verifies against its checkpoint."""

from __future__ import annotations

import os

import jax
import numpy as np
import pytest

import jax_ucp
from jax_ucp._src.exporters import DeepSpeedUniversalExport
from jax_ucp._src.language import apply_spec_to_tree, load_spec
from jax_ucp._src.language.inverse import invert_spec
from tests.exporters.test_by_spec import random_tree
from tests.ucp_testing import run_torchrun

pytestmark = pytest.mark.torch


@pytest.mark.slow  # ~1 min here: DeepSpeed's engine built on CPU (as test_export.py's)
@pytest.mark.timeout(300)
def test_deepspeed_loads_an_moe_export_into_the_transformers_model(tmp_path):
    pytest.importorskip("deepspeed")
    cfg, name, tree = random_tree("qwen3_moe")
    mu = jax.tree.map(lambda x: 0.5 * x, tree)
    nu = jax.tree.map(lambda x: x * x, tree)
    state = {"mu": mu, "nu": nu, "count": np.asarray(3, np.int32)}
    ckpt = jax_ucp.save(str(tmp_path / "jax"), {"params": tree, "opt_state": {"0": state}})
    spec = load_spec(name, **cfg.head_settings)  # hf_names = "files": the default
    jax_ucp.export(ckpt, tmp_path / "ds", DeepSpeedUniversalExport(spec=spec))
    zero = os.listdir(tmp_path / "ds" / "global_step3_universal" / "zero")
    assert "model.layers.1.mlp.experts.gate_up_proj" in zero  # layer 0: dense
    assert jax_ucp.verify(tmp_path / "ds", against=ckpt, spec=spec) == []

    script = os.path.join(os.path.dirname(__file__), "ds_universal_load.py")
    out = str(tmp_path / "loaded.npz")
    run_torchrun(script, "qwen3_moe", str(tmp_path / "ds"), out, processes=1, timeout=280)
    loaded = dict(np.load(out))
    assert list(loaded.pop("step")) == [3.0]
    fused = invert_spec(spec.with_settings(hf_names="state_dict"))
    want = {
        prefix: apply_spec_to_tree(fused, {"params": t})["params"]
        for prefix, t in (("", tree), ("exp_avg/", mu), ("exp_avg_sq/", nu))
    }
    want = {prefix + n: v for prefix, named in want.items() for n, v in named.items()}
    assert sorted(loaded) == sorted(want)
    for key, value in want.items():
        np.testing.assert_array_equal(loaded[key], np.asarray(value, np.float32), err_msg=key)
