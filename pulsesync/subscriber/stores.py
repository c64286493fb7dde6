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
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

from pulsesync import metrics
from pulsesync.errors import (
    ConfigError,
    DeadlineError,
    EngineError,
    LocalWriteError,
    NotFoundError,
    NothingPublishedError,
    PulseSyncError,
    ReplayError,
    StaleStoreError,
)
from pulsesync.protocol.chain import ChainClient
from pulsesync.store import Store
from pulsesync.subscriber.config import SubscriberConfig
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


@dataclass(frozen=True)
class Offer:
    """A store chosen for one attempt of a sync, and what it offers."""

    source: StoreSource
    target: int  # the step to reach through it
    newest: int  # the newest step it listed
    last: bool  # the last store: its failure is the sync's, and only it takes the slow path after a failed fast one
    following: bool  # no step was asked for: a withheld object may be gone around (`paths.slow`)
    up_to_date: bool = False  # behind the held step, within max_lag_seconds: nothing newer comes from it


class StoreList:
    """The stores in order of preference, and every decision that is about them, not about a path."""

    def __init__(self, sources: list[StoreSource], max_lag_seconds: float, pinned_step: int | None) -> None:
        self.sources = sources
        self.max_lag_seconds = max_lag_seconds
        self.pinned_step = pinned_step  # the configured step: every store is asked for it
        self.read = sources[0]  # the store the last sync read

    @classmethod
    def open(cls, stores: list[Store], trusted: Mapping[str, Ed25519PublicKey], config: SubscriberConfig) -> StoreList:
        """A subscriber's stores, each with its chain client and its pointer poll."""
        several = len(stores) > 1
        # With several stores the first is listed at least every max_lag_seconds: a lagging one is noticed.
        first_every = min(config.list_every_seconds, config.max_lag_seconds) if several else config.list_every_seconds
        sources = []
        for i, store in enumerate(stores):
            chain = ChainClient(
                store,
                trusted,
                threads=config.codec.threads,
                stream_id=config.stream_id,
                speculate=True,
                payload_wait_seconds=config.payload_wait_seconds,
            )
            every = first_every if i == 0 else config.list_every_seconds
            poll = PointerPoll(store, every, config.advisory_deadline_seconds) if config.poll_pointer else None
            sources.append(StoreSource(store, chain, poll))
        return cls(sources, config.max_lag_seconds, config.step)

    @property
    def chain(self) -> ChainClient:
        """The chain client of the store the last sync read."""
        return self.read.chain

    @property
    def bytes_downloaded(self) -> int:
        """Bytes read from every store since start."""
        return sum(source.chain.fetcher.bytes_downloaded for source in self.sources)

    def pin_stream(self, stream_id: str) -> None:
        """Follow this stream on every store: later manifests must be of it, from any store."""
        for source in self.sources:
            source.chain.pin_stream(stream_id)

    @property
    def stream_id(self) -> str | None:
        """The stream followed (None until one is pinned)."""
        return self.sources[-1].chain.stream_id

    async def choose_stream(self) -> None:
        """A cold subscriber with several stores follows the last store's newest stream (a mirror never chooses)."""
        if len(self.sources) > 1 and self.stream_id is None:
            self.pin_stream(await trusted_stream(self.sources))

    def attempt(self, target: int | None) -> StoreAttempt:
        """One sync's walk down the list, to `target` (None: the configured step, else the newest)."""
        return StoreAttempt(self, target)

    def report(self) -> dict[str, dict[str, Any]]:
        """What each store did for this subscriber, as /healthz shows it."""
        return {
            s.url: {"syncs": s.syncs, "fallbacks": dict(s.fallbacks), "rejected_markers": len(s.chain.rejected)}
            for s in self.sources
        }


class StoreAttempt:
    """One sync's walk down the store list: `offer()` the next store's step, then `failed()` or `delivered()`.

    A store that withheld or lied sends the step it offered (not the next store's newest) to the
    next store, unless the target is set or pinned; one that lagged, the next store's newest.
    """

    def __init__(self, stores: StoreList, target: int | None) -> None:
        self._stores = stores
        self._left = list(zip(stores.sources, [*stores.sources[1:], None], strict=True))
        self.target = target
        self._lagging: StoreSource | None = None
        self._downloaded = 0
        self._rejected: set[str] = set()

    @property
    def following(self) -> bool:
        """No step was asked for: the store's newest is the target."""
        return self.target is None and self._stores.pinned_step is None

    async def offer(self, held_step: int) -> Offer:
        """The next store that offers a step to sync to; a store that cannot is passed (the last one raises)."""
        while True:
            source, after = self._left[0]
            self._downloaded, source.offered = source.chain.fetcher.bytes_downloaded, None
            self._rejected = set(source.chain.rejected)
            try:
                return await self._offer(source, after, held_step)
            except PulseSyncError as e:
                self.failed(e)

    async def _offer(self, source: StoreSource, after: StoreSource | None, held_step: int) -> Offer:
        self._stores.read = source
        newest = await source.chain.newest_verified()
        if newest is None:
            if source.chain.last_rejection is not None:  # say why: e.g. every marker is signed by an unknown key
                raise source.chain.last_rejection
            raise NothingPublishedError(f"{source.url}: no step published yet")
        ready = source.chain.listed  # newest_verified() just listed: one LIST per sync
        source.offered = newest
        if source.poll is not None:
            source.poll.listed()
        following = self.following
        if after is not None and following:
            behind = await source.lags(newest, after, self._stores.max_lag_seconds)
            if behind is not None:
                raise StaleStoreError(
                    f"{source.url}: still at step {newest} {behind:.0f} s after {after.url} moved on "
                    f"(max_lag_seconds {self._stores.max_lag_seconds:g})"
                )
            if newest < held_step:  # a store behind the held step, within the bound: nothing newer here
                return Offer(source, held_step, newest, last=False, following=True, up_to_date=True)
        pinned = self._stores.pinned_step
        target = self.target if self.target is not None else pinned if pinned is not None else newest
        if target not in ready:
            raise NotFoundError(f"{source.url}: step {target} is not ready (newest is {newest})")
        if target < held_step:
            raise ReplayError(f"step {target} is older than the held step {held_step}; subscribers never go back")
        return Offer(source, target, newest, last=after is None, following=following)

    def failed(self, error: PulseSyncError) -> None:
        """The store under way did not deliver: raise when it was the last or no store is at fault; else pass it."""
        source, after = self._left[0]
        self._count(source)
        if after is None or isinstance(error, _NOT_THE_STORES_FAULT):
            raise error
        source.fell_back(self.target, error)
        self._lagging = source if isinstance(error, StaleStoreError) else None
        if self._lagging is None and self.following:
            self.target = source.offered
        self._left.pop(0)

    def delivered(self, result: SyncResult) -> None:
        """The store under way delivered (or had nothing newer)."""
        source, _ = self._left[0]
        self._count(source)
        if result.path != SyncPath.UP_TO_DATE:
            source.delivered()
        lagging = self._lagging
        if lagging is not None and lagging.behind_at is not None and result.step <= lagging.behind_at:
            lagging.caught_up()  # the next store had nothing newer: its pointer moved for nothing

    def _count(self, source: StoreSource) -> None:
        metrics.BYTES_DOWNLOADED.inc(source.chain.fetcher.bytes_downloaded - self._downloaded)
        count_rejections(source, self._rejected)


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
