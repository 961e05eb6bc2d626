"""DeepSpeed universal checkpoints as input: ``ds_to_universal``'s output of real DeepSpeed 0.19.8
runs (``tests/fixtures/deepspeed/<run>/universal/``, made by
``tools/fixtures/make_deepspeed_fixtures.py --universal``) and jax_ucp's own
``export --to deepspeed-universal``.

Truth: the same run's direct import (checked against its live state by test_deepspeed*.py) and
``ref_universal.npz`` (ds_to_universal's tensors as torch loaded them), bit for bit.
"""

from __future__ import annotations

import json
import os
import shutil

import numpy as np
import pytest

import jax_ucp
from jax_ucp._src.importers import registry
from jax_ucp._src.importers.deepspeed import DeepSpeedOptions
from jax_ucp._src.importers.deepspeed import files as deepspeed_files
from jax_ucp._src.importers.plan import ImportOptions
from jax_ucp._src.importers.registry import plan_import
from jax_ucp._src.store.storage import LocalDirectory
from jax_ucp.errors import SourceError
from jax_ucp.exporters import DeepSpeedUniversalExport
from tests.ucp_testing import REPO

FIXTURES = os.path.join(REPO, "tests", "fixtures", "deepspeed")
RUNS = [
    "z1_bf16_dp2",
    "z2_fp32_dp3",
    "z3_bf16_dp2",
    "z2_bf16_dp2_frozen",
    "z3_bf16_dp2_frozen",
    "autotp_tp2_dp2_z2_bf16",
]


def _flat(path):
    import jax

    tree = jax_ucp.restore(path)
    leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
    return {jax.tree_util.keystr(k): np.asarray(v) for k, v in leaves}


def _same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    return (
        a.dtype == b.dtype
        and a.shape == b.shape
        and np.array_equal(a.reshape(-1).view(np.uint8), b.reshape(-1).view(np.uint8))
    )


def _assert_same(direct: dict, universal: dict) -> None:
    assert sorted(direct) == sorted(universal)
    differ = [k for k in direct if not _same_bits(direct[k], universal[k])]
    assert differ == []


def _manifest(path):
    with open(os.path.join(path, "ucp.json")) as f:
        return json.load(f)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("run", RUNS)
def test_universal_imports_bit_exact_as_the_run(run, tmp_path):
    """Every tensor (fp32 masters, moments, step, bf16 model copy, frozen weights) equals the
    direct import of the checkpoint ds_to_universal read."""
    src = os.path.join(FIXTURES, run, "universal")
    assert registry.detect_format(src) == "deepspeed"
    jax_ucp.convert(os.path.join(FIXTURES, run, "ckpt"), tmp_path / "direct")
    jax_ucp.convert(src, tmp_path / "universal")
    _assert_same(_flat(tmp_path / "direct"), _flat(tmp_path / "universal"))
    direct, universal = _manifest(tmp_path / "direct"), _manifest(tmp_path / "universal")
    frozen = lambda m: sorted(e["key"] for e in m["entries"] if e.get("frozen"))
    assert frozen(universal) == frozen(direct)
    assert bool(frozen(direct)) == run.endswith("_frozen")
    source = universal["source"]
    assert source["layout"] == "universal"
    assert source["zero_stage"] == direct["source"]["zero_stage"]
    assert source["path"] == os.path.abspath(os.path.join(src, "global_step2_universal"))


