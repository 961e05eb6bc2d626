"""importers.torch.optimizer: which optimizer state belongs to which parameter, said out loud
when it rests on an assumption, refused naming the cause when it cannot be known."""

from __future__ import annotations

import shutil
import warnings

import numpy as np
import pytest

import jax_ucp
from jax_ucp.exporters import torch_out
from jax_ucp.importers.torch.optimizer import TorchImportError


def _folder(tmp_path, shapes: dict, order: list[str], param_names: list[str] | None = None):
    """A Hugging Face style folder: ``pytorch_model.bin`` holding ``shapes`` (in that order) and
    an ``optimizer.bin`` of one Adam group whose index ``i`` holds the moments of ``order[i]``
    (exp_avg = the parameter + 1000 * (i + 1), so whose moment it is can be read off);
    ``param_names``: the group's param_names, when given."""
    src = tmp_path / "src"
    src.mkdir()
    weights = {
        n: np.arange(np.prod(s), dtype=np.float32).reshape(s) + k
        for k, (n, s) in enumerate(shapes.items())
    }
    arrays = list(weights.values())
    model = {
        n: torch_out.TensorSlot(i, a.shape, a.dtype) for i, (n, a) in enumerate(weights.items())
    }
    torch_out.save_file(str(src / "pytorch_model.bin"), model, arrays)
    arrays, state = [], {}
    for i, name in enumerate(order):
        per = {}
        for k, scale in (("exp_avg", 1000), ("exp_avg_sq", 2000)):
            arrays.append(weights[name] + scale * (i + 1))
            per[k] = torch_out.TensorSlot(len(arrays) - 1, arrays[-1].shape, arrays[-1].dtype)
        arrays.append(np.asarray(3.0, np.float32))
        per["step"] = torch_out.TensorSlot(len(arrays) - 1, (), np.dtype(np.float32))
        state[i] = per
    group = {"lr": 1e-3, "betas": (0.9, 0.999), "params": list(range(len(order)))}
    if param_names is not None:
        group["param_names"] = param_names
    torch_out.save_file(
        str(src / "optimizer.bin"), {"state": state, "param_groups": [group]}, arrays
    )
    return src, weights


@pytest.mark.timeout(120)
def test_param_names_naming_a_parameter_twice_names_the_cause(tmp_path):
    src, _ = _folder(tmp_path, {"a": (4,), "b": (4,), "c": (4,)}, ["a", "b", "c"], ["a", "b", "a"])
    with pytest.raises(
        TorchImportError,
        match=r"optimizer\.bin: param_names names parameter 'a' twice: as 'a' in group 0 and as "
        r"'a' \(params entry 2\) in group 0;",
    ) as err:
        jax_ucp.convert(src, tmp_path / "out")
    assert "report" not in str(err.value)
    assert not (tmp_path / "out").exists()
    # the same once a wrapper prefix hides the duplicate
    shutil.rmtree(src)
    src, _ = _folder(tmp_path, {"a": (4,), "b": (4,)}, ["a", "b"], ["module.a", "a"])
    with pytest.raises(TorchImportError, match=r"names parameter 'a' twice: as 'module\.a'"):
        jax_ucp.convert(src, tmp_path / "out")


@pytest.mark.timeout(120)
def test_index_mapped_optimizer_with_same_shaped_parameters_says_so(tmp_path):
    """One Adam group built in another order than the model's parameters, all shapes equal:
    index i -> i-th parameter is the documented rule and torch cannot check it either; the
    import follows the rule, warns once naming it and how to confirm, and records it."""
    src, weights = _folder(tmp_path, {"a": (4,), "b": (4,), "c": (2, 3)}, ["b", "a", "c"])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = jax_ucp.convert(src, tmp_path / "out")
    ours = [w for w in caught if issubclass(w.category, jax_ucp.OptimizerOrderWarning)]
    assert len(ours) == 1, [str(w.message) for w in caught]
    message = str(ours[0].message)
    assert "optimizer.bin" in message and "mapped by order" in message
    assert "'a', 'b' are all [4]" in message and "param_names" in message
    notes = jax_ucp.inspect(out).source["notes"]
    assert any("mapped by order" in n and "param_names" in n for n in notes)
    mu = jax_ucp.restore(out)["opt_state"]["mu"]
    # the rule, applied as documented: index 0 (built from b) lands on a
    assert np.array_equal(mu["a"], weights["b"] + 1000)
    assert np.array_equal(mu["c"], weights["c"] + 3000)


@pytest.mark.timeout(120)
def test_param_names_or_distinct_shapes_need_no_warning(tmp_path):
    src, weights = _folder(tmp_path, {"a": (4,), "b": (4,)}, ["b", "a"], ["b", "a"])
    with warnings.catch_warnings():
        warnings.simplefilter("error", jax_ucp.OptimizerOrderWarning)
        out = jax_ucp.convert(src, tmp_path / "out")
    mu = jax_ucp.restore(out)["opt_state"]["mu"]
    assert np.array_equal(mu["a"], weights["a"] + 2000)  # by name: swapped back
    assert "notes" not in jax_ucp.inspect(out).source
    shutil.rmtree(src)
    src, _ = _folder(tmp_path, {"a": (4,), "b": (2, 2)}, ["a", "b"])
    with warnings.catch_warnings():
        warnings.simplefilter("error", jax_ucp.OptimizerOrderWarning)
        jax_ucp.convert(src, tmp_path / "out2")
