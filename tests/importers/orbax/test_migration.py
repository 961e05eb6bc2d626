"""Orbax checkpoints in (convert) and out (export with OrbaxExport): every layout Orbax writes, checked
bit-exact against the live state Orbax was given, restored onto another mesh."""

from __future__ import annotations

import json
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jax_ucp
from jax_ucp._src.exporters import OrbaxExport, options_for
from jax_ucp._src.exporters.orbax_out import export_orbax
from jax_ucp._src.importers import plan_import
from jax_ucp._src.writer import Deferred
from jax_ucp.conversion import ImportOptions, OrbaxOptions
from jax_ucp.errors import RequestError, SourceError
from tests.ucp_testing import (
    assert_bit_exact,
    assert_convert_refused,
    mesh,
    move_out,
    restored_params,
)


def _state():
    """A train state as Orbax users save it: sharded fp32 params, a bf16 leaf, optax Adam
    moments (a NamedTuple inside a tuple), a Python int step."""
    m = mesh((2, 4), ("data", "model"))
    w = jax.random.normal(jax.random.key(0), (8, 16))
    w = jax.device_put(w, NamedSharding(m, P("data", "model")))
    emb = jax.random.normal(jax.random.key(1), (4, 8)).astype(jnp.bfloat16)
    params = {"w": w, "emb": emb}
    opt_state = optax.adam(1e-3).init(params)
    mu = jax.tree.map(lambda x: x + 1, opt_state[0].mu)
    opt_state = (opt_state[0]._replace(mu=mu, count=jnp.int32(7)),) + opt_state[1:]
    return {"params": params, "opt_state": opt_state, "step": 7}


def _abstract(state):
    """The state's abstract target on another mesh (4 devices, other axis names)."""
    m = mesh((4,), ("x",), devices=jax.devices()[:4])

    def leaf(x):
        if not hasattr(x, "shape"):
            return x
        spec = P("x") if x.ndim and x.shape[0] % 4 == 0 else P()
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(m, spec))

    return jax.tree.map(leaf, state)


def _check(restored, state):
    assert jax.tree.structure(restored) == jax.tree.structure(state)
    for (path, got), want in zip(
        jax.tree_util.tree_flatten_with_path(restored)[0], jax.tree.leaves(state)
    ):
        if hasattr(want, "shape"):
            assert got.dtype == want.dtype, path
            assert_bit_exact(np.asarray(got), np.asarray(want), jax.tree_util.keystr(path))
        else:
            assert got == want, path


