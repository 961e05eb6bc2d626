"""The tree ucp.json records: container classes come back only from an allow list, never imported
or called from what a manifest names."""

from __future__ import annotations

import json

import numpy as np
import optax
import pytest
from typer.testing import CliRunner

import jax_ucp
from jax_ucp.cli import app
from jax_ucp.errors import CheckpointError

runner = CliRunner()


def _with_class(tmp_path, kind: str, cls: str):
    """A checkpoint whose dict node "cmd" claims to be ``cls``: its children's names would be
    the command line ["/bin/touch", "<tmp>/pwned"] if the class were called with them."""
    marker = tmp_path / "pwned"
    path = tmp_path / "c"
    jax_ucp.save(path, {"cmd": {"/bin/touch": 0, str(marker): 1}, "w": np.arange(3.0)})
    manifest = path / "ucp.json"
    d = json.loads(manifest.read_text())
    node = next(child for name, _, child in d["tree"]["children"] if name == "cmd")
    node.update(type=kind, **{"class": cls})
    manifest.write_text(json.dumps(d))
    return path, marker


HOSTILE_CLASSES = [
    ("object", "jax.version:subprocess.Popen"),
    ("namedtuple", "jax.version:subprocess.Popen"),
    ("object", "builtins:str"),
    ("object", "builtins:frozenset"),
    ("object", "builtins:SystemExit"),
    ("object", "collections:Counter"),
    ("namedtuple", "optax:tree_utils.__builtins__"),
    ("object", "optax._src.base:GradientTransformation"),  # allow-listed, but a NamedTuple
]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind,cls", HOSTILE_CLASSES)
def test_a_manifest_class_outside_the_allow_list_is_never_instantiated(tmp_path, kind, cls):
    path, marker = _with_class(tmp_path, kind, cls)
    out = jax_ucp.restore(path)
    assert type(out["cmd"]) is dict and list(out["cmd"]) == ["/bin/touch", str(marker)]
    assert [int(v) for v in out["cmd"].values()] == [0, 1]
    part = jax_ucp.restore(path, select=r"cmd/.*")
    assert type(part["cmd"]) is dict and not marker.exists()
    notice = f"Tree node 'cmd': class {cls!r} is not in the allow-list of container classes"
    if cls.startswith("optax._src.base"):
        notice = f"Tree node 'cmd': class {cls!r} is allow-listed but its fields are not"
    assert jax_ucp.verify(path) == [] and len(jax_ucp.verify(path).notices) == 1
    assert jax_ucp.verify(path).notices[0][0] == "cmd"
    assert jax_ucp.verify(path).notices[0][1].startswith(notice)
    assert jax_ucp.inspect(path).notices == [jax_ucp.verify(path).notices[0][1]]
    for command in ("verify", "inspect"):
        r = runner.invoke(app, [command, str(path)], env={"COLUMNS": "300"})
        assert r.exit_code == 0, r.output
        assert "gives it back as a dict of its fields" in " ".join(r.output.split())
    assert not marker.exists()


@pytest.mark.timeout(60)
def test_allow_listed_optax_states_are_rebuilt_even_from_a_moved_module(tmp_path):
    params = {"w": np.ones(3, np.float32)}
    state = {"opt": optax.chain(optax.add_decayed_weights(1e-2), optax.adam(1e-3)).init(params)}
    jax_ucp.save(tmp_path / "c", state)
    manifest = tmp_path / "c" / "ucp.json"
    d = json.loads(manifest.read_text())
    adam = d["tree"]["children"][0][2]["children"][1][2]["children"][0][2]
    assert adam["class"] == "optax._src.transform:ScaleByAdamState"
    adam["class"] = "optax._src.old_place:ScaleByAdamState"  # as an older optax recorded it
    manifest.write_text(json.dumps(d))
    out = jax_ucp.restore(tmp_path / "c")
    assert type(out["opt"][1][0]) is optax.ScaleByAdamState
    assert type(out["opt"][0]) is optax.EmptyState and type(out["opt"][1][1]) is optax.EmptyState
    assert jax_ucp.inspect(tmp_path / "c").notices == []


