"""The formats torch 2.13's own DCP writers offer beside the default, written by torch itself
(tools/fixtures/make_torch_dcp_formats_fixture.py: 2 gloo ranks, DTensors row- and
column-sharded, one replicated; read back by torch where torch can):

* ``dcp_zstd``: ``FileSystemWriter(_extensions=[ZStandard()])``, every entry a zstd frame
  (``transform_descriptors=['stream.zstd/1']``): restored bit-exact, straight onto a mesh and
  through convert; hostile frames and descriptors refused by name;
* ``dcp_safetensors_format``: ``FileSystemWriter(serialization_format=SAFETENSORS)``: refused,
  saying what it is (torch's own ``dcp.load`` fails on it: ``dcp_formats.json``);
* ``dcp_hf_ranklocal``: ``HuggingFaceStorageWriter(save_distributed=True)``'s rank-local
  safetensors: each tensor assembled from its pieces by their ``DCP_SHARDING_INFO`` offsets;
  overlaps, holes and disagreeing pieces refused naming the tensor and the files;
* ``dcp_hf_transformers_tp2``: the same layout as transformers 5.23's own
  ``save_pretrained(distributed_checkpoint=True)`` writes it for a tensor-parallel tiny Llama.

Torch-free except the ``torch``-marked tests, which check torch's own readers agree."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
import warnings

import jax
import numpy as np
import pytest
import zstandard
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jax_ucp
from jax_ucp._src.importers import registry
from jax_ucp._src.store.storage import storage_for
from jax_ucp._src.torchfiles import dcp as torch_dcp
from jax_ucp._src.torchfiles import dcp_safetensors
from jax_ucp.errors import SourceError
from tests.ucp_testing import REPO, assert_bit_exact, load_truth, mesh

FIX = os.path.join(REPO, "tests", "fixtures", "torch")
ZSTD, ST_FORMAT, RANK_LOCAL = "dcp_zstd", "dcp_safetensors_format", "dcp_hf_ranklocal"
TRANSFORMERS = "dcp_hf_transformers_tp2"  # save_pretrained(distributed_checkpoint=True), TP 2

pytestmark = pytest.mark.timeout(120)


def truth(name: str) -> dict[str, np.ndarray]:
    """The global tensors the ranks were cut from: ``{"w": ..., "e": ..., ...}``."""
    return {
        k.split("/", 1)[1]: v for k, v in load_truth(os.path.join(FIX, name + ".truth.npz")).items()
    }


def _target(want: dict[str, np.ndarray]) -> dict:
    """``want``'s arrays on a 2 x 4 mesh: rows on "a" and columns on "b" where they divide."""
    m = mesh((2, 4), ("a", "b"))

    def one(x):
        spec = [None] * x.ndim
        if x.shape[0] % 2 == 0:
            spec[0] = "a"
        if x.ndim > 1 and x.shape[-1] % 4 == 0:
            spec[-1] = "b"
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(m, P(*spec)))

    return {"params": {k: one(v) for k, v in want.items()}}


@pytest.mark.parametrize("name", [ZSTD, RANK_LOCAL, TRANSFORMERS])
def test_restores_bit_exact_onto_a_mesh_and_through_convert(tmp_path, name):
    src = os.path.join(FIX, name)
    assert registry.detect_format(src) == "torch"
    want = truth(name)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        direct = jax_ucp.restore(src, target=_target(want))
        ckpt = jax_ucp.convert(src, str(tmp_path / "ucp"))
        converted = jax_ucp.restore(ckpt, target=_target(want))
    assert sorted(direct["params"]) == sorted(want) == sorted(converted["params"])
    for key, value in want.items():
        got = direct["params"][key]
        assert isinstance(got, jax.Array) and got.sharding == _target(want)["params"][key].sharding
        assert_bit_exact(got, value, key)
        assert_bit_exact(converted["params"][key], value, key)
        assert converted["params"][key].sharding == got.sharding
    source = jax_ucp.inspect(ckpt).source
    assert source["framework"] == "torch_dcp"
    if name != ZSTD:
        assert source["layout"] == "hf_safetensors" and source["dcp_version"] == "1.0"
        # no global_shape in torch 2.13's files: the shapes are the pieces' extent, and said so
        assert any("missing its last rank's file" in n for n in source["notes"])
    else:
        assert source["skipped"] == {"step": "a pickled object, not a tensor"}