def _save_orbax(kind, path, state):
    if kind == "standard":  # StandardCheckpointer: OCDBT, zarr v2, zstd
        with ocp.StandardCheckpointer() as c:
            c.save(path, state)
    elif kind == "pytree_zarr2":  # no OCDBT: one zarr v2 directory per array
        ocp.PyTreeCheckpointer(use_ocdbt=False).save(path, state)
    elif kind == "pytree_zarr3":
        handler = ocp.PyTreeCheckpointHandler(use_ocdbt=False, use_zarr3=True)
        ocp.Checkpointer(handler).save(path, args=ocp.args.PyTreeSave(state))
    elif kind in ("manager_root", "manager_step"):
        with ocp.CheckpointManager(path) as mngr:
            for step in (3, 7):
                mngr.save(
                    step,
                    args=ocp.args.Composite(
                        state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave({"lr": 1e-3})
                    ),
                )
            mngr.wait_until_finished()
        return os.path.join(path, "7") if kind == "manager_step" else path
    return path


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    "kind", ["standard", "pytree_zarr2", "pytree_zarr3", "manager_root", "manager_step"]
)
def test_convert_orbax_checkpoint_bit_exact_onto_another_mesh(tmp_path, kind):
    state = _state()
    src = _save_orbax(kind, str(tmp_path / "orbax"), state)
    dst = jax_ucp.convert(src, tmp_path / "ucp")
    manifest = jax_ucp.inspect(dst)
    roles = {e.name: (e.role, e.sub_role) for e in manifest.tensors}
    assert roles["params/w"] == ("param", None)
    assert roles["opt_state/0/mu/w"] == ("opt_state", "mu")
    assert roles["opt_state/0/count"] == ("opt_state", "count")
    # Orbax's empty node (optax's EmptyState) and the Python step are manifest values
    assert [(v.name, v.value) for v in manifest.values] == [("opt_state/1", None), ("step", 7)]
    assert manifest.source["framework"] == "orbax"
    if kind.startswith("manager"):
        assert manifest.source["step"] == 7  # the latest committed step of a root
        assert manifest.source["skipped"] == {
            "meta/": "an Orbax JsonCheckpointHandler item, not a PyTree of arrays"
        }
    else:
        assert "skipped" not in manifest.source
    item = "state/" if kind.startswith("manager") else ""  # Orbax's names, under their item
    provenance = sorted(n for e in manifest.tensors for n in e.provenance["tensors"])
    assert provenance == [
        item + n
        for n in ["opt_state.0.count", "opt_state.0.mu.emb", "opt_state.0.mu.w"]
        + ["opt_state.0.nu.emb", "opt_state.0.nu.w", "params.emb", "params.w"]
    ]
    abstract = _abstract(state)
    restored = jax_ucp.restore(dst, target=abstract)
    _check(restored, state)
    assert restored["params"]["w"].sharding == abstract["params"]["w"].sharding
    assert isinstance(restored["opt_state"][0], optax.ScaleByAdamState)
    # Orbax's record of each array's sharding is kept: mesh= alone reuses the PartitionSpec
    saved = {e.name: e.saved_sharding for e in manifest.tensors}
    assert saved["params/w"].partition_spec == ("data", "model")
    assert saved["params/w"].mesh.axis_names == ("data", "model")
    assert saved["params/w"].mesh.shape == (2, 4)
    assert saved["params/emb"] is None  # a single-device array: no NamedSharding
    on_mesh = jax_ucp.restore(dst, mesh=mesh((4, 2), ("data", "model")))
    assert on_mesh["params"]["w"].sharding.spec == P("data", "model")
    assert_bit_exact(np.asarray(on_mesh["params"]["w"]), np.asarray(state["params"]["w"]))
    # without a target: Orbax's tuple comes back as a list (sequence keys kept), as Orbax does
    plain = jax_ucp.restore(dst)
    assert isinstance(plain["opt_state"], list) and plain["opt_state"][1] is None
    assert_bit_exact(plain["opt_state"][0]["nu"]["w"], np.asarray(state["opt_state"][0].nu["w"]))


@pytest.mark.timeout(60)
def test_import_streams_one_lazy_array_at_a_time(tmp_path):
    """Every array reaches the writer unread (a ``Deferred`` over the TensorStore opened with
    Orbax's read spec, reserving the array and its decoded chunks): the writer reads one at a
    time, so the tree is never in memory at once."""
    state = _state()
    with ocp.StandardCheckpointer() as c:
        c.save(tmp_path / "orbax", state)
    plan = plan_import(tmp_path / "orbax")
    items = list(plan.items)
    arrays = [i for i in items if not isinstance(i.value, (int, float, str, bool, type(None)))]
    assert len(arrays) == 7
    assert all(isinstance(i.value, Deferred) for i in arrays)
    assert plan.total_params == 2
    got = {"/".join(i.key): i.value for i in arrays}
    w = got["params/w"]
    assert (w.shape, w.dtype) == ((8, 16), np.float32)
    # the array and its decoded chunks in flight: its (4, 4) chunks (one per device), at least
    # one, at most all 8 at once
    assert 8 * 16 * 4 + 4 * 4 * 4 <= w.nbytes <= 2 * 8 * 16 * 4
    assert_bit_exact(w.build("params/w"), np.asarray(state["params"]["w"]))


