"""Megatron-DeepSpeed TP/PP checkpoints: equal to DeepSpeed's own ds_to_universal, element for element.

Fixtures ``tests/fixtures/deepspeed/megatron_ds_*_synthetic`` are labelled synthetic: a real DeepSpeed
checkpoint of the tiny GPT split the way Megatron-DeepSpeed's TP/PP lays it out
(tools/fixtures/make_megatron_deepspeed_fixtures.py, SYNTHETIC.md in each). ``ref_universal.npz`` is
``ds_to_universal``'s output on the synthetic checkpoint itself; ``ref_model.npz`` the expected
model-precision weights. No torch needed here; ``-m torch`` regenerates and compares live.
"""

from __future__ import annotations

import glob
import json
import os
import shutil
import subprocess
import sys
import zipfile

import ml_dtypes
import numpy as np
import pytest

import jax_ucp
from jax_ucp._src.importers.deepspeed import open_deepspeed_checkpoint
from jax_ucp._src.importers.deepspeed.megatron import MegatronDeepSpeedCheckpoint
from jax_ucp._src.store.storage import LocalDirectory
from jax_ucp.conversion import ImportOptions, convert
from jax_ucp.errors import SourceError
from tests.ucp_testing import REPO, assert_destination_untouched, copy_deepspeed_fixture

ROOT = REPO
FIX = os.path.join(ROOT, "tests", "fixtures", "deepspeed")
MEG = sorted(os.path.basename(d) for d in glob.glob(os.path.join(FIX, "megatron_ds_*_synthetic")))
TAG = "global_step2"

_converted: dict[str, str] = {}


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    def get(name: str) -> str:
        if name not in _converted:
            _converted[name] = convert(
                os.path.join(FIX, name, "ckpt"),
                tmp_path_factory.mktemp("meg") / name,
                format="deepspeed",
            )
        return _converted[name]

    return get


def test_fixtures_present_and_labelled():
    assert MEG == [
        "megatron_ds_tp2_dp2_z1_bf16_synthetic",
        "megatron_ds_tp2_dp3_z2_fp32_synthetic",
        "megatron_ds_tp2_pp2_dp2_z1_bf16_synthetic",
    ]
    total = 0
    for name in MEG:
        assert os.path.isfile(os.path.join(FIX, name, "SYNTHETIC.md"))
        total += sum(
            os.path.getsize(os.path.join(d, f))
            for d, _, fs in os.walk(os.path.join(FIX, name))
            for f in fs
        )
    assert total <= 1.5 * 2**20


@pytest.mark.parametrize("name", MEG)
def test_equals_ds_to_universal(converted, name):
    d = os.path.join(FIX, name)
    run = json.load(open(os.path.join(d, "run.json")))
    got = jax_ucp.restore(converted(name))
    U = np.load(os.path.join(d, "ref_universal.npz"))
    names = sorted({k.rsplit("/", 1)[0] for k in U.files})
    assert (
        sorted(got["params"])
        == names
        == sorted(got["opt_state"]["mu"])
        == sorted(got["opt_state"]["nu"])
    )
    for n in names:
        for state, tree in (
            ("fp32", got["params"]),
            ("exp_avg", got["opt_state"]["mu"]),
            ("exp_avg_sq", got["opt_state"]["nu"]),
        ):
            ref = U[f"{n}/{state}"]
            assert tree[n].dtype == np.float32 and tree[n].shape == ref.shape, (
                n,
                state,
                tree[n].shape,
                ref.shape,
            )
            np.testing.assert_array_equal(tree[n], ref, err_msg=f"{name} {n} {state}")
        assert int(U[f"{n}/step"]) == int(got["opt_state"]["count"])
    assert (
        np.asarray(got["opt_state"]["count"]).dtype == np.int32
        and int(got["opt_state"]["count"]) == run["steps"]
    )
    # vocab padding stripped to ORIGINAL_VOCAB_SIZE
    emb = [n for n in names if n.endswith("word_embeddings.weight")]
    assert emb and all(got["params"][n].shape[0] == run["vocab"] for n in emb)
    lowp = run["dtype"] != "fp32"
    assert ("model_params" in got) == lowp
    if lowp:
        M = np.load(os.path.join(d, "ref_model.npz"))
        for n in names:
            m = got["model_params"][n]
            assert m.dtype == ml_dtypes.bfloat16 and m.shape == got["params"][n].shape
            np.testing.assert_array_equal(m.view(np.int16), M[n], err_msg=n)


