"""A reader written from docs/FORMAT.md alone reads what ``jax_ucp.save`` writes, bit for bit.

The reader (everything above the "Tests" line) uses only ``json``, ``os``, ``numpy`` and
zarr-python 3: no jax_ucp, no TensorStore, no JAX. It follows the document's MUSTs: it refuses a
newer format version, checks every array's ``zarr.json`` against the manifest, treats a missing
shard file or a missing inner chunk as an error (never as fill values), checks the crc32c of
each shard index and the shard digests, and rebuilds the saved tree from ``tree`` (or from the
keys and ``key_types`` when there is none). The tests save with jax_ucp (imported inside them
only) and compare bytes.
"""

import json
import os

import numpy as np
import pytest
import zarr
import zarr.storage

# --- The reader: FORMAT.md only ------------------------------------------------------------------

MANIFEST = "ucp.json"
FORMAT_VERSION = 1
MISSING = (1 << 64) - 1  # an index entry [2^64-1, 2^64-1] marks an inner chunk never written


class SpecReadError(Exception):
    """The checkpoint is not a readable format-v1 checkpoint (corrupt, incomplete, or newer)."""


def _crc32c_table():
    table = []
    for n in range(256):
        c = n
        for _ in range(8):
            c = (c >> 1) ^ 0x82F63B78 if c & 1 else c >> 1
        table.append(c)
    return table


_CRC_TABLE = _crc32c_table()


def crc32c(data: bytes) -> int:
    """CRC-32C (Castagnoli), as the zarr v3 ``crc32c`` codec computes it."""
    c = 0xFFFFFFFF
    for b in data:
        c = _CRC_TABLE[(c ^ b) & 0xFF] ^ (c >> 8)
    return c ^ 0xFFFFFFFF


def find_checkpoint_dir(path: str) -> str:
    """The directory holding ucp.json: ``path`` itself, or its single item directory (an Orbax
    step); a missing ``path`` with an interrupted replacement beside it reads the newer one."""
    path = path.rstrip("/")
    if os.path.isfile(os.path.join(path, MANIFEST)):
        return path
    if not os.path.exists(path):
        for survivor in (path + ".ucp-replacing", path + ".ucp-replaced"):
            if os.path.isdir(survivor):
                return find_checkpoint_dir(survivor)
        raise SpecReadError(f"{path}: no checkpoint")
    items = [d for d in sorted(os.listdir(path)) if os.path.isfile(os.path.join(path, d, MANIFEST))]
    if len(items) != 1:
        raise SpecReadError(f"{path}: expected one item directory with {MANIFEST}, found {items}")
    return os.path.join(path, items[0])


def load_manifest(root: str) -> dict:
    with open(os.path.join(root, MANIFEST), encoding="utf-8") as f:
        manifest = json.load(f)
    if manifest.get("format") != "jax_ucp":
        raise SpecReadError(f"{root}: not a jax_ucp manifest")
    version = manifest.get("version")
    if type(version) is not int or version < 1:
        raise SpecReadError(f"{root}: invalid version {version!r}")
    if version > FORMAT_VERSION:
        raise SpecReadError(f"{root}: format version {version} is newer than {FORMAT_VERSION}")
    return manifest


def read_value(entry: dict):
    kind, value = entry["type"], entry["value"]
    if kind == "float":
        return float.fromhex(value)
    if kind in ("none", "bool", "int", "str"):
        return value
    raise SpecReadError(f"{entry['key']}: unknown value type {kind!r}")


