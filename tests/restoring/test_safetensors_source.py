"""jax_ucp.restore straight from Hugging Face safetensors (issue 26 item 1): files written by the
``safetensors`` package itself, restored onto a 2x4 mesh without conversion, equal element for
element to what was written and to convert + restore (also through the hf_llama spec's views);
only the needed bytes read; hostile files refused exactly as the importer refuses them."""

from __future__ import annotations

import json
import os

import jax
import ml_dtypes
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from safetensors.numpy import load_file, save_file

import jax_ucp
from jax_ucp._src import store
from jax_ucp._src.restoring.sources import gathered, import_source
from jax_ucp.language import load_spec
from jax_ucp.models import LMConfig
from tests.importers.safetensors.test_import import BAD

pytestmark = pytest.mark.timeout(120)
BF16 = np.dtype(ml_dtypes.bfloat16)


def _mesh():
    return Mesh(np.array(jax.devices()[:8]).reshape(2, 4), ("data", "model"))


def _llama(rng, dtype=BF16, layers=2):
    h, kv, f, v = 32, 16, 48, 64
    w = {
        "model.embed_tokens.weight": (v, h),
        "model.norm.weight": (h,),
        "lm_head.weight": (v, h),
    }
    for i in range(layers):
        p = f"model.layers.{i}."
        w |= {p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,)}
        w |= {p + "self_attn.q_proj.weight": (h, h), p + "self_attn.o_proj.weight": (h, h)}
        w |= {p + "self_attn.k_proj.weight": (kv, h), p + "self_attn.v_proj.weight": (kv, h)}
        w |= {p + "mlp.gate_proj.weight": (f, h), p + "mlp.up_proj.weight": (f, h)}
        w |= {p + "mlp.down_proj.weight": (h, f)}
    return {k: (rng.standard_normal(s) * 0.1).astype(dtype) for k, s in w.items()}