@pytest.mark.timeout(60)
@pytest.mark.parametrize("run", ["z1_bf16_dp2", "z3_bf16_dp2"])
def test_universal_matches_deepspeeds_own_tensors(run, tmp_path):
    """params / mu / nu equal ds_to_universal's tensors as torch.load gave them (stage 3: flat)."""
    ref = np.load(os.path.join(FIXTURES, run, "ref_universal.npz"))
    jax_ucp.convert(os.path.join(FIXTURES, run, "universal"), tmp_path / "u")
    tree = jax_ucp.restore(tmp_path / "u")
    where = {"fp32": tree["params"], "exp_avg": tree["opt_state"]["mu"]}
    where["exp_avg_sq"] = tree["opt_state"]["nu"]
    checked = 0
    for key in ref.files:
        name, state = key.rsplit("/", 1)
        if state == "step":
            assert int(tree["opt_state"]["count"]) == int(ref[key])
            continue
        got = np.asarray(where[state][name])
        assert _same_bits(got.reshape(-1), ref[key].reshape(-1)), key
        checked += 1
    assert checked == 3 * len(tree["params"])


@pytest.mark.timeout(60)
def test_universal_tag_folder_and_tag_option(tmp_path):
    """The ``<tag>_universal`` folder itself, or a run folder holding both ``latest`` and the
    universal folder with ``tag=``; ``latest`` wins without it."""
    run = os.path.join(FIXTURES, "z1_bf16_dp2")
    tag_dir = os.path.join(run, "universal", "global_step2_universal")
    plan = plan_import(tag_dir)
    assert plan.source["layout"] == "universal"
    both = tmp_path / "both"
    shutil.copytree(os.path.join(run, "ckpt"), both)
    shutil.copytree(tag_dir, both / "global_step2_universal")
    shutil.copy(os.path.join(run, "universal", "latest_universal"), both)
    assert "layout" not in plan_import(both).source
    assert (
        plan_import(both, DeepSpeedOptions(tag="global_step2_universal")).source["layout"]
        == "universal"
    )


@pytest.mark.timeout(60)
def test_universal_weights_only_lists_moments_and_step(tmp_path):
    src = os.path.join(FIXTURES, "z1_bf16_dp2", "universal")
    jax_ucp.convert(src, tmp_path / "w", importing=ImportOptions(weights_only=True))
    skipped = _manifest(tmp_path / "w")["source"]["skipped"]
    tree = jax_ucp.restore(tmp_path / "w")
    assert set(tree) == {"params", "model_params"}
    assert skipped["zero/h.0.ln_1.weight/exp_avg.pt:param"] == "weights_only: Adam moment"
    assert skipped["zero/h.0.ln_1.weight/step.pt:"] == "weights_only: optimizer step"
    direct = jax_ucp.restore(_convert(os.path.join(FIXTURES, "z1_bf16_dp2", "ckpt"), tmp_path))
    for name, value in tree["params"].items():
        assert _same_bits(np.asarray(value), np.asarray(direct["params"][name]))


def _convert(src, tmp_path):
    out = tmp_path / "direct"
    jax_ucp.convert(src, out)
    return out


@pytest.mark.timeout(120)
@pytest.mark.parametrize("run", ["z2_bf16_dp2", "z2_fp32_dp2"])
def test_jax_ucp_export_reimports_bit_exact(run, tmp_path):
    """import -> export --to deepspeed-universal -> import gives back every tensor."""
    first = _convert(os.path.join(FIXTURES, run, "ckpt"), tmp_path)
    jax_ucp.export(first, tmp_path / "ds", DeepSpeedUniversalExport())
    assert os.path.isfile(tmp_path / "ds" / "latest_universal")
    jax_ucp.convert(tmp_path / "ds", tmp_path / "again")
    _assert_same(_flat(first), _flat(tmp_path / "again"))
    assert _manifest(tmp_path / "again")["source"]["ds_version"] == "0.19.8"


def _copy_universal(run, tmp_path):
    dst = tmp_path / "u"
    shutil.copytree(os.path.join(FIXTURES, run, "universal"), dst)
    return dst, dst / "global_step2_universal"


@pytest.mark.timeout(60)
def test_universal_missing_moment_points_at_weights_only(tmp_path):
    root, tag = _copy_universal("z1_bf16_dp2", tmp_path)
    os.remove(tag / "zero" / "wte.weight" / "exp_avg_sq.pt")
    with pytest.raises(
        SourceError,
        match=r"zero/wte\.weight: parameter 'wte\.weight' has no exp_avg_sq\.pt .*"
        r"weights_only=True",
    ):
        plan_import(root)
    with pytest.raises(SourceError, match=r"zero/wte\.weight.*weights_only=True"):
        plan_import(root, ImportOptions(weights_only=True))