@pytest.mark.timeout(60)
def test_convert_step_tag_weights_only_and_refusals(tmp_path):
    state = _state()
    root = _save_orbax("manager_root", str(tmp_path / "run"), state)
    dst = jax_ucp.convert(root, tmp_path / "w", importing=OrbaxOptions(tag=3, weights_only=True))
    manifest = jax_ucp.inspect(dst)
    assert manifest.source["step"] == 3
    assert sorted(e.name for e in manifest.tensors) == ["params/emb", "params/w"]
    skipped = manifest.source["skipped"]
    assert skipped["state/opt_state.0.mu.w"] == "weights_only: not under params/"
    assert skipped["state/step"] == "weights_only: not under params/"
    assert skipped["meta/"] == "an Orbax JsonCheckpointHandler item, not a PyTree of arrays"
    with pytest.raises(SourceError, match=r"run:.*step 5; steps found: \[3, 7\]"):
        jax_ucp.convert(root, tmp_path / "x", importing=OrbaxOptions(tag=5))
    with ocp.CheckpointManager(tmp_path / "ucp_run") as mngr:
        mngr.save(1, args=ocp.args.Composite(state=jax_ucp.UCPSave(state)))
        mngr.wait_until_finished()
    with pytest.raises(SourceError, match=r"item 'state' is already a jax_ucp checkpoint"):
        jax_ucp.convert(tmp_path / "ucp_run", tmp_path / "y")
    with ocp.CheckpointManager(tmp_path / "json_run") as mngr:
        mngr.save(1, args=ocp.args.Composite(meta=ocp.args.JsonSave({"a": 1})))
        mngr.wait_until_finished()
    with pytest.raises(SourceError, match=r"no PyTree item .* among its items \['meta'\]"):
        jax_ucp.convert(tmp_path / "json_run", tmp_path / "z")
    assert not any(os.path.exists(tmp_path / n) for n in ("x", "y", "z"))


@pytest.mark.timeout(60)
def test_convert_strings_and_python_scalars(tmp_path):
    tree = {"name": "run-1", "lr": 0.5, "flag": True, "none": None, "a": np.arange(3.0)}
    ocp.PyTreeCheckpointer().save(tmp_path / "orbax", tree)
    manifest = jax_ucp.inspect(jax_ucp.convert(tmp_path / "orbax", tmp_path / "ucp"))
    assert {v.name: v.value for v in manifest.values} == {
        "name": "run-1",
        "lr": 0.5,
        "flag": True,
        "none": None,
    }
    assert [e.name for e in manifest.tensors] == ["a"]


@pytest.mark.timeout(120)
def test_export_orbax_restores_with_orbax_bit_exact(tmp_path):
    state = _state()
    jax_ucp.save(tmp_path / "ucp", state)
    out = jax_ucp.export(tmp_path / "ucp", tmp_path / "orbax", OrbaxExport())
    assert out.tensors == 7 and "_METADATA" in out.files
    abstract = _abstract(state)
    with ocp.StandardCheckpointer() as c:
        restored = c.restore(tmp_path / "orbax", abstract)
    _check(restored, state)  # optax NamedTuples, bf16 and the Python int come back as saved
    assert restored["params"]["w"].sharding == abstract["params"]["w"].sharding
    # into a CheckpointManager step, restored by the manager
    item = export_orbax(tmp_path / "ucp", tmp_path / "run", step=7)
    assert item == str(tmp_path / "run" / "7" / "state")
    with ocp.CheckpointManager(tmp_path / "run") as mngr:
        assert mngr.all_steps() == [7]
        got = mngr.restore(7, args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract)))
    _check(got.state, state)
    # and back: Orbax -> UCP gives the same arrays
    back = jax_ucp.convert(tmp_path / "orbax", tmp_path / "back")
    _check(jax_ucp.restore(back, target=abstract), state)
    with pytest.raises(
        RequestError, match=r"orbax: already exists and is not an export written by jax_ucp"
    ):
        jax_ucp.export(tmp_path / "ucp", tmp_path / "orbax", OrbaxExport())
    with pytest.raises(RequestError, match=r"^select=.*'orbax'"):
        jax_ucp.export(tmp_path / "ucp", tmp_path / "o2", options_for("orbax", select="params"))
    metadata = json.loads((tmp_path / "orbax" / "_METADATA").read_text())
    kinds = {k: v["value_metadata"]["value_type"] for k, v in metadata["tree_metadata"].items()}
    assert kinds["('params', 'w')"] == "np.ndarray" and kinds["('step',)"] == "scalar"


