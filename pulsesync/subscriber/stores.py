"""The stores a subscriber reads, in order of preference: a regional mirror first, the origin last.

Every manifest and object is verified whichever store it came from, so a mirror need not be
trusted: all it can do is lag, withhold or lie, and each sends the step to the next store in
the list, counted against the store that failed:

- it lags: the next store's pointer named a newer step more than `max_lag_seconds` ago and
  this store has nothing newer since. The next store's pointer (a conditional GET) is read only while this
  store's newest step is older than `max_lag_seconds`: while a run publishes and the mirror
  keeps up, the origin hears nothing from the subscriber, and a publisher gone quiet makes no
  store stale (its pointer does not move);
- it withholds: the step, a link of its chain or a payload is missing (a payload after
  `payload_wait_seconds`: a replica that copies in any order shows markers early);
- it lies: anything it serves fails verification.

A step a store withheld or lied about is taken from the next store at that step, not the next
store's newest: the sync after goes back to the first store for what follows.

The stream a subscriber follows is never chosen by a mirror: it is the configured `stream_id`,
else the stream of the cache's own signed marker, else that of the last store's newest step (the
origin, the store trusted most). Every store's markers of another stream are then refused and
counted against that store (`pulsesync_store_markers_rejected_total`), whatever the order of starts.

The next sync starts from the first store again, so a subscriber returns to its mirror as soon as
the mirror catches up. Only the last store (the origin) takes the slow path after a failed
fast path; on any other, a failure moves to the next store instead, so one bad mirror never
starts a slow-path storm in its region.
"""

from __future__ import annotations

import datetime as dt
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from pulsesync import metrics
from pulsesync.errors import (
    ConfigError,
    DeadlineError,
    EngineError,
    LocalWriteError,
    NothingPublishedError,
    PulseSyncError,
    StaleStoreError,
)
from pulsesync.protocol.chain import ChainClient
from pulsesync.store import Store
from pulsesync.subscriber.paths import SyncPath, SyncResult
from pulsesync.subscriber.poll import PointerPoll

log = logging.getLogger("pulsesync.subscriber")
# Failures no other store would change: raised at once, not taken to the next store.
_NOT_THE_STORES_FAULT = (EngineError, ConfigError, LocalWriteError, DeadlineError)


@dataclass
class StoreSource:
    """One store of the list: its chain client, its pointer poll, and what it did for this subscriber."""

    store: Store
    chain: ChainClient
    poll: PointerPoll | None
    syncs: int = 0  # syncs whose state came through this store
    fallbacks: dict[str, int] = field(default_factory=dict)  # steps it sent to the next store, by reason
    offered: int | None = None  # the newest step it listed in the sync under way
    behind_since: float | None = None  # monotonic time the next store was seen to move past this one
    behind_at: int | None = None  # this store's newest step then

    @property
    def url(self) -> str:
        """The store's location (URL, and endpoint), as logs, metrics and /healthz name it."""
        return self.store.location

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
        log.warning("%s did not deliver %s (%s: %s); reading the next store", self.url, what, reason, error)

    def delivered(self) -> None:
        """Count a sync whose state came through this store."""
        self.syncs += 1
        metrics.STORE_SYNCS.labels(self.url).inc()

    async def lags(self, newest: int, after: StoreSource, max_lag: float) -> float | None:
        """Seconds this store has been behind the next one, when more than `max_lag`; else None."""
        if self.behind_at is not None and newest > self.behind_at:
            self.behind_since = self.behind_at = None  # it moved on since
        age = self.age_of(newest)
        if age is None or age <= max_lag:
            self.behind_since = self.behind_at = None
            return None
        if self.behind_since is None and (after.poll is None or await after.poll.names_newer(newest)):
            self.behind_since, self.behind_at = time.monotonic(), newest
        behind = None if self.behind_since is None else time.monotonic() - self.behind_since
        return behind if behind is not None and behind > max_lag else None

    def caught_up(self) -> None:
        """The next store had nothing newer than this one: it is not behind."""
        self.behind_since = self.behind_at = None


async def trusted_stream(sources: list[StoreSource]) -> str:
    """The stream of the last store's newest verified step: what a cold subscriber follows on every store."""
    origin = sources[-1].chain
    newest = await origin.newest_verified()
    if newest is None:
        if origin.last_rejection is not None:
            raise origin.last_rejection
        raise NothingPublishedError(f"{sources[-1].url}: no step published yet")
    return (await origin.commit_manifest(newest)).stream_id


def count_rejections(source: StoreSource, before: set[str]) -> None:
    """Count against the store the markers its chain refused since `before` (another stream's, forged, replayed)."""
    for key in source.chain.rejected.keys() - before:
        metrics.STORE_MARKERS_REJECTED.labels(source.url, source.chain.rejected[key].partition(":")[0]).inc()


Attempt = Callable[[StoreSource, "StoreSource | None", "int | None"], Awaitable[SyncResult]]


async def through_stores(sources: list[StoreSource], target: int | None, pinned: bool, attempt: Attempt) -> SyncResult:
    """`attempt(store, next store, target)` on each store in order until one delivers; the last one's failure raises.

    A store that withheld or lied sends the step it offered (not the next store's newest) to the
    next store, unless the target is set or pinned; one that lagged, the next store's newest.
    """
    lagging: StoreSource | None = None
    for source, after in zip(sources, [*sources[1:], None], strict=True):
        downloaded, source.offered = source.chain.fetcher.bytes_downloaded, None
        rejected = set(source.chain.rejected)
        try:
            result = await attempt(source, after, target)
        except PulseSyncError as e:
            if after is None or isinstance(e, _NOT_THE_STORES_FAULT):
                raise
            source.fell_back(target, e)
            lagging = source if isinstance(e, StaleStoreError) else None
            if lagging is None and target is None and not pinned:
                target = source.offered
            continue
        finally:
            metrics.BYTES_DOWNLOADED.inc(source.chain.fetcher.bytes_downloaded - downloaded)
            count_rejections(source, rejected)
        if result.path != SyncPath.UP_TO_DATE:
            source.delivered()
        if lagging is not None and lagging.behind_at is not None and result.step <= lagging.behind_at:
            lagging.caught_up()  # the next store had nothing newer: its pointer moved for nothing
        return result
    raise AssertionError("unreachable")  # pragma: no cover