@pytest.mark.timeout(60)
def test_universal_missing_parameter_folder_named(tmp_path):
    root, tag = _copy_universal("z3_bf16_dp2", tmp_path)
    shutil.rmtree(tag / "zero" / "h.1.mlp_fc.bias")
    with pytest.raises(
        SourceError,
        match=r"zero:.*\['h\.1\.mlp_fc\.bias'\].*zero_pp_rank_0_mp_rank_00_model_states\.pt \(1 missing\)",
    ):
        plan_import(root)


@pytest.mark.timeout(60)
def test_universal_wrong_size_and_disagreeing_step(tmp_path):
    from jax_ucp._src.torchfiles import torch_zip

    root, tag = _copy_universal("z1_bf16_dp2", tmp_path)
    step = tag / "zero" / "ln_f.bias" / "step.pt"
    slot = torch_zip.TensorSlot(0, (), np.dtype(np.float32))
    torch_zip.save_file(str(step), slot, [np.asarray(7.0, np.float32)])
    with pytest.raises(
        SourceError,
        match=r"zero:.*optimizer step: 2 in zero/.*, 7 in zero/ln_f\.bias/step\.pt",
    ):
        plan_import(root)
    root, tag = _copy_universal("z3_bf16_dp2", tmp_path / "b")
    fp32 = tag / "zero" / "ln_f.bias" / "exp_avg.pt"
    slot = torch_zip.TensorSlot(0, (15,), np.dtype(np.float32))
    torch_zip.save_file(str(fp32), slot, [np.zeros(15, np.float32)])
    with pytest.raises(
        SourceError,
        match=r"exp_avg\.pt: parameter 'ln_f\.bias' holds 15 elements \(15,\); param_shapes "
        r"says \(16,\)",
    ):
        plan_import(root)


@pytest.mark.timeout(60)
def test_universal_parameter_folder_linked_to_another_refused(tmp_path):
    """A parameter folder under zero/ that is a link (here to another parameter's folder of the
    same shape, inside zero/) is refused: read through, one parameter would take another's
    master and moments silently."""
    root, tag = _copy_universal("z1_bf16_dp2", tmp_path)
    shutil.rmtree(tag / "zero" / "h.0.ln_1.bias")
    (tag / "zero" / "h.0.ln_1.bias").symlink_to("h.0.ln_2.bias")
    with pytest.raises(SourceError, match=r"zero/h\.0\.ln_1\.bias: .*link"):
        plan_import(root)


@pytest.mark.timeout(30)
def test_latest_universal_outside_refused_and_message_says_universal(tmp_path):
    (tmp_path / "latest_universal").write_text("../elsewhere")
    with pytest.raises(SourceError, match=r"names tag '\.\./elsewhere'.*refusing"):
        plan_import(tmp_path, format="deepspeed")
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(SourceError, match=r"no DeepSpeed checkpoint here .*universal"):
        deepspeed_files.resolve_tag_dir(LocalDirectory(str(empty)), None)