def test_kinds_come_from_universal_checkpoint_info(converted):
    name = "megatron_ds_tp2_dp2_z1_bf16_synthetic"
    m = jax_ucp.inspect(converted(name))
    assert m.source["layout"] == "megatron-deepspeed" and (m.source["tp"], m.source["pp"]) == (2, 1)
    assert m.source["original_vocab_size"] == 37 and m.source["padded_vocab_size"] == 48
    kinds = json.load(open(os.path.join(FIX, name, "run.json")))["kinds"]
    checkpoint = open_deepspeed_checkpoint(LocalDirectory(os.path.join(FIX, name, "ckpt")))
    assert isinstance(checkpoint, MegatronDeepSpeedCheckpoint)
    matches = checkpoint.matches
    expect = {
        "replicated": "replicated",
        "averaged": "averaged",
        "row": "partitioned",
        "col": "partitioned",
        "two_sub": "swiglu",
        "sub": "sub_params",
    }
    for n, k in kinds.items():
        kind = matches[n].kind
        if k.startswith("vocab+"):
            assert kind.kind == "vocab" and kind.vocab_size == 37, n
            kind, k = kind.inner, k.split("+")[1]
        assert kind.kind == expect[k], (n, kind, k)


def test_pipeline_tied_embedding_and_layer_files(converted):
    name = "megatron_ds_tp2_pp2_dp2_z1_bf16_synthetic"
    checkpoint = open_deepspeed_checkpoint(LocalDirectory(os.path.join(FIX, name, "ckpt")))
    assert (checkpoint.grid.tp, checkpoint.grid.pp, checkpoint.grid.dp) == (2, 2, 2)
    assert checkpoint.holders["tied_modules.embed.word_embeddings.weight"] == [0, 1]
    assert checkpoint.holders["3.self_attention.dense.weight"] == [1]
    # model weights come from the layer files (the mp_rank files hold module=None)
    weights = checkpoint.module
    assert weights["2.mlp.dense_h_to_4h.weight"][1][1] == "layer_02-model_01-model_states.pt"
    assert (
        weights["tied_modules.embed.word_embeddings.weight"][0][1]
        == "layer_01-model_00-model_states.pt"
    )


# ------------------------------------------------------------------ bad input


@pytest.mark.parametrize(
    "victim,match",
    [
        (
            "mp_rank_01_model_states.pt",
            r"mp_rank_01_model_states\.pt: missing model states file of model-parallel rank 1",
        ),
        (
            "bf16_zero_pp_rank_1_mp_rank_01_optim_states.pt",
            r"bf16_zero_pp_rank_1_mp_rank_01_optim_states\.pt: missing optimizer file for DP rank 1 of model-parallel rank 1",
        ),
        (
            "layer_03-model_01-model_states.pt",
            r"layer_03-model_01-model_states\.pt: missing layer file",
        ),
    ],
)
def test_missing_tp_pp_rank_file(tmp_path, victim, match):
    src = copy_deepspeed_fixture(tmp_path, "megatron_ds_tp2_pp2_dp2_z1_bf16_synthetic")
    os.remove(os.path.join(src, TAG, victim))
    dst = str(tmp_path / "out")
    with pytest.raises(SourceError, match=match):
        convert(src, dst, format="deepspeed")
    assert_destination_untouched(dst)


def test_all_tp_ranks_but_zero_missing(tmp_path):
    src = copy_deepspeed_fixture(tmp_path, "megatron_ds_tp2_dp2_z1_bf16_synthetic")
    for f in glob.glob(os.path.join(src, TAG, "*mp_rank_01_*")):
        os.remove(f)
    with pytest.raises(
        SourceError, match=r"mp_world_size is 2|mp_rank_01_model_states\.pt: missing"
    ):
        convert(src, tmp_path / "out", format="deepspeed")
    assert_destination_untouched(str(tmp_path / "out"))


