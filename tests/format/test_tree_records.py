"""A saved tree's records that name classes outside the allow-list or private attributes (issue
56): an NNX tree recording ``os:system``, ``subprocess:Popen`` or a dotted attribute path as a
node's class came back from ``restore`` silently as a plain dict (only ``verify`` and
``inspect`` said so); metadata naming ``__class__`` or ``_trace_state`` was kept, to be set on
the Variable. Now the restore warns, naming the nodes, and such metadata is refused."""

from __future__ import annotations

import json

import numpy as np
import pytest

import jax_ucp
from jax_ucp.errors import CheckpointError

pytestmark = pytest.mark.timeout(60)


def _saved_with(tmp_path, **node_fields):
    path = tmp_path / "c"
    jax_ucp.save(path, {"cmd": {"a": np.arange(2.0), "b": 1}, "w": np.arange(3.0)})
    d = json.loads((path / "ucp.json").read_text())
    node = next(child for name, _, child in d["tree"]["children"] if name == "cmd")
    node.update(node_fields)
    (path / "ucp.json").write_text(json.dumps(d))
    return path


@pytest.mark.parametrize("cls", ["os:system", "subprocess:Popen", "os:path.join.__globals__"])
def test_a_class_outside_the_allow_list_is_a_warning_naming_the_node_never_a_silent_dict(
    tmp_path, cls
):
    path = _saved_with(tmp_path, type="object", **{"class": cls})
    with pytest.warns(
        UserWarning, match=rf"Tree node 'cmd': class '{cls}' is not in the allow-list"
    ):
        out = jax_ucp.restore(path)
    assert type(out["cmd"]) is dict and sorted(out["cmd"]) == ["a", "b"]


@pytest.mark.parametrize("key", ["__class__", "_trace_state", "__dict__"])
def test_metadata_naming_a_private_attribute_is_refused(tmp_path, key):
    path = _saved_with(tmp_path, metadata={key: 1, "sharding": None})
    with pytest.raises(CheckpointError, match=rf"tree node 'cmd': metadata names \['{key}'\]"):
        jax_ucp.restore(path)
    with pytest.raises(CheckpointError, match=r"private or special attributes"):
        jax_ucp.inspect(path)