@pytest.mark.timeout(120)
def test_step_with_two_pytree_items_and_a_hostile_item_name(tmp_path):
    state = _state()
    ema = {"params": jax.tree.map(lambda x: x * 2, state["params"])}
    with ocp.CheckpointManager(tmp_path / "run") as mngr:
        mngr.save(
            4,
            args=ocp.args.Composite(
                state=ocp.args.StandardSave(state), ema=ocp.args.StandardSave(ema)
            ),
        )
        mngr.wait_until_finished()
    manifest = jax_ucp.inspect(jax_ucp.convert(tmp_path / "run", tmp_path / "ucp"))
    names = sorted(e.name for e in manifest.tensors)
    assert names[:2] == ["ema/params/emb", "ema/params/w"] and "state/params/w" in names
    assert manifest.source["items"] == ["ema", "state"]
    got = jax_ucp.restore(tmp_path / "ucp", target={"ema": _abstract(ema)})
    _check(got["ema"], ema)
    meta = tmp_path / "run" / "4" / "_CHECKPOINT_METADATA"
    record = json.loads(meta.read_text())
    record["item_handlers"] = {"../../elsewhere": record["item_handlers"]["state"]}
    meta.write_text(json.dumps(record))
    with pytest.raises(SourceError, match=r"item name '\.\./\.\./elsewhere' is not a"):
        jax_ucp.convert(tmp_path / "run", tmp_path / "bad")
    # an array name of 10 000 characters in an item's _METADATA: the file and the array named,
    # not the file system's raw ENAMETOOLONG
    record["item_handlers"] = {"state": record["item_handlers"]["../../elsewhere"]}
    meta.write_text(json.dumps(record))
    tree_meta = tmp_path / "run" / "4" / "state" / "_METADATA"
    md = json.loads(tree_meta.read_text())
    entry = next(iter(md["tree_metadata"].values()))
    entry["key_metadata"][-1]["key"] = "x" * 10_000
    tree_meta.write_text(json.dumps(md))
    with pytest.raises(SourceError, match=r"_METADATA: array '[\w.]*x+': .*10\d\d\d ch") as e:
        jax_ucp.convert(tmp_path / "run", tmp_path / "bad")
    assert str(tree_meta) in str(e.value) and len(str(e.value)) < 600


@pytest.mark.timeout(120)
def test_cli_convert_and_export_orbax_at_80_columns(tmp_path):
    from typer.testing import CliRunner

    from jax_ucp.cli import app

    state = _state()
    with ocp.StandardCheckpointer() as c:
        c.save(tmp_path / "orbax", state)
    env = {"COLUMNS": "80"}
    result = CliRunner().invoke(
        app, ["convert", str(tmp_path / "orbax"), str(tmp_path / "ucp"), "--from", "orbax"], env=env
    )
    assert result.exit_code == 0, result.output
    assert f"wrote {tmp_path / 'ucp'}" in result.output.replace("\n", "")
    result = CliRunner().invoke(
        app, ["export", str(tmp_path / "ucp"), str(tmp_path / "back"), "--to", "orbax"], env=env
    )
    assert result.exit_code == 0, result.output
    with ocp.StandardCheckpointer() as c:
        _check(c.restore(tmp_path / "back", _abstract(state)), state)
    result = CliRunner().invoke(
        app,
        ["convert", str(tmp_path / "orbax"), str(tmp_path / "x"), "--from", "orbax", "--tag", "3"],
    )
    assert result.exit_code == 1
    assert "a single Orbax checkpoint has no steps (tag=3)" in result.output.replace("\n", "")


