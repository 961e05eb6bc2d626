"""jax_ucp.export / jax-ucp export: safetensors out, bit-exact, atomic, clear refusals."""

from __future__ import annotations

import json
import os

import ml_dtypes
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file
from typer.testing import CliRunner

import jax_ucp
from jax_ucp._src.exporters import (
    DeepSpeedUniversalExport,
    SafetensorsExport,
    TorchDcpExport,
    options_for,
    safetensors_out,
)
from jax_ucp._src.store.storage import LocalDirectory
from jax_ucp.cli import app
from jax_ucp.errors import RequestError
from tests.ucp_testing import REPO, run_torchrun

pytestmark = pytest.mark.timeout(120)


def _hf_model(tmp_path):
    """A Hugging Face style safetensors file (written by the safetensors package): bf16, fp16,
    fp32 and int64 tensors with HF names."""
    rng = np.random.default_rng(0)
    tensors = {
        "model.embed_tokens.weight": rng.standard_normal((64, 16)).astype(ml_dtypes.bfloat16),
        "model.layers.0.self_attn.q_proj.weight": rng.standard_normal((16, 16)).astype(np.float16),
        "model.layers.0.mlp.up_proj.weight": rng.standard_normal((32, 16)).astype(np.float32),
        "model.norm.weight": np.ones(16, np.float32),
        "position_ids": np.arange(8, dtype=np.int64),
    }
    src = tmp_path / "hf"
    src.mkdir()
    save_file(tensors, str(src / "model.safetensors"), metadata={"format": "pt"})
    return src, tensors


def _same(a: np.ndarray, b: np.ndarray) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


def test_safetensors_round_trip_is_bit_exact(tmp_path):
    src, tensors = _hf_model(tmp_path)
    ckpt = jax_ucp.convert(str(src), str(tmp_path / "ucp"))
    out = jax_ucp.export(ckpt, tmp_path / "out")
    assert out.files == ["model.safetensors"] and out.tensors == len(tensors)
    back = load_file(str(tmp_path / "out" / "model.safetensors"))
    assert set(back) == set(tensors)
    for name, value in tensors.items():
        assert _same(back[name], value), name


def test_sharded_export_with_index(tmp_path):
    src, tensors = _hf_model(tmp_path)
    ckpt = jax_ucp.convert(str(src), str(tmp_path / "ucp"))
    out = jax_ucp.export(ckpt, tmp_path / "out", SafetensorsExport(max_file_bytes=2500))
    assert len(out.files) > 2 and out.files[-1] == "model.safetensors.index.json"
    index = json.loads((tmp_path / "out" / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(tensors)
    assert index["metadata"]["total_size"] == sum(v.nbytes for v in tensors.values())
    back = {}
    for name in out.files[:-1]:
        assert name.startswith("model-0000") and name.endswith(
            f"-of-{len(out.files) - 1:05d}.safetensors"
        )
        back.update(load_file(str(tmp_path / "out" / name)))
    for name, value in tensors.items():
        assert _same(back[name], value), name
        assert name in load_file(str(tmp_path / "out" / index["weight_map"][name]))
    # and the export imports again, to the same checkpoint
    again = jax_ucp.convert(str(tmp_path / "out"), str(tmp_path / "ucp2"))
    assert jax_ucp.diff(ckpt, again).identical


def test_jax_tree_exports_with_dotted_names_and_chosen_dtype(tmp_path):
    params = {
        "Dense_0": {"kernel": np.arange(12, dtype=np.float32).reshape(3, 4), "bias": np.ones(4)},
        "scale": np.float32(2.5) * np.ones((2,), np.float32),
    }
    path = str(tmp_path / "ck")
    jax_ucp.save(path, {"params": params, "step": 7})
    out = jax_ucp.export(path, tmp_path / "out", SafetensorsExport(dtype="bfloat16"))
    back = load_file(str(tmp_path / "out" / "model.safetensors"))
    assert set(back) == {"Dense_0.kernel", "Dense_0.bias", "scale"}
    assert back["Dense_0.kernel"].dtype == ml_dtypes.bfloat16
    np.testing.assert_array_equal(
        back["Dense_0.kernel"], params["Dense_0"]["kernel"].astype(ml_dtypes.bfloat16)
    )
    assert "step" in out.skipped
    everything = jax_ucp.export(path, tmp_path / "all", SafetensorsExport(select=""))
    assert set(load_file(str(tmp_path / "all" / "model.safetensors"))) == {
        "params.Dense_0.kernel",
        "params.Dense_0.bias",
        "params.scale",
    }
    assert everything.skipped == ["step"]


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"dtype": "int4", "casting": "unsafe"}, "cannot be stored in safetensors"),
        ({"dtype": "int4"}, "not a 'same_kind' cast"),
        ({"dtype": "int32"}, "narrow|casting|unsafe"),
        ({"select": "opt_state"}, "no tensor under 'opt_state'"),
        ({"to": "onnx"}, "export format 'onnx' is not supported"),
    ],
)
def test_refusals_write_nothing(tmp_path, kwargs, message):
    path = str(tmp_path / "ck")
    jax_ucp.save(path, {"params": {"w": np.ones((4, 4), np.float32)}})
    with pytest.raises(jax_ucp.UCPError, match=message):
        options = options_for(kwargs.pop("to", "safetensors"), **kwargs)
        jax_ucp.export(path, tmp_path / "out", options)
    assert sorted(os.listdir(tmp_path)) == ["ck"]