def test_zstd_chunks_and_objects_are_frames_torch_compressed():
    """Every entry is one zstd frame; ``big`` (16 x 64 float32 of 7 values per rank) takes
    fewer bytes than its elements', so its entry holds less than it declares (the refusal
    before this format was read); the pickled ``step`` decodes too."""
    ck = torch_dcp.open_dcp(os.path.join(FIX, ZSTD))
    chunks = [c for t in ck.tensors.values() for c in t.chunks]
    assert {c.transforms for c in chunks} == {("stream.zstd/1",)}
    big = ck.tensors["model.big"]
    assert all(c.byte_length < 16 * 64 * 4 for c in big.chunks)
    assert ck.objects["step"].transforms == ("stream.zstd/1",)
    assert ck.read_object("step") == 3
    assert_bit_exact(ck.read_rows("model.big", 10, 20), truth(ZSTD)["big"][10:20], "rows")


@pytest.mark.timeout(300)
def test_zstd_dcp_in_an_object_store_restores_as_the_local_folder(bucket_url):
    """The compressed entries are fetched by ranged reads (their compressed lengths) and
    decoded as from a local file."""
    from jax_ucp._src.store.storage import object_store

    folder = os.path.join(FIX, ZSTD)
    prefix = f"{bucket_url}/dcp-zstd-{os.getpid()}"
    for entry in os.listdir(folder):
        with open(os.path.join(folder, entry), "rb") as f:
            object_store.write(prefix, entry, f.read())
    want = truth(ZSTD)
    remote = jax_ucp.restore(prefix, target=_target(want))
    for key, value in want.items():
        assert_bit_exact(remote["params"][key], value, key)
    assert torch_dcp.open_dcp(storage_for(prefix)).read_object("step") == 3


