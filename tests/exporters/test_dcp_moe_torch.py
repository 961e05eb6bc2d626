"""torch DCP of an MoE model both ways, under the names transformers 5's model holds (its
experts fused: ``mlp.experts.gate_up_proj`` [E, 2F, H], ``down_proj`` [E, H, F]; Mixtral's
router ``mlp.gate``): a tiny model trained 2 AdamW steps in torch, saved by ``dcp.save`` of
``get_state_dict``, imported and continued one step in JAX with the family's spec at
``hf_names="state_dict"``, saved, exported with ``TorchDcpExport(spec=, optimizer="optim")``;
torch loads it into a fresh model and AdamW (``dcp.load`` + ``set_state_dict``): every weight,
moment and step is the JAX state's bit for bit, and torch's next step is JAX's next step."""

from __future__ import annotations

import numpy as np
import pytest

import jax_ucp
from jax_ucp._src.exporters import TorchDcpExport
from jax_ucp.language import load_spec
from tests.exporters.test_dcp_optimizer_torch import (
    _hf_tree,
    _jax_step,
    _state_dicts,
    _torch_step,
)
from tests.models.test_hf_families import FAMILIES, _config

pytestmark = pytest.mark.torch


def _torch_run(family: str, seed: int = 0):
    """The family's tiny transformers model and AdamW (decay on matrices, none on norms)."""
    import torch
    import transformers

    config_class, model_class, kwargs, _, _ = FAMILIES[family]
    torch.manual_seed(seed)
    config = getattr(transformers, config_class)(**kwargs)
    model = getattr(transformers, model_class)(config).float()
    decay = [p for p in model.parameters() if p.ndim > 1]
    rest = [p for p in model.parameters() if p.ndim <= 1]
    groups = [{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}]
    return model, torch.optim.AdamW(groups, lr=1e-2, betas=(0.9, 0.95))


@pytest.mark.timeout(300)
@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_an_moe_run_continued_in_jax_goes_back_to_torch_with_its_optimizer(tmp_path, family):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict

    from jax_ucp._src.models.transformer import hf_model

    vocab = FAMILIES[family][2]["vocab_size"]
    tokens = np.random.default_rng(0).integers(0, vocab, (4, 2, 8))
    model, optim = _torch_run(family)
    for ids in tokens[:2]:
        _torch_step(model, optim, ids)
    msd, osd = _state_dicts(model, optim)
    assert any(n.endswith("mlp.experts.gate_up_proj") for n in msd)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=str(tmp_path / "torch"))

    imported = jax_ucp.convert(tmp_path / "torch", tmp_path / "ucp")
    cfg, name = hf_model(_config(family))
    spec = load_spec(name, **cfg.head_settings, hf_names="state_dict")
    run = jax_ucp.optax_from_torch(imported, spec=spec, clip=None)
    step = _jax_step(run, cfg)
    params, opt_state, _ = step(run.params, run.opt_state, tokens[2])
    continued = jax_ucp.save(str(tmp_path / "jax"), {"params": params, "opt_state": opt_state})
    next_params, _, next_loss = step(params, opt_state, tokens[3])
    # the files' names asked (hf_names' default): the export writes the model's all the same
    files = load_spec(name, **cfg.head_settings)
    options = TorchDcpExport(spec=files, optimizer="optim", run_record=imported)
    done = jax_ucp.export(continued, tmp_path / "back", options)
    assert done.tensors == 4 * len(msd)  # weight, 2 moments, step each

    model, optim = _torch_run(family, seed=1)  # other weights: the load must replace every one
    msd, osd = _state_dicts(model, optim)
    dcp.load({"model": msd, "optim": osd}, checkpoint_id=str(tmp_path / "back"))
    flat = StateDictOptions(flatten_optimizer_state_dict=True)
    set_state_dict(model, optim, model_state_dict=msd, optim_state_dict=osd, options=flat)

    hf = _hf_tree(spec, params, opt_state)
    assert len(hf["params"]) == len(list(model.parameters()))
    for pname, p in model.named_parameters():
        assert np.array_equal(p.detach().numpy(), hf["params"][pname]), pname
        s = optim.state[p]
        assert np.array_equal(s["exp_avg"].numpy(), hf["mu"][pname]), pname
        assert np.array_equal(s["exp_avg_sq"].numpy(), hf["nu"][pname]), pname
        assert float(s["step"]) == 3.0
    assert [g["weight_decay"] for g in optim.param_groups] == [0.1, 0.0]

    loss = _torch_step(model, optim, tokens[3])
    assert abs(loss - float(next_loss)) < 1e-5
    after = _hf_tree(spec, next_params, opt_state)["params"]
    for pname, p in model.named_parameters():
        moved = np.abs(after[pname] - hf["params"][pname]).max()
        assert moved > 1e-4, pname  # the step moved it: the comparison can fail
        np.testing.assert_allclose(p.detach().numpy(), after[pname], rtol=0, atol=2e-6)
