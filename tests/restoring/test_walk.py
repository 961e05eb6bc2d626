"""``restore(path, mesh=, rules=, target=)`` walks its stages in order (issue 39): measured by
tools/restore_walk.py, as a module entered from another one, at most 6 returns to a room
already left (locate at the end, the source's second visit to read, the tree rebuilt, the mesh
checked twice, the options object's ``has_target`` and ``read_budget`` read where they are used)."""

import importlib.util
import os

import pytest

TOOL = os.path.join(os.path.dirname(__file__), "..", "..", "tools", "restore_walk.py")


@pytest.mark.timeout(60)
def test_a_restore_walks_its_stages_in_order():
    spec = importlib.util.spec_from_file_location("restore_walk", TOOL)
    assert spec is not None and spec.loader is not None
    walk = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(walk)
    stays = [s.partition(" ")[0] for s in walk.measure()]
    assert stays[:4] == [
        "_src/restoring/options.py",
        "_src/restoring/restore_entry.py",
        "_src/restoring/sources/__init__.py",  # the open stage: a manifest, or an import?
        "_src/restoring/locate.py",
    ], stays
    assert stays.count("_src/restoring/engine.py") == 1, stays
    assert stays.count("_src/restoring/requests.py") == 1, stays
    assert walk.returns(stays) <= 6, stays
