"""The subscriber: sync to the newest (or a pinned) ready step, verify every link, deliver to sinks.

Paths: up to date; fast (one patch) or chain (every patch from the held step, walking base_step
links back from the target); slow (nearest anchor at or below the target, then patches; also
cold start). Every manifest is checked against the trusted keys (and must be newer than the held
step), every object against its SHA-256, the base digest before and the state digest after each
patch. A failure on the fast or chain path falls back to the slow path and is counted by reason.
New states are staged: sinks only ever see a verified, completely applied state. The fast and
chain paths patch the held state in place under an undo log (a full copy of the state would cost
more than the patch itself) and roll it back, bit for bit, if anything fails before the sinks take
the new state; the slow path builds its state in a separate buffer.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import json
import logging
import threading
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from enum import Enum
from typing import Any, cast

import torch
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey
from safetensors import SafetensorError
from tenacity import (
    AsyncRetrying,
    RetryCallState,
    retry_if_exception,
    stop_after_attempt,
    stop_never,
    wait_exponential,
)

from pulsesync import metrics, mixsum, state_cache
from pulsesync.codec import StepHistory, UndoLog, fused
from pulsesync.deadlines import within
from pulsesync.digest import StateDigest, TensorHasher
from pulsesync.dtypes import dense_bytes
from pulsesync.errors import (
    ConfigError,
    DeadlineError,
    EngineError,
    ForeignStreamError,
    IntegrityError,
    LocalWriteError,
    MissingReferenceError,
    NotFoundError,
    NothingPublishedError,
    PulseSyncError,
    ReplayError,
    StoreError,
)
from pulsesync.protocol import signing
from pulsesync.protocol.chain import ChainClient, check_patch
from pulsesync.protocol.manifest import PatchManifest, verify_manifest
from pulsesync.rebuild import apply_chain, apply_step, reconstruct
from pulsesync.sinks import DirectorySinkConfig, Sink, Update, build_sinks
from pulsesync.store import Store, open_store
from pulsesync.subscriber.config import SubscriberConfig
from pulsesync.subscriber.fleet import FleetReporter, default_subscriber_id
from pulsesync.subscriber.poll import PointerPoll
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


_KERNEL_WARM_UPS = (fused.warm_up, mixsum.warm_up)  # the decode kernels and the digest's


def _worth_retrying(error: BaseException) -> bool:
    """Every pulsesync error but an empty prefix, which a daemon waits out at its poll interval."""
    return isinstance(error, PulseSyncError) and not isinstance(error, NothingPublishedError)


class _Changed(Exception):
    """The held state changed while a scrub was reading a tensor."""


class SyncPath(str, Enum):
    """How a sync reached the state it serves (JSON, metrics and logs carry the value)."""

    UP_TO_DATE = "up-to-date"  # nothing newer than the held step
    FAST = "fast"  # one patch from the held step, in place
    CHAIN = "chain"  # several patches from the held step, in place
    SLOW = "slow"  # an anchor and the patches after it
    CACHE = "cache"  # the state cache, at start

    def __str__(self) -> str:
        return str(self.value)


@dataclass
class SyncResult:
    """Outcome of one sync, as `pulsesync subscribe --once` prints it."""

    step: int
    path: SyncPath
    digest: str
    seconds: float
    bytes_downloaded: int

    def to_json(self) -> str:
        """One JSON line."""
        return json.dumps(asdict(self) | {"seconds": round(self.seconds, 3)})


@dataclass
class _Staged(VerifiedState):
    """A verified state on its way to the sinks, and the path that produced it."""

    path: SyncPath = SyncPath.SLOW
    undo: list[UndoLog] = field(default_factory=list)  # set when `state` is the held state, patched in place
    history: StepHistory | None = None  # of the last patch applied: the next patch's reference
    patches: list[tuple[PatchManifest, bytes]] = field(default_factory=list)  # applied in place, for the journal

    def rollback(self) -> None:
        """Undo in-place patches, newest first."""
        for log_ in reversed(self.undo):
            log_.rollback(self.state)
        self.undo.clear()


@dataclass
class SubscriberStatus:
    """What /healthz reports."""

    step: int = -1
    digest: str | None = None
    consecutive_failures: int = 0
    last_error: str | None = None
    paths: dict[SyncPath, int] = field(default_factory=dict)
    fallbacks: dict[str, int] = field(default_factory=dict)
    stream_id: str | None = None
    rejected_markers: int = 0  # ready markers skipped because they do not verify
    last_rejected: str | None = None
    sync_running_seconds: float | None = None
    diverged: str | None = None  # a scrub found the held state differs from its digest (rebuilt at the next sync)


class Subscriber:
    """Holds the served, verified state and moves it forward; `sync()` is one attempt."""

    def __init__(
        self,
        config: SubscriberConfig,
        *,
        store: Store | None = None,
        trusted: Mapping[str, Ed25519PublicKey] | None = None,
        sinks: list[Sink] | None = None,
    ) -> None:
        trusted = trusted if trusted is not None else signing.trusted_keys(config.trusted_keys)
        if not trusted:
            raise ConfigError("trusted_keys: a subscriber needs at least one trusted public key (--trusted-key)")
        self.config = config
        self.store = store or open_store(config.store)
        self.chain = ChainClient(
            self.store, trusted, threads=config.codec.threads, stream_id=config.stream_id, speculate=True
        )
        advisory = config.advisory_deadline_seconds
        self.poll = PointerPoll(self.store, config.list_every_seconds, advisory) if config.poll_pointer else None
        fleet_id = config.subscriber_id or default_subscriber_id(config.cache_dir)
        fleet_every = config.fleet_status_seconds
        self.fleet = FleetReporter(self.store, fleet_id, fleet_every, advisory) if config.fleet_status else None
        sink_configs = list(config.sinks)
        if config.out_dir is not None:
            sink_configs.append(DirectorySinkConfig(out_dir=config.out_dir))
        self.sinks = sinks if sinks is not None else build_sinks(sink_configs)
        self.state: dict[str, torch.Tensor] | None = None
        self.digest: StateDigest | None = None
        self.step = -1
        self.files: dict[str, bytes] = {}
        self.history: StepHistory | None = None  # of the patch that produced the held state
        self.status = SubscriberStatus()
        self._undelivered: _Staged | None = None  # a slow-path state a sink refused: deliver again
        self._state_lock = threading.Lock()  # held while the held state is patched in place
        self._warm_up: asyncio.Future[list[None]] | None = None
        self._sync_started: float | None = None  # monotonic time the running sync began
        self._unsaved = False  # the served state is not in cache_dir yet (the last save failed)
        self._version = 0  # bumped whenever the held state is about to change (a scrub then starts over)
        self._diverged: str | None = None  # a scrub found the held state differs from its digest: rebuild
        # Patches applied since the state in cache_dir, to journal; None: the whole state must be written.
        self._journal: list[tuple[PatchManifest, bytes]] | None = None
        self._journal_bytes = 0  # what cache_dir's journal holds
        self._compacting: asyncio.Task[None] | None = None
        self.cache_bytes_written = 0

    # --- lifecycle -------------------------------------------------------------------------------
    async def start(self) -> None:
        """Resume from cache_dir when it holds an intact verified state; load the decode kernels meanwhile."""
        if self._warm_up is None:
            self._warm_up = asyncio.ensure_future(asyncio.gather(*map(asyncio.to_thread, _KERNEL_WARM_UPS)))
        if self.config.cache_dir is None or self.state is not None:
            return
        cached = await asyncio.to_thread(state_cache.load, self.config.cache_dir, self.config.codec.threads)
        if cached is None:
            return
        await self._replay(cached)
        if not await self._authenticate_and_pin(cached):
            return
        self._journal = []
        self._journal_bytes = await asyncio.to_thread(state_cache.journal_bytes, self.config.cache_dir)
        log.info("resumed step %d from %s (digest %s)", cached.step, self.config.cache_dir, cached.digest.root)
        staged = _Staged(cached.step, cached.state, cached.digest, cached.files, SyncPath.CACHE, history=cached.history)
        await self._activate(staged, persist=False)

    async def _replay(self, cached: state_cache.CachedState) -> None:
        """Apply the cache's journal to its base, each entry verified as a patch from the store would be.

        Replay stops at the first entry that does not verify or link up (its files are removed):
        the state up to there is verified and is resumed from.
        """
        assert self.config.cache_dir is not None
        for entry in cached.journal:
            where = f"the state cache in {self.config.cache_dir}: journal entry {entry.step}"
            undo = UndoLog()
            try:
                raw, data = await asyncio.to_thread(entry.read)
                manifest = verify_manifest(raw, self.chain.trusted, newer_than=cached.step, name=where)
                if not isinstance(manifest, PatchManifest) or (manifest.step, manifest.base_step) != (
                    entry.step,
                    cached.step,
                ):
                    raise IntegrityError(
                        f"{where}: holds the {manifest.kind} of step {manifest.step}, not a patch "
                        f"from step {cached.step}"
                    )
                check_patch(manifest, data, where)
                history = StepHistory()
                cached.digest = await apply_step(
                    self.chain, cached.state, cached.digest, manifest, data, undo, cached.history, history
                )
            except (PulseSyncError, OSError) as e:
                undo.rollback(cached.state)
                log.warning("%s: not replayed (%s: %s); resuming from step %d", where, type(e).__name__, e, cached.step)
                await asyncio.to_thread(state_cache.truncate_journal, self.config.cache_dir, entry.step)
                return
            cached.step, cached.marker, cached.history = manifest.step, raw, history

    async def _authenticate_and_pin(self, cached: state_cache.CachedState) -> bool:
        """Whether a signed manifest vouches for the cached state: the store's for its step, else the cached copy.

        The stream is pinned first: by the config, else by the cache's own signed marker (the stream
        this subscriber learned), so markers another run copied into the prefix are foreign and
        skipped. Only a cache without a marker, or `reset_stream`, takes the store's newest stream,
        and a cache of another stream is then discarded.
        """
        where = f"the state cache in {self.config.cache_dir}"
        try:
            own = None
            if cached.marker is not None:
                own = verify_manifest(cached.marker, self.chain.trusted, name=f"{where}: its ready marker")
                if not self.config.reset_stream:
                    self._learn_stream(own.stream_id)
            store_stream = None
            try:
                newest = await self.chain.newest_verified()  # with the pin set, another stream's markers are skipped
                listed = cached.step in self.chain.listed  # newest_verified() just listed ready/
                if newest is not None:
                    store_stream = self.chain.verified_marker(newest)[1].stream_id  # type: ignore[index]
            except StoreError as e:  # unreachable for now: the cached copy of the marker decides
                log.warning("checking %s against the store's markers: %s", where, e)
                listed = False
            manifest = None
            if listed:
                try:
                    manifest = await self.chain.commit_manifest(cached.step)
                except IntegrityError as e:  # e.g. rewritten by another stream: the cached copy still vouches
                    if own is None:
                        raise
                    log.warning("%s: the store's marker of step %d does not verify (%s)", where, cached.step, e)
                except NotFoundError:  # removed since the listing
                    pass
            if manifest is None:
                if own is None:
                    raise NotFoundError(
                        f"step {cached.step} has no ready marker in {self.store.url} and none was cached"
                    )
                manifest = own
            if manifest.step != cached.step or manifest.state_digest.root != cached.digest.root:
                raise IntegrityError(
                    f"its marker is step {manifest.step} with state digest {manifest.state_digest.root}, the cache "
                    f"holds step {cached.step} with {cached.digest.root}"
                )
            pinned = self.chain.stream_id if self.chain.stream_id is not None else store_stream
            if pinned and manifest.stream_id != pinned:
                raise ForeignStreamError(f"it is of stream {manifest.stream_id!r}, the store's is {pinned!r}")
        except PulseSyncError as e:
            log.warning("discarding %s: no signed manifest vouches for it (%s: %s)", where, type(e).__name__, e)
            return False
        self._learn_stream(manifest.stream_id)
        return True

    def _learn_stream(self, stream_id: str) -> None:
        """Pin the stream of the first verified state: later manifests must be of the same stream."""
        if self.chain.stream_id is None and stream_id:
            self.chain.stream_id = stream_id
            log.info("following publishing stream %s", stream_id)
        self.status.stream_id = self.chain.stream_id

    async def _wait_for_compaction(self) -> None:
        """Wait for a compaction of the state cache to finish (it holds the state lock); a failed one is retried."""
        if self._compacting is not None:
            try:
                await self._compacting
            except LocalWriteError as e:
                log.error("%s; retried at the next sync", e)
            finally:
                self._compacting = None

    async def wait_saved(self) -> None:
        """Wait until the served state is in cache_dir (a compaction in the background has finished)."""
        await self._wait_for_compaction()

    async def close(self) -> None:
        """Finish writing the state cache; release the store."""
        await self._wait_for_compaction()
        await self.chain.drop_read_ahead()
        if self._warm_up is not None:
            await asyncio.wait([self._warm_up])
        await self.store.close()

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
        t0, downloaded = time.perf_counter(), self.chain.bytes_downloaded
        await self._wait_for_compaction()
        newest = await self.chain.newest_verified()
        self.status.rejected_markers = len(self.chain.rejected)
        self.status.last_rejected = next(reversed(self.chain.rejected.values()), None)
        if newest is None:
            if self.chain.last_rejection is not None:  # say why: e.g. every marker is signed by an unknown key
                raise self.chain.last_rejection
            raise NothingPublishedError(f"{self.store.url}: no step published yet")
        ready = self.chain.listed  # newest_verified() just listed: one LIST per sync
        target = target if target is not None else self.config.step if self.config.step is not None else newest
        if target not in ready:
            raise NotFoundError(f"{self.store.url}: step {target} is not ready (newest is {newest})")
        if target < self.step:
            raise ReplayError(f"step {target} is older than the held step {self.step}; subscribers never go back")
        staged: _Staged | None = None
        if self._undelivered is not None and self._undelivered.step == target:
            staged = self._undelivered
        elif self._diverged is not None:  # the held state is not what its digest says: rebuild it
            staged = await self._slow(target)
        elif target != self.step:
            if self.state is not None:
                try:
                    staged = await self._incremental(target)
                except PulseSyncError as e:
                    self._fallback(target, e)
            if staged is None:
                staged = await self._slow(target)
        if staged is not None:
            await self._activate(staged)
        path = staged.path if staged is not None else SyncPath.UP_TO_DATE
        seconds = time.perf_counter() - t0
        got = self.chain.bytes_downloaded - downloaded
        metrics.BYTES_DOWNLOADED.inc(got)
        metrics.LAG_STEPS.set(newest - self.step)
        if staged is not None and (published := self.chain.published_at.get(self.step)):
            age = dt.datetime.now(dt.timezone.utc) - published
            metrics.LAG_SECONDS.set(max(age.total_seconds(), 0.0))
        if staged is not None:
            metrics.SYNC_SECONDS.labels(path).observe(seconds)
            self.status.paths[path] = self.status.paths.get(path, 0) + 1
        assert self.digest is not None
        if self._unsaved:  # also retries a save that failed before
            await self._save()
        return SyncResult(self.step, path, self.digest.root, seconds, got)

    async def _incremental(self, target: int) -> _Staged | None:
        """Fast or chain path: patches from the held step to target, or None when they do not connect.

        Patches the held state in place, each patch under an undo log; on failure it is rolled back.
        Returns with the state lock held: `_activate` releases it once the sinks took the state.
        """
        assert self.state is not None and self.digest is not None
        held = self.step
        walk, links = await self.chain.walk(target, lambda s: s <= held, newer_than=held)
        if not walk.complete or walk.end != held:
            return None  # a gap (pruned, or an anchor in place of a failed patch), or another chain
        path = SyncPath.FAST if len(links) == 1 else SyncPath.CHAIN
        staged = _Staged(target, self.state, self.digest, self.files, path)
        self._state_lock.acquire()
        self._version += 1
        try:
            staged.digest, staged.history = await apply_chain(
                self.chain,
                self.state,
                self.digest,
                links,
                undo=staged.undo,
                reference=self.history,
                applied=staged.patches,
            )
        except BaseException:
            staged.rollback()
            self._state_lock.release()
            raise
        return staged

    async def _slow(self, target: int) -> _Staged:
        """Slow path: the nearest anchor on the target's chain, then its patches."""
        rebuilt = await reconstruct(self.chain, target)
        return _Staged(
            rebuilt.step, rebuilt.state, rebuilt.digest, rebuilt.files, SyncPath.SLOW, history=rebuilt.history
        )

    def _fallback(self, target: int, error: PulseSyncError) -> None:
        reason = type(error).__name__
        self.status.fallbacks[reason] = self.status.fallbacks.get(reason, 0) + 1
        metrics.FALLBACKS.labels(reason).inc()
        if not isinstance(error, _NOT_A_VERIFICATION_FAILURE):
            metrics.VERIFICATION_FAILURES.labels(reason).inc()
        log.warning("step %d: falling back to the slow path (%s: %s)", target, reason, error)

    async def _activate(self, staged: _Staged, persist: bool = True) -> None:
        """Hand a verified state to every sink, then serve it; a sink failure keeps the old state served."""
        update = Update(staged.step, staged.state, staged.digest, staged.files, self.digest, list(staged.undo))
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
            if staged.state is self.state:  # patched in place: _incremental took the lock
                self._state_lock.release()
        self._undelivered = None
        self._version += 1
        self._diverged = None
        self.state, self.digest, self.step, self.files = staged.state, staged.digest, staged.step, staged.files
        self.history = staged.history
        self.status.step, self.status.digest = staged.step, staged.digest.root
        # A verified state is served: the sync succeeded as far as health goes, now and not after
        # the awaits that follow (a /healthz read in between said unhealthy while serving it).
        self.status.consecutive_failures = 0
        metrics.SUBSCRIBER_STEP.set(staged.step)
        log.info("serving step %d (path %s, digest %s)", staged.step, staged.path, staged.digest.root)
        if (found := self.chain.verified_marker(staged.step)) is not None:
            self._learn_stream(found[1].stream_id)
        if persist and self.config.cache_dir is not None:
            self._unsaved = True
            journal = self._journal if staged.undo else None  # a new state (slow path): a new base
            self._journal = None if journal is None else [*journal, *staged.patches]

    async def _save(self) -> None:
        """Persist the served state to cache_dir: journal the patches since the cached state, or compact.

        Compaction (the whole state as the new base) runs in the background; the next sync waits for
        it. A failure (LocalWriteError) is retried at the next sync.
        """
        cache_dir = self.config.cache_dir
        assert cache_dir is not None and self.state is not None and self.digest is not None
        journal = self._journal
        held = dense_bytes(self.state)
        if journal:
            added = sum(len(data) for _, data in journal)
            if self._journal_bytes + added <= self.config.cache_journal_ratio * held:
                while journal:  # what was journaled before a failure is not written again
                    manifest, data = journal[0]
                    written = await asyncio.to_thread(
                        state_cache.append, cache_dir, manifest.step, manifest.to_bytes(), data
                    )
                    self._count_cache_bytes("journal", written)
                    self._journal_bytes += written
                    journal.pop(0)
                self._unsaved = False
                return
        found = self.chain.verified_marker(self.step)
        served = VerifiedState(self.step, self.state, self.digest, self.files)
        marker, history = (found[0] if found else None), self.history
        self._state_lock.acquire()  # not patched while it is written out; released by the thread
        self._unsaved, background, self._journal = False, journal is not None, []

        def write_base() -> None:
            try:
                self._journal_bytes = 0  # save() clears the journal first
                state_cache.save(cache_dir, served, marker, history)
                self._count_cache_bytes("base", held)
            except LocalWriteError:
                self._unsaved, self._journal = True, None
                raise
            finally:
                self._state_lock.release()

        if not background:  # a new base (cold start, slow path): written before the sync returns
            await asyncio.to_thread(write_base)
            return
        # Compaction: the journal outgrew its budget. The next sync waits for it (it holds the lock).
        self._compacting = asyncio.ensure_future(asyncio.to_thread(write_base))

    def _count_cache_bytes(self, kind: str, written: int) -> None:
        self.cache_bytes_written += written
        metrics.CACHE_BYTES_WRITTEN.labels(kind).inc(written)

    # --- scrub ------------------------------------------------------------------------------------
    async def scrub(self, bytes_per_second: float | None = None, piece_bytes: int = 64 << 20) -> list[str]:
        """Re-hash the whole served state against its digest, paced; returns the tensors that differ.

        The fast path keeps the digest up to date from the changed elements alone, so memory
        corruption in the other 99% would go unseen: this catches it. A tensor the state changed
        under (a sync) is skipped until the next scrub. A mismatch is counted, logged and makes the
        next sync rebuild the state from an anchor (the sinks then get the verified state again).
        """
        rate = bytes_per_second or self.config.scrub_bytes_per_second
        if self.state is None or self.digest is None:
            return []
        bad = []
        for name in sorted(self.digest.tensors):
            version, state, expected = self._version, self.state, self.digest
            if name not in state:
                continue
            hasher = TensorHasher(state[name], expected.algorithm)
            piece = max(piece_bytes // state[name].element_size(), 1)
            while hasher.hashed < hasher.flat.numel() and version == self._version:
                t0 = time.perf_counter()
                with contextlib.suppress(_Changed):
                    await asyncio.to_thread(self._hash_piece, hasher, piece, version)
                await asyncio.sleep(max(piece_bytes / rate - (time.perf_counter() - t0), 0.0))
            if version != self._version:
                continue  # patched meanwhile: scrubbed again next time
            metrics.SCRUBBED_BYTES.labels("subscriber").inc(hasher.flat.numel() * hasher.flat.element_size())
            if hasher.digest() != expected.tensors[name]:
                bad.append(name)
        metrics.SCRUBS.labels("subscriber", "mismatch" if bad else "ok").inc()
        if bad:
            self._diverged = f"scrub: the held tensors {bad[:5]} differ from the digest of step {self.step}"
            log.error("%s; the next sync rebuilds the state from an anchor", self._diverged)
        return bad

    def _hash_piece(self, hasher: TensorHasher, elements: int, version: int) -> None:
        with self._state_lock:  # never while a sync patches the state
            if version != self._version:
                raise _Changed
            hasher.update(elements)

    async def _scrub_periodically(self, stop: asyncio.Event) -> None:
        interval = self.config.scrub_interval_seconds
        assert interval is not None
        while not stop.is_set():
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(stop.wait(), interval)
            if not stop.is_set():
                await self.scrub()

    # --- in-process sink -------------------------------------------------------------------------
    def apply_to(self, module: torch.nn.Module) -> None:
        """Overwrite a module's parameters and buffers in place with the served state, bit-exact.

        From another thread it waits for a sync that is patching the state; on the event loop's
        thread (where waiting would deadlock) it raises EngineError instead.
        """
        try:
            asyncio.get_running_loop()
            on_loop = True
        except RuntimeError:
            on_loop = False
        if not self._state_lock.acquire(blocking=not on_loop):
            raise EngineError(f"apply_to: step {self.step} is being patched; call it after sync() returns")
        try:
            self._copy_into(module)
        finally:
            self._state_lock.release()

    def _copy_into(self, module: torch.nn.Module) -> None:
        if self.state is None:
            raise EngineError("apply_to: the subscriber holds no verified state yet")
        targets = dict(module.named_parameters()) | dict(module.named_buffers())
        missing = sorted(set(targets) - set(self.state))
        if missing:
            raise EngineError(f"apply_to: step {self.step} has no tensor {missing[0]!r} the module needs")
        with torch.no_grad():
            for name, target in targets.items():
                source = self.state[name]
                if source.dtype != target.dtype or source.shape != target.shape:
                    raise EngineError(
                        f"apply_to: {name!r} is {source.dtype} {tuple(source.shape)} at step {self.step}, "
                        f"the module's is {target.dtype} {tuple(target.shape)}"
                    )
                target.data.copy_(source)

    # --- daemon ----------------------------------------------------------------------------------
    def _retrying(self, attempts: int | None, stop: asyncio.Event | None = None) -> AsyncRetrying:
        """The retry policy of failed syncs: exponential backoff, retry_initial_seconds doubling to retry_max_seconds.

        Each failure is recorded (status, metrics, log); a set `stop` cuts a backoff wait short.
        """

        async def sleep(seconds: float) -> None:
            if stop is None:
                return await asyncio.sleep(seconds)
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(stop.wait(), seconds)

        def failed(state: RetryCallState) -> None:
            assert state.outcome is not None
            self._failed(cast(PulseSyncError, state.outcome.exception()))

        return AsyncRetrying(
            stop=stop_never if attempts is None else stop_after_attempt(attempts),
            wait=wait_exponential(multiplier=self.config.retry_initial_seconds, max=self.config.retry_max_seconds),
            retry=retry_if_exception(_worth_retrying),
            after=failed,
            sleep=sleep,
            reraise=True,
        )

    async def sync_with_retries(self, attempts: int) -> SyncResult:
        """Sync, retrying failures with exponential backoff up to `attempts` tries."""
        async for attempt in self._retrying(attempts):
            with attempt:
                return await self.sync()
        raise AssertionError("unreachable")  # pragma: no cover

    def _failed(self, error: PulseSyncError) -> None:
        self.status.consecutive_failures += 1
        self.status.last_error = f"{type(error).__name__}: {error}"
        metrics.SYNC_FAILURES.inc()
        metrics.HEALTHY.set(int(self.healthy()[0]))
        log.error("sync failed (%s); still serving step %d", self.status.last_error, self.step)

    def healthy(self) -> tuple[bool, dict[str, Any]]:
        """(healthy, details): serving a verified state and fewer than `unhealthy_after` failures in a row."""
        running = None if self._sync_started is None else time.monotonic() - self._sync_started
        self.status.sync_running_seconds = running
        stuck = running is not None and running > self.config.sync_deadline_seconds  # its cut-off did not take
        self.status.diverged = self._diverged
        ok = self.state is not None and self.status.consecutive_failures < self.config.unhealthy_after and not stuck
        ok = ok and self._diverged is None
        return ok, asdict(self.status) | {"healthy": ok}

    async def _report(self, path: SyncPath | None) -> None:
        """The fleet status after a sync (`path`) or an idle poll (None), when fleet statuses are on."""
        if self.fleet is not None:
            digest = self.digest.root if self.digest is not None else None
            await self.fleet.report(path, self.step, digest, max(self.chain.listed, default=self.step))

    async def run(self, stop: asyncio.Event) -> None:
        """Follow the store until stop is set: poll, sync, back off on failures; serve /metrics and /healthz."""
        await self.start()
        runner = None
        if self.config.metrics_port is not None:
            runner = await metrics.serve_with_health(self.config.metrics_port, self.healthy)
        scrubbing, said_waiting = None, False
        if self.config.scrub_interval_seconds is not None:
            scrubbing = asyncio.create_task(self._scrub_periodically(stop), name="pulsesync-scrub")
        try:
            while not stop.is_set():
                if self.poll is not None and self.state is not None and not await self.poll.worth_listing():
                    await self._report(None)
                    with contextlib.suppress(asyncio.TimeoutError):  # the pointer did not change: nothing new
                        await asyncio.wait_for(stop.wait(), self.config.poll_seconds)
                    continue
                result = None
                try:
                    async for attempt in self._retrying(None, stop):  # until a sync succeeds or stop is set
                        with attempt:
                            if not stop.is_set():
                                result = await self.sync()
                except NothingPublishedError as e:  # the start of a run: poll on at the usual interval
                    if not said_waiting:
                        log.info("%s; polling every %g s", e, self.config.poll_seconds)
                        said_waiting = True
                    with contextlib.suppress(asyncio.TimeoutError):
                        await asyncio.wait_for(stop.wait(), self.config.poll_seconds)
                    continue
                if result is None:
                    break
                self.status.consecutive_failures = 0
                metrics.HEALTHY.set(1)
                if result.path != SyncPath.UP_TO_DATE:
                    log.info("%s", result.to_json())
                if self.poll is not None:
                    self.poll.listed()
                await self._report(result.path)  # best effort, after the health the sync earned
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(stop.wait(), self.config.poll_seconds)
        finally:
            if scrubbing is not None:
                scrubbing.cancel()
                await asyncio.gather(scrubbing, return_exceptions=True)
            if runner is not None:
                await runner.cleanup()