def shard_keys(shape, chunk_shape) -> list:
    """Keys of every shard file of the chunk grid ("c" for a 0-d array); none if zero-size."""
    if 0 in shape:
        return []
    keys = ["c"]
    for n, c in zip(shape, chunk_shape):
        keys = [f"{k}/{i}" for k in keys for i in range(-(-n // c))]
    return keys


def read_shard_index(path: str, n_chunks: int, index_crc: bool) -> list:
    """[(offset, nbytes)] per inner chunk, in C order of the inner-chunk grid; checks the index's
    crc32c and that every inner chunk was written and lies inside the file."""
    size = os.path.getsize(path)
    index_size = 16 * n_chunks + (4 if index_crc else 0)
    if size < index_size:
        raise SpecReadError(f"{path}: truncated shard file")
    with open(path, "rb") as f:
        f.seek(size - index_size)
        raw = f.read(index_size)
    if index_crc:
        if crc32c(raw[:-4]) != int.from_bytes(raw[-4:], "little"):
            raise SpecReadError(f"{path}: shard index crc32c mismatch")
        raw = raw[:-4]
    pairs = np.frombuffer(raw, "<u8").reshape(n_chunks, 2)
    index = []
    for i, (offset, nbytes) in enumerate(pairs.tolist()):
        if offset == MISSING or nbytes == MISSING:
            raise SpecReadError(f"{path}: inner chunk {i} is missing (incomplete checkpoint)")
        if offset + nbytes > size - index_size:
            raise SpecReadError(f"{path}: inner chunk {i} lies outside the data area")
        index.append((offset, nbytes))
    return index


def shard_digest(path: str, index: list) -> str:
    """crc32c of the inner chunks' 4-byte crc32c trailers, in index order, as 8 hex digits."""
    with open(path, "rb") as f:
        trailers = b""
        for offset, nbytes in index:
            f.seek(offset + nbytes - 4)
            trailers += f.read(4)
    return f"{crc32c(trailers):08x}"


def read_tensor(root: str, entry: dict) -> np.ndarray:
    directory = entry["dir"]
    name = directory.split("/", 1)[1]
    if not directory.startswith("arrays/") or "/" in name or name in (".", ".."):
        raise SpecReadError(f"{entry['key']}: bad dir {directory!r}")
    array_dir = os.path.join(root, directory)
    with open(os.path.join(array_dir, "zarr.json"), encoding="utf-8") as f:
        meta = json.load(f)
    shape, dtype = list(entry["shape"]), entry["dtype"]
    chunk_shape, inner = list(entry["chunk_shape"]), list(entry["inner_chunk_shape"])
    (codec,) = meta["codecs"]
    cfg = codec["configuration"]
    if (
        meta.get("zarr_format") != 3
        or meta.get("node_type") != "array"
        or meta["shape"] != shape
        or meta["data_type"] != dtype
        or meta["chunk_grid"]["configuration"]["chunk_shape"] != chunk_shape
        or codec["name"] != "sharding_indexed"
        or cfg["chunk_shape"] != inner
        or cfg.get("index_location", "end") != "end"
        or meta.get("chunk_key_encoding", {}).get("name") != "default"
    ):
        raise SpecReadError(f"{array_dir}/zarr.json does not match {MANIFEST}")
    index_crc = any(c["name"] == "crc32c" for c in cfg["index_codecs"])
    n_chunks = 1
    for c, i in zip(chunk_shape, inner):
        n_chunks *= c // i
    keys = shard_keys(shape, chunk_shape)
    digests = entry.get("shard_digests")
    if digests is not None and set(digests) != set(keys):
        raise SpecReadError(f"{array_dir}: shard_digests do not list the chunk grid {keys}")
    for key in keys:  # a missing shard file or inner chunk is an error, never fill values
        path = os.path.join(array_dir, *key.split("/"))
        if not os.path.isfile(path):
            raise SpecReadError(f"{path}: shard file missing (incomplete checkpoint)")
        index = read_shard_index(path, n_chunks, index_crc)
        if digests is not None and shard_digest(path, index) != digests[key]:
            raise SpecReadError(f"{path}: not the shard file this checkpoint saved (digest)")
    store = zarr.storage.LocalStore(array_dir, read_only=True)
    data = np.asarray(zarr.open_array(store=store, mode="r")[...])
    if data.dtype != np.dtype(dtype) or list(data.shape) != shape:
        raise SpecReadError(f"{array_dir}: read {data.dtype}{data.shape}, expected {dtype}{shape}")
    return data


def rebuild(node: dict, leaves: dict, prefix: tuple):
    """The saved containers from ``tree``: dict, list, tuple; NamedTuples and other objects as
    dicts of their fields (this reader imports no classes)."""
    if node["type"] == "leaf":
        if prefix not in leaves:
            raise SpecReadError(f"tree leaf {list(prefix)} has no entry")
        return leaves.pop(prefix)
    children = [(n, rebuild(child, leaves, prefix + (n,))) for n, _, child in node["children"]]
    if node["type"] == "list":
        return [v for _, v in children]
    if node["type"] == "tuple":
        return tuple(v for _, v in children)
    return dict(children)


def nest(entries: list, leaves: dict):
    """Without ``tree``: nested dicts by key component; a level whose children all have key type
    "index" and are exactly "0".."n-1" becomes a list."""
    root: dict = {}
    types: dict = {}
    for e in entries:
        key = tuple(e["key"])
        key_types = e.get("key_types") or ["key"] * len(key)
        node = root
        for depth, component in enumerate(key):
            types.setdefault(key[:depth], set()).add(key_types[depth])
            if depth == len(key) - 1:
                node[component] = leaves[key]
            else:
                node = node.setdefault(component, {})

    def convert(node, prefix):
        if not isinstance(node, dict):
            return node
        out = {k: convert(v, prefix + (k,)) for k, v in node.items()}
        indices = [str(i) for i in range(len(out))]
        if types.get(prefix) == {"index"} and sorted(out) == sorted(indices):
            return [out[str(i)] for i in range(len(out))]
        return out

    return convert(root, ())


def read_checkpoint(path: str):
    """The saved tree: np.ndarray for tensors, Python values for values."""
    root = find_checkpoint_dir(os.fspath(path))
    manifest = load_manifest(root)
    leaves = {}
    for e in manifest["entries"]:
        key = tuple(e["key"])
        if key in leaves:
            raise SpecReadError(f"duplicate key {list(key)}")
        if e["entry"] == "tensor":
            leaves[key] = read_tensor(root, e)
        elif e["entry"] == "value":
            leaves[key] = read_value(e)
        else:
            raise SpecReadError(f"unknown entry type {e['entry']!r}")
    if manifest.get("tree") is None:
        return nest(manifest["entries"], leaves)
    tree = rebuild(manifest["tree"], leaves, ())
    if leaves:
        raise SpecReadError(f"entries not in tree: {sorted(leaves)[:3]}")
    return tree


# --- Tests (these may use jax_ucp to write checkpoints) ----------------------------------------

LONG = "layer_" + "x" * 250  # escaped name longer than 200 characters: hashed directory name


def _float32_specials():
    bits = np.array([0x7FC00001, 0xFFC12345, 0x80000000, 0x7F800000, 0xFF800000, 1], np.uint32)
    return bits.view(np.float32)


def _tree():
    rng = np.random.default_rng(0)
    return {
        "params": {
            "w": rng.standard_normal((16, 8)).astype(np.float32),
            "decoder.layers.0.weight": rng.standard_normal((3, 5)),
            "a/b": np.arange(6, dtype=np.int16).reshape(2, 3),
            "50%": np.array([1, -2, 3], np.int8),
            "": np.array([True, False, True]),
            LONG: np.arange(7, dtype=np.uint16),
            "nested": {"deep": {"z": (rng.standard_normal(4) + 1j).astype(np.complex64)}},
            "specials": _float32_specials(),
        },
        "ints": {
            "i32": np.array([-(2**31), 2**31 - 1], np.int32),
            "i64": np.array([-(2**63), 2**63 - 1], np.int64),
            "u8": np.arange(250, 256, dtype=np.uint8),
            "u32": np.array([2**32 - 1], np.uint32),
            "u64": np.array([2**64 - 1, 0], np.uint64),
            "h": np.array([0.5, -0.0, np.inf], np.float16),
        },
        "scalar": np.float32(-0.0),
        "scalar_i": np.array(7, np.int64),
        "empty": np.zeros((0, 3), np.float32),
        "empty2": np.zeros((4, 0, 2), np.int32),
        "lst": [np.arange(3, dtype=np.float64), 1, "one"],
        "tup": (np.ones(2, np.uint8), None, -0.0),
        "vals": {
            "int": 3,
            "big": 2**70,
            "neg": -5,
            "nan": float("nan"),
            "negzero": -0.0,
            "inf": float("-inf"),
            "pi": 3.141592653589793,
            "true": True,
            "false": False,
            "str": "héllo/.%~",
            "empty_str": "",
            "none": None,
        },
    }


def assert_same(got, want, where="tree"):
    """Same containers, same Python types, same bytes (NaN payloads and -0.0 included)."""
    assert type(got) is type(want), f"{where}: {type(got).__name__} != {type(want).__name__}"
    if isinstance(want, dict):
        assert sorted(got) == sorted(want), f"{where}: keys {sorted(got)} != {sorted(want)}"
        for k in want:
            assert_same(got[k], want[k], f"{where}/{k}")
    elif isinstance(want, (list, tuple)):
        assert len(got) == len(want), where
        for i, (g, w) in enumerate(zip(got, want)):
            assert_same(g, w, f"{where}/{i}")
    elif isinstance(want, np.ndarray):
        assert got.dtype == want.dtype and got.shape == want.shape, where
        assert got.tobytes() == want.tobytes(), where
    elif isinstance(want, float):
        assert np.float64(got).tobytes() == np.float64(want).tobytes(), where
    else:
        assert got == want, where


def _as_saved(tree):
    """What a restore gives back for ``tree``: numpy scalars are 0-d arrays."""
    if isinstance(tree, dict):
        return {k: _as_saved(v) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(_as_saved(v) for v in tree)
    if isinstance(tree, np.generic):
        return np.asarray(tree)
    return tree


def _save(path, tree, **kw):
    import jax_ucp

    return jax_ucp.save(path, tree, **kw)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    path = tmp_path_factory.mktemp("spec") / "ckpt"
    tree = _tree()
    # Small inner chunks: several inner chunks per shard file.
    _save(path, tree, inner_chunk_bytes=16)
    return str(path), tree


def test_reader_rebuilds_the_saved_tree_bit_exact(saved):
    path, tree = saved
    assert_same(read_checkpoint(path), _as_saved(tree))


def test_layout_is_the_documented_one(saved):
    path, _ = saved
    with open(os.path.join(path, MANIFEST)) as f:
        manifest = json.load(f)
    by_key = {tuple(e["key"]): e for e in manifest["entries"]}
    assert by_key[("params", "decoder.layers.0.weight")]["dir"] == (
        "arrays/params.decoder%2Elayers%2E0%2Eweight"
    )
    assert by_key[("params", "a/b")]["dir"] == "arrays/params.a%2Fb"
    assert by_key[("params", "50%")]["dir"] == "arrays/params.50%25"
    assert by_key[("params", "")]["dir"] == "arrays/params.%"
    long_dir = by_key[("params", LONG)]["dir"]
    assert len(long_dir) == len("arrays/") + 200 and long_dir[len("arrays/") + 183] == "~"
    assert by_key[("lst", "1")]["key_types"] == ["key", "index"]
    nan = by_key[("vals", "nan")]
    assert (nan["entry"], nan["type"], nan["value"]) == ("value", "float", "nan")
    assert by_key[("vals", "negzero")]["value"] == "-0x0.0p+0"
    empty = os.path.join(path, by_key[("empty",)]["dir"])
    assert sorted(os.listdir(empty)) == ["zarr.json"]  # zero-size: no shard files
    assert by_key[("empty",)]["chunk_shape"] == [1, 3]
    scalar = by_key[("scalar",)]
    assert scalar["shape"] == scalar["chunk_shape"] == scalar["inner_chunk_shape"] == []
    assert os.path.isfile(os.path.join(path, scalar["dir"], "c"))
    assert list(by_key[("scalar",)]["shard_digests"]) == ["c"]


def test_multi_shard_multi_chunk_arrays_and_orbax_item_directory(tmp_path):
    import jax
    import orbax.checkpoint as ocp
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    import jax_ucp

    mesh = Mesh(np.array(jax.devices()[:8]).reshape(4, 2), ("data", "model"))
    host = np.arange(64 * 32, dtype=np.float32).reshape(64, 32) - 1000.5
    tree = {
        "sharded": jax.device_put(host, NamedSharding(mesh, P("data", "model"))),
        "replicated": jax.device_put(host[:8], NamedSharding(mesh, P())),
        "step": 12,
    }
    root = tmp_path / "run"
    options = ocp.CheckpointManagerOptions(enable_async_checkpointing=False, create=True)
    with ocp.CheckpointManager(root, options=options) as manager:
        manager.save(3, args=ocp.args.Composite(state=jax_ucp.UCPSave(tree, inner_chunk_bytes=256)))
        manager.wait_until_finished()
    item = root / "3" / "state"
    with open(item / MANIFEST) as f:
        entry = next(e for e in json.load(f)["entries"] if e["key"] == ["sharded"])
    assert entry["chunk_shape"] == [16, 16] and entry["inner_chunk_shape"] == [4, 16]
    assert len(entry["shard_digests"]) == 8
    assert entry["saved_sharding"]["partition_spec"] == ["data", "model"]
    got = read_checkpoint(str(root / "3"))  # the step directory: its single UCP item
    assert_same(got, {"sharded": host, "replicated": host[:8], "step": 12})


@pytest.mark.parametrize("options", [{"compression": "zstd"}, {"checksum": None}])
def test_compressed_and_unchecksummed_checkpoints(tmp_path, options):
    tree = _tree()
    _save(tmp_path / "c", tree, **options)
    with open(tmp_path / "c" / MANIFEST) as f:
        entries = json.load(f)["entries"]
    w = next(e for e in entries if e["key"] == ["params", "w"])
    if "compression" in options:
        assert w["compression"] == "zstd" and w["checksum"] == "crc32c"
    else:
        assert w["checksum"] is None and w["shard_digests"] is None
    assert_same(read_checkpoint(tmp_path / "c"), _as_saved(tree))


def test_without_tree_lists_come_back_from_index_key_types(saved, tmp_path):
    import shutil

    path, tree = saved
    copy = tmp_path / "notree"
    shutil.copytree(path, copy)
    with open(copy / MANIFEST) as f:
        manifest = json.load(f)
    del manifest["tree"]
    with open(copy / MANIFEST, "w") as f:
        json.dump(manifest, f)
    want = _as_saved(tree)
    want["tup"] = list(want["tup"])  # a tuple is recorded as such only in ``tree``
    assert_same(read_checkpoint(copy), want)


def test_missing_data_is_an_error_never_fill_values(saved, tmp_path):
    import shutil

    path, _ = saved
    with open(os.path.join(path, MANIFEST)) as f:
        w = next(e for e in json.load(f)["entries"] if e["key"] == ["params", "w"])
    n_chunks = 1
    for c, i in zip(w["chunk_shape"], w["inner_chunk_shape"]):
        n_chunks *= c // i
    assert n_chunks > 1

    gone = tmp_path / "gone"
    shutil.copytree(path, gone)
    os.remove(gone / w["dir"] / "c" / "0" / "0")
    with pytest.raises(SpecReadError, match="shard file missing"):
        read_checkpoint(gone)

    hole = tmp_path / "hole"
    shutil.copytree(path, hole)
    shard = hole / w["dir"] / "c" / "0" / "0"
    data = bytearray(shard.read_bytes())
    start = len(data) - 4 - 16 * n_chunks
    data[start + 16 : start + 32] = b"\xff" * 16  # inner chunk 1: never written
    data[-4:] = crc32c(bytes(data[start:-4])).to_bytes(4, "little")
    shard.write_bytes(bytes(data))
    with pytest.raises(SpecReadError, match="inner chunk 1 is missing"):
        read_checkpoint(hole)


def test_newer_format_version_is_refused(saved, tmp_path):
    import shutil

    path, _ = saved
    newer = tmp_path / "newer"
    shutil.copytree(path, newer)
    with open(newer / MANIFEST) as f:
        manifest = json.load(f)
    manifest["version"] = FORMAT_VERSION + 1
    with open(newer / MANIFEST, "w") as f:
        json.dump(manifest, f)
    with pytest.raises(SpecReadError, match="newer"):
        read_checkpoint(newer)
