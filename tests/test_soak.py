"""The fault soak (bench/soak.py) as a test: `pytest -m soak` runs it for SOAK_MINUTES minutes (default 2).

Not part of the default run; CI runs it as a stage of its own (.ci/run).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from bench.soak import run_soak


@pytest.mark.soak
@pytest.mark.integration
def test_soak_no_unverified_state_is_ever_served_and_every_subscriber_converges(tmp_path: Path) -> None:
    """One publisher, three subscriber daemons, retention with grace 0, the vLLM stand-in and a directory sink.

    SeaweedFS behind the fault proxy; every fault kind of docs/reliability.md at random.
    """
    report = run_soak(float(os.environ.get("SOAK_MINUTES", "2")), tmp_path)
    assert report["violations"] == [], report["violations"]
    assert report["exited"] == [], report["exited"]
    assert all(s["converged_s"] is not None for s in report["subscribers"].values()), report["subscribers"]
    minutes = float(os.environ.get("SOAK_MINUTES", "2"))
    assert sum(report["faults"].values()) >= 5 * minutes and report["engine_updates"] > 0