def _sharded_folder(path, weights):
    """Two shards and the index, as save_pretrained lays them out."""
    path.mkdir()
    names = sorted(weights)
    half = len(names) // 2
    weight_map = {}
    for k, part in enumerate((names[:half], names[half:])):
        file = f"model-{k + 1:05d}-of-00002.safetensors"
        save_file({n: weights[n] for n in part}, str(path / file))
        weight_map |= {n: file for n in part}
    (path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return path


def _tp_spec(name, ndim):
    if ndim == 1:
        return P()
    if "o_proj" in name or "down_proj" in name:
        return P(None, "model")  # row-parallel
    return P("model", None)  # column-parallel


def _assert_same(got, want, name):
    assert got.dtype == want.dtype and got.shape == want.shape, name
    assert np.array_equal(
        np.asarray(got).reshape(-1).view(np.uint8), np.asarray(want).reshape(-1).view(np.uint8)
    ), name


@pytest.mark.timeout(60)
def test_tp_split_onto_mesh_bit_exact(tmp_path):
    """Megatron-style TP (column-parallel on dim 0, row-parallel on dim 1) on 2x4 from a sharded
    folder: every device's slice holds the bytes the safetensors package reads back."""
    weights = _llama(np.random.default_rng(0))
    src = _sharded_folder(tmp_path / "hf", weights)
    mesh = _mesh()
    target = {
        "params": {
            n: jax.ShapeDtypeStruct(
                w.shape, w.dtype, sharding=NamedSharding(mesh, _tp_spec(n, w.ndim))
            )
            for n, w in weights.items()
        }
    }
    got = jax_ucp.restore(src, target=target)["params"]
    want = {}
    for f in sorted(os.listdir(src)):
        if f.endswith(".safetensors"):
            want |= load_file(str(src / f))
    assert sorted(got) == sorted(want)
    for name, value in want.items():
        x = got[name]
        assert x.sharding == target["params"][name].sharding, name
        for shard in x.addressable_shards:
            _assert_same(shard.data, value[shard.index], name)


@pytest.mark.timeout(60)
def test_dtypes_ranks_and_a_single_file(tmp_path):
    """f32/f16/bf16/int8/bool/f64, 0-d and 3-d tensors; a file given by its path; no target gives
    host numpy arrays under params/ as convert + restore does."""
    rng = np.random.default_rng(1)
    weights = {
        "f32": rng.standard_normal((8, 12)).astype(np.float32),
        "f16": rng.standard_normal((4, 8, 6)).astype(np.float16),
        "bf16": rng.standard_normal((16,)).astype(BF16),
        "i8": rng.integers(-128, 127, (8, 4), dtype=np.int8),
        "mask": rng.integers(0, 2, (4, 4)).astype(bool),
        "f64": rng.standard_normal((3,)),
        "scalar": np.array(2.5, np.float32),
    }
    file = tmp_path / "model.safetensors"
    save_file(weights, str(file))
    direct = jax_ucp.restore(file)
    converted = jax_ucp.restore(jax_ucp.convert(file, tmp_path / "ucp"))
    assert sorted(direct["params"]) == sorted(weights) == sorted(converted["params"])
    for name, value in weights.items():
        assert isinstance(direct["params"][name], np.ndarray), name
        _assert_same(direct["params"][name], value, name)
        _assert_same(direct["params"][name], converted["params"][name], name)
    mesh = _mesh()
    sh = NamedSharding(mesh, P(None, "model", None))  # a 3-d tensor cut on its middle dim
    got = jax_ucp.restore(
        file, target={"params": {"f16": jax.ShapeDtypeStruct((4, 8, 6), np.float16, sharding=sh)}}
    )
    for shard in got["params"]["f16"].addressable_shards:
        _assert_same(shard.data, weights["f16"][shard.index], "f16")


@pytest.mark.timeout(90)
def test_hf_llama_spec_equals_convert_then_restore(tmp_path, monkeypatch):
    """The spec's views (transpose, q/k/v merged, gate|up concatenated, renames) over the
    files give, on a mesh and on host, exactly what the converted checkpoint gives. Every kernel
    (transposed, q/k/v merged, gate|up concatenated) is read by ``Gathered`` (row blocks and
    tiles made small here so that several of each are cut), the rest as stored."""
    monkeypatch.setattr(import_source, "BLOCK_BYTES", 200)
    monkeypatch.setattr(gathered, "TILE", 3)
    read = []
    gather_map = gathered.gather_map

    def counting(plan, shapes, dtypes):
        found = gather_map(plan, shapes, dtypes)
        read.extend("/".join(k[1:]) for k in plan.sources if found is not None)
        return found

    monkeypatch.setattr(import_source, "gather_map", counting)
    weights = _llama(np.random.default_rng(2))
    src = _sharded_folder(tmp_path / "hf", weights)
    config = {"hidden_size": 32, "num_attention_heads": 4, "num_key_value_heads": 2,
              "num_hidden_layers": 2, "intermediate_size": 48, "vocab_size": 64}  # fmt: skip
    spec = load_spec("hf_llama", **LMConfig.from_hf_llama(config).head_settings)
    ckpt = jax_ucp.convert(src, tmp_path / "ucp")
    host_direct, host_converted = (jax_ucp.restore(p, spec=spec) for p in (src, ckpt))
    flat = jax.tree_util.tree_flatten_with_path
    assert jax.tree.structure(host_direct) == jax.tree.structure(host_converted)
    for (path, x), (_, y) in zip(flat(host_direct)[0], flat(host_converted)[0]):
        _assert_same(x, y, jax.tree_util.keystr(path))
    assert host_direct["params"]["layers_0"]["attn"]["qkv"]["kernel"].shape == (32, 64)
    assert sorted(set(read)) == sorted(
        n for n in weights if weights[n].ndim == 2 and "embed_tokens" not in n
    )
    # the same through TensorStore's lazy views over the files (what any other op takes)
    ops = gathered.GATHER_OPS
    monkeypatch.setattr(gathered, "GATHER_OPS", set())
    read.clear()
    for (path, x), (_, y) in zip(flat(jax_ucp.restore(src, spec=spec))[0], flat(host_converted)[0]):
        _assert_same(x, y, jax.tree_util.keystr(path))
    assert read == []
    monkeypatch.setattr(gathered, "GATHER_OPS", ops)
    mesh = _mesh()
    for spec2d in (P(None, "model"), P("model", None), P("data", "model")):
        target = jax.tree.map(
            lambda x, s=spec2d: jax.ShapeDtypeStruct(
                x.shape, x.dtype, sharding=NamedSharding(mesh, s if x.ndim == 2 else P())
            ),
            host_converted,
        )
        direct, converted = (jax_ucp.restore(p, target=target, spec=spec) for p in (src, ckpt))
        for (path, x), (_, y) in zip(flat(direct)[0], flat(converted)[0]):
            assert x.sharding == y.sharding, jax.tree_util.keystr(path)
            for sx, sy in zip(x.addressable_shards, y.addressable_shards):
                assert sx.index == sy.index
                _assert_same(sx.data, sy.data, jax.tree_util.keystr(path))


@pytest.mark.timeout(60)
def test_reads_only_the_needed_bytes_once(tmp_path):
    """A target naming two tensors reads their bytes and nothing else: a row-parallel weight cut
    on dim 1 over 4 devices and replicated over 2 is read once, not 8 times; select= likewise."""
    weights = _llama(np.random.default_rng(3))
    src = _sharded_folder(tmp_path / "hf", weights)
    mesh = _mesh()
    picked = ["model.layers.1.mlp.down_proj.weight", "model.layers.0.self_attn.q_proj.weight"]
    target = {
        "params": {
            n: jax.ShapeDtypeStruct(
                weights[n].shape, BF16, sharding=NamedSharding(mesh, _tp_spec(n, 2))
            )
            for n in picked
        }
    }
    before = store.bytes_read()
    got = jax_ucp.restore(src, target=target)
    assert store.bytes_read() - before == sum(weights[n].nbytes for n in picked)
    for n in picked:
        _assert_same(np.asarray(got["params"][n]), weights[n], n)
    before = store.bytes_read()
    sel = jax_ucp.restore(src, select=r"params/model\.norm\.weight")
    assert store.bytes_read() - before == weights["model.norm.weight"].nbytes
    assert list(sel["params"]) == ["model.norm.weight"]
    _assert_same(sel["params"]["model.norm.weight"], weights["model.norm.weight"], "norm")


@pytest.mark.timeout(60)
def test_small_blocks_and_budget(tmp_path, monkeypatch):
    """Row blocks smaller than a tensor and a read budget smaller than one: still exact (column
    cuts across block edges, several regions sharing one block)."""
    monkeypatch.setattr(import_source, "BLOCK_BYTES", 200)
    monkeypatch.setattr(import_source, "VIEW_CHUNK_BYTES", 100)
    weights = _llama(np.random.default_rng(4), dtype=np.float32, layers=1)
    src = _sharded_folder(tmp_path / "hf", weights)
    mesh = _mesh()
    for spec_of in (_tp_spec, lambda n, d: P() if d == 1 else P("data", "model")):
        target = {
            "params": {
                n: jax.ShapeDtypeStruct(
                    w.shape, BF16, sharding=NamedSharding(mesh, spec_of(n, w.ndim))
                )
                for n, w in weights.items()
            }
        }
        got = jax_ucp.restore(src, target=target, memory_budget=1000)["params"]
        for n, w in weights.items():
            for shard in got[n].addressable_shards:  # float32 -> bfloat16 as asked
                _assert_same(shard.data, w.astype(BF16)[shard.index], n)


@pytest.mark.parametrize("case", sorted(BAD))
def test_hostile_files_refused_as_by_the_importer(tmp_path, case):
    make, message = BAD[case]
    src = tmp_path / "hf"
    src.mkdir()
    make(src / "model.safetensors")
    with pytest.raises(jax_ucp.UCPError, match=message):
        jax_ucp.restore(src)


def test_duplicate_key_and_unconsolidated_shard_refused(tmp_path):
    src = tmp_path / "hf"
    src.mkdir()
    raw = (
        b'{"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}, '
        b'"a": {"dtype": "F32", "shape": [1], "data_offsets": [4, 8]}}'
    )
    (src / "model.safetensors").write_bytes(len(raw).to_bytes(8, "little") + raw + b"\0" * 8)
    with pytest.raises(jax_ucp.UCPError, match=r"names 'a' twice"):
        jax_ucp.restore(src)
    dcp = tmp_path / "shard-00001-model-00001-of-00001.safetensors"
    save_file(
        {"w": np.ones((2, 2), np.float32)},
        str(dcp),
        metadata={"DCP_SHARDING_INFO": json.dumps({"w": {"saved_offsets": [0, 0]}})},
    )
    with pytest.raises(jax_ucp.UCPError, match=r"unconsolidated shard.*saved_offsets \[0, 0\]"):
        jax_ucp.restore(dcp)


def test_target_errors_name_the_tensor_and_file(tmp_path):
    file = tmp_path / "model.safetensors"
    save_file({"w": np.ones((4, 6), np.float32), "n": np.ones(3, np.float32)}, str(file))
    sds = jax.ShapeDtypeStruct
    with pytest.raises(
        jax_ucp.UCPError,
        match=r"'params/w': the target asks for shape \(6, 4\), .*model\.safetensors:w\) holds "
        r"shape \(4, 6\)",
    ):
        jax_ucp.restore(file, target={"params": {"w": sds((6, 4), np.float32)}})
    with pytest.raises(jax_ucp.UCPError, match=r"'params/x'.*safetensors"):
        jax_ucp.restore(file, target={"params": {"x": sds((4, 6), np.float32)}})
    with pytest.raises(
        jax_ucp.UCPError, match=r"'params/w' was saved as float32; converting it to int8"
    ):
        jax_ucp.restore(file, target={"params": {"w": sds((4, 6), np.int8)}})
    with pytest.raises(  # the UCP reader's message: one select= path for both sources
        jax_ucp.UCPError,
        match=r"select='opt_state/\.\*' matches no tensor or value of the checkpoint "
        r".*model\.safetensors; its top-level names: 'params' \(a regex is matched in full "
        r"against '/'-joined names such as 'params/n'\)\.$",
    ):
        jax_ucp.restore(file, select="opt_state/.*")
    big = tmp_path / "big.safetensors"
    save_file({"w": np.full((2,), 1e10, np.float32)}, str(big))
    with pytest.raises(jax_ucp.UCPError, match=r"'params/w' .*big\.safetensors:w.*2 of its values"):
        jax_ucp.restore(big, target={"params": {"w": sds((2,), np.float16)}})


def test_a_ucp_checkpoint_beside_safetensors_is_read_as_ucp(tmp_path):
    """A folder holding ucp.json (or an Orbax step holding a UCP item) stays a UCP checkpoint
    even with a .safetensors file in it."""
    file = tmp_path / "model.safetensors"
    save_file({"w": np.arange(6, dtype=np.float32)}, str(file))
    ckpt = jax_ucp.convert(file, tmp_path / "step" / "100" / "state")
    save_file({"w": np.zeros(6, np.float32)}, str(tmp_path / "step" / "100" / "model.safetensors"))
    save_file({"w": np.zeros(6, np.float32)}, os.path.join(ckpt, "model.safetensors"))
    for path in (ckpt, tmp_path / "step" / "100"):
        _assert_same(jax_ucp.restore(path)["params"]["w"], np.arange(6, dtype=np.float32), "w")
    _assert_same(jax_ucp.restore(file)["params"]["w"], np.arange(6, dtype=np.float32), "w")
