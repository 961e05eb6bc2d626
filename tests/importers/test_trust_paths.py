"""Nothing outside the checkpoint is read, and no tensor borrows another's bytes.

Every hostile checkpoint here is built by the test: a real fixture (written by torch, DeepSpeed,
megatron-core, Orbax or safetensors themselves) copied into tmp_path, then a storage file
replaced by a symlink leading out of it, or its metadata edited (torch-free: ``.metadata`` through
the writer of tests/importers/megatron/test_trust_megatron.py, Orbax's JSON, a safetensors index) to name a file
outside it or another tensor's bytes. Each is refused with an error naming the file and the
entry, nothing written; links that stay inside (a Hugging Face cache snapshot) keep working.
"""

from __future__ import annotations

import json
import os
import re
import shutil

import numpy as np
import pytest

import jax_ucp
from jax_ucp.format import files
from tests.importers.megatron.test_trust_megatron import read_layout, write_layout
from tests.ucp_testing import REPO, assert_bit_exact, assert_destination_untouched

pytestmark = pytest.mark.timeout(120)

FIX = os.path.join(REPO, "tests", "fixtures")


def _copy(tmp_path, rel: str):
    dst = tmp_path / os.path.basename(rel)
    shutil.copytree(os.path.join(FIX, rel), dst)
    return dst


def _move_out(path, outside):
    """``path`` moved to the folder ``outside`` (created) and replaced by a symlink to it."""
    outside.mkdir(exist_ok=True)
    target = outside / path.name
    shutil.move(path, target)
    path.symlink_to(target)
    return target


def _params(path) -> dict:
    return jax_ucp.restore(path)["params"]


# --------------------------------------------------------------------------- the one function


@pytest.mark.parametrize(
    "name, message",
    [
        ("/etc/passwd", r"'/etc/passwd' is an absolute path"),
        ("../x", r"has a '\.\.' part"),
        ("a/../../x", r"has a '\.\.' part"),
        ("a\0b", r"holds a NUL character"),
        ("", r"is not a non-empty string"),
        (7, r"is not a non-empty string"),
    ],
)
def test_inside_refuses_names_leading_out(tmp_path, name, message):
    with pytest.raises(files.OutsideCheckpointError, match=r"^index\.json: file name .*" + message):
        files.inside(tmp_path, name, "index.json")


def test_inside_follows_links_that_stay_inside_and_refuses_those_that_leave(tmp_path):
    root = tmp_path / "ckpt"
    (root / "sub").mkdir(parents=True)
    (root / "sub" / "real").write_bytes(b"x")
    (root / "inner").symlink_to("sub/real")
    (tmp_path / "outside").write_bytes(b"y")
    (root / "outer").symlink_to(tmp_path / "outside")
    (root / "dir").symlink_to(tmp_path, target_is_directory=True)
    assert files.inside(root, "inner", "m") == os.path.realpath(root / "sub" / "real")
    assert os.path.samefile(files.inside(root, "sub/real", "m"), root / "sub" / "real")
    for name in ("outer", "dir/outside"):
        with pytest.raises(files.OutsideCheckpointError, match=r"outside the checkpoint"):
            files.inside(root, name, "m")
    # the checkpoint folder reached through a link is its target: links inside it still count
    (tmp_path / "alias").symlink_to(root, target_is_directory=True)
    assert files.inside(tmp_path / "alias", "inner", "m") == os.path.realpath(root / "sub/real")


# --------------------------------------------------------------------------- torch DCP


@pytest.mark.timeout(120)
def test_dcp_storage_file_linked_outside_is_refused(tmp_path):
    """The issue's reproduction: ``__1_0.distcp`` a symlink to a file outside the checkpoint
    folder. Before, ``convert`` succeeded and read the outside bytes."""
    src = _copy(tmp_path, "torch/fsdp2_fp32")
    _move_out(src / "__1_0.distcp", tmp_path / "elsewhere")
    dst = tmp_path / "out"
    with pytest.raises(
        jax_ucp.UCPError,
        match=r"fsdp2_fp32/\.metadata: storage file: file name '__1_0\.distcp' resolves to "
        r"\S+/elsewhere/__1_0\.distcp, outside the checkpoint",
    ):
        jax_ucp.convert(src, dst)
    assert_destination_untouched(dst)


