"""The subscriber: sync to the newest (or a pinned) ready step, verify every link, deliver to sinks.

Paths (`paths.py`): up to date; fast (one patch) or chain (every patch from the held step,
walking base_step links back from the target); slow (nearest anchor at or below the target, then
patches; also cold start). Every manifest is checked against the trusted keys (and must be newer
than the held step), every object against its SHA-256, the base digest before and the state
digest after each patch. A failure on the fast or chain path falls back to the slow path and is
counted by reason. Sinks only ever see a verified, completely applied state; the state served
(`held.py`) changes only once every sink took it. Around that: resuming from cache_dir
(`resume.py`), keeping it current (`cache_writer.py`), the scrub (`scrub.py`) and the daemon loop
(`daemon.py`).
"""

from __future__ import annotations

import asyncio
import datetime as dt
import functools
import logging
import time
from collections.abc import Mapping
from dataclasses import asdict
from typing import Any

import torch
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey
from safetensors import SafetensorError

from pulsesync import metrics, mixsum, state_cache
from pulsesync.codec import Changes, StepHistory, batch
from pulsesync.deadlines import within
from pulsesync.digest import StateDigest
from pulsesync.errors import (
    ConfigError,
    DeadlineError,
    EngineError,
    LocalWriteError,
    MissingReferenceError,
    NotFoundError,
    NothingPublishedError,
    PulseSyncError,
    ReplayError,
    StaleStoreError,
    StoreError,
)
from pulsesync.protocol import signing
from pulsesync.protocol.chain import ChainClient
from pulsesync.sinks import DirectorySinkConfig, Sink, Update, build_sinks
from pulsesync.store import Store, open_store
from pulsesync.subscriber import daemon, paths, resume
from pulsesync.subscriber.cache_writer import CacheWriter
from pulsesync.subscriber.config import SubscriberConfig
from pulsesync.subscriber.fleet import FleetReporter, default_subscriber_id
from pulsesync.subscriber.held import HeldState
from pulsesync.subscriber.paths import Staged, SyncPath, SyncResult
from pulsesync.subscriber.poll import PointerPoll
from pulsesync.subscriber.restarts import RestartWatch
from pulsesync.subscriber.scrub import scrub
from pulsesync.subscriber.status import SubscriberStatus
from pulsesync.subscriber.stores import StoreSource, through_stores, trusted_stream
from pulsesync.verified import VerifiedState

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


_KERNEL_WARM_UPS = (batch.warm_up, mixsum.warm_up)  # the decode kernels and the digest's


