"""Hugging Face's Adafactor (``transformers.optimization.Adafactor``, the Trainer's
``optim="adafactor"``): Adam's identification refuses its groups naming it (issue 60), and
``optax_from_torch`` continues it with its factored ``exp_avg_sq_row`` / ``exp_avg_sq_col``
(issue 70): the next three steps equal transformers' own within 1e-6."""

from __future__ import annotations

import pytest

import jax_ucp
from jax_ucp._src.optax_torch import identify

#: transformers.optimization.Adafactor's param_groups keys (its defaults), as state_dict() saves them
HF_ADAFACTOR_GROUP = dict(
    lr=None, eps=[1e-30, 1e-3], clip_threshold=1.0, decay_rate=-0.8, beta1=None,
    weight_decay=0.0, scale_parameter=True, relative_step=True, warmup_init=False, params=[0],
)  # fmt: skip


def test_hf_adafactor_groups_are_refused_naming_adafactor():
    with pytest.raises(
        jax_ucp.UCPError,
        match=r"ckpt: param_groups\[0\] holds the keys of transformers' Adafactor \(beta1, "
        r"clip_threshold, decay_rate, eps, .*\): optax_from_torch translates torch's Adam",
    ):
        identify([HF_ADAFACTOR_GROUP], {"optim": "adafactor"}, "ckpt")


@pytest.mark.torch
def test_the_param_groups_of_a_stepped_transformers_adafactor_are_refused_naming_it():
    torch = pytest.importorskip("torch")
    from transformers.optimization import Adafactor

    w = torch.nn.Parameter(torch.randn(4, 3))
    opt = Adafactor([w], lr=1e-3, relative_step=False, scale_parameter=False)
    w.grad = torch.randn(4, 3)
    opt.step()
    groups = opt.state_dict()["param_groups"]
    assert set(groups[0]) - {"params"} == set(HF_ADAFACTOR_GROUP) - {"params"}
    with pytest.raises(jax_ucp.UCPError, match=r"keys of transformers' Adafactor"):
        identify(groups, {}, "ckpt")


@pytest.mark.torch
@pytest.mark.parametrize(
    "settings",
    [
        {},  # transformers' defaults: relative step, parameter scale, no beta1
        dict(lr=1e-2, relative_step=False, scale_parameter=False, beta1=0.9, weight_decay=0.01),
        dict(lr=3e-3, relative_step=False, decay_rate=-0.5, clip_threshold=0.5),
    ],
)
def test_a_transformers_adafactor_run_continues_exactly(tmp_path, settings):
    """Matrices factored (row and column second moments), 1-D parameters not; a step pickled as
    a Python int is the count; the parameter scale and relative step recomputed as it steps."""
    torch = pytest.importorskip("torch")
    from transformers.optimization import Adafactor

    from tests.test_optax_torch_families import _continue, _torch_steps

    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(8, 16), torch.nn.LayerNorm(16), torch.nn.Linear(16, 4)
    )
    opt = Adafactor(list(model.named_parameters()), **settings)
    path, grads, want = _torch_steps(tmp_path, model, [opt], torch.randn(5, 8))
    with pytest.warns(UserWarning, match="clipping"):
        run = jax_ucp.optax_from_torch(path)
    assert run.optimizer == "adafactor" and run.step == 3
    assert not any("no saved state" in n for n in run.notes)
    tree = jax_ucp.restore(jax_ucp.convert(path, tmp_path / "ucp"))
    assert tree["opt_state"]["exp_avg_sq_row"]["0.weight"].shape == (16,)
    assert tree["opt_state"]["exp_avg_sq_col"]["0.weight"].shape == (8,)
    _continue(run, grads, want)
