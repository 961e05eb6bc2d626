"""Live comparison against DeepSpeed (opt-in: needs torch + deepspeed; ~1 min per case).

Trains fresh checkpoints with DeepSpeed itself (tools/fixtures/ds_train.py under torchrun), then
checks the importer against ds_to_universal / zero_to_fp32 run right now, and checks the
committed fixtures are still what the generator produces layout-wise.
Run: ``pytest -m torch tests/importers/deepspeed/test_live.py``.
"""

from __future__ import annotations

import os
import sys

import numpy as np
import pytest

from tests.ucp_testing import REPO, free_port

pytestmark = [pytest.mark.torch, pytest.mark.slow]

ROOT = REPO
sys.path.insert(0, os.path.join(ROOT, "tools", "fixtures"))


@pytest.mark.parametrize("stage,dtype,world", [(1, "bf16", 3), (2, "fp32", 2), (3, "bf16", 2)])
def test_live_against_deepspeed_tools(tmp_path, stage, dtype, world):
    pytest.importorskip("torch")
    pytest.importorskip("deepspeed")
    import make_deepspeed_fixtures as M

    import jax_ucp
    from jax_ucp.conversion import convert

    work = str(tmp_path / "run")
    M.train(stage, dtype, world, work, port=free_port())
    tag = os.path.join(work, "ckpt", "global_step2")
    uni = M.universal(tag, str(tmp_path / "universal"))
    z = M.zero_to_fp32(os.path.join(work, "ckpt"), "global_step2")
    got = jax_ucp.restore(convert(os.path.join(work, "ckpt"), tmp_path / "ucp", format="deepspeed"))
    assert sorted(got["params"]) == sorted(z)
    for n, ref in z.items():
        np.testing.assert_array_equal(got["params"][n], ref)
        for state, tree in (
            ("fp32", got["params"]),
            ("exp_avg", got["opt_state"]["mu"]),
            ("exp_avg_sq", got["opt_state"]["nu"]),
        ):
            np.testing.assert_array_equal(
                tree[n], uni[f"{n}/{state}"].reshape(ref.shape), err_msg=f"{n} {state}"
            )
    assert int(got["opt_state"]["count"]) == 2
    assert ("model_params" in got) == (dtype != "fp32")


@pytest.mark.parametrize("name", ["bf16opt_z1_dp2", "z0_bf16_dp2"])
def test_live_bf16_optimizer_and_zero0_bf16(tmp_path, name):
    """DeepSpeed's BF16_Optimizer (ZeRO-1, fp32 gradient accumulation) and ZeRO-0 bf16
    (FP16_UnfusedOptimizer), trained now: masters, moments, step and module weights equal the
    engine's live state right after the save, bit for bit."""
    pytest.importorskip("torch")
    pytest.importorskip("deepspeed")
    import make_deepspeed_fixtures as M
    import ml_dtypes

    import jax_ucp

    stage, dtype, extra = M.LIVE[name]
    work = str(tmp_path / "run")
    M.train(stage, dtype, 2, work, extra=extra + ["--live", "--no-next"], port=free_port())
    live = M.merged_live(work, "live", 2, name)
    got = jax_ucp.restore(jax_ucp.convert(os.path.join(work, "ckpt"), str(tmp_path / "u")))
    where = {"param": got["model_params"], "fp32": got["params"]}
    where.update(exp_avg=got["opt_state"]["mu"], exp_avg_sq=got["opt_state"]["nu"])
    for key, value in live.items():
        if key == "step":
            assert int(got["opt_state"]["count"]) == int(value)
            continue
        state, _, param = key.partition("/")
        if value.dtype == np.dtype("V2"):
            value = value.view(ml_dtypes.bfloat16)
        found = np.asarray(where[state][param])
        assert (found.dtype, found.shape) == (value.dtype, value.shape), key
        assert found.tobytes() == value.tobytes(), key


def test_torch_reader_on_fresh_deepspeed_files(tmp_path):
    """Every .pt DeepSpeed writes (model + optimizer, all stages) loads with the restricted reader
    and equals torch.load's view of it."""
    torch = pytest.importorskip("torch")
    import glob

    from jax_ucp._src.importers.deepspeed import DS_CLASSES
    from jax_ucp._src.torchfiles.unpickler import load_torch_file

    files = glob.glob(
        os.path.join(ROOT, "tests", "fixtures", "deepspeed", "*", "ckpt", "global_step2", "*.pt")
    )
    assert files

    def cmp(a, b, where):
        if isinstance(a, torch.Tensor):
            a = a.detach()
            exp = a.float().numpy() if a.dtype == torch.bfloat16 else a.numpy()
            assert b.shape == exp.shape, where
            np.testing.assert_array_equal(np.asarray(b).astype(exp.dtype), exp, err_msg=where)
        elif isinstance(a, dict):
            assert list(a) == list(b), where
            for k in a:
                cmp(a[k], b[k], f"{where}/{k}")
        elif isinstance(a, (list, tuple)) and not isinstance(a, torch.Size):
            assert len(a) == len(b), where
            for i, (x, y) in enumerate(zip(a, b)):
                cmp(x, y, f"{where}[{i}]")
        elif isinstance(a, (int, float, str, bool, type(None), torch.Size, set, frozenset)):
            assert a == b and (not isinstance(a, int) or int(a) == int(b)), where
        elif isinstance(a, torch.dtype):
            assert str(a).split(".")[-1] == str(b), where
        else:  # DeepSpeed objects: the stand-in carries the same attributes
            assert vars(a).keys() <= vars(b).keys(), where
            for k, v in vars(a).items():
                cmp(v, getattr(b, k), f"{where}.{k}")

    for f in files:
        cmp(torch.load(f, weights_only=False), load_torch_file(f, DS_CLASSES), f)