def test_a_manifest_never_makes_us_import_a_module_outside_the_allow_list(tmp_path):
    import json

    jax_ucp.save(tmp_path / "c", {"s": optax.EmptyState(), "t": (np.ones(2),)})
    path = tmp_path / "c" / "ucp.json"
    d = json.loads(path.read_text())
    node = d["tree"]["children"][1][2]
    node.update(type="namedtuple", **{"class": "os:_wrap_close"})
    d["tree"]["children"][0][2]["class"] = "subprocess:CompletedProcess"
    path.write_text(json.dumps(d))
    out = jax_ucp.restore(tmp_path / "c")
    assert out["s"] == {} and isinstance(out["t"], dict)  # plain containers instead


def test_the_static_allow_list_is_what_the_installed_optax_and_flax_give():
    """``inspect``/``verify`` judge classes by ``tree.KNOWN_CLASSES`` without importing optax or flax:
    it must say what the live allow-list says (regenerate it when either package changes)."""
    from jax_ucp._src import tree

    live: dict[str, dict] = {"optax": {}, "flax": {}}
    for cls in tree.allowed_classes().values():
        package = cls.__module__.split(".")[0]
        kind = tree.class_kind(tree.class_name(cls), live=True)
        assert kind is not None
        live[package][cls.__qualname__] = kind[1] if kind[0] == "namedtuple" else kind[0]
    assert live == tree.KNOWN_CLASSES


@pytest.mark.timeout(60)
def test_many_classes_outside_the_allow_list_make_one_notice_for_the_tree(tmp_path):
    path, _ = _with_class(tmp_path, "object", "mylib.state:Box")
    d = json.loads((path / "ucp.json").read_text())
    d["tree"]["type"] = "object"
    d["tree"]["class"] = "mylib.state:Root"
    (path / "ucp.json").write_text(json.dumps(d))
    notices = jax_ucp.inspect(path).notices
    assert len(notices) == 1 and notices == [m for _, m in jax_ucp.verify(path).notices]
    assert notices[0].startswith("2 tree nodes come back as dicts of their fields")
    assert "'mylib.state:Root'" in notices[0] and "'mylib.state:Box'" in notices[0]
    r = runner.invoke(app, ["inspect", str(path)], env={"COLUMNS": "300"})
    assert r.exit_code == 0 and r.output.count("2 tree nodes") == 1, r.output


@pytest.mark.timeout(60)
@pytest.mark.parametrize("metadata", [True, False], ids=["with_metadata", "value_in_state"])
def test_an_nnx_variable_recorded_as_a_standard_library_class_is_refused(tmp_path, metadata):
    """An NNX checkpoint whose Param is recorded as ``os:system`` (with its Variable metadata,
    or as the lone ``value`` of a node in an ``nnx.State``) came back as a plain dict in the
    Param's place; refused naming the node and the class. A user's own Variable subclass
    (``mylib.layers:MyParam``) still comes back as a dict with a notice, as documented."""
    from flax import nnx

    jax_ucp.save(tmp_path / "c", nnx.state(nnx.Linear(2, 3, rngs=nnx.Rngs(0))))
    manifest = tmp_path / "c" / "ucp.json"
    d = json.loads(manifest.read_text())
    kernel = next(child for name, _, child in d["tree"]["children"] if name == "kernel")
    kernel["class"] = "mylib.layers:MyParam"
    manifest.write_text(json.dumps(d))
    own = jax_ucp.restore(tmp_path / "c")["kernel"]  # its fields, nnx.State making it one
    assert not isinstance(own, nnx.Variable) and list(own) == ["value"]
    assert (
        "'mylib.layers:MyParam' is not in the allow-list"
        in jax_ucp.inspect(tmp_path / "c").notices[0]
    )
    kernel["class"] = "os:system"
    if not metadata:
        del kernel["metadata"]
    manifest.write_text(json.dumps(d))
    refused = r"tree node 'kernel' is recorded as an nnx.Variable .*of class 'os:system'"
    for read in (jax_ucp.restore, jax_ucp.verify, jax_ucp.inspect):
        with pytest.raises(CheckpointError, match=refused):
            read(tmp_path / "c")
