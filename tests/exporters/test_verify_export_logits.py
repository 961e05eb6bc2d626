"""``verify EXPORTED --against CKPT --logits``, torch-free: the export's model weights read by
its format's import (safetensors, torch DCP) and the checkpoint's run through
``TransformerLM`` on one batch; the model's settings are the export's ``config.json``, else the
checkpoint's recorded one, else refused naming both. bf16 / fp16 weights are computed in fp32."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

import jax_ucp
from jax_ucp._src.exporters import SafetensorsExport, TorchDcpExport
from jax_ucp.errors import RequestError
from jax_ucp.language import load_spec
from tests.exporters.test_by_spec import _config, random_tree

#: torch-free, but JAX compiles the model's ops on their first use (seconds on a CI runner, far
#: beyond a default test's): run in the framework stage beside the other model round trips
pytestmark = pytest.mark.torch


@pytest.fixture(scope="module")
def mistral(tmp_path_factory):
    """A Mistral flax tree (random weights) saved, its spec and config.json (dense, untied: an
    MoE's first forward pass costs JAX ~30 s of compiling here; a tied model's DCP names all
    start with ``model.``, which its import reads as the state dict's model key)."""
    root = tmp_path_factory.mktemp("export_logits")
    cfg, name, tree = random_tree("mistral")
    ckpt = jax_ucp.save(str(root / "flax"), {"params": tree})
    return root, ckpt, tree, load_spec(name, **cfg.head_settings), _config("mistral")


def test_safetensors_and_dcp_exports_compute_the_checkpoints_logits(mistral):
    root, ckpt, _, spec, config = mistral
    jax_ucp.export(ckpt, root / "hf", SafetensorsExport(spec=spec, config=config))
    found = jax_ucp.verify(root / "hf", against=ckpt, spec=spec, logits=True)
    assert list(found) == [] and found.logits is not None, found
    assert found.logits.max_abs_diff == 0 and "safetensors import" in found.logits.source
    # the safetensors folder imported (it records its config.json), exported as torch DCP under
    # the same names: the settings come from the checkpoint's record
    imported = jax_ucp.convert(root / "hf", root / "ucp")
    jax_ucp.export(imported, root / "dcp", TorchDcpExport(select="params"))
    found = jax_ucp.verify(root / "dcp", against=imported, logits=True)
    assert list(found) == [] and found.logits is not None and found.logits.max_abs_diff == 0
    # a DCP export by spec: neither it nor the flax tree names the model
    jax_ucp.export(ckpt, root / "dcp_by_spec", TorchDcpExport(spec=spec, select="params"))
    assert not jax_ucp.verify(root / "dcp_by_spec", against=ckpt, spec=spec)
    with pytest.raises(RequestError, match=r"--logits needs the model's settings.*records none"):
        jax_ucp.verify(root / "dcp_by_spec", against=ckpt, spec=spec, logits=True)


@pytest.mark.parametrize("half", ["bfloat16", "float16"])
def test_half_precision_runs_and_exports(mistral, half):
    """A bf16 / fp16 run exported as it is: the logits equal (computed in fp32); an fp32 run
    exported in half precision: the logits moved by its rounding, a problem (the random weights'
    logits are large: 1e-4 is far below the rounding's effect)."""
    root, ckpt, tree, spec, config = mistral
    dtype = getattr(ml_dtypes, half, None) or np.dtype(half)
    low = jax_ucp.save(str(root / f"flax_{half}"), {"params": _cast(tree, dtype)})
    jax_ucp.export(low, root / f"hf_{half}", SafetensorsExport(spec=spec, config=config))
    found = jax_ucp.verify(root / f"hf_{half}", against=low, spec=spec, logits=True)
    assert list(found) == [] and found.logits is not None and found.logits.max_abs_diff == 0

    rounded = SafetensorsExport(spec=spec, config=config, dtype=dtype, casting="unsafe")
    jax_ucp.export(ckpt, root / f"rounded_{half}", rounded)
    found = jax_ucp.verify(root / f"rounded_{half}", against=ckpt, spec=spec, logits=True)
    assert found.logits is not None and found.logits.max_abs_diff > 1e-4
    assert [n for n, _ in found if n == "logits"] == ["logits"]


def _cast(tree, dtype):
    return {k: _cast(v, dtype) if isinstance(v, dict) else v.astype(dtype) for k, v in tree.items()}
