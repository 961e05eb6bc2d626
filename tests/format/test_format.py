import json
import os
from pathlib import Path

import hypothesis.strategies as st
import numpy as np
import pytest
from hypothesis import given

import jax_ucp
from jax_ucp._src import format as fmt
from jax_ucp._src.format import keypath
from jax_ucp._src.store import chunking
from jax_ucp.errors import CheckpointError


@given(st.lists(st.text(min_size=0, max_size=40), min_size=1, max_size=5))
def test_key_escape_is_reversible_and_path_safe(key):
    name = keypath.encode_key(key)
    assert "/" not in name and name not in (".", "..")
    if "~" not in name:
        assert keypath.decode_key(name) == tuple(key)
    assert len(name) <= keypath.MAX_DIR_NAME


def test_long_names_are_hashed_and_distinct():
    a = keypath.encode_key(["x" * 300])
    b = keypath.encode_key(["x" * 299 + "y"])
    assert a != b and len(a) <= keypath.MAX_DIR_NAME and "~" in a
    with pytest.raises(ValueError, match="shortened"):
        keypath.decode_key(a)


def test_dotted_source_names_do_not_collide_with_nesting():
    assert keypath.encode_key(["params", "a.b"]) != keypath.encode_key(["params", "a", "b"])


def test_manifest_json_round_trip_keeps_values_exact():
    entries = [
        fmt.ValueEntry.of(("f",), ("key",), float("nan")),
        fmt.ValueEntry.of(("g",), ("key",), -0.0),
        fmt.ValueEntry.of(("i",), ("key",), 2**70),
        fmt.ValueEntry.of(("s",), ("key",), "x/y"),
        fmt.ValueEntry.of(("b",), ("key",), True),
        fmt.ValueEntry.of(("n",), ("key",), None),
    ]
    m = fmt.Manifest.loads(fmt.new_manifest(entries).dumps())
    vals = {e.key[0]: e.value for e in m.values}
    assert vals["f"] != vals["f"]  # nan
    assert str(vals["g"]) == "-0.0" and vals["i"] == 2**70 and vals["s"] == "x/y"
    assert vals["b"] is True and vals["n"] is None


def test_newer_version_and_foreign_json_are_refused():
    d = json.loads(fmt.new_manifest([]).dumps())
    d["version"] = fmt.FORMAT_VERSION + 1
    with pytest.raises(CheckpointError, match="newer"):
        fmt.Manifest.loads(json.dumps(d))
    with pytest.raises(CheckpointError, match="not a jax_ucp manifest"):
        fmt.Manifest.loads(json.dumps({"zarr_format": 3}))
    with pytest.raises(CheckpointError, match="not valid JSON"):
        fmt.Manifest.loads("{oops")


@given(
    st.lists(st.integers(1, 3000), min_size=0, max_size=4),
    st.sampled_from([1, 2, 4, 8]),
    st.sampled_from([1 << 10, 1 << 16, 1 << 20]),
)
def test_inner_chunks_tile_the_shard_and_respect_the_bound(shape, itemsize, bound):
    inner = chunking.inner_chunk_shape(shape, itemsize, bound)
    assert len(inner) == len(shape)
    for s, c in zip(shape, inner):
        assert s % c == 0
    nbytes = itemsize
    for c in inner:
        nbytes *= c
    # Over budget only for an extent without a usable divisor (then it is the minimal one).
    if nbytes > bound:
        over = [i for i, (s, c) in enumerate(zip(shape, inner)) if c not in (1, s)]
        assert len(over) <= 1


def test_replicated_large_embedding_gets_bounded_chunks():
    inner = chunking.inner_chunk_shape((262144, 1024), 4)  # 1 GiB replicated
    assert inner[1] == 1024 and inner[0] * 1024 * 4 <= chunking.DEFAULT_INNER_CHUNK_BYTES