def test_destination_rules(tmp_path):
    path = str(tmp_path / "ck")
    jax_ucp.save(path, {"params": {"w": np.ones((4, 4), np.float32)}})
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("keep me")
    with pytest.raises(RequestError, match="already exists"):
        jax_ucp.export(path, mine)
    with pytest.raises(RequestError, match="not an export"):
        jax_ucp.export(path, mine, SafetensorsExport(force=True))
    assert (mine / "notes.txt").read_text() == "keep me"
    with pytest.raises(RequestError, match=r"ck/out:.*lies inside"):
        jax_ucp.export(path, tmp_path / "ck" / "out")
    jax_ucp.export(path, tmp_path / "out")
    jax_ucp.export(
        path, tmp_path / "out", SafetensorsExport(force=True, dtype="float16")
    )  # an export: replaced
    assert load_file(str(tmp_path / "out" / "model.safetensors"))["w"].dtype == np.float16


def test_failed_export_leaves_nothing(tmp_path, monkeypatch):
    path = str(tmp_path / "ck")
    jax_ucp.save(path, {"params": {"a": np.ones(4, np.float32), "b": np.zeros(4, np.float32)}})
    jax_ucp.export(path, tmp_path / "out")
    before = (tmp_path / "out" / "model.safetensors").read_bytes()

    def failing(values):
        for i, value in enumerate(values):
            if i == 1:
                raise OSError(28, "No space left on device")
            yield value

    real = safetensors_out.write_file
    monkeypatch.setattr(safetensors_out, "write_file", lambda p, t, v, m: real(p, t, failing(v), m))
    with pytest.raises(OSError, match="No space"):
        jax_ucp.export(path, tmp_path / "out", SafetensorsExport(force=True, dtype="float16"))
    assert (tmp_path / "out" / "model.safetensors").read_bytes() == before
    assert sorted(os.listdir(tmp_path)) == ["ck", "out"]  # no temporary left