@pytest.mark.timeout(120)
def test_dcp_storage_file_linked_inside_reads_exactly(tmp_path):
    src = _copy(tmp_path, "torch/fsdp2_fp32")
    want = _params(jax_ucp.convert(os.path.join(FIX, "torch/fsdp2_fp32"), tmp_path / "ref"))
    (src / "blobs").mkdir()
    shutil.move(src / "__1_0.distcp", src / "blobs" / "rank1")
    (src / "__1_0.distcp").symlink_to("blobs/rank1")
    got = _params(jax_ucp.convert(src, tmp_path / "out"))
    assert sorted(got) == sorted(want)
    for name in want:
        assert_bit_exact(got[name], want[name], name)


def _same_shape_pair(tensors: dict) -> tuple[str, str]:
    """Two weight tensors of one shape and dtype (the borrower reads as the lender)."""
    seen: dict = {}
    for name, t in sorted(tensors.items()):
        if not name.startswith("model.") or not t["chunks"]:
            continue
        key = (tuple(t["shape"]), str(t["dtype"]), len(t["chunks"]))
        if key in seen:
            return seen[key], name
        seen[key] = name
    raise AssertionError("the fixture has no two tensors of one shape")


@pytest.mark.timeout(120)
def test_dcp_tensor_pointing_at_another_tensors_bytes_is_refused(tmp_path):
    """Tensor b's storage entries set to a's file/offset/length: before, ``convert`` succeeded
    and b restored with a's values. Now an error naming both tensors and the file."""
    src = _copy(tmp_path, "torch/fsdp2_fp32")
    tensors, objects = read_layout(src)
    a, b = _same_shape_pair(tensors)
    for ca, cb in zip(tensors[a]["chunks"], tensors[b]["chunks"]):
        cb.update(file=ca["file"], offset=ca["offset"], length=ca["length"])
    write_layout(src, tensors, objects)
    dst = tmp_path / "out"
    with pytest.raises(
        jax_ucp.UCPError,
        match=rf"\.metadata: tensor '({a}|{b})' \(chunk at offsets \[\d+(, \d+)*\]\) and "
        rf"tensor '({a}|{b})' \(chunk at offsets .*\) share bytes \[\d+, \d+\) of storage file "
        r"__\d_0\.distcp",
    ) as e:
        jax_ucp.convert(src, dst)
    assert a in str(e.value) and b in str(e.value)
    assert_destination_untouched(dst)


@pytest.mark.timeout(120)
def test_dcp_entries_overlapping_in_part_across_tensors_are_refused(tmp_path):
    """An entry lying inside a longer one of another tensor (not equal to it) is found too;
    adjacent entries, and equal ranges of two files, are fine."""
    from jax_ucp.importers.torch.dcp_reader import DcpChunk, DcpError, DcpTensor, check_disjoint

    f32 = np.dtype(np.float32)
    tensors = {
        "a": DcpTensor("a", (100,), f32, (DcpChunk((0,), (100,), "__0_0.distcp", 0, 400),)),
        "c": DcpTensor("c", (2,), f32, (DcpChunk((0,), (2,), "__0_0.distcp", 8, 8),)),
        "d": DcpTensor("d", (2,), f32, (DcpChunk((0,), (2,), "__1_0.distcp", 8, 8),)),
    }
    with pytest.raises(DcpError, match=r"tensor 'a' .* and tensor 'c' .* share bytes \[8, 16\)"):
        check_disjoint(tensors, {}, "m")
    tensors["c"] = DcpTensor("c", (2,), f32, (DcpChunk((0,), (2,), "__0_0.distcp", 400, 8),))
    check_disjoint(tensors, {}, "m")  # adjacent, and equal ranges in two files: fine


