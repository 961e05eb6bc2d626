"""importers.torch_state: which optimizer state belongs to which parameter, said out loud
when it rests on an assumption, refused naming the cause when it cannot be known."""

from __future__ import annotations

import shutil
import warnings

import numpy as np
import pytest

import jax_ucp
from jax_ucp.errors import SourceError
from tests.ucp_testing import hf_torch_folder


@pytest.mark.timeout(120)
def test_param_names_naming_a_parameter_twice_names_the_cause(tmp_path):
    src, _ = hf_torch_folder(
        tmp_path, {"a": (4,), "b": (4,), "c": (4,)}, ["a", "b", "c"], ["a", "b", "a"]
    )
    with pytest.raises(
        SourceError,
        match=r"optimizer\.bin: param_names names parameter 'a' twice: as 'a' in group 0 and as "
        r"'a' \(params entry 2\) in group 0;",
    ) as err:
        jax_ucp.convert(src, tmp_path / "out")
    assert "report" not in str(err.value)
    assert not (tmp_path / "out").exists()
    # the same once a wrapper prefix hides the duplicate
    shutil.rmtree(src)
    src, _ = hf_torch_folder(tmp_path, {"a": (4,), "b": (4,)}, ["a", "b"], ["module.a", "a"])
    with pytest.raises(SourceError, match=r"names parameter 'a' twice: as 'module\.a'"):
        jax_ucp.convert(src, tmp_path / "out")


@pytest.mark.timeout(120)
def test_index_mapped_optimizer_with_same_shaped_parameters_says_so(tmp_path):
    """One Adam group built in another order than the model's parameters, all shapes equal:
    index i -> i-th parameter is the documented rule and torch cannot check it either; the
    import follows the rule, warns once naming it and how to confirm, and records it."""
    src, weights = hf_torch_folder(tmp_path, {"a": (4,), "b": (4,), "c": (2, 3)}, ["b", "a", "c"])
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
    src, weights = hf_torch_folder(tmp_path, {"a": (4,), "b": (4,)}, ["b", "a"], ["b", "a"])
    with warnings.catch_warnings():
        warnings.simplefilter("error", jax_ucp.OptimizerOrderWarning)
        out = jax_ucp.convert(src, tmp_path / "out")
    mu = jax_ucp.restore(out)["opt_state"]["mu"]
    assert np.array_equal(mu["a"], weights["a"] + 2000)  # by name: swapped back
    assert "notes" not in jax_ucp.inspect(out).source
    shutil.rmtree(src)
    src, _ = hf_torch_folder(tmp_path, {"a": (4,), "b": (2, 2)}, ["a", "b"])
    with warnings.catch_warnings():
        warnings.simplefilter("error", jax_ucp.OptimizerOrderWarning)
        jax_ucp.convert(src, tmp_path / "out2")
