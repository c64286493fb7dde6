"""The benchmarks' generated workloads are what their docstrings (and docs/benchmarks.md) say they are."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
import scale


@pytest.mark.parametrize("step", [2, 3, 7])
def test_scale_steps_change_half_the_positions_the_step_before_changed(step: int) -> None:
    """bench/scale.py: half of each step's positions changed at the step before too (Adam's momentum)."""
    total, changes = 50_000_000, 100_000
    before, now = scale._positions(step - 1, total, changes), scale._positions(step, total, changes)
    recurring = np.intersect1d(before, now).size / now.size
    assert 0.49 < recurring < 0.51
