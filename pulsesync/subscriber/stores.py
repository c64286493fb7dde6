"""The stores a subscriber reads, in order of preference: a regional mirror first, the origin last.

Every manifest and object is verified whichever store it came from, so a mirror need not be
trusted: all it can do is lag, withhold or lie, and each sends the step to the next store in
the list, counted against the store that failed:

- it lags: its newest step was published more than `max_lag_seconds` ago and the next store's
  pointer moved since (a publisher gone quiet makes no store stale: the next store's pointer,
  a conditional GET, says nothing changed);
- it withholds: the step, a link of its chain or a payload is missing (a payload after
  `payload_wait_seconds`: a replica that copies in any order shows markers early);
- it lies: anything it serves fails verification.

The next sync starts from the first store again, so a subscriber returns to its mirror as soon as
the mirror catches up. Only the last store (the origin) takes the slow path after a failed
fast path; on any other, a failure moves to the next store instead, so one bad mirror never
starts a slow-path storm in its region.
"""

from __future__ import annotations

import datetime as dt
import logging
from dataclasses import dataclass, field

from pulsesync import metrics
from pulsesync.errors import PulseSyncError
from pulsesync.protocol.chain import ChainClient
from pulsesync.store import Store
from pulsesync.subscriber.poll import PointerPoll

log = logging.getLogger("pulsesync.subscriber")


@dataclass
class StoreSource:
    """One store of the list: its chain client, its pointer poll, and what it did for this subscriber."""

    store: Store
    chain: ChainClient
    poll: PointerPoll | None
    syncs: int = 0  # syncs whose state came through this store
    fallbacks: dict[str, int] = field(default_factory=dict)  # steps it sent to the next store, by reason

    @property
    def url(self) -> str:
        """The store's URL, as metrics and /healthz name it."""
        return self.store.url

    def age_of(self, step: int) -> float | None:
        """Seconds since a verified step was published; None if its manifest was not read."""
        published = self.chain.published_at.get(step)
        return None if published is None else (dt.datetime.now(dt.timezone.utc) - published).total_seconds()

    def fell_back(self, step: int | None, error: PulseSyncError) -> None:
        """Count a step this store did not deliver (taken from the next store instead)."""
        reason = type(error).__name__
        self.fallbacks[reason] = self.fallbacks.get(reason, 0) + 1
        metrics.STORE_FALLBACKS.labels(self.url, reason).inc()
        what = f"step {step}" if step is not None else "the newest step"
        log.warning("%s from the next store: %s did not deliver it (%s: %s)", what, self.url, reason, error)

    def delivered(self) -> None:
        """Count a sync whose state came through this store."""
        self.syncs += 1
        metrics.STORE_SYNCS.labels(self.url).inc()


async def next_store_moved(source: StoreSource) -> bool:
    """Whether the next store may hold something newer: its pointer changed, or it cannot tell (no pointer)."""
    return source.poll is None or await source.poll.worth_listing()