def _tamper_fp32(rank, name: str, change) -> None:
    """Change one ZeRO rank's fp32 master of ``name`` in memory (its first element)."""
    fragments = rank.fragment_plan[name]
    piece = fragments.pieces[0]
    partitions = rank.optim_states[piece.dp_rank]["single_partition_of_fp32_groups"]
    changed = np.array(partitions[fragments.group])
    changed[piece.start] = change(changed[piece.start])
    partitions[fragments.group] = changed


def _tamper_replicated(checkpoint, name: str, tp_rank: int, value: float) -> None:
    """Change TP rank ``tp_rank``'s fp32 copy of ``name`` in memory (its first element)."""
    _tamper_fp32(checkpoint.ranks[checkpoint.holders[name][0]][tp_rank], name, lambda _: value)


def test_tp_ranks_disagreeing_on_replicated_tensor(tmp_path, monkeypatch):
    from jax_ucp._src.importers.deepspeed import megatron as meg

    name = "language_model.encoder.layers.1.input_layernorm.weight"
    real_open = meg.open_megatron_deepspeed_checkpoint

    def tampered(tag_dir, **kw):
        checkpoint = real_open(tag_dir, **kw)
        _tamper_replicated(checkpoint, name, 1, 123.0)
        return checkpoint

    monkeypatch.setattr(meg, "open_megatron_deepspeed_checkpoint", tampered)
    dst = str(tmp_path / "out")
    with pytest.raises(
        SourceError,
        match=rf"{name}:.*TP ranks: rank 0 vs rank\(s\) \[1\].*mp_rank_01_model_states\.pt",
    ):
        convert(
            os.path.join(FIX, "megatron_ds_tp2_dp2_z1_bf16_synthetic", "ckpt"),
            dst,
            format="deepspeed",
        )
    assert_destination_untouched(dst)


def test_pipeline_stages_disagreeing_on_tied_embedding(tmp_path, monkeypatch):
    from jax_ucp._src.importers.deepspeed import megatron as meg

    name = "tied_modules.embed.word_embeddings.weight"
    real_open = meg.open_megatron_deepspeed_checkpoint

    def tampered(tag_dir, **kw):
        checkpoint = real_open(tag_dir, **kw)
        _tamper_fp32(checkpoint.ranks[1][0], name, lambda value: value + 1.0)
        return checkpoint

    monkeypatch.setattr(meg, "open_megatron_deepspeed_checkpoint", tampered)
    dst = str(tmp_path / "out")
    with pytest.raises(
        SourceError,
        match=rf"{name}: pipeline-tied copies disagree: stage 0 vs stage\(s\) \[1\]",
    ):
        convert(
            os.path.join(FIX, "megatron_ds_tp2_pp2_dp2_z1_bf16_synthetic", "ckpt"),
            dst,
            format="deepspeed",
        )
    assert_destination_untouched(dst)


def test_missing_universal_checkpoint_info_needs_a_spec(tmp_path, monkeypatch):
    from jax_ucp._src.importers.deepspeed import files as deepspeed_files

    real_load = deepspeed_files.load_deepspeed_file

    def load(folder, path, **kwargs):
        d = real_load(folder, path, **kwargs)
        if os.path.basename(path).startswith("mp_rank_"):
            d = dict(d)
            d.pop("universal_checkpoint_info", None)
        return d

    monkeypatch.setattr(deepspeed_files, "load_deepspeed_file", load)
    src = os.path.join(FIX, "megatron_ds_tp2_dp3_z2_fp32_synthetic", "ckpt")
    with pytest.raises(SourceError, match="no universal_checkpoint_info"):
        convert(src, tmp_path / "out", format="deepspeed")
    # an explicit import spec stands in for the missing patterns
    from jax_ucp._src.importers.deepspeed.ucp_info import spec_from_ucp_info

    info = real_load(LocalDirectory(os.path.join(src, TAG)), "mp_rank_00_model_states.pt")[
        "universal_checkpoint_info"
    ]
    out = convert(
        src,
        tmp_path / "out2",
        format="deepspeed",
        importing=ImportOptions(spec=spec_from_ucp_info(info)),
    )
    U = np.load(os.path.join(FIX, "megatron_ds_tp2_dp3_z2_fp32_synthetic", "ref_universal.npz"))
    got = jax_ucp.restore(out)
    for n, v in got["params"].items():
        np.testing.assert_array_equal(v, U[f"{n}/fp32"])


