"""The benchmarks' generated workloads are what their docstrings (and docs/benchmarks.md) say they are."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
import counting
import scale


@pytest.mark.parametrize("step", [2, 3, 7])
def test_scale_steps_change_half_the_positions_the_step_before_changed(step: int) -> None:
    """bench/scale.py: half of each step's positions changed at the step before too (Adam's momentum)."""
    total, changes = 50_000_000, 100_000
    before, now = scale._positions(step - 1, total, changes), scale._positions(step, total, changes)
    recurring = np.intersect1d(before, now).size / now.size
    assert 0.49 < recurring < 0.51


@pytest.mark.parametrize("size", [0, 1, 7, 100_000])
def test_counting_by_one_sort_gives_what_np_unique_gives(size: int) -> None:
    """bench/counting.py: the entropy bounds and the scale workload count as np.unique would."""
    rng = np.random.default_rng(size)
    a, b, c = rng.integers(-32768, 32768, size), rng.integers(0, 256, size), rng.integers(-8, 9, size)
    values, counts = np.unique(a, return_counts=True)
    got_values, got_counts = counting.unique_counts(a)
    assert np.array_equal(got_values, values) and np.array_equal(got_counts, counts)
    rows = np.stack([b, c, a], axis=1)
    expected = np.unique(rows, axis=0, return_counts=True)[1] if size else np.zeros(0, np.int64)
    assert np.array_equal(counting.row_counts(b, c, a), expected)
