"""``verify(ckpt, against=SRC, logits=True)`` from a source holding no weights transformers'
``from_pretrained`` reads (a torch DCP folder, a DeepSpeed checkpoint beside the config.json):
the model its config.json names is built by transformers and given the weights the source
framework's own loader reads; the logits agree with the converted checkpoint's, and a weight
changed in the source moves them beyond the tolerance. Real fixtures (torch stage)."""

from __future__ import annotations

import os
import shutil

import pytest

import jax_ucp
from tests.ucp_testing import FIXTURES

pytestmark = [
    pytest.mark.torch,
    pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning"),
]

DCP = os.path.join(FIXTURES, "torch", "hf_llama_fsdp2")
TRAINER_DS = os.path.join(FIXTURES, "hf_trainer", "llama_z2_dp2", "checkpoint-2")


def _dcp_with_config(tmp_path):
    src = shutil.copytree(DCP, tmp_path / "src")
    shutil.copy(DCP + ".config.json", src / "config.json")
    return src


def _norm_weight(node):
    """The final norm's weight in torch's (nested) state dict of the run."""
    for key, value in node.items():
        if isinstance(value, dict):
            found = _norm_weight(value)
            if found is not None:
                return found
        elif str(key).endswith("model.norm.weight"):
            return value
    return None


def test_dcp_folder_with_its_config(tmp_path):
    src = _dcp_with_config(tmp_path)
    ckpt = jax_ucp.convert(src, tmp_path / "ucp")
    found = jax_ucp.verify(ckpt, against=src, logits=True)
    assert list(found) == [] and found.logits is not None and found.logits.ok
    assert found.logits.max_abs_diff < 1e-5
    assert (
        "built from" in found.logits.source and "source framework's loader" in found.logits.source
    )


def test_a_weight_changed_in_the_dcp_source_moves_the_logits(tmp_path):
    import torch  # pyright: ignore[reportMissingImports]
    from torch.distributed.checkpoint.format_utils import (  # pyright: ignore[reportMissingImports]
        dcp_to_torch_save,
        torch_save_to_dcp,
    )

    src = _dcp_with_config(tmp_path)
    ckpt = jax_ucp.convert(src, tmp_path / "ucp")
    whole = tmp_path / "whole.pt"
    dcp_to_torch_save(str(src), str(whole))
    state = torch.load(whole, weights_only=True)
    _norm_weight(state)[0] += 1.0
    torch.save(state, whole)
    changed = tmp_path / "changed"
    torch_save_to_dcp(str(whole), str(changed))
    shutil.copy(src / "config.json", changed / "config.json")
    found = jax_ucp.verify(ckpt, against=changed, logits=True)
    assert found.logits is not None and not found.logits.ok
    assert found.logits.max_abs_diff > 1e-2


def test_deepspeed_checkpoint_without_its_safetensors(tmp_path):
    """A Trainer + DeepSpeed checkpoint whose model.safetensors is gone: the weights are
    DeepSpeed's own (zero_to_fp32)."""
    src = shutil.copytree(TRAINER_DS, tmp_path / "src")
    os.remove(src / "model.safetensors")
    ckpt = jax_ucp.convert(src, tmp_path / "ucp")
    found = jax_ucp.verify(ckpt, against=src, logits=True)
    assert found.logits is not None and found.logits.ok, (list(found), found.logits)
    assert "built from" in found.logits.source


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_a_half_precision_run_through_its_framework_loader(tmp_path, dtype):
    """A bf16 / fp16 run's weights (a torch.save state dict beside its config.json, read by
    torch.load): computed in fp32 on both sides, the logits agree within the default tolerance
    (before: bf16 was a raw ``TypeError: can't convert np.ndarray of type
    ml_dtypes.bfloat16``)."""
    import torch  # pyright: ignore[reportMissingImports]
    from torch.distributed.checkpoint.format_utils import (  # pyright: ignore[reportMissingImports]
        dcp_to_torch_save,
    )

    whole = tmp_path / "whole.pt"
    dcp_to_torch_save(DCP, str(whole))
    state = torch.load(whole, weights_only=True)
    model = {k: v for k, v in state["model"].items()} if "model" in state else state
    src = tmp_path / "src"
    src.mkdir()
    half = {k: v.to(getattr(torch, dtype)) for k, v in model.items() if torch.is_tensor(v)}
    torch.save(half, src / "weights.pt")
    shutil.copy(DCP + ".config.json", src / "config.json")
    ckpt = jax_ucp.convert(src / "weights.pt", tmp_path / "ucp")
    found = jax_ucp.verify(ckpt, against=src / "weights.pt", logits=True)
    assert list(found) == [] and found.logits is not None and found.logits.ok, found.logits
    assert "built from" in found.logits.source
