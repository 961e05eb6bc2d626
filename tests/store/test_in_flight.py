"""store.InFlightBytes: the one byte budget of restore, verify and pipelined writes."""

import asyncio

import numpy as np
import pytest

import jax_ucp
from jax_ucp._src import store


@pytest.mark.timeout(10)
def test_make_room_releases_oldest_first_until_the_next_fits():
    window = store.InFlightBytes(10)
    finished = []
    for name, nbytes in [("a", 4), ("b", 4), ("c", 4), ("d", 9), ("e", 1)]:
        finished += [(name, list(window.make_room(nbytes)))]
        window.add(name, nbytes)
        assert window.bytes <= 10
    assert finished == [("a", []), ("b", []), ("c", ["a"]), ("d", ["b", "c"]), ("e", [])]
    assert list(window) == ["d", "e"] and window.bytes == 10
    assert list(window.drain()) == ["d", "e"] and window.bytes == 0 and len(window) == 0


@pytest.mark.timeout(10)
def test_an_item_larger_than_the_budget_goes_alone():
    window = store.InFlightBytes(8)
    window.add("small", 2)
    assert list(window.make_room(100)) == ["small"]
    window.add("huge", 100)
    assert window.bytes == 100 and list(window.make_room(1)) == ["huge"]


@pytest.mark.timeout(10)
def test_max_items_bounds_the_count():
    window = store.InFlightBytes(1 << 30, max_items=2)
    released = []
    for i in range(5):
        released += list(window.make_room(1))
        window.add(i, 1)
        assert len(window) <= 2
    assert released == [0, 1, 2] and list(window.drain()) == [3, 4]


@pytest.mark.timeout(10)
def test_budget_must_be_positive():
    with pytest.raises(ValueError, match=r"^max_bytes.*got 0\.$"):
        store.InFlightBytes(0)
    with pytest.raises(ValueError, match=r"^max_items.*got 0\.$"):
        store.InFlightBytes(1, max_items=0)


@pytest.mark.timeout(10)
def test_async_callers_await_inside_the_loop():
    async def run():
        window = store.InFlightBytes(2)
        done = []

        async def finish(task):
            done.append(await task)

        for i in range(4):
            for task in window.make_room(1):
                await finish(task)
            window.add(asyncio.ensure_future(asyncio.sleep(0, result=i)), 1)
        for task in window.drain():
            await finish(task)
        return done

    assert asyncio.run(run()) == [0, 1, 2, 3]


@pytest.mark.timeout(60)
def test_restore_and_verify_read_within_memory_budget(tmp_path, monkeypatch):
    """A restore starts a tensor's reads only once the ones in flight fit the budget with it."""
    tree = {f"t{i}": np.full(256, i, np.float32) for i in range(6)}  # 1 KiB each
    jax_ucp.save(tmp_path / "c", tree)
    peaks = []
    real_add = store.InFlightBytes.add

    def add(self, item, nbytes):
        real_add(self, item, nbytes)
        peaks.append((self.max_bytes, len(self), self.bytes))

    monkeypatch.setattr(store.InFlightBytes, "add", add)
    back = jax_ucp.restore(tmp_path / "c", memory_budget=2048)
    assert {k: v.tolist() for k, v in back.items()} == {k: v.tolist() for k, v in tree.items()}
    assert [p for p in peaks if p[0] == 2048] == [(2048, 1, 1024)] + [(2048, 2, 2048)] * 5
    peaks.clear()
    assert jax_ucp.verify(tmp_path / "c", memory_budget=3072) == []
    assert [p for p in peaks if p[0] == 3072] == [(3072, 1, 1024), (3072, 2, 2048)] + [
        (3072, 3, 3072)
    ] * 4