@pytest.mark.timeout(60)
def test_dcp_disjoint_verdict_matches_a_brute_force_pairwise_check():
    """Random storage entries (tensors' chunks and objects over 3 files, some empty): an error
    exactly when some two entries share a byte, naming two entries that do."""
    from jax_ucp.importers.torch.dcp_reader import (
        DcpChunk,
        DcpError,
        DcpObject,
        DcpTensor,
        check_disjoint,
    )

    rng = np.random.default_rng(3)
    f32 = np.dtype(np.float32)
    verdicts = set()
    for _ in range(400):
        spans = [
            (f"__{rng.integers(3)}_0.distcp", int(rng.integers(0, 60)), int(rng.integers(0, 8)))
            for _ in range(int(rng.integers(2, 9)))
        ]
        tensors, objects = {}, {}
        for k, (file, offset, length) in enumerate(spans):
            if k % 3 == 2:
                objects[f"o{k}"] = DcpObject(f"o{k}", file, offset, length)
            else:
                chunk = DcpChunk((k,), (1,), file, offset, length)
                tensors[f"t{k}"] = DcpTensor(f"t{k}", (len(spans),), f32, (chunk,))
        shared = {
            (a, b)
            for a in range(len(spans))
            for b in range(len(spans))
            if a < b
            and spans[a][0] == spans[b][0]
            and max(spans[a][1], spans[b][1])
            < min(spans[a][1] + spans[a][2], spans[b][1] + spans[b][2])
        }
        try:
            check_disjoint(tensors, objects, "m")
        except DcpError as e:
            named = {int(n[1:]) for n in re.findall(r"'([ot]\d+)'", str(e))}
            assert any(set(pair) == named for pair in shared), (spans, str(e))
            verdicts.add("shared")
        else:
            assert not shared, spans
            verdicts.add("disjoint")
    assert verdicts == {"shared", "disjoint"}


# --------------------------------------------------------------------------- safetensors / .bin