def test_corrupt_checkpoint_is_an_error_not_an_export(tmp_path):
    path = tmp_path / "ck"
    jax_ucp.save(str(path), {"params": {"w": np.arange(4096, dtype=np.float32)}})
    shard = next(p for p in (path / "arrays").rglob("*") if p.is_file() and p.name != "zarr.json")
    raw = bytearray(shard.read_bytes())
    raw[10] ^= 1
    shard.write_bytes(bytes(raw))
    with pytest.raises(jax_ucp.UCPError, match=r"crc32c|digest|corrupt"):
        jax_ucp.export(str(path), tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_cli_export(tmp_path):
    src, _tensors = _hf_model(tmp_path)
    ckpt = jax_ucp.convert(str(src), str(tmp_path / "ucp"))
    r = CliRunner().invoke(app, ["export", ckpt, str(tmp_path / "out"), "--max-file-size", "3KB"])
    assert r.exit_code == 0, r.output
    assert "wrote 5 tensors" in r.output
    assert (tmp_path / "out" / "model.safetensors.index.json").is_file()
    r = CliRunner().invoke(app, ["export", ckpt, str(tmp_path / "out")])
    assert r.exit_code == 1 and "already exists" in r.output
    r = CliRunner().invoke(
        app,
        ["export", ckpt, str(tmp_path / "o2"), "--max-file-size", "lots"],
        env={"COLUMNS": "300"},
    )
    assert r.exit_code == 2 and "'--max-file-size': cannot read 'lots' as a size" in r.output


# ------------------------------------------------------------------ torch DCP


def _optax_like_state():
    rng = np.random.default_rng(1)
    params = {
        "w": rng.standard_normal((4, 6)).astype(np.float32),
        "emb": rng.standard_normal((8, 4)).astype(ml_dtypes.bfloat16),
    }
    return {
        "params": params,
        "opt_state": {
            "mu": {k: (v * 0.5).astype(v.dtype) for k, v in params.items()},
            "nu": {k: (v * v).astype(v.dtype) for k, v in params.items()},
            "count": np.asarray(3, np.int32),
        },
        "step": 3,
    }


def test_dcp_export_reads_back_bit_exact_without_torch(tmp_path):
    """Read with jax_ucp's own DCP reader (written for megatron-core's torch_dist files)."""
    from jax_ucp._src.importers.megatron import dcp as megatron_dcp

    state = _optax_like_state()
    jax_ucp.save(str(tmp_path / "ck"), state)
    out = jax_ucp.export(str(tmp_path / "ck"), tmp_path / "dcp", TorchDcpExport())
    assert out.files == [".metadata", "__0_0.distcp"] and out.tensors == 7 and not out.skipped
    back = megatron_dcp.open_dcp(LocalDirectory(str(tmp_path / "dcp")))
    flat = {
        "params.w": state["params"]["w"],
        "params.emb": state["params"]["emb"],
        "opt_state.mu.w": state["opt_state"]["mu"]["w"],
        "opt_state.nu.emb": state["opt_state"]["nu"]["emb"],
        "opt_state.count": state["opt_state"]["count"],
    }
    for name, value in flat.items():
        assert _same(back.read(name), value), name


def test_megatron_to_ucp_to_dcp_keeps_every_weight_bit_exact(tmp_path):
    from jax_ucp._src.importers.megatron import dcp as megatron_dcp
    from tests.ucp_testing import REPO

    src = os.path.join(REPO, "tests", "fixtures", "megatron", "gpt_tp2")
    ckpt = jax_ucp.convert(src, str(tmp_path / "ucp"))
    jax_ucp.export(ckpt, tmp_path / "dcp", TorchDcpExport(select="params"))
    original, back = (
        megatron_dcp.open_dcp(LocalDirectory(str(src))),
        megatron_dcp.open_dcp(LocalDirectory(str(tmp_path / "dcp"))),
    )
    assert set(back.tensors) == {n for n in original.tensors if not n.startswith("optimizer.")}
    for name in back.tensors:
        assert _same(back.read(name), original.read(name)), name


def test_dcp_refuses_what_torch_cannot_hold(tmp_path):
    jax_ucp.save(str(tmp_path / "ck"), {"params": {"w": np.ones(4, ml_dtypes.float8_e4m3fn)}})
    with pytest.raises(RequestError, match=r"'params\.w': dtype float8_e4m3fn.*dtype="):
        jax_ucp.export(str(tmp_path / "ck"), tmp_path / "dcp", TorchDcpExport())
    assert not (tmp_path / "dcp").exists()


def _load_dcp_worker(rank, world, port, directory, result_dir):
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )
    state = {
        "params": {"w": torch.zeros(4, 6), "emb": torch.zeros(8, 4, dtype=torch.bfloat16)},
        "opt_state": {
            "mu": {"w": torch.zeros(4, 6), "emb": torch.zeros(8, 4, dtype=torch.bfloat16)},
            "nu": {"w": torch.zeros(4, 6), "emb": torch.zeros(8, 4, dtype=torch.bfloat16)},
            "count": torch.zeros((), dtype=torch.int32),
        },
        "step": 0,
    }
    dcp.load(state, checkpoint_id=directory)

    def bits(v):
        return v.view(torch.int16).numpy() if v.dtype == torch.bfloat16 else v.numpy()

    out = {f"params.{k}": bits(v) for k, v in state["params"].items()}
    for m in ("mu", "nu"):
        out.update({f"{m}.{k}": bits(v) for k, v in state["opt_state"][m].items()})
    out["count"] = state["opt_state"]["count"].numpy()
    out["step"] = np.asarray(state["step"])
    np.savez(os.path.join(result_dir, f"rank{rank}.npz"), **out)
    dist.destroy_process_group()


