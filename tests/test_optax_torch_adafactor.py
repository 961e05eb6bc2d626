"""Hugging Face's Adafactor (``transformers.optimization.Adafactor``, the Trainer's
``optim="adafactor"``) is refused by optax_from_torch naming it, not as an unknown optimizer:
its groups hold none of torch's keys (issue 60)."""

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
