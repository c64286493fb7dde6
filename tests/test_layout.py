"""Store key layout: the protocol's names, zero-padded so lexicographic order is step order."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pulsesync.protocol import layout


def test_key_names_match_the_protocol() -> None:
    assert layout.patch_key(42, "a1b2") == "patches/000000000042/patch-a1b2.bin"
    assert layout.anchor_prefix(50) == "anchors/000000000050/"
    assert layout.anchor_dir(50, "a1b2") == "anchors/000000000050/a1b2/"
    assert layout.ready_key(7, "patch") == "ready/000000000007.patch.json"
    assert layout.ready_key(7, "anchor") == "ready/000000000007.anchor.json"


@given(st.lists(st.integers(0, layout.MAX_STEP), min_size=2, max_size=50))
def test_listing_order_is_step_order(steps: list[int]) -> None:
    keys = [layout.ready_key(s, "patch") for s in steps]
    assert [layout.parse_ready_key(k).step for k in sorted(keys)] == sorted(steps)


def test_parse_ready_key_round_trip_and_rejects_others() -> None:
    for kind in ("patch", "anchor"):
        entry = layout.parse_ready_key(layout.ready_key(123, kind))
        assert entry == layout.ReadyEntry(123, kind)
    for key in [
        "ready/12.patch.json",
        "ready/000000000001.delta.json",
        "patches/000000000001/patch.bin",
        "000000000001.patch.json",
        "ready/000000000001.patch.json.tmp",
    ]:
        assert layout.parse_ready_key(key) is None


def test_step_bounds() -> None:
    with pytest.raises(ValueError):
        layout.patch_key(-1, "a1")
    with pytest.raises(ValueError):
        layout.ready_key(layout.MAX_STEP + 1, "patch")


@pytest.mark.parametrize("run_id", ["", "../x", "A1", "a/b", "x" * 33])
def test_run_ids_cannot_escape_the_step_folder(run_id: str) -> None:
    with pytest.raises(ValueError):
        layout.patch_key(1, run_id)
    with pytest.raises(ValueError):
        layout.anchor_dir(1, run_id)