@pytest.mark.torch
@pytest.mark.parametrize("world", [1, 2])
def test_dcp_load_by_torch_at_world_size(tmp_path, world):
    import socket

    import torch.multiprocessing as mp

    state = _optax_like_state()
    jax_ucp.save(str(tmp_path / "ck"), state)
    jax_ucp.export(str(tmp_path / "ck"), tmp_path / "dcp", TorchDcpExport())
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(
        _load_dcp_worker,
        args=(world, port, str(tmp_path / "dcp"), str(tmp_path)),
        nprocs=world,
        join=True,
    )

    def bits(a):
        return a.view(np.int16) if a.dtype == ml_dtypes.bfloat16 else a

    for rank in range(world):
        got = np.load(tmp_path / f"rank{rank}.npz")
        for k, v in state["params"].items():
            np.testing.assert_array_equal(got[f"params.{k}"], bits(v))
        for m in ("mu", "nu"):
            for k, v in state["opt_state"][m].items():
                np.testing.assert_array_equal(got[f"{m}.{k}"], bits(v))
        assert int(got["count"]) == 3 and int(got["step"]) == 3


# ------------------------------------------------------------------ DeepSpeed universal

DS = os.path.join(REPO, "tests", "fixtures", "deepspeed")
REPO_TOOLS = os.path.join(REPO, "tools", "fixtures")


@pytest.mark.parametrize("fixture", ["z1_bf16_dp3", "z2_fp32_dp2", "z2_bf16_dp2"])
def test_deepspeed_universal_values_equal_deepspeeds_own(tmp_path, fixture):
    """DeepSpeed ZeRO run -> convert -> export: every zero/<param>/<state>.pt holds what
    DeepSpeed's own ds_to_universal wrote (committed as ref_universal.npz), read torch-free."""
    from jax_ucp._src.torchfiles.torch_zip import load_torch_file

    ckpt = jax_ucp.convert(os.path.join(DS, fixture, "ckpt"), str(tmp_path / "ucp"))
    out = jax_ucp.export(ckpt, tmp_path / "uni", DeepSpeedUniversalExport())
    tag = (tmp_path / "uni" / "latest_universal").read_text()
    assert tag == "global_step2_universal"
    ref = np.load(os.path.join(DS, fixture, "ref_universal.npz"))
    assert len(out.files) == len(ref) + 3  # + optimizer_state, model states, latest_universal
    for key in ref:
        name, state = key.rsplit("/", 1)
        got = load_torch_file(tmp_path / "uni" / tag / "zero" / name / f"{state}.pt")
        if state == "step":
            assert got.shape == () and got.dtype == np.float32 and float(got) == float(ref[key])
        else:
            assert set(got) == {"param", "cat_dim"} and got["cat_dim"] == 0
            assert _same(np.asarray(got["param"]), ref[key]), key


def test_deepspeed_universal_needs_moments(tmp_path):
    jax_ucp.save(str(tmp_path / "ck"), {"params": {"w": np.ones(4, np.float32)}})
    with pytest.raises(RequestError, match="needs every parameter's Adam moments"):
        jax_ucp.export(str(tmp_path / "ck"), tmp_path / "uni", DeepSpeedUniversalExport())
    assert sorted(os.listdir(tmp_path)) == ["ck"]


