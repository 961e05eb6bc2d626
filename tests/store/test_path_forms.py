"""Every path form a user types reaches the same checkpoint: ``../ck``, ``./../ck/``, trailing
slashes, a link's ``..``, ``/./`` in an absolute path, from a working directory reached through a
symlink, under a folder whose name has a space and non-ASCII letters. An intact checkpoint reached
as ``../ck`` made restore and ``jax-ucp verify`` raise TensorStore's raw ``ValueError: ...
Invalid file path: "../ck/arrays/w"`` (TensorStore's ``file`` kvstore refuses ``..`` and ``.``
components): the storage seam now gives TensorStore one resolved spelling (``LocalDirectory
.kvstore``). Each entry point, Python and CLI, is run on each form."""

from __future__ import annotations

import os
import re

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest
from safetensors.numpy import save_file
from typer.testing import CliRunner

import jax_ucp
from jax_ucp._src.store import storage
from jax_ucp.cli import app
from tests.ucp_testing import move_out

pytestmark = pytest.mark.timeout(300)
runner = CliRunner()

W = np.arange(12, dtype=np.float32).reshape(3, 4)
FORMS = ["../{}", "./../{}/", "../{}//", "../real/../{}", "{base}/./{}"]


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> str:
    """``<tmp>/dir spé ç`` holding a checkpoint, a CheckpointManager run of UCP items, a
    safetensors folder and an Orbax checkpoint; ``real`` and a link ``link`` -> ``real``."""
    root = str(tmp_path_factory.mktemp("paths") / "dir spé ç")
    os.makedirs(os.path.join(root, "real"))
    os.symlink("real", os.path.join(root, "link"))
    jax_ucp.save(os.path.join(root, "ck"), {"params": {"w": W}})
    os.makedirs(os.path.join(root, "st"))
    save_file({"w": W}, os.path.join(root, "st", "model.safetensors"))
    with ocp.StandardCheckpointer() as ckptr:
        ckptr.save(os.path.join(root, "orb"), {"params": {"w": W}})
    with ocp.CheckpointManager(os.path.join(root, "run")) as mngr:
        for step in (1, 2):
            args = ocp.args.Composite(state=jax_ucp.UCPSave({"params": {"w": W + step}}))
            mngr.save(step, args=args)
        mngr.wait_until_finished()
    return root


@pytest.fixture
def in_link(base, monkeypatch):
    """The working directory is ``link`` (a symlink to ``real``): ``..`` is ``base``."""
    monkeypatch.chdir(os.path.join(base, "link"))
    return base


def _form(form: str, base: str, name: str) -> str:
    return form.format(name, base=base)


def test_the_storage_seam_gives_tensorstore_one_resolved_path(in_link):
    for form in FORMS:
        spec = storage.storage_for(_form(form, in_link, "ck")).kvstore("arrays/params.w")
        assert spec == {"driver": "file", "path": os.path.join(in_link, "ck", "arrays/params.w")}


@pytest.mark.parametrize("form", FORMS)
def test_every_python_entry_point_reads_every_path_form(in_link, form, tmp_path):
    ck, run = _form(form, in_link, "ck"), _form(form, in_link, "run")
    np.testing.assert_array_equal(jax_ucp.restore(ck)["params"]["w"], W)
    assert jax_ucp.verify(ck) == []
    assert [e.name for e in jax_ucp.inspect(ck).tensors] == ["params/w"]
    mesh = jax_ucp.abstract_mesh([("data", 1)])
    assert jax_ucp.plan(ck, mesh=mesh) is not None
    assert jax_ucp.diff(ck, os.path.join(in_link, "ck")).identical
    jax_ucp.export(ck, tmp_path / "exported")
    assert jax_ucp.latest_step(run) == 2
    np.testing.assert_array_equal(jax_ucp.restore(run, step="latest")["params"]["w"], W + 2)
    assert jax_ucp.verify(_form(form, in_link, "run/2/state")) == []
    st, orb = _form(form, in_link, "st"), _form(form, in_link, "orb")
    (leaf,) = jax.tree.leaves(jax_ucp.restore(st))
    np.testing.assert_array_equal(leaf, W)
    np.testing.assert_array_equal(jax_ucp.restore(orb)["params"]["w"], W)
    for source in (st, orb):
        out = jax_ucp.convert(source, tmp_path / f"from-{os.path.basename(source.rstrip('/'))}")
        assert jax_ucp.verify(out) == []
    saved = jax_ucp.save(_form(form, in_link, f"new{FORMS.index(form)}"), {"w": W})
    assert saved == os.path.join(in_link, f"new{FORMS.index(form)}")
    np.testing.assert_array_equal(jax_ucp.restore(saved)["w"], W)


@pytest.mark.parametrize("form", FORMS[:3])
def test_every_cli_command_reads_every_path_form(in_link, form, tmp_path):
    ck, run = _form(form, in_link, "ck"), _form(form, in_link, "run")
    env = {"COLUMNS": "300"}
    for args in (
        ["inspect", ck],
        ["verify", ck],
        ["plan", ck, "--mesh", "data=1"],
        ["diff", ck, os.path.join(in_link, "ck")],
        ["export", ck, str(tmp_path / "exported")],
        ["latest", run],
        ["verify", _form(form, in_link, "run/2/state")],
        ["convert", _form(form, in_link, "st"), str(tmp_path / "from-st")],
        ["convert", _form(form, in_link, "orb"), str(tmp_path / "from-orb")],
    ):
        r = runner.invoke(app, args, env=env)
        assert r.exit_code == 0, (args, r.output)
        assert "Invalid file path" not in r.output, (args, r.output)


@pytest.mark.parametrize("how", ["linked_parent", "link_to_checkpoint"])
def test_a_checkpoint_read_through_symlinks_reads_as_its_real_path(tmp_path, how):
    """A data disk mounted as a symlinked folder, or a link to the checkpoint itself: restore,
    ``verify`` and the CLI read exactly what the real path reads (they raised "shard file name
    '../../real/ck/arrays/w/c/0' has a '..' part", the reader's root spelled as given and its
    files spelled resolved), while a shard linked out of the checkpoint is still refused."""
    (tmp_path / "disk").mkdir()
    os.symlink(tmp_path / "disk", tmp_path / "mnt")
    tree = {"w": W, "b": np.ones(5, np.float32)}
    real = tmp_path / "disk" / "ck"
    if how == "linked_parent":
        through = str(tmp_path / "mnt" / "ck")
        jax_ucp.save(through, tree)  # saved through the link as well
    else:
        jax_ucp.save(real, tree)
        through = str(tmp_path / "ck-link")
        os.symlink(real, through)
    want = jax_ucp.restore(real)
    got = jax_ucp.restore(through)
    assert set(got) == set(want) == set(tree)
    for k in tree:
        np.testing.assert_array_equal(got[k], want[k])
        np.testing.assert_array_equal(got[k], tree[k])
    assert jax_ucp.verify(through) == []
    r = runner.invoke(app, ["verify", through], env={"COLUMNS": "300"})
    assert r.exit_code == 0, r.output
    shard = next(p for p in (real / "arrays").rglob("*") if p.is_file() and "/w/c" in str(p))
    move_out(shard, tmp_path / "elsewhere")  # a link below the checkpoint that leaves it
    outside = r"resolves to \S+/elsewhere/\S+, outside the checkpoint"
    with pytest.raises(jax_ucp.UCPError, match=outside):
        jax_ucp.restore(through)
    ((name, problem),) = jax_ucp.verify(through)
    assert name == "w" and re.search(outside, problem), problem