class Subscriber:
    """Holds the served, verified state and moves it forward; `sync()` is one attempt, `run()` the daemon."""

    def __init__(
        self,
        config: SubscriberConfig,
        *,
        store: Store | None = None,
        stores: list[Store] | None = None,
        trusted: Mapping[str, Ed25519PublicKey] | None = None,
        sinks: list[Sink] | None = None,
    ) -> None:
        trusted = trusted if trusted is not None else signing.trusted_keys(config.trusted_keys)
        if not trusted:
            raise ConfigError("trusted_keys: a subscriber needs at least one trusted public key (--trusted-key)")
        self.config = config
        advisory = config.advisory_deadline_seconds
        if stores is None:
            stores = [store] if store is not None else [open_store(c) for c in config.store_list]
        several = len(stores) > 1
        # With several stores the first is listed at least every max_lag_seconds: a lagging one is noticed.
        list_every = min(config.list_every_seconds, config.max_lag_seconds) if several else config.list_every_seconds
        self.sources = [
            StoreSource(
                each,
                ChainClient(
                    each,
                    trusted,
                    threads=config.codec.threads,
                    stream_id=config.stream_id,
                    speculate=True,
                    payload_wait_seconds=config.payload_wait_seconds,
                ),
                PointerPoll(each, list_every if i == 0 else config.list_every_seconds, advisory)
                if config.poll_pointer
                else None,
            )
            for i, each in enumerate(stores)
        ]
        self.store = stores[0]  # the first store: fleet status goes here
        self.chain = self.sources[0].chain  # the chain of the store the last sync read
        self.poll = self.sources[0].poll
        fleet_id = config.subscriber_id or default_subscriber_id(config.cache_dir)
        fleet_every = config.fleet_status_seconds
        self.fleet = FleetReporter(self.store, fleet_id, fleet_every, advisory) if config.fleet_status else None
        sink_configs = list(config.sinks)
        if config.out_dir is not None:
            sink_configs.append(DirectorySinkConfig(out_dir=config.out_dir))
        self.sinks = sinks if sinks is not None else build_sinks(sink_configs)
        self.held = HeldState()
        self.restarts = RestartWatch(self.sinks)
        self.status = SubscriberStatus()
        self.cache = (
            CacheWriter(config.cache_dir, config.cache_journal_ratio, self.held.lock)
            if config.cache_dir is not None
            else None
        )
        self._undelivered: Staged | None = None  # a slow-path state a sink refused: deliver again
        self._warm_up: asyncio.Future[list[None]] | None = None
        self._sync_started: float | None = None  # monotonic time the running sync began

    # --- the served state ------------------------------------------------------------------------
    @property
    def served(self) -> VerifiedState | None:
        """The verified state served now, None before the first."""
        return self.held.served

    @property
    def serving(self) -> bool:
        """Whether a verified state is served."""
        return self.held.served is not None

    @property
    def state(self) -> dict[str, torch.Tensor] | None:
        """The served tensors."""
        return self.held.served.state if self.held.served is not None else None

    @property
    def digest(self) -> StateDigest | None:
        """The served state's digest."""
        return self.held.served.digest if self.held.served is not None else None

    @property
    def step(self) -> int:
        """The served step, -1 before the first."""
        return self.held.step

    @property
    def files(self) -> dict[str, bytes]:
        """The served state's non-weight files."""
        return self.held.served.files if self.held.served is not None else {}

    @property
    def history(self) -> StepHistory | None:
        """The history of the patch that produced the served state: the next patch's reference."""
        return self.held.served.history if self.held.served is not None else None

    @property
    def cache_bytes_written(self) -> int:
        """Bytes written to cache_dir since start."""
        return self.cache.bytes_written if self.cache is not None else 0

    def apply_to(self, module: torch.nn.Module) -> None:
        """Overwrite a module's parameters and buffers in place with the served state, bit-exact.

        From another thread it waits for a sync that is patching the state; on the event loop's
        thread (where waiting would deadlock) it raises EngineError instead.
        """
        self.held.copy_into(module)

    # --- lifecycle -------------------------------------------------------------------------------
    async def start(self) -> None:
        """Resume from cache_dir when it holds an intact verified state; load the decode kernels meanwhile."""
        if self._warm_up is None:
            self._warm_up = asyncio.ensure_future(asyncio.gather(*map(asyncio.to_thread, _KERNEL_WARM_UPS)))
        if self.cache is None or self.serving:
            return
        cache_dir = self.cache.cache_dir
        cached = await asyncio.to_thread(state_cache.load, cache_dir, self.config.codec.threads)
        if cached is None:
            return
        await resume.replay(self.chain, cached, cache_dir)
        # The last store (the origin) is asked: a mirror does not choose the stream (`stores.py`).
        stream = await resume.vouching_stream(self.sources[-1].chain, cached, cache_dir, self.config.reset_stream)
        if stream is None:
            return
        self._learn_stream(stream)
        await self.cache.resumed()
        log.info("resumed step %d from %s (digest %s)", cached.step, cache_dir, cached.digest.root)
        staged = Staged(cached.step, cached.state, cached.digest, cached.files, cached.history, SyncPath.CACHE)
        await self._activate(staged, persist=False)

    def _learn_stream(self, stream_id: str) -> None:
        """Pin the stream of the first verified state: later manifests must be of the same stream, from any store."""
        for source in self.sources:
            source.chain.pin_stream(stream_id)
        self.status.stream_id = self.chain.stream_id

    async def wait_saved(self) -> None:
        """Wait until the served state is in cache_dir (a compaction in the background has finished)."""
        if self.cache is not None:
            await self.cache.wait()

    async def close(self) -> None:
        """Finish writing the state cache; release the store."""
        await self.wait_saved()
        for source in self.sources:
            await source.chain.fetcher.drop_read_ahead()
        if self._warm_up is not None:
            await asyncio.wait([self._warm_up])
        for source in self.sources:
            await source.store.close()

    async def __aenter__(self) -> Subscriber:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # --- syncing ---------------------------------------------------------------------------------
    async def sync(self, target: int | None = None) -> SyncResult:
        """One sync to `target` (default: the configured step, else the newest step whose marker verifies).

        Cut off after sync_deadline_seconds (DeadlineError), the held state rolled back first.
        """
        deadline = self.config.sync_deadline_seconds
        self._sync_started = time.monotonic()
        try:
            return await within(deadline, self._sync(target))
        except asyncio.TimeoutError:
            raise DeadlineError(
                f"sync did not finish within sync_deadline_seconds ({deadline:g} s); still serving step {self.step}"
            ) from None
        finally:
            self._sync_started = None

    async def _sync(self, target: int | None) -> SyncResult:
        """Sync from the first store of the list that delivers (`stores.py`); the last store's failure is raised."""
        t0, before = time.perf_counter(), self._bytes_downloaded()
        await self.wait_saved()
        if len(self.sources) > 1 and self.sources[-1].chain.stream_id is None:  # cold: the origin names the stream
            self._learn_stream(await trusted_stream(self.sources))
        started = functools.partial(self._sync_from, t0=t0)
        result = await through_stores(self.sources, target, self.config.step is not None, started)
        result.bytes_downloaded = self._bytes_downloaded() - before
        self.status.stores = {
            s.url: {"syncs": s.syncs, "fallbacks": dict(s.fallbacks), "rejected_markers": len(s.chain.rejected)}
            for s in self.sources
        }
        return result

    async def _sync_from(
        self, source: StoreSource, after: StoreSource | None, target: int | None, *, t0: float
    ) -> SyncResult:
        """One sync through one store; `after` is the next store of the list (None: this is the last)."""
        chain = self.chain = source.chain
        newest = await chain.newest_verified()
        self.status.rejected_markers = len(chain.rejected)
        self.status.last_rejected = next(reversed(chain.rejected.values()), None)
        if newest is None:
            if chain.last_rejection is not None:  # say why: e.g. every marker is signed by an unknown key
                raise chain.last_rejection
            raise NothingPublishedError(f"{source.url}: no step published yet")
        ready = chain.listed  # newest_verified() just listed: one LIST per sync
        source.offered = newest
        if source.poll is not None:
            source.poll.listed()
        following = target is None and self.config.step is None
        if after is not None and following:
            behind = await source.lags(newest, after, self.config.max_lag_seconds)
            if behind is not None:
                raise StaleStoreError(
                    f"{source.url}: still at step {newest} {behind:.0f} s after {after.url} moved on "
                    f"(max_lag_seconds {self.config.max_lag_seconds:g})"
                )
            if newest < self.step:  # a store behind the held step, within the bound: nothing newer here
                return SyncResult(self.step, SyncPath.UP_TO_DATE, self._served_root(), time.perf_counter() - t0, 0)
        target = target if target is not None else self.config.step if self.config.step is not None else newest
        if target not in ready:
            raise NotFoundError(f"{source.url}: step {target} is not ready (newest is {newest})")
        if target < self.step:
            raise ReplayError(f"step {target} is older than the held step {self.step}; subscribers never go back")
        staged: Staged | None = None
        if self._undelivered is not None and self._undelivered.step == target:
            staged = self._undelivered
        elif self.held.diverged is not None:  # the held state is not what its digest says: rebuild it
            staged = await paths.slow(chain, target)
        elif target != self.step:
            if self.serving:
                try:
                    staged = await paths.incremental(chain, self.held, target)
                except MissingReferenceError as e:  # no store has the history: rebuild it here
                    self._fallback(target, e)
                except PulseSyncError as e:
                    if after is not None:  # another store may hold the chain intact: no slow path from here
                        raise
                    self._fallback(target, e)
                if staged is None and after is not None:
                    raise NotFoundError(f"{source.url}: the chain from step {self.step} to step {target} has a gap")
            if staged is None:
                staged = await paths.slow(chain, target, around_withheld=following)
        if staged is not None:
            await self._activate(staged)
        path = staged.path if staged is not None else SyncPath.UP_TO_DATE
        seconds = time.perf_counter() - t0
        metrics.LAG_STEPS.set(newest - self.step)
        if staged is not None and (published := chain.published_at.get(self.step)):
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

    def _bytes_downloaded(self) -> int:
        return sum(source.chain.fetcher.bytes_downloaded for source in self.sources)

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

    async def _activate(self, staged: Staged, persist: bool = True) -> None:
        """Hand a verified state to every sink, then serve it; a sink failure keeps the old state served."""
        changes = Changes.of(staged.undo)  # positions read from the logs only if a sink asks (a sparse update)
        update = Update(
            staged.step, staged.state, staged.digest, staged.files, previous_digest=self.digest, changes=changes
        )
        in_place = self.held.served is not None and staged.state is self.held.served.state
        try:
            for sink in self.sinks:
                try:
                    await sink.deliver(update)
                except (OSError, SafetensorError) as e:  # a local write failed (disk full): go on, retry later
                    raise LocalWriteError(f"{type(sink).__name__}: step {staged.step} not delivered ({e})") from None
        except BaseException:
            if staged.undo:
                staged.rollback()  # the next sync applies the patches again
            else:
                self._undelivered = staged  # keep the rebuilt state: no second anchor download
            raise
        finally:
            if in_place:  # patched in place: paths.incremental took the lock
                self.held.end_patch()
        self._undelivered = None
        self.held.serve(staged)
        self.status.step, self.status.digest = staged.step, staged.digest.root
        # A verified state is served: the sync succeeded as far as health goes, now and not after
        # the awaits that follow (a /healthz read in between said unhealthy while serving it).
        self.status.consecutive_failures, self.status.last_error = 0, None
        metrics.SUBSCRIBER_STEP.set(staged.step)
        log.info("serving step %d (path %s, digest %s)", staged.step, staged.path, staged.digest.root)
        if (found := self.chain.verified_marker(staged.step)) is not None:
            self._learn_stream(found[1].stream_id)
        if persist and self.cache is not None:
            self.cache.served(staged.patches if staged.undo else None)  # a new state (slow path): a new base

    async def bring_back_engines(self) -> int:
        """Send the served state again to every engine that restarted since (`restarts.py`); how many were."""
        served = self.held.served
        if served is None or self._sync_started is not None:
            return 0
        brought = await self.restarts.bring_back(served)
        self.status.engine_restarts = self.restarts.restarts
        return brought

    # --- scrub, health, daemon -------------------------------------------------------------------
    async def scrub(self, bytes_per_second: float | None = None, piece_bytes: int = 64 << 20) -> list[str]:
        """Re-hash the whole served state against its digest, paced; returns the tensors that differ (`scrub.py`)."""
        return await scrub(self.held, bytes_per_second or self.config.scrub_bytes_per_second, piece_bytes)

    def healthy(self) -> tuple[bool, dict[str, Any]]:
        """(healthy, details): serving a verified state and fewer than `unhealthy_after` failures in a row."""
        running = None if self._sync_started is None else time.monotonic() - self._sync_started
        self.status.sync_running_seconds = running
        stuck = running is not None and running > self.config.sync_deadline_seconds  # its cut-off did not take
        self.status.diverged = self.held.diverged
        ok = self.serving and self.status.consecutive_failures < self.config.unhealthy_after and not stuck
        ok = ok and self.held.diverged is None
        return ok, asdict(self.status) | {"healthy": ok}

    async def report(self, path: SyncPath | None) -> None:
        """The fleet status after a sync (`path`) or an idle poll (None), when fleet statuses are on."""
        if self.fleet is not None:
            digest = self.digest.root if self.digest is not None else None
            await self.fleet.report(path, self.step, digest, max(self.chain.listed, default=self.step))

    async def sync_with_retries(self, attempts: int) -> SyncResult:
        """Sync, retrying failures with exponential backoff up to `attempts` tries."""
        async for attempt in daemon.retrying(self, attempts):
            with attempt:
                return await self.sync()
        raise AssertionError("unreachable")  # pragma: no cover

    async def run(self, stop: asyncio.Event) -> None:
        """Follow the store until stop is set: poll, sync, back off on failures; serve /metrics and /healthz."""
        await daemon.run(self, stop)