def test_deepspeed_universal_refuses_a_moment_shaped_unlike_its_parameter(tmp_path):
    state = _optax_like_state()  # synthetic: the first moment of "w" transposed
    state["opt_state"]["mu"]["w"] = state["opt_state"]["mu"]["w"].T.copy()
    jax_ucp.save(str(tmp_path / "ck_synthetic"), state)
    with pytest.raises(RequestError, match=r"'w' exp_avg: shape \(6, 4\).* \(4, 6\)"):
        jax_ucp.export(tmp_path / "ck_synthetic", tmp_path / "uni", DeepSpeedUniversalExport())
    assert sorted(os.listdir(tmp_path)) == ["ck_synthetic"]


def test_optax_state_exports_as_deepspeed_universal(tmp_path):
    import optax

    from jax_ucp._src.torchfiles.torch_zip import load_torch_file

    params = {"Dense_0": {"kernel": np.arange(6, dtype=np.float32).reshape(2, 3)}}
    opt_state = optax.adam(1e-3).init(params)
    jax_ucp.save(str(tmp_path / "ck"), {"params": params, "opt_state": opt_state})
    jax_ucp.export(str(tmp_path / "ck"), tmp_path / "uni", DeepSpeedUniversalExport())
    zero = tmp_path / "uni" / "global_step0_universal" / "zero" / "Dense_0.kernel"
    assert sorted(os.listdir(zero)) == ["exp_avg.pt", "exp_avg_sq.pt", "fp32.pt", "step.pt"]
    np.testing.assert_array_equal(
        load_torch_file(zero / "fp32.pt")["param"], params["Dense_0"]["kernel"]
    )


@pytest.mark.torch
@pytest.mark.parametrize("fixture", ["z1_bf16_dp3", "z2_fp32_dp2"])
def test_deepspeed_universal_files_equal_ds_to_universal(tmp_path, fixture):
    """File by file against ds_to_universal run now: keys, cat_dim, dtypes, shapes, values."""
    import sys

    import torch

    sys.path.insert(0, os.path.join(os.path.dirname(DS), "..", "..", "tools", "fixtures"))
    import make_deepspeed_fixtures as M

    pytest.importorskip("deepspeed")
    tag_dir = os.path.join(DS, fixture, "ckpt", "global_step2")
    M.universal(tag_dir, str(tmp_path / "theirs" / "global_step2_universal"))
    ckpt = jax_ucp.convert(os.path.join(DS, fixture, "ckpt"), str(tmp_path / "ucp"))
    jax_ucp.export(ckpt, tmp_path / "ours", DeepSpeedUniversalExport())
    theirs = tmp_path / "theirs" / "global_step2_universal" / "zero"
    ours = tmp_path / "ours" / "global_step2_universal" / "zero"
    assert sorted(os.listdir(theirs)) == sorted(os.listdir(ours))
    for param in sorted(p for p in os.listdir(theirs) if (theirs / p).is_dir()):
        assert sorted(os.listdir(theirs / param)) == sorted(os.listdir(ours / param))
        for f in os.listdir(theirs / param):
            a = torch.load(theirs / param / f, weights_only=False)
            b = torch.load(ours / param / f, weights_only=True)
            if isinstance(a, dict):
                assert a.keys() == b.keys() and a["cat_dim"] == b["cat_dim"]
                a, b = a["param"], b["param"]
            assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b), (param, f)


def _deepspeed_load_universal(tmp_path, batch: str) -> None:
    """tools/fixtures/ds_load_universal.py under torchrun, one process (DP=1), fp32 ZeRO-2:
    loads tmp_path/uni, writes tmp_path/run/{loaded,stepped}.npz and loss.txt."""
    script = os.path.join(REPO_TOOLS, "ds_load_universal.py")
    args = ["--load", str(tmp_path / "uni"), "--out", str(tmp_path / "run"), "--batch", batch]
    args += ["--stage", "2", "--dtype", "fp32"]
    run_torchrun(script, *args, processes=1, env={"PYTHONWARNINGS": "ignore"}, timeout=900)