def test_written_manifests_follow_the_published_json_schema(tmp_path):
    import jsonschema
    import ml_dtypes

    import jax_ucp

    with open(
        os.path.join(os.path.dirname(fmt.manifest.__file__), "ucp_manifest.v1.schema.json")
    ) as f:
        schema = json.load(f)
    jax_ucp.save(
        tmp_path / "c",
        {
            "params": {"w": np.zeros((3, 2), ml_dtypes.bfloat16)},
            "opt_state": {"mu": {"w": np.zeros((3, 2), np.float32)}},
            "step": 3,
            "name": "x",
            "lr": 1e-3,
            "none": None,
        },
    )
    jsonschema.validate(json.loads((tmp_path / "c" / "ucp.json").read_text()), schema)
    bad = json.loads((tmp_path / "c" / "ucp.json").read_text())
    next(e for e in bad["entries"] if e["entry"] == "tensor")["dtype"] = "float128"
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(bad, schema)


MUTATIONS = {
    "version 0": lambda d: d.update(version=0),
    "version 2": lambda d: d.update(version=2),
    "source null": lambda d: d.update(source=None),
    "key_types null": lambda d: d["entries"][0].update(key_types=None),
    "no save_id": lambda d: d.pop("save_id"),
    "extra top-level field": lambda d: d.update(x=1),
    "extra entry field": lambda d: d["entries"][0].update(x=1),
    "dir ..": lambda d: d["entries"][0].update(dir="arrays/.."),
    "dir with newline": lambda d: d["entries"][0].update(dir="arrays/params.w\n"),
    "zero chunk": lambda d: d["entries"][0].update(chunk_shape=[0, 2]),
    "float dim": lambda d: d["entries"][0].update(shape=[3.0, 2]),
    "digest not hex": lambda d: d["entries"][0].update(shard_digests={"c/0/0": "xyz"}),
    "digest key newline": lambda d: d["entries"][0].update(shard_digests={"c/0/0\n": "0" * 8}),
    "int value true": lambda d: next(e for e in d["entries"] if e["key"] == ["step"]).update(
        value=True
    ),
    "float value plain": lambda d: next(e for e in d["entries"] if e["key"] == ["lr"]).update(
        value="1.5"
    ),
    "none value 3": lambda d: next(e for e in d["entries"] if e["key"] == ["none"]).update(value=3),
    "tree node junk": lambda d: d.update(tree={"type": "leaf", "children": []}),
    "saved_sharding partial": lambda d: d["entries"][0].update(
        saved_sharding={"mesh": {"axis_names": [], "shape": []}}
    ),
    "fine (unchanged)": lambda d: None,
}


@pytest.mark.parametrize("name", sorted(MUTATIONS))
def test_schema_and_reader_agree(tmp_path, name):
    """The reader is never looser than the published schema, nor stricter on a per-field rule."""
    import jsonschema

    schema = json.loads(
        (Path(jax_ucp._src.format.__file__).parent / "ucp_manifest.v1.schema.json").read_text()
    )
    jax_ucp.save(
        tmp_path / "c",
        {"params": {"w": np.zeros((3, 2), np.float32)}, "step": 3, "lr": 1e-3, "none": None},
    )
    d = json.loads((tmp_path / "c" / "ucp.json").read_text())
    d["entries"].sort(key=lambda e: e["entry"] != "tensor")  # the tensor first
    MUTATIONS[name](d)
    schema_ok = jsonschema.Draft202012Validator(schema).is_valid(d)
    try:
        jax_ucp._src.format.Manifest.loads(json.dumps(d))
        reader_ok = True
    except CheckpointError:
        reader_ok = False
    if name in READER_ONLY:  # JSON Schema cannot express it; the reader is stricter, never looser
        assert schema_ok and not reader_ok
        return
    assert schema_ok == reader_ok == (name == "fine (unchanged)"), (schema_ok, reader_ok)


# JSON Schema's "integer" admits 3.0; the reader wants a JSON integer.
READER_ONLY = {"float dim"}


def test_the_checked_in_schema_is_the_one_the_model_generates():
    """``ucp_manifest.v1.schema.json`` is generated from the typed model (regenerate it with
    ``python -m jax_ucp._src.format.schema``), never edited by hand."""
    from jax_ucp._src.format import schema

    assert schema.SCHEMA_FILE.read_text(encoding="utf-8") == schema.schema_text()
    assert json.loads(schema.schema_text()) == schema.json_schema()