def _hf_cache(tmp_path, tensors: dict) -> tuple:
    """A Hugging Face cache repo as ``huggingface_hub`` lays it out: the files in
    ``blobs/<sha256>``, ``snapshots/<rev>/`` holding relative links to them (index included)."""
    import hashlib

    from safetensors.numpy import save_file

    repo = tmp_path / "hub" / "models--org--tiny"
    blobs, snap = repo / "blobs", repo / "snapshots" / ("c0ffee" * 6 + "beef")
    blobs.mkdir(parents=True)
    snap.mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(snap.name)
    staging = tmp_path / "staging"
    staging.mkdir()
    weight_map = {}
    for i, (name, value) in enumerate(sorted(tensors.items())):
        shard = f"model-{i + 1:05d}-of-{len(tensors):05d}.safetensors"
        save_file({name: value}, str(staging / shard))
        weight_map[name] = shard
    (staging / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    for f in sorted(staging.iterdir()):
        sha = hashlib.sha256(f.read_bytes()).hexdigest()
        shutil.move(f, blobs / sha)
        (snap / f.name).symlink_to(f"../../blobs/{sha}")
    return repo, snap


@pytest.mark.timeout(120)
def test_hugging_face_cache_snapshot_imports_and_restores(tmp_path):
    """Every file of a cache snapshot is a link to ``../../blobs/<sha>``, outside the snapshot
    folder but inside the cache repo: imported and restored straight from it, exactly, under the
    snapshot's file names."""
    want = {
        "embed.weight": np.arange(12, dtype=np.float32).reshape(3, 4),
        "norm.weight": np.linspace(0, 1, 4).astype(np.float32),
    }
    _, snap = _hf_cache(tmp_path, want)
    out = jax_ucp.convert(snap, tmp_path / "out")
    got = _params(out)
    for name, value in want.items():
        assert_bit_exact(got[name], value, name)
    assert jax_ucp.inspect(out).source["files"] == [
        "model-00001-of-00002.safetensors",
        "model-00002-of-00002.safetensors",
    ]
    direct = jax_ucp.restore(snap)  # restore straight from safetensors: the same checks
    for name, value in want.items():
        assert_bit_exact(direct["params"][name], value, name)


@pytest.mark.timeout(60)
def test_safetensors_shard_linked_outside_is_refused(tmp_path):
    """A snapshot link leading out of the cache repo, a folder's one file and an index's shard
    linked elsewhere: refused naming the entry, on import and on restore."""
    repo, snap = _hf_cache(tmp_path, {"a": np.ones(2, np.float32), "b": np.zeros(3, np.float32)})
    shard = snap / "model-00002-of-00002.safetensors"
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    shutil.copy(shard, elsewhere / "b.safetensors")
    shard.unlink()
    shard.symlink_to(elsewhere / "b.safetensors")
    message = (
        r"model\.safetensors\.index\.json: weight_map entry 'b': file name "
        r"'model-00002-of-00002\.safetensors' resolves to \S+/elsewhere/b\.safetensors, outside "
        r"the checkpoint"
    )
    with pytest.raises(jax_ucp.UCPError, match=message):
        jax_ucp.convert(snap, tmp_path / "out")
    assert_destination_untouched(tmp_path / "out")
    with pytest.raises(jax_ucp.UCPError, match=message):
        jax_ucp.restore(snap)
    single = tmp_path / "single"
    single.mkdir()
    (single / "model.safetensors").symlink_to(elsewhere / "b.safetensors")
    with pytest.raises(jax_ucp.UCPError, match=r"'model\.safetensors' resolves to .*outside"):
        jax_ucp.convert(single, tmp_path / "out1")
    assert_destination_untouched(tmp_path / "out1")


@pytest.mark.timeout(60)
def test_safetensors_index_naming_a_file_with_a_nul_is_a_clear_error(tmp_path):
    """Before: a raw ``ValueError: embedded null byte`` naming neither the index nor the entry."""
    from safetensors.numpy import save_file

    src = tmp_path / "hf"
    src.mkdir()
    save_file({"a": np.ones(2, np.float32)}, str(src / "model.safetensors"))
    (src / "model.safetensors.index.json").write_text(
        '{"weight_map": {"a": "model.safetensors", "b": "mod\\u0000el.safetensors"}}'
    )
    with pytest.raises(
        jax_ucp.UCPError,
        match=r"hf/model\.safetensors\.index\.json: weight_map entry 'b': file name "
        r"'mod\\x00el\.safetensors' holds a NUL character",
    ):
        jax_ucp.convert(src, tmp_path / "out")
    assert_destination_untouched(tmp_path / "out")


@pytest.mark.timeout(60)
def test_bin_shard_linked_outside_and_index_nul_are_refused(tmp_path):
    """``pytorch_model.bin.index.json`` shards: one linked elsewhere, or named with a NUL."""
    src = _copy(tmp_path, "torch/hf_bin_sharded")
    _move_out(src / "pytorch_model-00002-of-00002.bin", tmp_path / "elsewhere")
    with pytest.raises(
        jax_ucp.UCPError,
        match=r"pytorch_model\.bin\.index\.json: weight_map entry '.*': file name "
        r"'pytorch_model-00002-of-00002\.bin' resolves to \S+/elsewhere/.*outside the checkpoint",
    ):
        jax_ucp.convert(src, tmp_path / "out")
    index = src / "pytorch_model.bin.index.json"
    data = json.loads(index.read_text())
    name = sorted(data["weight_map"])[0]
    data["weight_map"][name] = "pytorch\0model.bin"
    index.write_text(json.dumps(data))
    with pytest.raises(
        jax_ucp.UCPError, match=rf"weight_map entry '{name}': file name .* holds a NUL character"
    ):
        jax_ucp.convert(src, tmp_path / "out")
    single = _copy(tmp_path, "torch/hf_bin")
    _move_out(single / "pytorch_model.bin", tmp_path / "elsewhere2")
    with pytest.raises(jax_ucp.UCPError, match=r"'pytorch_model\.bin' resolves to .*outside"):
        jax_ucp.convert(single, tmp_path / "out")
    assert_destination_untouched(tmp_path / "out")


# --------------------------------------------------------------------------- Orbax


def _orbax(path, tree, ocdbt: bool = False):
    import orbax.checkpoint as ocp

    ocp.PyTreeCheckpointer(use_ocdbt=ocdbt).save(path, tree)
    return path


def _rename_leaf(ckpt, old: tuple, keys: list) -> None:
    """The ``_METADATA`` entry of leaf ``old`` given the key path ``keys`` instead (Orbax reads
    the array from the directory or OCDBT key ``'.'.join(keys)``)."""
    meta_file = ckpt / "_METADATA"
    meta = json.loads(meta_file.read_text())
    entry = meta["tree_metadata"].pop(str(old))
    entry["key_metadata"] = [{"key": k, "key_type": 2} for k in keys]
    meta["tree_metadata"][str(tuple(keys))] = entry
    meta_file.write_text(json.dumps(meta))


@pytest.mark.timeout(120)
@pytest.mark.parametrize("ocdbt", [False, True], ids=["zarr", "ocdbt"])
def test_orbax_leaf_name_joining_to_an_absolute_path_is_refused(tmp_path, ocdbt):
    """An Orbax ``_METADATA`` whose key path joins to another checkpoint's array directory
    (``/abs/other/params`` + ``w``): before, the other checkpoint's array was imported and its
    absolute path recorded as provenance."""
    tree = {"params": {"w": np.arange(4, dtype=np.float32), "b": np.ones(3, np.float32)}}
    other = _orbax(tmp_path / "other", {"params": {"w": np.full(4, 7, np.float32)}}, ocdbt)
    mine = _orbax(tmp_path / "mine", tree, ocdbt)
    _rename_leaf(mine, ("params", "w"), [f"{other}/params", "w"])
    with pytest.raises(
        jax_ucp.UCPError,
        match=rf"mine/_METADATA: array '{other}/params\.w': file name '{other}/params\.w' is an "
        r"absolute path",
    ):
        jax_ucp.convert(mine, tmp_path / "out")
    assert_destination_untouched(tmp_path / "out")
    for keys, message in (
        (["", "", "/other/params", "w"], r"'\.\./other/params\.w' has a '\.\.' part"),
        (["params", "w\0"], r"holds a NUL character"),
    ):
        _rename_leaf(mine, tuple(_key_path(mine)), keys)
        with pytest.raises(jax_ucp.UCPError, match=message):
            jax_ucp.convert(mine, tmp_path / "out")
        assert_destination_untouched(tmp_path / "out")


def _key_path(ckpt) -> list:
    """The key path of the one ``_METADATA`` entry not named ``('params', 'b')``."""
    meta = json.loads((ckpt / "_METADATA").read_text())["tree_metadata"]
    (entry,) = [e for k, e in meta.items() if k != str(("params", "b"))]
    return [k["key"] for k in entry["key_metadata"]]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("ocdbt", [False, True], ids=["zarr", "ocdbt"])
def test_orbax_files_linked_outside_are_refused_and_inside_links_read(tmp_path, ocdbt):
    """A chunk file (zarr) or OCDBT data file that is a symlink leading out of the checkpoint:
    refused naming it, nothing written (TensorStore would have read it). Linked within the
    checkpoint, the same files import exactly."""
    tree = {"params": {"w": np.arange(4, dtype=np.float32), "b": np.ones(3, np.float32)}}
    mine = _orbax(tmp_path / "mine", tree, ocdbt)
    data = sorted(
        p for p in mine.rglob("*") if p.is_file() and (ocdbt and "/d/" in str(p) or p.name == "0")
    )
    assert data, "the fixture has no data file"
    inner = mine / "moved"
    inner.mkdir()
    for i, p in enumerate(data):
        shutil.move(p, inner / str(i))
        p.symlink_to(inner / str(i))
    got = _params(jax_ucp.convert(mine, tmp_path / "ok"))
    for name, value in tree["params"].items():
        assert_bit_exact(got[name], value, name)
    target = _move_out(inner / "0", tmp_path / "elsewhere")
    (inner / "0").unlink()
    data[0].unlink()
    data[0].symlink_to(target)
    with pytest.raises(
        jax_ucp.UCPError,
        match=rf"mine: file: file name '{os.path.relpath(data[0], mine)}' resolves to "
        r"\S+/elsewhere/0, outside the checkpoint",
    ):
        jax_ucp.convert(mine, tmp_path / "out")
    assert_destination_untouched(tmp_path / "out")


# --------------------------------------------------------------------------- DeepSpeed / Megatron

DS = "deepspeed/z2_bf16_dp2/ckpt"
DS_RANK1 = "global_step2/bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt"
LEGACY = "megatron/legacy_gpt_tp2pp2_synthetic"


def _link_out(rel):
    def damage(src, tmp):
        _move_out(src / rel, tmp / "elsewhere")

    return damage


LINKED_OUT = {
    "DeepSpeed optimizer rank file": (
        DS,
        _link_out(DS_RANK1),
        r"global_step2: file name 'bf16_zero_pp_rank_1_mp_rank_00_optim_states\.pt' resolves "
        r"to \S+/elsewhere/\S+, outside the checkpoint",
    ),
    "DeepSpeed model states file": (
        DS,
        _link_out("global_step2/mp_rank_00_model_states.pt"),
        r"file name 'mp_rank_00_model_states\.pt' resolves to \S+/elsewhere/",
    ),
    "Megatron torch_dist .distcp": (
        "megatron/gpt_tp2",
        _link_out("__1_0.distcp"),
        r"gpt_tp2/\.metadata: storage file: file name '__1_0\.distcp' resolves to "
        r"\S+/elsewhere/__1_0\.distcp, outside the checkpoint",
    ),
    "Megatron torch_dist common.pt": (
        "megatron/gpt_tp2",
        _link_out("common.pt"),
        r"gpt_tp2: file name 'common\.pt' resolves to \S+/elsewhere/common\.pt, outside",
    ),
    "Megatron legacy rank file": (
        LEGACY,
        _link_out("iter_0000007/mp_rank_01_001/model_optim_rng.pt"),
        r"iter_0000007: file name 'mp_rank_01_001/model_optim_rng\.pt' resolves to "
        r"\S+/elsewhere/",
    ),
    "Megatron legacy rank directory": (
        LEGACY,
        _link_out("iter_0000007/mp_rank_01_000"),
        r"iter_0000007: file name 'mp_rank_01_000' resolves to \S+/elsewhere/mp_rank_01_000, "
        r"outside the checkpoint",
    ),
    "DeepSpeed universal zero folder": (
        "deepspeed/z1_bf16_dp2/universal",
        _link_out("global_step2_universal/zero"),
        r"global_step2_universal: file name 'zero' resolves to \S+/elsewhere/zero, outside",
    ),
    "torch DCP .metadata": (
        "torch/fsdp2_fp32",
        _link_out(".metadata"),
        r"fsdp2_fp32: file name '\.metadata' resolves to \S+/elsewhere/\.metadata, outside",
    ),
    "torch Accelerate DCP folder": (
        "torch/accelerate_fsdp",
        _link_out("optimizer_0"),
        r"accelerate_fsdp: file name 'optimizer_0' resolves to \S+/elsewhere/optimizer_0, outside",
    ),
    "torch .bin index": (
        "torch/hf_bin_sharded",
        _link_out("pytorch_model.bin.index.json"),
        r"hf_bin_sharded: file name 'pytorch_model\.bin\.index\.json' resolves to \S+/elsewhere/",
    ),
    "Megatron Bridge iteration folder": (
        "megatron_bridge/llama_tp1dp2",
        _link_out("iter_0000002"),
        r"llama_tp1dp2: file name 'iter_0000002' resolves to \S+/elsewhere/iter_0000002, "
        r"outside the checkpoint",
    ),
}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("case", sorted(LINKED_OUT))
def test_rank_files_linked_outside_are_refused(tmp_path, case):
    """A rank file (or rank folder) of a real DeepSpeed / megatron-core checkpoint replaced by a
    symlink to the same bytes moved elsewhere: refused naming it, nothing written. Before, each
    was read through the link."""
    rel, damage, message = LINKED_OUT[case]
    src = _copy(tmp_path, rel)
    damage(src, tmp_path)
    dst = tmp_path / "out"
    options = {"vocab_size": 61} if case.startswith("Megatron ") and "Bridge" not in case else {}
    with pytest.raises(jax_ucp.UCPError, match=message):
        jax_ucp.convert(src, dst, **options)
    assert_destination_untouched(dst)


@pytest.mark.timeout(120)
def test_rank_files_and_folders_linked_inside_read_exactly(tmp_path):
    """Links that stay inside: a DeepSpeed tag folder linked to a folder elsewhere in the
    checkpoint, a Megatron legacy rank file linked to a copy in its rank folder: both import
    exactly as the originals."""
    for rel, options, link in (
        (DS, {}, lambda src: _link_within(src, "global_step2", src / "kept")),
        (
            LEGACY,
            {"vocab_size": 61},
            lambda src: _link_within(
                src, "iter_0000007/mp_rank_01_001/model_optim_rng.pt", src / "iter_0000007/kept"
            ),
        ),
    ):
        want = _params(jax_ucp.convert(os.path.join(FIX, rel), tmp_path / "ref", **options))
        src = _copy(tmp_path, rel)
        link(src)
        got = _params(jax_ucp.convert(src, tmp_path / "out", **options))
        assert sorted(got) == sorted(want)
        for name in want:
            assert_bit_exact(got[name], want[name], name)
        for path in (tmp_path / "ref", tmp_path / "out", src):
            shutil.rmtree(path)


def _link_within(src, rel: str, store) -> None:
    """``src/rel`` moved into ``store`` (inside the checkpoint) and replaced by a link to it."""
    _move_out(src / rel, store)


# --------------------------------------------------------------------------- jax_ucp's own format


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    "compression, checksum",
    [(None, "crc32c"), (None, None), ("zstd", "crc32c"), ("zstd", None)],
    ids=["plain", "no_checksum", "zstd", "zstd_no_checksum"],
)
def test_own_shard_file_or_array_linked_outside_is_refused(tmp_path, compression, checksum):
    """A shard file of a jax_ucp checkpoint replaced by a symlink to an identical copy outside
    (its digest matches, and without checksums there is none), or a whole array folder linked
    elsewhere: ``restore`` and ``verify`` refuse it naming the file, on jax_ucp's own reader
    (uncompressed) and before TensorStore reads (zstd). Linked inside, it reads exactly."""
    tree = {"w": np.arange(24, dtype=np.float32).reshape(4, 6), "b": np.ones(5, np.float32)}
    ckpt = tmp_path / "ckpt"
    jax_ucp.save(ckpt, tree, compression=compression, checksum=checksum)
    shard = next(p for p in (ckpt / "arrays").rglob("*") if p.is_file() and "/w/c" in str(p))
    moved = ckpt / "kept" / "w-shard"
    moved.parent.mkdir()
    shutil.move(shard, moved)
    shard.symlink_to(moved)
    assert_bit_exact(jax_ucp.restore(ckpt)["w"], tree["w"], "w")  # a link that stays inside
    target = _move_out(moved, tmp_path / "elsewhere")
    shard.unlink()
    shard.symlink_to(target)
    outside = r"file name '\S*c/0(/0)?' resolves to \S+/elsewhere/w-shard, outside the checkpoint"
    with pytest.raises(jax_ucp.UCPError, match=outside):
        jax_ucp.restore(ckpt)
    (problem,) = jax_ucp.verify(ckpt)
    assert problem[0] == "w" and re.search(outside, problem[1]), problem
    array = shard.parent
    while array.parent.name != "arrays":
        array = array.parent
    _move_out(array, tmp_path / "arrays_elsewhere")
    with pytest.raises(
        jax_ucp.UCPError,
        match=rf"Tensor 'w': ucp\.json: file name 'arrays/{array.name}/zarr\.json' resolves to "
        r"\S+/arrays_elsewhere/",
    ):
        jax_ucp.restore(ckpt)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("ocdbt", [False, True], ids=["zarr", "ocdbt"])
