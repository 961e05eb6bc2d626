"""Importer inputs a careless or hostile user hands over (issue 30, round 3): each either imports
exactly or is refused with an error naming the file, the key and the cause (never an internal
"please report" for a fault of the input), and an assumption the import rests on is said out
loud. Every input is built here, torch-free (the exporter's ``torch.save`` writer, or a real
fixture rewritten with it).
"""

from __future__ import annotations

import os
import shutil
import warnings

import numpy as np
import pytest

import jax_ucp
from jax_ucp.exporters import torch_out
from jax_ucp.importers.torch.optimizer import TorchImportError
from tests.importers.test_trust_importers import TAG, _copy, _rewrite
from tests.ucp_testing import REPO

pytestmark = pytest.mark.timeout(120)


# --------------------------------------------------------------------------- ZeRO int step


def _steps_as_ints(src) -> float:
    """Every rank's Adam ``step`` rewritten as a Python int (older torch pickled ints); returns
    the step the tensors held."""
    steps = []
    for path in sorted((src / TAG).glob("*optim_states.pt")):

        def edit(nodes, arrays):
            for group in nodes["optimizer_state_dict"]["base_optimizer_state"]["state"].values():
                value = float(arrays[group["step"].index].reshape(()))
                steps.append(value)
                group["step"] = int(value)

        _rewrite(path, edit)
    assert len(set(steps)) == 1 and steps
    return steps[0]


def _flat(tree, prefix=()) -> dict:
    if isinstance(tree, dict):
        return {k: v for name, sub in tree.items() for k, v in _flat(sub, (*prefix, name)).items()}
    return {prefix: tree}


def test_zero1_adam_step_pickled_as_an_int_imports(tmp_path):
    src = _copy(tmp_path, "z1_fp32_dp2")
    truth = jax_ucp.restore(jax_ucp.convert(_copy(tmp_path / "t", "z1_fp32_dp2"), tmp_path / "u"))
    step = _steps_as_ints(src)
    out = jax_ucp.convert(src, tmp_path / "out")
    restored = jax_ucp.restore(out)
    assert int(restored["opt_state"]["count"]) == int(step) == int(truth["opt_state"]["count"])
    flat, want = _flat(restored), _flat(truth)
    assert flat.keys() == want.keys()
    for key, value in want.items():
        assert np.array_equal(np.asarray(flat[key]), np.asarray(value)), key
    entry = next(e for e in jax_ucp.inspect(out).tensors if list(e.key) == ["opt_state", "count"])
    values = entry.provenance["values"]
    assert len(values) == 2 and all(v.endswith("base_optimizer_state.state.0.step") for v in values)


# --------------------------------------------------------------------------- torch.save optimizer


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


def test_folder_builder_is_a_torch_save_folder(tmp_path):
    """The builder above writes what the torch importer detects as such."""
    from jax_ucp.importers import registry

    src, _ = _folder(tmp_path, {"a": (4,)}, ["a"])
    assert registry.detect_format(str(src)) == "torch"
    assert os.path.getsize(src / "optimizer.bin") > 0


# --------------------------------------------------------------------------- Megatron Bridge

BRIDGE = os.path.join(REPO, "tests", "fixtures", "megatron_bridge", "llama_tp1dp2")
ITER = "iter_0000002"


def _bridge(tmp_path):
    dst = tmp_path / "bridge"
    shutil.copytree(BRIDGE, dst)
    return dst


def _bridge_refused(src, tmp_path, match: str) -> str:
    from jax_ucp.importers.megatron.bridge import MegatronBridgeError

    with pytest.raises(MegatronBridgeError, match=match) as err:
        jax_ucp.convert(str(src), str(tmp_path / "ucp"))
    assert not (tmp_path / "ucp").exists()
    assert len(str(err.value)) < 1000
    return str(err.value)


def test_bridge_train_state_step_that_only_looks_like_a_tensor_is_named(tmp_path):
    """``step`` pickled as an OrderedDict given a ``shape`` attribute by BUILD: it has the shape
    of a 0-d tensor but is none (was a raw AttributeError on ``.item()``)."""
    import pickle as P

    from tests.importers.torch.test_unpickler import D, G, prog, write_pt

    src = _bridge(tmp_path)
    step = G("collections", "OrderedDict") + P.EMPTY_TUPLE + P.REDUCE
    step += P.EMPTY_DICT + D("shape") + D(()) + P.SETITEM + P.BUILD
    body = P.EMPTY_DICT + D("step") + step + P.SETITEM
    os.remove(src / "latest_train_state.pt")
    os.remove(src / ITER / "train_state.pt")
    write_pt(src / ITER / "train_state.pt", prog(body))
    _bridge_refused(
        src / ITER,
        tmp_path,
        ITER + r"/train_state\.pt: entry 'step' is \{\}, expected a 0-d tensor",
    )


def test_bridge_train_state_step_of_5000_digits_is_named(tmp_path):
    """A pickled int past Python's 4300-digit repr limit: the error is built without repr()."""
    from tests.importers.torch.test_unpickler import D, prog, write_pt

    src = _bridge(tmp_path)
    os.remove(src / "latest_train_state.pt")
    os.remove(src / ITER / "train_state.pt")
    write_pt(src / ITER / "train_state.pt", prog(b"}" + D("step") + D(10**5000) + b"s"))
    _bridge_refused(
        src / ITER,
        tmp_path,
        ITER + r"/train_state\.pt: entry 'step' is <int of 16610 bits>, expected a 0-d tensor",
    )


def _run_config_with(src, key: str, value: str) -> None:
    path = src / ITER / "run_config.yaml"
    text = path.read_text()
    old = next(line for line in text.splitlines() if line.startswith(f"  {key}: "))
    path.write_text(text.replace(old + "\n", f"  {key}: {value}\n", 1))


@pytest.mark.parametrize(
    "key, value, shown",
    [
        ("hidden_size", "9" * 5000, "9" * 20),  # Python's int-digit limit: was a raw ValueError
        ("vocab_size", "0x" + "f" * 2_000_000, "0x" + "f" * 18),  # was raised formatting ours
    ],
    ids=["5000-digit hidden_size", "2-million-hex-digit vocab_size"],
)
def test_bridge_run_config_number_too_long_is_named(tmp_path, key, value, shown):
    src = _bridge(tmp_path)
    _run_config_with(src, key, value)
    _bridge_refused(
        src,
        tmp_path,
        rf"{ITER}/run_config\.yaml: model\.{key} \(line \d+\) is a number of {len(value)} "
        rf"characters \({shown}\.\.\.\); a run config's numbers have at most 64",
    )


def test_bridge_run_config_integer_beyond_int64_is_named(tmp_path):
    src = _bridge(tmp_path)
    _run_config_with(src, "vocab_size", "0x" + "f" * 40)  # 160 bits, short enough to spell
    _bridge_refused(
        src,
        tmp_path,
        r"run_config\.yaml: model\.vocab_size is an integer of 160 bits, expected a "
        r"non-negative integer below 2\*\*63",
    )
