"""The line budget of jax_ucp/ (issue 58): a ceiling per package of ``jax_ucp/_src`` and one for
the whole library, at the lines each holds now, no margin. A change that adds lines to a
package fails here until it removes as many elsewhere in that package, or raises the ceiling in
the same change, on purpose and said in its note (as ``MAX_PUBLIC_NAMES`` caps the public
names): new features pay for themselves."""

from __future__ import annotations

import pathlib

from tests.ucp_testing import REPO

ROOT = pathlib.Path(REPO) / "jax_ucp"
#: package of jax_ucp/_src (or "modules": its top-level modules; "public": jax_ucp/ outside
#: _src) -> the most lines its .py files may hold
CEILINGS = {
    "cli": 1756,
    "continuation": 2272,
    "exporters": 2478,
    "format": 2677,
    "importers": 17394,
    "language": 3231,
    "models": 2625,
    "multihost": 839,
    "orbax": 415,
    "restoring": 5027,
    "saving": 969,
    "sharding": 707,
    "store": 3565,
    "torchfiles": 3114,
    "writer": 1674,
    "modules": 4717,
    "public": 368,
}
#: the whole library: every .py file under jax_ucp/
TOTAL = 53828


def _lines(paths) -> int:
    return sum(len(p.read_bytes().splitlines()) for p in paths)


def counts() -> dict[str, int]:
    """Lines per budget entry, as the ceilings count them."""
    src = ROOT / "_src"
    out = {p.name: _lines(p.rglob("*.py")) for p in sorted(src.iterdir()) if p.is_dir()}
    out = {k: v for k, v in out.items() if v and k != "__pycache__"}
    out["modules"] = _lines(src.glob("*.py"))
    out["public"] = _lines(p for p in ROOT.rglob("*.py") if "_src" not in p.parts)
    return out


def test_each_package_stays_within_its_ceiling():
    found = counts()
    assert set(found) == set(CEILINGS), (
        f"packages without a ceiling or gone: {sorted(set(found) ^ set(CEILINGS))}"
    )
    over = {k: f"{found[k]} > {CEILINGS[k]}" for k in found if found[k] > CEILINGS[k]}
    assert not over, f"over the line budget (remove lines, or raise the ceiling on purpose): {over}"


def test_the_library_stays_within_its_total():
    total = _lines(ROOT.rglob("*.py"))
    assert total <= TOTAL, f"jax_ucp/ holds {total} lines, its budget is {TOTAL}"
    assert sum(CEILINGS.values()) == TOTAL, "the ceilings add up to the total"


def test_one_line_over_fails(tmp_path, monkeypatch):
    """The budget bites at +1: one package one line over its ceiling is refused."""
    found = counts()
    name = max(found, key=found.get)
    monkeypatch.setitem(CEILINGS, name, found[name] - 1)
    try:
        test_each_package_stays_within_its_ceiling()
    except AssertionError as e:
        assert name in str(e)
    else:
        raise AssertionError("a package one line over its ceiling passed")
