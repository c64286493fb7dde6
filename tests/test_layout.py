"""Store key layout: the protocol's names, zero-padded so lexicographic order is step order."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pulsesync.protocol import layout


def test_key_names_match_the_protocol() -> None:
    assert layout.patch_key(42, "a1b2") == "patches/000000000042/patch-a1b2.bin"
    assert layout.anchor_prefix(50) == "anchors/000000000050/"
    assert layout.anchor_dir(50, "a1b2") == "anchors/000000000050/a1b2/"
    assert layout.commit_key(7) == "ready/000000000007.json"
    assert layout.anchor_ready_key(7) == "ready-anchors/000000000007.json"
    assert layout.legacy_ready_key(7, "patch") == "ready/000000000007.patch.json"
    assert layout.legacy_ready_key(7, "anchor") == "ready/000000000007.anchor.json"


@given(st.lists(st.integers(0, layout.MAX_STEP), min_size=2, max_size=50))
def test_listing_order_is_step_order(steps: list[int]) -> None:
    keys = [layout.commit_key(s) for s in steps]
    assert [layout.parse_ready_key(k).step for k in sorted(keys)] == sorted(steps)


def test_parse_ready_key_round_trip_and_rejects_others() -> None:
    assert layout.parse_ready_key(layout.commit_key(123)) == layout.ReadyEntry(123, None)
    for kind in ("patch", "anchor"):
        entry = layout.parse_ready_key(layout.legacy_ready_key(123, kind))
        assert entry == layout.ReadyEntry(123, kind)
    assert layout.parse_anchor_ready_key(layout.anchor_ready_key(123)) == 123
    assert layout.parse_anchor_ready_key(layout.commit_key(123)) is None
    assert layout.parse_tombstone_key(layout.tombstone_key(123, "anchor")) == (123, "anchor")
    for key in [
        "ready/12.patch.json",
        "ready/000000000001.delta.json",
        "patches/000000000001/patch.bin",
        "000000000001.patch.json",
        "ready/000000000001.patch.json.tmp",
    ]:
        assert layout.parse_ready_key(key) is None


def test_next_patch_key_keeps_the_run_and_takes_only_patch_keys() -> None:
    assert layout.next_patch_key(layout.patch_key(7, "ab12"), 8) == layout.patch_key(8, "ab12")
    for key in [
        layout.part_key(7, "ab12", 0),  # a sharded step's part
        layout.anchor_dir(7, "ab12") + "model.safetensors",
        "patches/000000000007/patch-AB.bin",
        "patches/000000000007/patch-ab12.bin.tmp",
        "x/patches/000000000007/patch-ab12.bin",
    ]:
        assert layout.next_patch_key(key, 8) is None


def test_step_bounds() -> None:
    with pytest.raises(ValueError):
        layout.patch_key(-1, "a1")
    with pytest.raises(ValueError):
        layout.commit_key(layout.MAX_STEP + 1)


@pytest.mark.parametrize("run_id", ["", "../x", "A1", "a/b", "x" * 33])
def test_run_ids_cannot_escape_the_step_folder(run_id: str) -> None:
    with pytest.raises(ValueError):
        layout.patch_key(1, run_id)
    with pytest.raises(ValueError):
        layout.anchor_dir(1, run_id)


@st.composite
def chains(draw: st.DrawFn) -> tuple[dict[int, int], set[int], int]:
    """Patch links (step -> base_step < step, some missing), anchor steps, and a start step."""
    steps = sorted(draw(st.sets(st.integers(0, 60), min_size=1, max_size=30)))
    bases = {
        s: draw(st.sampled_from([b for b in steps if b < s])) for s in steps if s > steps[0] and draw(st.booleans())
    }
    anchors = set(draw(st.lists(st.sampled_from(steps), max_size=5)))
    return bases, anchors, draw(st.sampled_from(steps))


@given(chains())
def test_walk_follows_links_to_the_first_stop_or_the_first_gap(chain: tuple[dict[int, int], set[int], int]) -> None:
    bases, anchors, start = chain
    walk = layout.walk_known(start, anchors.__contains__, bases)
    path = [*walk.patches, walk.end]
    assert path[0] == start
    assert all(bases[a] == b for a, b in itertools.pairwise(path))  # every step passed through is a link
    assert not any(s in anchors for s in walk.patches)  # it stops at the first anchor
    if walk.complete:
        assert walk.end in anchors
    else:
        assert walk.end not in anchors and walk.end not in bases  # a gap: no link to follow


def test_walk_asks_the_driver_for_each_base_in_turn() -> None:
    walker = layout.walk_links(9, lambda s: s <= 4)
    assert next(walker) == 9
    assert walker.send(7) == 7
    with pytest.raises(StopIteration) as done:
        walker.send(4)
    assert done.value.value == layout.Walk([9, 7], 4, complete=True)
    walker = layout.walk_links(9, lambda s: s <= 4)
    next(walker)
    with pytest.raises(StopIteration) as done:
        walker.send(None)
    assert done.value.value == layout.Walk([], 9, complete=False)
