"""Orbax checkpoints in an object store (``s3://`` on the local moto server), written by Orbax's
own CheckpointManager: a step imports through its ``Storage`` (its names listed, its JSON records
read, its arrays opened by TensorStore on the bucket) bit for bit as the local step does and as
the state saved; the manager root's steps are listed there; a damaged array object is refused
naming it."""

from __future__ import annotations

import hashlib
import json
import os
import re
import uuid

import numpy as np
import orbax.checkpoint as ocp
import pytest

import jax_ucp
from jax_ucp._src.store.storage import object_store

pytestmark = pytest.mark.timeout(300)


def _state(step: int) -> dict:
    rng = np.random.default_rng(step)
    return {
        "params": {
            "w": rng.standard_normal((48, 16)).astype(np.float32),
            "b": rng.standard_normal(16).astype(np.float32),
        },
        "opt": {
            "mu": rng.standard_normal(8).astype(np.float16),
            "count": np.array([step], np.int32),
        },
    }


def _saved(root: str, ocdbt: bool) -> dict[int, dict]:
    """A CheckpointManager root of steps 1, 2, 3 (one PyTree item, ``state``); their states."""
    options = ocp.CheckpointManagerOptions(enable_async_checkpointing=False)
    handlers = {"state": ocp.PyTreeCheckpointHandler(use_ocdbt=ocdbt)}
    with ocp.CheckpointManager(root, options=options, item_handlers=handlers) as mngr:
        for step in (1, 2, 3):
            mngr.save(step, args=ocp.args.Composite(state=ocp.args.PyTreeSave(_state(step))))
    return {step: _state(step) for step in (1, 2, 3)}


def _upload(root: str, server, monkeypatch, drop=(), cut: dict | None = None) -> str:
    """Every file under ``root`` as objects of a fresh prefix of the ``server`` fixture's bucket
    (but ``drop``; ``cut``: a file name -> its bytes kept); the prefix's URL."""
    env, bucket = server
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    url = f"{bucket}/orbax-{uuid.uuid4().hex[:8]}"
    for folder, _, names in os.walk(root):
        for name in names:
            rel = os.path.relpath(os.path.join(folder, name), root).replace(os.sep, "/")
            with open(os.path.join(folder, name), "rb") as f:
                data = f.read()
            if rel not in drop:
                object_store.write(url, rel, data[: (cut or {}).get(rel, len(data))])
    return url


def _flat(tree) -> dict[str, bytes]:
    return {
        "/".join(str(getattr(k, "key", k)) for k in path): np.asarray(v).tobytes()
        for path, v in __import__("jax").tree_util.tree_flatten_with_path(tree)[0]
    }


def _files(out) -> dict[str, str]:
    """sha256 of every file a convert wrote, ucp.json without its save's identity and source."""
    hashes = {}
    for folder, _, names in os.walk(out):
        for name in names:
            with open(os.path.join(folder, name), "rb") as f:
                data = f.read()
            if name == "ucp.json":
                manifest = json.loads(data)
                for k in ("save_id", "created_at", "source"):
                    manifest.pop(k, None)
                data = json.dumps(manifest, sort_keys=True).encode()
            hashes[os.path.relpath(os.path.join(folder, name), out)] = hashlib.sha256(
                data
            ).hexdigest()
    return hashes


@pytest.mark.parametrize("ocdbt", [True, False])
def test_a_remote_orbax_step_imports_as_the_local_one(tmp_path, s3_server, monkeypatch, ocdbt):
    root = str(tmp_path / "run")
    live = _saved(root, ocdbt)
    url = _upload(root, s3_server, monkeypatch)
    local = jax_ucp.restore(os.path.join(root, "2"))
    remote = jax_ucp.restore(f"{url}/2")
    assert _flat(remote) == _flat(local) == _flat(live[2])
    jax_ucp.convert(f"{url}/2", str(tmp_path / "from_s3"))
    jax_ucp.convert(os.path.join(root, "2"), str(tmp_path / "from_disk"))
    assert _files(tmp_path / "from_s3") == _files(tmp_path / "from_disk")
    assert _flat(jax_ucp.restore(str(tmp_path / "from_s3"))) == _flat(live[2])


def test_a_remote_orbax_manager_root_lists_its_steps(tmp_path, s3_server, monkeypatch):
    root = str(tmp_path / "run")
    live = _saved(root, ocdbt=True)
    url = _upload(root, s3_server, monkeypatch)
    assert jax_ucp.latest_step(url) == 3 == jax_ucp.latest_step(root)
    assert _flat(jax_ucp.restore(url, step=2)) == _flat(live[2])
    assert _flat(jax_ucp.restore(url)) == _flat(live[3])


@pytest.mark.parametrize("damage", ["missing", "truncated"])
def test_a_remote_orbax_step_with_a_damaged_array_file_is_refused_naming_it(
    tmp_path, s3_server, monkeypatch, damage
):
    root = str(tmp_path / "run")
    _saved(root, ocdbt=False)
    chunk = "3/state/params.w/0.0"
    with open(os.path.join(root, chunk), "rb") as f:
        size = len(f.read())
    url = _upload(
        root,
        s3_server,
        monkeypatch,
        drop=(chunk,) if damage == "missing" else (),
        cut={chunk: size // 2},
    )
    with pytest.raises(jax_ucp.SourceError, match=re.escape(f"{url}/3/state/params.w")) as e:
        jax_ucp.convert(f"{url}/3", str(tmp_path / "out"))
    assert "params.w" in str(e.value) and "0.0" in str(e.value), e.value
