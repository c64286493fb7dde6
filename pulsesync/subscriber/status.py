"""What a subscriber reports on /healthz: the step served, failures in a row, paths taken, fallbacks by reason."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pulsesync.subscriber.paths import SyncPath


@dataclass
class SubscriberStatus:
    """What /healthz reports."""

    step: int = -1
    digest: str | None = None
    consecutive_failures: int = 0
    last_error: str | None = None  # of the failures in a row now (None once a sync succeeds)
    paths: dict[SyncPath, int] = field(default_factory=dict)
    fallbacks: dict[str, int] = field(default_factory=dict)
    stream_id: str | None = None
    rejected_markers: int = 0  # ready markers skipped because they do not verify
    last_rejected: str | None = None
    sync_running_seconds: float | None = None
    stores: dict[str, dict[str, Any]] = field(default_factory=dict)  # per store: syncs, fallbacks by reason
    engine_restarts: int = 0  # engines found restarted under the subscriber and sent the served state again
    diverged: str | None = None  # a scrub found the held state differs from its digest (rebuilt at the next sync)
