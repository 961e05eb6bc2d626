"""benchmarks/ab.py's table and verdict (the logic, not timings): a regression is called only
when the two trees' rounds do not overlap."""

from __future__ import annotations

import importlib.util
import os

import pytest

_PATH = os.path.join(os.path.dirname(os.path.dirname(__file__)), "benchmarks", "ab.py")


@pytest.fixture(scope="module")
def ab():
    spec = importlib.util.spec_from_file_location("ab_under_test", _PATH)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_verdict_needs_disjoint_rounds(ab):
    assert ab.verdict([1.0, 1.1, 1.2], [1.3, 1.4, 1.5]) == "regression beyond spread"
    assert ab.verdict([1.3, 1.4, 1.5], [1.0, 1.1, 1.2]) == "improvement beyond spread"
    assert ab.verdict([1.0, 1.1, 1.3], [1.25, 1.4, 1.5]) == "within noise"  # overlapping
    assert ab.verdict([1.0, 1.1], [2.0, 2.1]) == "too few rounds for a verdict"
    assert ab.verdict([1.0, 1.0, 1.0], [1.0, 1.0, 1.0]) == "within noise"
    assert ab.chance(3) == 1 / 20 and ab.chance(5) == 1 / 252


def test_table_rows_medians_ratio_and_spread(ab):
    text = ab.table(
        {
            "first save 64 MiB (call)": {"base": [0.2, 0.3, 0.25], "work": [0.4, 0.5, 0.45]},
            "jax-ucp --version (process)": {"base": [0.5, 0.4, 0.45], "work": [0.3, 0.6, 0.45]},
        },
        base_name="4abeab2",
    )
    lines = text.splitlines()
    assert lines[0].startswith("| row | 4abeab2 median | work median | work/base |")
    assert lines[2] == (
        "| first save 64 MiB (call) | 250 ms | 450 ms | 1.80 | 200 ms–300 ms; 400 ms–500 ms "
        "| regression beyond spread |"
    )
    assert lines[3] == (
        "| jax-ucp --version (process) | 450 ms | 450 ms | 1.00 | 400 ms–500 ms; 300 ms–600 ms "
        "| within noise |"
    )


def test_a_row_failed_in_one_tree_is_shown_not_compared(ab):
    text = ab.table(
        {
            "direct DCP restore 1 GB (call)": {
                "base": "TypeError: unexpected keyword\nmore",
                "work": [2.0],
            }
        }
    )
    row = text.splitlines()[2]
    assert row == (
        "| direct DCP restore 1 GB (call) | failed: TypeError: unexpected keyword | 2000 ms | — | — "
        "| not compared |"
    )
