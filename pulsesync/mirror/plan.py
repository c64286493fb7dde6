"""Which ready markers a mirror copies next, in commit order (pure).

A mirror copies the steps committed after the newest one its target holds, each commit before
the anchor added to its step; an anchor added later to a step the target holds is copied too.
A target that holds no step starts at the origin's newest anchor, the first step a subscriber
of the target can rebuild. Steps older than the target's newest are never copied again, so
the target's own retention is not undone.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping

from pulsesync.protocol import layout


def marker_step(key: str) -> int | None:
    """The step of a ready marker key (a commit, a legacy marker or an added anchor), or None."""
    if (entry := layout.parse_ready_key(key)) is not None:
        return entry.step
    return layout.parse_anchor_ready_key(key)


def to_copy(origin: Mapping[str, int], target: Collection[str], start: int) -> list[str]:
    """The origin's marker keys (key -> step) the target lacks, from step `start` on, in the order to copy them.

    Commits (ready/) go in step order; an added anchor (ready-anchors/) goes after its step's
    commit, and only where the target holds that commit or gets it in this same list.
    """
    held = {marker_step(key) for key in target if key.startswith(layout.READY_PREFIX)}
    commits = sorted((step, key) for key, step in origin.items() if key.startswith(layout.READY_PREFIX))
    ordered = [(step, 0, key) for step, key in commits if step >= start and key not in target]
    held |= {step for step, _, _ in ordered}
    anchors = [(step, 1, key) for key, step in origin.items() if key.startswith(layout.ANCHOR_READY_PREFIX)]
    ordered += [(step, rank, key) for step, rank, key in anchors if step in held and key not in target]
    return [key for _, _, key in sorted(ordered)]


def first_step(newest_target: int | None, origin_anchors: Collection[int], newest_origin: int) -> int:
    """Where copying starts: after the target's newest step, else at the origin's newest anchor (else step 0)."""
    if newest_target is not None:
        return newest_target + 1
    return max((s for s in origin_anchors if s <= newest_origin), default=0)
