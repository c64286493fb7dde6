"""The anchor schedule (pure): anchors every `interval` steps, past the byte budget, and again after a failure."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from pulsesync.publisher.schedule import AnchorSchedule


@given(
    interval=st.integers(1, 12),
    budget=st.none() | st.integers(1, 5000),
    sizes=st.lists(st.integers(0, 1000), min_size=1, max_size=60),
)
def test_an_anchor_is_due_exactly_at_the_interval_or_past_the_budget(
    interval: int, budget: int | None, sizes: list[int]
) -> None:
    schedule = AnchorSchedule(interval, budget)
    since, spent = 0, 0
    for size in sizes:
        schedule.patch_committed(size)
        since, spent = since + 1, spent + size
        expected = since >= interval or (budget is not None and spent > budget)
        assert schedule.due is expected
        if schedule.due:
            schedule.anchor_started()
            since, spent = 0, 0


def test_a_failed_anchor_is_due_again_at_the_next_step() -> None:
    schedule = AnchorSchedule(interval=3)
    for _ in range(3):
        schedule.patch_committed(10)
    assert schedule.due
    schedule.anchor_started()
    schedule.anchor_failed()
    schedule.patch_committed(10)
    assert schedule.due  # one patch after the restart, but owed
    schedule.anchor_started()
    schedule.patch_committed(10)
    assert not schedule.due


def test_anchor_step_only_moves_forward_and_resume_counts_patches_since_it() -> None:
    schedule = AnchorSchedule(interval=50)
    schedule.anchor_committed(20)
    schedule.anchor_committed(10)  # a background anchor finishing late
    assert schedule.anchor_step == 20
    resumed = AnchorSchedule(interval=5)
    resumed.resume({0: {"anchor", "patch"}, 1: {"patch"}, 5: {"anchor", "patch"}, 6: {"patch"}, 7: {"patch"}})
    assert (resumed.anchor_step, resumed.since_anchor) == (5, 2)
    resumed.patch_committed(1)
    resumed.patch_committed(1)
    assert not resumed.due
    resumed.patch_committed(1)
    assert resumed.due
