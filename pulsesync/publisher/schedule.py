"""When the publisher anchors (pure): the anchor schedule, testable without a store.

An anchor is due every `interval` published steps, once the patch bytes since the last anchor
exceed `bytes_budget`, and at the next step after a due anchor failed. The first publish after a
start (unless resuming) and a step whose patch failed are anchors too, decided by the pipeline.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from pulsesync.protocol import layout


@dataclass
class AnchorSchedule:
    """Counts published steps and patch bytes since the last anchor; says when the next is due."""

    interval: int
    bytes_budget: int | None = None
    anchor_step: int = -1  # newest committed anchor of the chain
    since_anchor: int = 0  # published steps since the last anchor was started
    patch_bytes: int = 0  # patch bytes since then
    owed: bool = False  # a due anchor failed: try again at the next step

    def patch_committed(self, wire_bytes: int) -> None:
        """Count a committed patch."""
        self.since_anchor += 1
        self.patch_bytes += wire_bytes

    @property
    def due(self) -> bool:
        """Whether the step just committed should also be published as an anchor."""
        over_budget = self.bytes_budget is not None and self.patch_bytes > self.bytes_budget
        return self.owed or self.since_anchor >= self.interval or over_budget

    def anchor_started(self) -> None:
        """Start counting anew: an anchor is being published."""
        self.since_anchor, self.patch_bytes, self.owed = 0, 0, False

    def anchor_committed(self, step: int) -> None:
        """Record a committed anchor (background anchors may finish out of order)."""
        self.anchor_step = max(self.anchor_step, step)

    def anchor_failed(self) -> None:
        """A due anchor failed: it is due again at the next step."""
        self.owed = True

    def resume(self, ready: Mapping[int, set[layout.Kind]]) -> None:
        """Continue the schedule of a chain found in the store."""
        self.anchor_step = max((s for s, kinds in ready.items() if "anchor" in kinds), default=-1)
        self.since_anchor = sum(1 for s, kinds in ready.items() if "patch" in kinds and s > self.anchor_step)