def test_tp_ranks_disagreeing_on_step(tmp_path, monkeypatch):
    from jax_ucp._src.importers.deepspeed import zero

    checkpoint = open_deepspeed_checkpoint(
        LocalDirectory(os.path.join(FIX, "megatron_ds_tp2_dp2_z1_bf16_synthetic", "ckpt"))
    )
    assert zero.optimizer_step(*checkpoint.every_rank) == 2
    rank = checkpoint.ranks[0][1]
    rank.optim_states[1]["base_optimizer_state"]["state"][0]["step"] = np.float32(3)
    with pytest.raises(
        SourceError,
        match=r"optimizer step: 2 in .*, 3 in .*rank_1_mp_rank_01",
    ):
        zero.optimizer_step(*checkpoint.every_rank)


# ------------------------------------------------------------------ live (torch + deepspeed)


@pytest.mark.torch
def test_regenerate_and_compare_live(tmp_path):
    """Regenerate the fixtures into a scratch copy and run ds_to_universal on them live: the
    generator asserts ds_to_universal equals the unsplit originals; the importer must equal it."""
    pytest.importorskip("deepspeed")
    env = dict(os.environ, DS_ACCELERATOR="cpu", DSFX_WORK=str(tmp_path / "work"))
    scratch = tmp_path / "repo"
    shutil.copytree(os.path.join(ROOT, "tools"), scratch / "tools")
    shutil.copytree(
        FIX,
        scratch / "tests" / "fixtures" / "deepspeed",
        ignore=shutil.ignore_patterns("megatron_ds_*"),
    )
    subprocess.run(
        [
            sys.executable,
            str(scratch / "tools" / "fixtures" / "make_megatron_deepspeed_fixtures.py"),
        ],
        check=True,
        env=env,
        cwd=scratch,
        stdout=subprocess.DEVNULL,
    )
    for name in MEG:
        d = scratch / "tests" / "fixtures" / "deepspeed" / name
        U = np.load(d / "ref_universal.npz")
        got = jax_ucp.restore(convert(d / "ckpt", tmp_path / f"out_{name}", format="deepspeed"))
        for n in got["params"]:
            for state, tree in (
                ("fp32", got["params"]),
                ("exp_avg", got["opt_state"]["mu"]),
                ("exp_avg_sq", got["opt_state"]["nu"]),
            ):
                np.testing.assert_array_equal(
                    tree[n], U[f"{n}/{state}"], err_msg=f"{name} {n} {state}"
                )


@pytest.mark.torch
def test_restricted_reader_matches_torch_load():
    torch = pytest.importorskip("torch")
    from jax_ucp._src.importers.deepspeed import DS_CLASSES
    from jax_ucp._src.torchfiles.torch_zip import load_torch_file

    for name in MEG:
        for f in glob.glob(os.path.join(FIX, name, "ckpt", TAG, "*.pt")):
            a = load_torch_file(f, DS_CLASSES)
            b = torch.load(f, weights_only=False)
            if os.path.basename(f).startswith("layer_"):
                assert list(a) == list(b), f
                for k in a:
                    np.testing.assert_array_equal(
                        np.asarray(a[k]).astype(np.float32), b[k].float().numpy(), err_msg=f
                    )
            else:
                assert sorted(a) == sorted(b), f