def test_orbax_export_of_a_key_naming_an_absolute_path_writes_nothing_outside(tmp_path, ocdbt):
    """A jax_ucp checkpoint whose tensor key is an absolute path: Orbax would write that array's
    folder there (its folder is the joined key path). The export is refused before Orbax runs;
    nothing appears at that path."""
    from jax_ucp.exporters import orbax_out

    victim = tmp_path / "victim"
    ckpt = tmp_path / "ckpt"
    jax_ucp.save(ckpt, {str(victim): np.ones(3, np.float32), "ok": np.zeros(2, np.float32)})
    with pytest.raises(
        jax_ucp.UCPError, match=rf"ucp\.json: tensor '{victim}': file name .* is an absolute path"
    ):
        orbax_out.export_orbax(ckpt, tmp_path / "orbax", use_ocdbt=ocdbt)
    assert not victim.exists() and not (tmp_path / "orbax").exists()


@pytest.mark.timeout(60)
def test_safetensors_index_linked_outside_is_refused(tmp_path):
    """The index itself a link to another model's index (its shards beside it here): refused
    before its names are read."""
    _, snap = _hf_cache(tmp_path, {"a": np.ones(2, np.float32)})
    other = tmp_path / "other"
    other.mkdir()
    index = snap / "model.safetensors.index.json"
    shutil.copy(index, other / "index.json")
    index.unlink()
    index.symlink_to(other / "index.json")
    with pytest.raises(
        jax_ucp.UCPError,
        match=r"file name 'model\.safetensors\.index\.json' resolves to \S+/other/index\.json, "
        r"outside the checkpoint",
    ):
        jax_ucp.convert(snap, tmp_path / "out")
    assert_destination_untouched(tmp_path / "out")


@pytest.mark.timeout(120)
def test_orbax_step_whose_ucp_item_is_linked_outside_is_refused(tmp_path):
    """An Orbax step (written by a CheckpointManager) whose UCP item folder is a link to
    another checkpoint: ``restore(step)`` refuses it; the real item restores."""
    step = tmp_path / "run" / "3"
    shutil.copytree(os.path.join(FIX, "orbax_manager_step", "3"), step)
    want = jax_ucp.restore(step)["params"]
    _move_out(step / "model", tmp_path / "elsewhere")
    with pytest.raises(
        jax_ucp.UCPError, match=r"file name 'model' resolves to \S+/elsewhere/model, outside"
    ):
        jax_ucp.restore(step)
    got = jax_ucp.restore(tmp_path / "elsewhere" / "model")["params"]
    for name in want:
        assert_bit_exact(got[name], want[name], name)