@pytest.mark.torch
@pytest.mark.slow
@pytest.mark.timeout(900)  # DeepSpeed builds its CPU ops on the first run of a fresh machine
def test_deepspeed_engine_loads_the_export_at_another_dp_size_and_continues(tmp_path):
    """A DP=2 ZeRO-2 run -> convert -> export; DeepSpeed at DP=1 with load_universal loads it
    (fp32 masters bit-exact) and one step on the next batch matches the DP=2 run's next step."""

    pytest.importorskip("deepspeed")
    fixture = os.path.join(DS, "z2_fp32_dp2")
    ckpt = jax_ucp.convert(os.path.join(fixture, "ckpt"), str(tmp_path / "ucp"))
    jax_ucp.export(ckpt, tmp_path / "uni", DeepSpeedUniversalExport())
    _deepspeed_load_universal(tmp_path, os.path.join(fixture, "next_batch.npy"))
    saved = np.load(os.path.join(fixture, "ref_zero_to_fp32.npz"))
    loaded = np.load(tmp_path / "run" / "loaded.npz")
    for name in saved:
        np.testing.assert_array_equal(loaded[name], saved[name])
    after, expected = (
        np.load(tmp_path / "run" / "stepped.npz"),
        np.load(os.path.join(fixture, "next_params.npz")),
    )
    # DP=1 here vs DP=2 on the machine that wrote the fixture: the same math, gradients summed
    # in another order and DeepSpeed's CPU Adam built for another CPU. Where a gradient is near
    # 0, Adam's m / (sqrt(v) + eps) amplifies that rounding: seen 2.3e-5 on 2 of 48 elements
    # (lr 1e-3). Wrong moments or step count move elements by O(lr), far beyond lr / 10.
    lr = 1e-3
    moved = 0
    for name in expected:
        np.testing.assert_allclose(after[name], expected[name], rtol=0, atol=lr / 10)
        moved += int(np.sum(np.abs(expected[name] - saved[name]) > lr / 10))
    assert moved > 0  # the step did move the parameters


def _torch_layout(flax_params, names):
    """The flax twin's tree back in DeepSpeed's torch names and layouts (GPT_SPEC inverted)."""
    import re

    out = {}
    for name in names:
        transpose = False
        if m := re.fullmatch(r"(wte|wpe)\.weight", name):
            path = (m[1], "embedding")
        elif m := re.fullmatch(r"h\.(\d+)\.(ln_1|ln_2)\.weight", name):
            path = (f"h_{m[1]}", m[2], "scale")
        elif m := re.fullmatch(r"h\.(\d+)\.(\w+)\.weight", name):
            path, transpose = (f"h_{m[1]}", m[2], "kernel"), True
        elif m := re.fullmatch(r"h\.(\d+)\.(\w+)\.bias", name):
            path = (f"h_{m[1]}", m[2], "bias")
        elif name == "ln_f.weight":
            path = ("ln_f", "scale")
        elif m := re.fullmatch(r"(ln_f|lm_head)\.bias", name):
            path = (m[1], "bias")
        else:
            assert name == "lm_head.weight", name
            path, transpose = ("lm_head", "kernel"), True
        value = flax_params
        for part in path:
            value = value[part]
        value = np.asarray(value)
        out[name] = np.ascontiguousarray(value.T if transpose else value)
    return out