@pytest.mark.torch
@pytest.mark.timeout(300)
def test_restricted_reader_equals_torch_load_on_universal_files():
    """Every .pt of the committed universal folders (ds_to_universal's state dicts, 0-d steps,
    ZeRO-3's optimizer_state.pt, the AutoTP run's v0.4 model states) reads with the restricted
    reader as torch.load reads it."""
    torch = pytest.importorskip("torch")
    import glob

    from jax_ucp._src.torchfiles.torch_zip import load_torch_file

    pattern = os.path.join(FIXTURES, "*", "universal", "*", "**", "*.pt")
    found = glob.glob(pattern, recursive=True)
    assert len(found) > 4 * 30 * len(RUNS) // 2

    def same(a, b, where):
        if isinstance(a, torch.Tensor):
            a = a.detach()
            expected = a.float().numpy() if a.dtype == torch.bfloat16 else a.numpy()
            np.testing.assert_array_equal(np.asarray(b).astype(expected.dtype), expected, where)
        elif isinstance(a, dict):
            assert list(a) == list(b), where
            for key in a:
                same(a[key], b[key], f"{where}/{key}")
        elif isinstance(a, (list, tuple)) and not isinstance(a, torch.Size):
            assert len(a) == len(b), where
            for i, (x, y) in enumerate(zip(a, b)):
                same(x, y, f"{where}[{i}]")
        elif isinstance(a, (int, float, str, bool, type(None), torch.Size)):
            assert a == b, where
        elif isinstance(a, torch.dtype):
            assert str(a).split(".")[-1] == str(b), where
        else:  # DeepSpeed objects: the stand-in carries the same attributes
            for key, value in vars(a).items():
                same(value, getattr(b, key), f"{where}.{key}")

    for path in found:
        same(
            torch.load(path, weights_only=False),
            load_torch_file(path, deepspeed_files.DS_CLASSES),
            path,
        )


@pytest.mark.timeout(120)
def test_universal_cli_and_shares(tmp_path):
    """``jax-ucp convert deepspeed`` on a universal folder; two processes' shares together name
    every parameter once (the step in share 0 only)."""
    from typer.testing import CliRunner

    from jax_ucp._src.importers.plan import Share
    from jax_ucp.cli import app

    src = os.path.join(FIXTURES, "z3_bf16_dp2", "universal")
    result = CliRunner().invoke(app, ["convert", src, str(tmp_path / "cli"), "--from", "deepspeed"])
    assert result.exit_code == 0, result.output
    jax_ucp.convert(os.path.join(FIXTURES, "z3_bf16_dp2", "ckpt"), tmp_path / "direct")
    _assert_same(_flat(tmp_path / "direct"), _flat(tmp_path / "cli"))
    keys = []
    for index in range(2):
        plan = plan_import(src, share=Share(index, 2))
        keys += ["/".join(item.key) for item in plan.items]
    assert len(keys) == len(set(keys)) == 4 * 30 + 1
    assert keys.count("opt_state/count") == 1


@pytest.mark.timeout(60)
def test_universal_frozen_copy_differing_from_the_fragments_is_refused(tmp_path):
    """ds_to_universal writes zero/<name>/fp32.pt for a frozen parameter too; the import reads
    the weights from frozen_param_fragments, as the direct import does, and refuses a copy that
    disagrees (here: rewritten by the test) instead of picking one."""
    from jax_ucp._src.torchfiles import torch_zip

    root, tag = _copy_universal("z2_bf16_dp2_frozen", tmp_path)
    fp32 = tag / "zero" / "h.0.ln_1.bias" / "fp32.pt"
    slot = torch_zip.TensorSlot(0, (16,), np.dtype(np.float32))
    torch_zip.save_file(str(fp32), slot, [np.full(16, 7.0, np.float32)])
    with pytest.raises(
        SourceError,
        match=r"zero/h\.0\.ln_1\.bias/fp32\.pt: frozen parameter 'h\.0\.ln_1\.bias'.*frozen_param_fragments of \['mp_rank_00_model_states\.pt'\]$",
    ):
        jax_ucp.convert(root, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_a_parameter_both_frozen_and_trained_is_refused():
    from jax_ucp._src.importers.deepspeed.files import frozen_shapes_of

    states = {"frozen_param_shapes": {"a": (2,), "b": [3]}}
    with pytest.raises(SourceError, match=r"^f\.pt:.*frozen and trained: \['a'\]$"):
        frozen_shapes_of(states, "f.pt", trained=["a", "c"])
    assert frozen_shapes_of(states, "f.pt", trained=["c"]) == {"a": (2,), "b": (3,)}