@pytest.mark.timeout(300)
@pytest.mark.parametrize("where", ["s3", "hub"])
def test_a_dcp_object_cut_short_remotely_is_reported_at_its_real_size(
    s3_server, hub_server, monkeypatch, where
):
    """``__1_0.distcp`` cut to half its bytes on S3 or the Hub: refused naming the object's
    real size; before: "has 0 bytes" (the size of its empty stand-in in the local view)."""
    from jax_ucp._src.store.storage import object_store

    folder = os.path.join(FIX, ZSTD)
    files = {}
    for entry in os.listdir(folder):
        with open(os.path.join(folder, entry), "rb") as f:
            files[entry] = f.read()
    files["__1_0.distcp"] = files["__1_0.distcp"][: len(files["__1_0.distcp"]) // 2]
    if where == "s3":
        for k, v in s3_server[0].items():
            monkeypatch.setenv(k, v)
        url = f"{s3_server[1]}/dcp-short-{os.getpid()}"
        for entry, data in files.items():
            object_store.write(url, entry, data)
    else:
        hub_server.add("org/short", files)
        url = "hf://org/short"
    size = len(files["__1_0.distcp"])
    with pytest.raises(SourceError, match=rf"__1_0\.distcp has {size} bytes, metadata needs"):
        jax_ucp.restore(url)


def test_a_rank_local_folder_with_its_first_rank_file_cut_short_names_the_cut(tmp_path):
    """torch's rank-local safetensors with the first rank's file cut short, in a local folder:
    refused naming that file and the truncation (as from S3 or the Hub). Before: detection,
    unable to read the header, read the folder as plain safetensors, whose reader refused the
    file as "an unconsolidated shard ... pass the folder holding all of them": the folder given."""
    folder = str(tmp_path / "tp2")
    shutil.copytree(os.path.join(FIX, TRANSFORMERS), folder)
    first = os.path.join(folder, RANK[0])
    with open(first, "rb") as f:
        data = f.read()
    with open(first, "wb") as f:
        f.write(data[:-4])
    with pytest.raises(SourceError, match=rf"{RANK[0]}: .*the file is shorter \(truncated\)"):
        jax_ucp.restore(folder)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("where", ["s3", "hub"])
def test_rank_local_dcp_in_an_object_store_or_the_hub_restores_as_the_local_folder(
    s3_server, hub_server, monkeypatch, where
):
    """transformers' distributed checkpoint (rank-local safetensors, config.json) on S3 or the
    Hub: each rank file a sparse stand-in of its header, the pieces read by ranges; restored as
    the local folder; a rank file cut short or gone refused; before: "2 .safetensors objects and
    no model.safetensors.index.json ...; add the index" (the index would not have helped)."""
    from jax_ucp._src.store.storage import object_store

    folder = os.path.join(FIX, TRANSFORMERS)
    files = {e: open(os.path.join(folder, e), "rb").read() for e in os.listdir(folder)}

    def put(name: str, files: dict[str, bytes]) -> str:
        if where == "hub":
            hub_server.add(f"org/{name}", files)
            return f"hf://org/{name}"
        for k, v in s3_server[0].items():
            monkeypatch.setenv(k, v)
        url = f"{s3_server[1]}/{name}-{os.getpid()}"
        for entry, data in files.items():
            object_store.write(url, entry, data)
        return url

    want = jax_ucp.restore(folder)["params"]
    got = jax_ucp.restore(put("tp2", files))["params"]
    assert sorted(got) == sorted(want)
    for key, value in want.items():
        assert_bit_exact(got[key], np.asarray(value), key)
    cut = {**files, RANK[0]: files[RANK[0]][:-4]}
    with pytest.raises(SourceError, match=rf"{RANK[0]}: .*the file is shorter \(truncated\)"):
        jax_ucp.restore(put("tp2-cut", cut))
    del files[RANK[1]]
    with pytest.raises(SourceError, match=r"rank 2's file \(shard-00002-model-\*\.safetensors\)"):
        jax_ucp.restore(put("tp2-short", files))


def _copy(name: str, tmp_path) -> str:
    dst = str(tmp_path / name)
    shutil.copytree(os.path.join(FIX, name), dst)
    return dst


def test_an_unknown_transform_descriptor_is_refused_by_name(tmp_path):
    src = _copy(ZSTD, tmp_path)
    meta = os.path.join(src, ".metadata")
    with open(meta, "rb") as f:
        raw = f.read()
    with open(meta, "wb") as f:  # same length: the pickle stays valid
        f.write(raw.replace(b"stream.zstd/1", b"stream.lz4f/1"))
    with pytest.raises(SourceError, match=r"unsupported transform descriptor 'stream.lz4f/1'"):
        jax_ucp.restore(src)
    with pytest.raises(SourceError, match=r"unsupported transform descriptor 'stream.lz4f/1'"):
        jax_ucp.convert(src, str(tmp_path / "ucp"))
    assert not os.path.exists(tmp_path / "ucp")
    with open(meta, "wb") as f:  # a major version torch's ZStandard does not decode either
        f.write(raw.replace(b"stream.zstd/1", b"stream.zstd/2"))
    with pytest.raises(SourceError, match=r"unsupported transform descriptor 'stream.zstd/2'"):
        torch_dcp.open_dcp(src).read("model.w")


def _with_entry(src: str, name: str, data: bytes) -> tuple[torch_dcp.DcpCheckpoint, str]:
    """``src`` opened with tensor ``name``'s first chunk replaced by ``data`` (zstd), in a file
    of its own beside the others; what the tensor's chunk is named by in errors."""
    ck = torch_dcp.open_dcp(src)
    with open(os.path.join(src, "__9_0.distcp"), "wb") as f:
        f.write(data)
    t = ck.tensors[name]
    first = dataclasses.replace(
        t.chunks[0], file="__9_0.distcp", byte_offset=0, byte_length=len(data)
    )
    ck.tensors[name] = dataclasses.replace(t, chunks=(first, *t.chunks[1:]))
    return ck, re.escape(f"tensor '{name}' chunk at offsets {list(first.offsets)}")


def test_a_zstd_frame_past_the_chunk_budget_is_refused(tmp_path):
    """A chunk decodes into at most its elements' bytes + the archive's own
    (``ARCHIVE_OVERHEAD``): a frame declaring more is refused before decoding, one with no
    declared size as it decodes past it, a frame followed by anything, or not a frame, too."""
    src = _copy(ZSTD, tmp_path)
    budget = 16 * 64 * 4 + torch_dcp.ARCHIVE_OVERHEAD
    bomb = bytes(budget + 1)
    ck, where = _with_entry(src, "model.big", zstandard.ZstdCompressor().compress(bomb))
    assert (
        len(ck.tensors["model.big"].chunks[0].file)
        and os.path.getsize(os.path.join(src, "__9_0.distcp")) < 4096
    )  # a few KiB on disk
    with pytest.raises(
        SourceError, match=rf"{where}.*declares {budget + 1} decoded bytes, more than the {budget}"
    ):
        ck.read("model.big")
    streamed = zstandard.ZstdCompressor(write_content_size=False).compress(bomb)
    assert zstandard.frame_content_size(streamed) == -1
    ck, where = _with_entry(src, "model.big", streamed)
    with pytest.raises(SourceError, match=rf"{where}.*does not decode within the {budget} bytes"):
        ck.read("model.big")
    with open(os.path.join(FIX, ZSTD, "__0_0.distcp"), "rb") as f:
        good = f.read()
    c = torch_dcp.open_dcp(os.path.join(FIX, ZSTD)).tensors["model.big"].chunks[0]
    frame = good[c.byte_offset : c.byte_offset + c.byte_length]
    ck, where = _with_entry(src, "model.big", frame + b"\x00junk")
    with pytest.raises(SourceError, match=rf"{where}.*5 bytes after its zstd frame"):
        ck.read("model.big")
    ck, where = _with_entry(src, "model.big", frame[:-2])
    with pytest.raises(SourceError, match=rf"{where}.*zstd frame is cut short"):
        ck.read("model.big")
    ck, where = _with_entry(src, "model.big", b"PK\x03\x04" + frame)
    with pytest.raises(SourceError, match=rf"{where}.*do not start a zstd frame \(504b0304\)"):
        ck.read("model.big")
    ck, _ = _with_entry(src, "model.big", frame)  # the same frame in its own file: read
    assert_bit_exact(ck.read("model.big"), truth(ZSTD)["big"], "big")


def test_a_compressed_object_decodes_within_its_budget(tmp_path, monkeypatch):
    """A pickled object (BytesStorageMetadata) has no declared size: it decodes within
    ``MAX_OBJECT_BYTES``, a frame past it refused naming the object."""
    src = _copy(ZSTD, tmp_path)
    monkeypatch.setattr(torch_dcp, "MAX_OBJECT_BYTES", 1 << 16)
    bomb = zstandard.ZstdCompressor(write_content_size=False).compress(bytes((1 << 16) + 1))
    with open(os.path.join(src, "__9_0.distcp"), "wb") as f:
        f.write(bomb)
    ck = torch_dcp.open_dcp(src)
    ck.objects["step"] = dataclasses.replace(
        ck.objects["step"], file="__9_0.distcp", byte_offset=0, byte_length=len(bomb)
    )
    with pytest.raises(SourceError, match=r"object 'step' in .*does not decode within the 65536"):
        ck.read_object("step")


def test_dcp_in_safetensors_format_is_refused_saying_what_it_is(tmp_path):
    """torch's ``serialization_format=SAFETENSORS`` puts every tensor of a rank at the start of
    one safetensors file appended to its ``.distcp``; torch's own ``dcp.load`` fails on it
    (recorded by the generator, and checked by the torch test below)."""
    src = os.path.join(FIX, ST_FORMAT)
    with open(os.path.join(FIX, "dcp_formats.json")) as f:
        assert "UnpicklingError" in json.load(f)["safetensors_format_dcp_load"]
    expected = (
        r"a torch DCP checkpoint saved with serialization_format=SAFETENSORS \(FileSystemWriter\):"
        r" its storage file __0_0\.distcp holds a safetensors file from byte 0.*torch's own "
        r"dcp\.load cannot read this folder either"
    )
    with pytest.raises(SourceError, match=expected):
        jax_ucp.restore(src)
    with pytest.raises(SourceError, match=expected):
        jax_ucp.convert(src, str(tmp_path / "ucp"))
    assert not os.path.exists(tmp_path / "ucp")


def test_dcp_in_safetensors_format_with_one_tensor_a_file_is_refused_too():
    """With no two entries overlapping (one tensor a rank file), a tensor's entry still starts a
    safetensors header: refused as it is read, never its header bytes read as the tensor's."""
    src = os.path.join(FIX, ST_FORMAT)
    with open(os.path.join(src, "__1_0.distcp"), "rb") as f:
        at = f.read().index(b'{"__metadata__"') - 8  # after the pickled step: the safetensors
    chunk = torch_dcp.DcpChunk((0,), (6,), "__1_0.distcp", at, 6 * 4)
    t = torch_dcp.DcpTensor("model.b", (6,), np.dtype(np.float32), (chunk,))
    ck = torch_dcp.DcpCheckpoint(torch_dcp.folder(src), {"model.b": t}, {})
    with pytest.raises(SourceError, match=rf"serialization_format=SAFETENSORS.*from byte {at}"):
        ck.read("model.b")
    with pytest.raises(SourceError, match=rf"serialization_format=SAFETENSORS.*from byte {at}"):
        ck.read_chunk(t, chunk)


# ---------------------------------------------------------------- rank-local safetensors


def _header(path) -> tuple[dict, bytes]:
    with open(path, "rb") as f:
        raw = f.read()
    n = int.from_bytes(raw[:8], "little")
    return json.loads(raw[8 : 8 + n]), raw[8 + n :]


def _rewrite(path, edit) -> None:
    """The safetensors file ``path`` with ``edit(sharding)`` applied to its
    ``DCP_SHARDING_INFO`` (its data kept)."""
    header, data = _header(path)
    sharding = json.loads(header["__metadata__"]["DCP_SHARDING_INFO"])
    edit(sharding)
    header["__metadata__"]["DCP_SHARDING_INFO"] = json.dumps(sharding)
    raw = json.dumps(header).encode()
    with open(path, "wb") as f:
        f.write(len(raw).to_bytes(8, "little") + raw + data)


RANK = [
    "shard-00001-model-00001-of-00001.safetensors",
    "shard-00002-model-00001-of-00001.safetensors",
]


def test_rank_local_pieces_are_placed_by_their_offsets():
    ck = dcp_safetensors.open_rank_local(os.path.join(FIX, RANK_LOCAL))
    assert ck.layout == "hf_safetensors"
    assert [(c.file, c.offsets, c.sizes) for c in ck.tensors["w"].chunks] == [
        (RANK[0], (0, 0), (3, 6)),  # 5 rows over 2 ranks: 3 + 2
        (RANK[1], (3, 0), (2, 6)),
    ]
    assert [(c.offsets, c.sizes) for c in ck.tensors["e"].chunks] == [
        ((0, 0), (4, 3)),
        ((0, 3), (4, 3)),
    ]
    assert [c.file for c in ck.tensors["b"].chunks] == [RANK[1]]  # replicated: written once
    for name, value in truth(RANK_LOCAL).items():
        assert_bit_exact(ck.read(name), value, name)


def test_a_recorded_global_shape_is_used_and_checked(tmp_path):
    src = _copy(RANK_LOCAL, tmp_path)
    for rank in RANK:
        _rewrite(os.path.join(src, rank), lambda s: s["w"].update(global_shape=[5, 6]))
    ck = dcp_safetensors.open_rank_local(src)
    assert ck.tensors["w"].shape == (5, 6)
    assert "3 of 4 tensors' shapes are the extent of their pieces" in ck.notes[0]
    assert_bit_exact(jax_ucp.restore(src)["params"]["w"], truth(RANK_LOCAL)["w"], "w")
    for rank in RANK:  # a shape larger than its pieces: the rows no rank wrote are a hole
        _rewrite(os.path.join(src, rank), lambda s: s["w"].update(global_shape=[6, 6]))
    with pytest.raises(
        SourceError,
        match=r"tensor 'w'.*incomplete shard coverage: chunks hold 30 of 36 elements of shape \[6, 6\]",
    ):
        jax_ucp.restore(src)
    _rewrite(os.path.join(src, RANK[1]), lambda s: s["w"].update(global_shape=[5, 6]))
    with pytest.raises(
        SourceError,
        match=rf"tensor 'w' disagrees between its pieces: float32 of rank 2, global_shape \[6, 6\] in {RANK[0]}; float32 of rank 2, global_shape \[5, 6\] in {RANK[1]}",
    ):
        jax_ucp.restore(src)


@pytest.mark.parametrize(
    ("edit", "expected"),
    [
        (  # rank 2's rows start inside rank 1's
            lambda s: s["w"].update(saved_offsets=[2, 0]),
            r"tensor 'w': overlapping shards: \[0, 0\]\+\[3, 6\] in shard-00001.* and \[2, 0\]\+\[2, 6\] in shard-00002.*both hold element \[2, 0\]",
        ),
        (  # rank 2's rows one further: row 3 is in no file
            lambda s: s["w"].update(saved_offsets=[4, 0]),
            r"tensor 'w'.*incomplete shard coverage: chunks hold 30 of 36 elements of shape \[6, 6\] \(files \['shard-00001.*', 'shard-00002.*'\]\)",
        ),
        (
            lambda s: s["e"].update(saved_offsets=[0]),
            rf"{RANK[1]}: __metadata__ DCP_SHARDING_INFO: tensor 'e' saved_offsets is \[0\]: expected 2 non-negative integers",
        ),
        (
            lambda s: s.pop("big"),
            rf"{RANK[1]}: __metadata__ DCP_SHARDING_INFO: tensor 'big' is in the file but not in it",
        ),
        (
            lambda s: s["b"].update(placements="Replicate"),
            r"tensor 'b': .*expected saved_offsets \(and global_shape\) only, found 'placements'",
        ),
    ],
)
def test_hostile_offsets_are_refused_naming_the_tensor_and_file(tmp_path, edit, expected):
    src = _copy(RANK_LOCAL, tmp_path)
    _rewrite(os.path.join(src, RANK[1]), edit)
    with pytest.raises(SourceError, match=expected):
        jax_ucp.restore(src)
    with pytest.raises(SourceError, match=expected):
        jax_ucp.convert(src, str(tmp_path / "ucp"))
    assert not os.path.exists(tmp_path / "ucp")


def test_one_rank_local_file_alone_is_refused_pointing_at_the_folder(tmp_path):
    src = os.path.join(FIX, RANK_LOCAL, RANK[0])
    with pytest.raises(
        jax_ucp.UCPError, match=r"unconsolidated shard.*Pass the folder holding all of them"
    ):
        jax_ucp.restore(src)


def test_a_rank0_save_with_its_index_is_read_and_a_file_it_names_missing_is_refused(tmp_path):
    """``HuggingFaceStorageWriter(save_distributed=False)`` writes whole tensors (offsets all
    zero) in ``model-0000M-of-0000N.safetensors`` files and an index: read as safetensors;
    a file the index names, deleted, is refused (its tensors would be gone without a word)."""
    from safetensors.numpy import save_file

    src = tmp_path / "rank0"
    src.mkdir()
    a, b = np.arange(12, dtype=np.float32).reshape(3, 4), np.ones(5, np.float32)
    for i, (name, value) in enumerate((("a", a), ("b", b)), start=1):
        offsets = json.dumps({name: {"saved_offsets": [0] * value.ndim}})
        save_file(
            {name: value},
            str(src / f"model-0000{i}-of-00002.safetensors"),
            metadata={"DCP_SHARDING_INFO": offsets, "DCP_VERSION": "1.0", "format": "pt"},
        )
    weight_map = {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}
    (src / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    restored = jax_ucp.restore(str(src))["params"]
    assert_bit_exact(restored["a"], a, "a")
    assert_bit_exact(restored["b"], b, "b")
    os.remove(src / "model-00002-of-00002.safetensors")
    with pytest.raises(
        SourceError, match=r"weight_map entry 'b' names the file 'model-00002-of-00002.safetensors'"
    ):
        jax_ucp.restore(str(src))


def test_a_rank_local_folder_missing_a_rank_file_is_refused_naming_it(tmp_path):
    """A rank's file gone: in the middle (the ranks' numbers have a gap), or the last one of
    transformers' save (its config.json's vocab_size is no tensor's dimension any more). Both
    read as smaller tensors, and a tensor held by that rank alone (a replicated norm, ``b``)
    vanished, without a word; refused naming the missing file and the tensors affected."""
    src = _copy(RANK_LOCAL, tmp_path)
    os.rename(os.path.join(src, RANK[1]), os.path.join(src, RANK[1].replace("00002", "00003", 1)))
    with pytest.raises(
        SourceError, match=r"no shard-00002-model-\*\.safetensors \(rank 2\).*\(big, e, w\)"
    ):
        jax_ucp.restore(src)
    tp2 = _copy(TRANSFORMERS, tmp_path)
    assert jax_ucp.restore(tp2)["params"]["model.embed_tokens.weight"].shape == (32, 8)
    os.remove(os.path.join(tp2, RANK[1]))
    with pytest.raises(
        SourceError,
        match=r"config.json says vocab_size 32, but no tensor has that dimension.*"
        r"rank 2's file \(shard-00002-model-\*\.safetensors\) is missing.*model.embed_tokens",
    ):
        jax_ucp.restore(tp2)
    with pytest.raises(SourceError, match="rank 2's file"):
        jax_ucp.convert(tp2, str(tmp_path / "ucp"))


def test_rank_local_shapes_nothing_can_check_are_a_warning(tmp_path):
    """No global_shape and no config.json: a last rank's file gone cannot be told from the
    files (torch's reader has the same blind spot), so the import says so as a warning."""
    src = _copy(RANK_LOCAL, tmp_path)
    os.remove(os.path.join(src, RANK[1]))
    with pytest.warns(UserWarning, match=r"missing its last rank's file would read as smaller"):
        jax_ucp.restore(src)


def test_a_rank_local_file_without_offsets_beside_the_others_is_refused(tmp_path):
    from safetensors.numpy import save_file

    src = _copy(RANK_LOCAL, tmp_path)
    save_file(
        {"x": np.ones(2, np.float32)},
        os.path.join(src, "shard-00003-model-00001-of-00001.safetensors"),
    )
    with pytest.raises(SourceError, match=r"shard-00003.*no DCP_SHARDING_INFO in its __metadata__"):
        jax_ucp.restore(src)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("stray", ["model.safetensors", "adapter_model.safetensors"])
def test_a_stray_safetensors_sorting_before_the_rank_files_is_refused_naming_it(
    tmp_path, hub_server, stray
):
    """A ``model.safetensors`` (or ``adapter_model``) beside the rank files, locally and on the
    Hub, is refused naming it; before: its name sorting first, the folder was read as plain
    safetensors ("an unconsolidated shard ... pass the folder"; on the Hub "add the index",
    or "no ucp.json here")."""
    from safetensors.numpy import save_file

    src = _copy(TRANSFORMERS, tmp_path)
    save_file({"x": np.ones(2, np.float32)}, os.path.join(src, stray))
    files = {e: open(os.path.join(src, e), "rb").read() for e in os.listdir(src)}
    hub_server.add("org/stray", files)
    for path in (src, "hf://org/stray"):
        with pytest.raises(SourceError, match=rf"{stray}: no DCP_SHARDING_INFO in its __metad"):
            jax_ucp.restore(path)


# ---------------------------------------------------------------- torch's own readers agree


@pytest.mark.torch
def test_torch_reads_the_same_values():
    """torch's ``dcp.load`` (zstd) and ``HuggingFaceStorageReader`` (rank-local) give what
    jax_ucp reads; torch's ``dcp.load`` of the safetensors-format folder fails."""
    import torch  # pyright: ignore[reportMissingImports]
    from torch.distributed.checkpoint.api import (  # pyright: ignore[reportMissingImports]
        CheckpointException,
    )
    from torch.distributed.checkpoint.filesystem import (  # pyright: ignore[reportMissingImports]
        FileSystemReader,
    )
    from torch.distributed.checkpoint.hf_storage import (  # pyright: ignore[reportMissingImports]
        HuggingFaceStorageReader,
    )
    from torch.distributed.checkpoint.state_dict_loader import (  # pyright: ignore[reportMissingImports]
        load,
    )

    def empty(name):
        return {
            k: torch.zeros(
                v.shape, dtype=torch.float32 if v.dtype == np.float32 else torch.bfloat16
            )
            for k, v in truth(name).items()
        }

    def as_numpy(t):
        return (
            t.view(torch.int16).numpy().view(truth(ZSTD)["e"].dtype)
            if t.dtype == torch.bfloat16
            else t.numpy()
        )

    back = {"model": empty(ZSTD), "step": 0}
    load(back, storage_reader=FileSystemReader(os.path.join(FIX, ZSTD)), no_dist=True)
    ours = jax_ucp.restore(os.path.join(FIX, ZSTD))["params"]
    assert back["step"] == 3
    for k, v in back["model"].items():
        assert_bit_exact(ours[k], as_numpy(v), k)

    for name in (RANK_LOCAL, TRANSFORMERS):
        back = empty(name)
        reader = HuggingFaceStorageReader(os.path.join(FIX, name))
        load(back, storage_reader=reader, no_dist=True)
        ours = jax_ucp.restore(os.path.join(FIX, name))["params"]
        assert sorted(ours) == sorted(back)
        for k, v in back.items():
            assert_bit_exact(ours[k], as_numpy(v), k)

    back = {"model": empty(ST_FORMAT), "step": 0}
    with pytest.raises(CheckpointException):
        load(back, checkpoint_id=os.path.join(FIX, ST_FORMAT), no_dist=True)


@pytest.mark.torch
def test_verify_against_reads_the_sources_with_torch(tmp_path):
    """``verify --against`` compares each import with torch's own read of its source
    (``dcp.load``; ``HuggingFaceStorageReader`` for the rank-local shards); a value changed in
    a rank's file after the import is found."""
    for name in (ZSTD, RANK_LOCAL, TRANSFORMERS):
        out = jax_ucp.convert(os.path.join(FIX, name), str(tmp_path / name))
        assert jax_ucp.verify(out, against=os.path.join(FIX, name)) == [], name
    (tmp_path / "tampered").mkdir()
    src = _copy(RANK_LOCAL, tmp_path / "tampered")
    out = jax_ucp.convert(src, str(tmp_path / "ucp"))
    path = os.path.join(src, RANK[1])
    header, data = _header(path)
    begin = header["w"]["data_offsets"][0]
    raw = bytearray(data)
    raw[begin] ^= 0x40  # rank 2's first element of w
    with open(path, "r+b") as f:
        f.seek(os.path.getsize(path) - len(data))
        f.write(raw)
    problems = jax_ucp.verify(out, against=src)
    assert problems and any("w" in str(p) for p in problems), problems


SINGLE = "dcp_hf_single_process"  # HuggingFaceStorageWriter in one process: whole tensors


@pytest.mark.timeout(300)
def test_a_single_process_hf_writer_folder_restores_locally_and_from_s3(bucket_url, tmp_path):
    """``model-00001-of-00001.safetensors`` + index, offsets all zero: whole tensors, read as
    Hugging Face safetensors from an object store too (before: refused as pieces of larger
    ones); a rank's ``shard-...`` file so named stays refused alone; a prefix holding only it
    reads as a local folder holding only it does (rank-local DCP, the shapes' doubt said)."""
    from jax_ucp._src.store.storage import object_store

    folder = os.path.join(FIX, SINGLE)
    want = truth(SINGLE)
    prefix = f"{bucket_url}/hf-single-{os.getpid()}"
    for entry in os.listdir(folder):
        with open(os.path.join(folder, entry), "rb") as f:
            object_store.write(prefix, entry, f.read())
    assert registry.detect_format(folder) == "safetensors"
    for where in (folder, prefix):
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # whole tensors: no shape to doubt
            got = jax_ucp.restore(where, target=_target(want))
        assert sorted(got["params"]) == sorted(want)
        for key, value in want.items():
            assert_bit_exact(got["params"][key], value, key)
    rank_file = os.path.join(FIX, RANK_LOCAL, "shard-00001-model-00001-of-00001.safetensors")
    with open(rank_file, "rb") as f:
        object_store.write(
            prefix + "-rank", "shard-00001-model-00001-of-00001.safetensors", f.read()
        )
    with pytest.raises(SourceError, match="pieces of larger"):
        jax_ucp.restore(f"{prefix}-rank/shard-00001-model-00001-of-00001.safetensors")
    shutil.copy(rank_file, tmp_path)
    doubt = r"missing its last rank's file would read as smaller"
    with pytest.warns(UserWarning, match=doubt):
        local = jax_ucp.restore(str(tmp_path))["params"]
    with pytest.warns(UserWarning, match=doubt):
        remote = jax_ucp.restore(prefix + "-rank")["params"]
    for key, value in local.items():
        assert_bit_exact(remote[key], np.asarray(value), key)