@pytest.mark.torch
@pytest.mark.slow
@pytest.mark.timeout(900)  # JAX compiles the un-jitted grad op by op: minutes on a busy machine
def test_a_jax_step_continues_in_deepspeed_with_the_same_loss(tmp_path):
    """DeepSpeed ZeRO-2 run -> convert -> one optax Adam step in JAX (flax twin) -> save (flax
    key paths) -> export deepspeed-universal by the import's spec -> DeepSpeed (DP=1) loads it: its loss on a batch equals the
    JAX model's loss on that batch within 1e-5 relative, and its moments are JAX's."""

    import jax
    import jax.numpy as jnp
    import optax

    from tests.importers.deepspeed.test_nextstep import GPT_SPEC, TinyGPT, _jnp, adam_step

    pytest.importorskip("deepspeed")
    fixture = os.path.join(DS, "z2_fp32_dp2")
    run = json.load(open(os.path.join(fixture, "run.json")))
    model = TinyGPT(run["vocab"], run["width"], run["layers"], run["heads"], run["seq"])
    batch = np.load(os.path.join(fixture, "next_batch.npy"))
    ucp = jax_ucp.convert(os.path.join(fixture, "ckpt"), str(tmp_path / "ucp"))
    names = list(jax_ucp.restore(ucp)["params"])
    r = jax_ucp.restore(ucp, spec=GPT_SPEC)
    st = r["opt_state"]["0"] if "0" in r["opt_state"] else r["opt_state"][0]
    params = _jnp(r["params"])
    state = (
        optax.ScaleByAdamState(
            count=jnp.asarray(st["count"], jnp.int32), mu=_jnp(st["mu"]), nu=_jnp(st["nu"])
        ),
        optax.EmptyState(),
    )
    new = adam_step(params, state, jnp.asarray(batch), model=model, lr=run["lr"])
    grads = jax.grad(lambda p: model.apply({"params": p}, jnp.asarray(batch)))(params)
    _, (adam, _) = optax.adam(run["lr"], b1=0.9, b2=0.999, eps=1e-8).update(grads, state, params)
    other = np.asarray(np.random.default_rng(5).integers(0, run["vocab"], batch.shape), np.int32)
    jax_loss = float(model.apply({"params": new}, jnp.asarray(other)))
    flax = jax.tree.map(np.asarray, {"mu": adam.mu, "nu": adam.nu})
    count = np.asarray(adam.count, np.int32)
    jax_ucp.save(
        str(tmp_path / "jax_step"),
        {"params": jax.tree.map(np.asarray, new), "opt_state": {"0": {**flax, "count": count}}},
    )
    # the flax tree as saved, under the torch model's names by the import's spec run backwards
    spec_export = DeepSpeedUniversalExport(spec=GPT_SPEC)
    jax_ucp.export(str(tmp_path / "jax_step"), tmp_path / "uni", spec_export)
    np.save(tmp_path / "other.npy", other)
    _deepspeed_load_universal(tmp_path, str(tmp_path / "other.npy"))
    ds_loss = float((tmp_path / "run" / "loss.txt").read_text())
    print(f"next-step loss: JAX {jax_loss!r}, DeepSpeed {ds_loss!r}")
    assert abs(ds_loss - jax_loss) <= 1e-5 * abs(jax_loss)
    loaded = np.load(tmp_path / "run" / "loaded.npz")
    for name, value in _torch_layout(new, names).items():
        np.testing.assert_array_equal(loaded[name], value)


def test_deepspeed_universal_leaves_frozen_parameters_out(tmp_path):
    """Frozen parameters (no moments, not in DeepSpeed's optimizer) are not under zero/; the
    export says it skipped them."""
    ckpt = jax_ucp.convert(os.path.join(DS, "z2_bf16_dp2_frozen", "ckpt"), str(tmp_path / "ucp"))
    out = jax_ucp.export(ckpt, tmp_path / "uni", DeepSpeedUniversalExport())
    zero = tmp_path / "uni" / "global_step2_universal" / "zero"
    assert not (zero / "wpe.weight").exists() and (zero / "wte.weight" / "fp32.pt").exists()
    assert {"params/wpe.weight", "params/h.0.ln_1.bias"} <= set(out.skipped)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (
            {"to": "deepspeed-universal", "dtype": "bfloat16"},
            "^dtype= does not apply to 'deepspeed-universal' exports",
        ),
        (
            {"to": "deepspeed-universal", "select": "params"},
            "^select= does not apply to 'deepspeed-universal' exports",
        ),
        (
            {"to": "torch-dcp", "config": {"model_type": "llama"}},
            "^config= does not apply to 'torch-dcp' exports",
        ),
        (
            {"to": "orbax", "max_file_bytes": "1GB"},
            "^max_file_bytes= does not apply to 'orbax' exports",
        ),
        (
            {"to": "safetensors", "param_groups": 2},
            "^param_groups= does not apply to 'safetensors' exports",
        ),
    ],
)
def test_options_that_do_not_apply_are_refused(tmp_path, kwargs, message):
    """A format's options built from its name (``jax-ucp export --to``) refuse the fields of
    other formats, naming the field and the format."""
    jax_ucp.save(str(tmp_path / "ck"), {"params": {"w": np.ones(4, np.float32)}})
    with pytest.raises(RequestError, match=message):
        options = options_for(kwargs.pop("to"), **kwargs)
        jax_ucp.export(str(tmp_path / "ck"), tmp_path / "out", options)
    assert sorted(os.listdir(tmp_path)) == ["ck"]