def test_sub_params_legacy_count_and_uneven_shard_widths():
    """DeepSpeed's two sub-param metadata forms, resolved per tensor like merge_tp_slices."""
    from jax_ucp._src.importers.deepspeed.megatron import resolve_sub_params
    from jax_ucp._src.importers.deepspeed.ucp_info import spec_from_ucp_info
    from jax_ucp.language import merge

    pat = r"layers.\d+.qkv.weight"
    full = np.arange(10 * 3, dtype=np.float32).reshape(10, 3)
    # legacy: shape (2, -1) = two equal sub-params; rank r holds [a_r; b_r]
    info = {
        "parameter_with_sub_params": [{"patterns": [pat], "shape": (2, -1), "partition_dim": 0}]
    }
    kind = spec_from_ucp_info(info).match("layers.0.qkv.weight").kind
    a, b = full[:5], full[5:]
    frags = [np.concatenate([a[:2], b[:2]]), np.concatenate([a[2:4], b[2:4]])]
    k = resolve_sub_params(kind, "layers.0.qkv.weight", info, [f.shape[0] for f in frags])
    np.testing.assert_array_equal(merge(k, frags), np.concatenate([a[:4], b[:4]]))
    # v0.4: physical sizes (6, 4) with uneven per-rank widths [[4, 2], [1, 3]]
    info = {
        "universal_checkpoint_version": 0.4,
        "sub_param_shard_widths": {pat: [[4, 2], [1, 3]]},
        "parameter_with_sub_params": [
            {"patterns": [pat], "shape": ((6, 4), -1), "partition_dim": 0}
        ],
    }
    kind = spec_from_ucp_info(info).match("layers.0.qkv.weight").kind
    q, kv = full[:6], full[6:]
    frags = [np.concatenate([q[:4], kv[:1]]), np.concatenate([q[4:], kv[1:]])]
    k = resolve_sub_params(kind, "layers.0.qkv.weight", info, [5, 5])
    np.testing.assert_array_equal(merge(k, frags), full)


def test_spec_file_form(tmp_path):
    """A TOML spec (the plain file form) can stand in for universal_checkpoint_info."""
    from jax_ucp._src.importers.deepspeed import DS_CLASSES
    from jax_ucp._src.importers.deepspeed.ucp_info import spec_from_ucp_info
    from jax_ucp._src.torchfiles.torch_zip import load_torch_file
    from jax_ucp.language import dump_spec

    name = "megatron_ds_tp2_dp3_z2_fp32_synthetic"
    src = os.path.join(FIX, name, "ckpt")
    info = load_torch_file(os.path.join(src, TAG, "mp_rank_00_model_states.pt"), DS_CLASSES)[
        "universal_checkpoint_info"
    ]
    path = tmp_path / "spec.toml"
    dump_spec(spec_from_ucp_info(info), path)
    got = jax_ucp.restore(
        jax_ucp.convert(src, tmp_path / "out", importing=ImportOptions(spec=str(path)))
    )
    U = np.load(os.path.join(FIX, name, "ref_universal.npz"))
    for n, v in got["opt_state"]["nu"].items():
        np.testing.assert_array_equal(v, U[f"{n}/exp_avg_sq"])


def test_two_names_for_one_model_parallel_rank_are_refused_naming_both(tmp_path):
    """``mp_rank_1_model_states.pt`` (saved under that name: its archive folder says so) beside
    ``mp_rank_01_model_states.pt``: both are model-parallel rank 1. The listing kept the last
    one listed (a ZeRO optimizer file's cross-check then refused it indirectly); the two names
    are now refused as such, naming both."""
    src = copy_deepspeed_fixture(tmp_path, "megatron_ds_tp2_dp2_z1_bf16_synthetic")
    tag = os.path.join(src, TAG)
    with zipfile.ZipFile(os.path.join(tag, "mp_rank_01_model_states.pt")) as z:
        members = [(i.filename, z.read(i)) for i in z.infolist()]
    with zipfile.ZipFile(os.path.join(tag, "mp_rank_1_model_states.pt"), "w") as z:
        for name, data in members:
            z.writestr("mp_rank_1_model_states/" + name.split("/", 1)[1], data)
    with pytest.raises(
        SourceError,
        match=r"'mp_rank_01_model_states\.pt' and 'mp_rank_1_model_states\.pt' both name "
        r"model-parallel rank 1",
    ):
        convert(src, tmp_path / "out", format="deepspeed")
    assert_destination_untouched(str(tmp_path / "out"))
