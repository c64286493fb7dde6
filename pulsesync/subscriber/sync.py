"""One sync: a store chosen from the list (`stores.py`), the way to the target (`paths.py`), delivery.

The fast and chain paths patch the served state in place inside one `held.patching()` scope that
also delivers and serves it, so the patch, the sinks' take and the rollback on a failure all
happen under the same lease. A failure on the fast or chain path falls back to the slow path
(on the last store; any other store passes the step to the next) and is counted by reason.
"""

from __future__ import annotations

import datetime as dt
import logging
import time

from pulsesync import metrics
from pulsesync.errors import (
    ConfigError,
    DeadlineError,
    EngineError,
    LocalWriteError,
    MissingReferenceError,
    NotFoundError,
    PulseSyncError,
    StoreError,
)
from pulsesync.subscriber import paths
from pulsesync.subscriber.cache_writer import CacheWriter
from pulsesync.subscriber.delivery import Delivery
from pulsesync.subscriber.held import HeldState
from pulsesync.subscriber.paths import Staged, SyncPath, SyncResult
from pulsesync.subscriber.status import SubscriberStatus
from pulsesync.subscriber.stores import Offer, StoreList

log = logging.getLogger("pulsesync.subscriber")
_NOT_A_VERIFICATION_FAILURE = (
    StoreError,
    NotFoundError,
    EngineError,
    ConfigError,
    LocalWriteError,
    DeadlineError,
    MissingReferenceError,  # a history-coded patch after a restart: the slow path rebuilds the history
)


class Sync:
    """Moves the held state forward through the store list and serves what every sink took."""

    def __init__(
        self,
        stores: StoreList,
        held: HeldState,
        delivery: Delivery,
        cache: CacheWriter | None,
        status: SubscriberStatus,
    ) -> None:
        self.stores = stores
        self.held = held
        self.delivery = delivery
        self.cache = cache
        self.status = status

    async def run(self, target: int | None) -> SyncResult:
        """One sync to `target` (None: the configured step, else the newest verified one), from the first store
        of the list that delivers; the last store's failure is raised."""
        t0, before = time.perf_counter(), self.stores.bytes_downloaded
        if self.cache is not None:
            await self.cache.wait()
        await self.stores.choose_stream()
        attempt = self.stores.attempt(target)
        try:
            while True:
                offer = await attempt.offer(self.held.step)
                try:
                    result = await self._through(offer, t0)
                except PulseSyncError as e:
                    attempt.failed(e)
                    continue
                attempt.delivered(result)
                break
        finally:  # what the store read last refused, also when it raised
            chain = self.stores.chain
            self.status.rejected_markers = len(chain.rejected)
            self.status.last_rejected = next(reversed(chain.rejected.values()), None)
        result.bytes_downloaded = self.stores.bytes_downloaded - before
        self.status.stores = self.stores.report()
        return result

    async def _through(self, offer: Offer, t0: float) -> SyncResult:
        """Reach the offered step through its store, deliver and serve it."""
        chain = offer.source.chain
        if offer.up_to_date:
            return SyncResult(self.held.step, SyncPath.UP_TO_DATE, self._served_root(), time.perf_counter() - t0, 0)
        target, staged = offer.target, None
        undelivered = self.delivery.undelivered
        if undelivered is not None and undelivered.step == target:
            staged = undelivered
        elif self.held.diverged is not None:  # the held state is not what its digest says: rebuild it
            staged = await paths.slow(chain, target)
        elif target != self.held.step:
            if self.held.served is not None and (patched := await self._incremental(offer)) is not None:
                return await self._finish(offer, patched, t0)  # delivered and served in its patch scope
            staged = await paths.slow(chain, target, around_withheld=offer.following)
        if staged is not None:
            await self.serve(staged)
        return await self._finish(offer, staged, t0)

    async def _incremental(self, offer: Offer) -> Staged | None:
        """The fast or chain path, patched, delivered and served in one scope; None: take the slow path."""
        async with self.held.patching():
            try:
                staged = await paths.incremental(offer.source.chain, self.held, offer.target)
            except MissingReferenceError as e:  # no store has the history: rebuild it here
                self._fallback(offer.target, e)
                return None
            except PulseSyncError as e:
                if not offer.last:  # another store may hold the chain intact: no slow path from here
                    raise
                self._fallback(offer.target, e)
                return None
            if staged is None:
                if not offer.last:
                    raise NotFoundError(
                        f"{offer.source.url}: the chain from step {self.held.step} to step {offer.target} has a gap"
                    )
                return None
            await self.serve(staged)
            return staged

    async def serve(self, staged: Staged, persist: bool = True) -> None:
        """Deliver a verified state to every sink and serve it (`delivery.py`), then say so."""
        await self.delivery.deliver(staged)
        digest = staged.verified.digest.root
        self.status.step, self.status.digest = staged.step, digest
        # A verified state is served: the sync succeeded as far as health goes, now and not after
        # the awaits that follow (a /healthz read in between said unhealthy while serving it).
        self.status.consecutive_failures, self.status.last_error = 0, None
        metrics.SUBSCRIBER_STEP.set(staged.step)
        log.info("serving step %d (path %s, digest %s)", staged.step, staged.path, digest)
        if (found := self.stores.read.chain.verified_marker(staged.step)) is not None:
            self.stores.pin_stream(found[1].stream_id)
            self.status.stream_id = self.stores.stream_id
        if persist and self.cache is not None:
            self.cache.served(staged.patches if staged.undo else None)  # a new state (slow path): a new base

    async def _finish(self, offer: Offer, staged: Staged | None, t0: float) -> SyncResult:
        """Metrics, lag and the cache after a step was reached."""
        chain = offer.source.chain
        path = staged.path if staged is not None else SyncPath.UP_TO_DATE
        seconds = time.perf_counter() - t0
        metrics.LAG_STEPS.set(offer.newest - self.held.step)
        if staged is not None and (published := chain.published_at.get(self.held.step)):
            age = (dt.datetime.now(dt.timezone.utc) - published).total_seconds()
            metrics.LAG_SECONDS.set(max(age, 0.0))
        if staged is not None:
            metrics.SYNC_SECONDS.labels(path).observe(seconds)
            self.status.paths[path] = self.status.paths.get(path, 0) + 1
        served = self.held.served
        assert served is not None
        if self.cache is not None and self.cache.unsaved:  # also retries a save that failed before
            found = chain.verified_marker(served.step)
            await self.cache.save(served, found[0] if found else None)
        return SyncResult(served.step, path, served.digest.root, seconds, 0)

    def _served_root(self) -> str:
        served = self.held.served
        assert served is not None
        return served.digest.root

    def _fallback(self, target: int, error: PulseSyncError) -> None:
        reason = type(error).__name__
        self.status.fallbacks[reason] = self.status.fallbacks.get(reason, 0) + 1
        metrics.FALLBACKS.labels(reason).inc()
        if not isinstance(error, _NOT_A_VERIFICATION_FAILURE):
            metrics.VERIFICATION_FAILURES.labels(reason).inc()
        log.warning("step %d: falling back to the slow path (%s: %s)", target, reason, error)