# Nothing outside the checkpoint is read, and no tensor borrows another's bytes.


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
    assert_convert_refused(
        mine,
        tmp_path / "out",
        rf"mine/_METADATA: array '{other}/params\.w': file name '{other}/params\.w' is an "
        r"absolute path",
    )
    for keys, message in (
        (["", "", "/other/params", "w"], r"'\.\./other/params\.w' has a '\.\.' part"),
        (["params", "w\0"], r"holds a NUL character"),
    ):
        _rename_leaf(mine, tuple(_key_path(mine)), keys)
        assert_convert_refused(mine, tmp_path / "out", message)


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
        p for p in mine.rglob("*") if p.is_file() and ((ocdbt and "/d/" in str(p)) or p.name == "0")
    )
    assert data, "the fixture has no data file"
    inner = mine / "moved"
    inner.mkdir()
    for i, p in enumerate(data):
        shutil.move(p, inner / str(i))
        p.symlink_to(inner / str(i))
    got = restored_params(jax_ucp.convert(mine, tmp_path / "ok"))
    for name, value in tree["params"].items():
        assert_bit_exact(got[name], value, name)
    target = move_out(inner / "0", tmp_path / "elsewhere")
    (inner / "0").unlink()
    data[0].unlink()
    data[0].symlink_to(target)
    assert_convert_refused(
        mine,
        tmp_path / "out",
        rf"mine: file: file name '{os.path.relpath(data[0], mine)}' resolves to "
        r"\S+/elsewhere/0, outside the checkpoint",
    )


@pytest.mark.timeout(120)
@pytest.mark.parametrize("ocdbt", [False, True], ids=["zarr", "ocdbt"])
def test_orbax_export_of_a_key_naming_an_absolute_path_writes_nothing_outside(tmp_path, ocdbt):
    """A jax_ucp checkpoint whose tensor key is an absolute path: Orbax would write that array's
    folder there (its folder is the joined key path). The export is refused before Orbax runs;
    nothing appears at that path."""
    from jax_ucp._src.exporters import orbax_out

    victim = tmp_path / "victim"
    ckpt = tmp_path / "ckpt"
    jax_ucp.save(ckpt, {str(victim): np.ones(3, np.float32), "ok": np.zeros(2, np.float32)})
    with pytest.raises(
        jax_ucp.UCPError, match=rf"ucp\.json: tensor '{victim}': file name .* is an absolute path"
    ):
        orbax_out.export_orbax(ckpt, tmp_path / "orbax", use_ocdbt=ocdbt)
    assert not victim.exists() and not (tmp_path / "orbax").exists()


@pytest.mark.timeout(120)
def test_step_folders_in_other_digits_or_two_names_for_one_step(tmp_path):
    """A manager root with steps 3 and 7, step 3 copied as ``٩`` (Arabic-Indic nine): ``\\d``
    read it as step 9, "the latest", and imported step 3's values as it; only ASCII digits
    number a step. Copied as ``0007`` beside ``7``: two names for step 7, refused naming both
    (one of them was taken by listing order)."""
    root = _save_orbax("manager_root", str(tmp_path / "run"), _state())
    shutil.copytree(os.path.join(root, "3"), os.path.join(root, "\u0669"))
    dst = jax_ucp.convert(root, tmp_path / "latest", importing=ImportOptions(weights_only=True))
    assert jax_ucp.inspect(dst).source["step"] == 7
    shutil.copytree(os.path.join(root, "3"), os.path.join(root, "0007"))
    with pytest.raises(SourceError, match=r"run: '0007' and '7' both name step 7"):
        jax_ucp.convert(root, tmp_path / "refused", importing=ImportOptions(weights_only=True))
    assert not os.path.exists(tmp_path / "refused")
