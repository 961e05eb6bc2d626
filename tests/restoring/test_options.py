"""Restore options checked once (RestoreOptions) and passed down whole, for both sources."""

import re

import numpy as np
import pytest

import jax_ucp
from jax_ucp._src.format.sizes import DEFAULT_MEMORY_BUDGET
from jax_ucp._src.restoring import options as restore_options
from jax_ucp._src.restoring import restore_entry
from jax_ucp.errors import RequestError


def _re(text: str) -> str:
    return re.escape(text)


@pytest.mark.timeout(30)
@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"casting": "lossless"}, "restore(casting=): expected one of 'no', 'equiv', 'safe', "),
        (
            {"memory_budget": 0},
            "restore(memory_budget=): must be a positive number of bytes, got 0.",
        ),
        ({"dtype": "floaty"}, "restore(dtype=): expected a dtype (np.float32, jnp.bfloat16, "),
        ({"select": 3}, "restore(select=): expected a regex string or a predicate on the name, "),
        ({"rules": [("embed", "data")]}, "Logical-axis `rules` need a `mesh` to map onto."),
        (
            {"select": "w", "target": {"w": np.ones(2, np.float32)}},
            "select= restores part of a checkpoint without a target; a target already says",
        ),
    ],
)
def test_restore_keywords_are_checked_before_anything_is_read(tmp_path, kwargs, message):
    """Both sources refuse the same keywords with the same message, before opening a file."""
    from safetensors.numpy import save_file

    missing = tmp_path / "absent"  # never opened: the options are checked first
    with pytest.raises(RequestError, match="^" + _re(message)):
        jax_ucp.restore(missing, **kwargs)
    save_file({"w": np.ones(2, np.float32)}, str(tmp_path / "m.safetensors"))
    with pytest.raises(RequestError, match="^" + _re(message)):
        jax_ucp.restore(tmp_path / "m.safetensors", **kwargs)


@pytest.mark.timeout(30)
def test_rules_given_as_a_generator_are_read_once_and_kept():
    options = restore_options.RestoreOptions(
        mesh=None, target={"w": np.ones(2)}, rules=(r for r in [("embed", None)])
    )
    assert options.rules == (("embed", None),)
    assert options.read_budget == DEFAULT_MEMORY_BUDGET
    assert restore_options.RestoreOptions(memory_budget=7).read_budget == 7


@pytest.mark.timeout(60)
def test_orbax_args_and_the_keywords_reach_the_reader_as_one_object(tmp_path, monkeypatch):
    jax_ucp.save(tmp_path / "c", {"w": np.arange(4, dtype=np.float32), "step": 3})
    seen = []
    real = restore_entry.restore_tree

    def spy(path, options):
        seen.append(options)
        return real(path, options)

    monkeypatch.setattr(restore_entry, "restore_tree", spy)
    by_keywords = jax_ucp.restore(tmp_path / "c", dtype=np.float16, select="w")
    handler = jax_ucp.UCPCheckpointHandler()
    by_args = handler.restore(tmp_path / "c", args=jax_ucp.UCPRestore(dtype=np.float16, select="w"))
    assert isinstance(seen[1], restore_options.RestoreOptions)  # UCPRestore is the options
    assert vars(seen[0]) == vars(seen[1]) and seen[0].dtype is np.float16
    assert seen[0].select == "w"
    for got in (by_keywords, by_args):
        assert list(got) == ["w"] and got["w"].dtype == np.float16
        assert got["w"].tolist() == [0.0, 1.0, 2.0, 3.0]


@pytest.mark.timeout(30)
def test_plan_checks_its_arguments_as_restore_does(tmp_path):
    with pytest.raises(
        RequestError,
        match="^" + _re("plan(casting=): expected one of 'no', 'equiv', 'safe', 'same_kind', "),
    ):
        jax_ucp.plan(tmp_path / "absent", mesh=None, casting="lossless")
    with pytest.raises(
        RequestError, match="^" + _re("plan(strict=): expected True or False, got 1.")
    ):
        jax_ucp.plan(tmp_path / "absent", strict=1)


@pytest.mark.timeout(30)
def test_both_sources_check_a_target_leaf_alike(tmp_path):
    """One check of a target leaf (model.check_tensor_request): a 0-d tensor fills a Python
    scalar leaf from safetensors as from a UCP checkpoint; an array does not."""
    from safetensors.numpy import save_file

    tensors = {"step": np.array(7, np.int64), "w": np.ones(3, np.float32)}
    save_file(tensors, str(tmp_path / "m.safetensors"))
    jax_ucp.save(tmp_path / "c", {"params": tensors})
    for path, holder in [
        (tmp_path / "m.safetensors", r".*m\.safetensors \(m\.safetensors:w\)"),
        (tmp_path / "c", "the checkpoint .*c"),
    ]:
        back = jax_ucp.restore(path, target={"params": {"step": 0}})
        assert back == {"params": {"step": 7}} and type(back["params"]["step"]) is int
        with pytest.raises(
            jax_ucp.UCPError,
            match=r"^Leaf 'params/w': the target is a Python float, but "
            + holder
            + r" holds an array of shape \(3,\)\.$",
        ):
            jax_ucp.restore(path, target={"params": {"w": 0.0}})
