"""The publisher: a host copy on the trainer's thread; its rounds (diff, encode, upload, commit) in the background.

One pipeline for a world of one and for every rank of a sharded job (the torch.distributed.checkpoint
shape: a single process is a world of one). `publish()` copies the state to host memory and queues
it; the worker hands each copy to the rounds (`publisher/rounds.py`): the whole model's
(`publisher/whole.py`) or this rank's part of a sharded step's (`publisher/sharded.py`). Backpressure,
flush and close are the pipeline's; what a step's objects are is the rounds'.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import deque
from collections.abc import Mapping
from types import TracebackType
from typing import Any

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from pulsesync import metrics
from pulsesync.dtypes import State
from pulsesync.errors import ConfigError, ConflictError, PulseSyncError
from pulsesync.protocol import layout, signing
from pulsesync.publisher.config import PublisherConfig
from pulsesync.publisher.coordinator import Coordinator, GlooGroup, WorldOfOne, multi_rank
from pulsesync.publisher.host_copy import FileSource, HostCopy, read_files
from pulsesync.publisher.report import StepReport
from pulsesync.publisher.rounds import Rounds
from pulsesync.publisher.sharded import ShardedRounds
from pulsesync.publisher.whole import WholeModelRounds
from pulsesync.retention import RetentionWorker
from pulsesync.sharding.layout import Ownership
from pulsesync.store import Store, open_store
from pulsesync.threads import LoopThread

log = logging.getLogger("pulsesync.publisher")


class AsyncPublisher:
    """Publishes states into a store; `publish()` returns once the state is copied to host memory.

    `coordinator` places this process in its publishing world: a world of one (default) publishes
    the whole model; on each rank of a sharded job every rank constructs it and publishes its own
    `state_dict()`, each uploading the pieces it owns (docs/sharding.md), and `declared` names the
    owners of plain tensors there.
    """

    def __init__(
        self,
        config: PublisherConfig,
        *,
        store: Store | None = None,
        signing_key: Ed25519PrivateKey | None = None,
        coordinator: Coordinator | None = None,
        declared: Mapping[str, Ownership] | None = None,
    ) -> None:
        coordinator = coordinator or WorldOfOne()
        if signing_key is None and coordinator.rank == 0:
            if config.signing_key is None:
                raise ConfigError("signing_key: a publisher needs an Ed25519 private key (pulsesync keygen)")
            signing_key = signing.load_private_key(config.signing_key)
        self.config = config
        self.store = store or open_store(config.store)
        self.reports: deque[StepReport] = deque(maxlen=1000)
        self.skipped = 0
        self.last_error: PulseSyncError | None = None  # of the newest step that failed
        self._key = signing_key
        self._coordinator = coordinator
        self.rounds: Rounds
        if coordinator.world > 1:
            self.rounds = ShardedRounds(config, self.store, signing_key, self._record, coordinator, declared)
        else:
            assert signing_key is not None
            self.rounds = WholeModelRounds(config, self.store, signing_key, self._record)
        self._pending: deque[HostCopy] = deque()
        self._cond: asyncio.Condition | None = None
        self._worker: asyncio.Task[None] | None = None
        self._busy = False
        self._fatal: BaseException | None = None
        self._last_step = -1  # newest step accepted, ours or found in the store
        self._retention: asyncio.Task[None] | None = None
        self._stop_retention = asyncio.Event()

    @property
    def run_id(self) -> str:
        """This run's id, part of every payload key it writes."""
        return self.rounds.run_id

    @property
    def stream_id(self) -> str:
        """The stream signed into every manifest (a restart continues the prefix's)."""
        return self.rounds.stream_id

    # --- lifecycle -------------------------------------------------------------------------------
    async def start(self, first_step: int | None = None) -> None:
        """Read the prefix's ready markers, resume the baseline if configured, start the pipeline.

        `first_step`, the step about to be published, is checked against the store's before any
        baseline is rebuilt (ConflictError), so a one-shot publish of a taken step fails at once.
        A failed start closes the store.
        """
        if self._worker is not None:
            return
        try:
            self._cond = asyncio.Condition()
            self._last_step = await self.rounds.scan()
            if first_step is not None:
                self.check_step(first_step)
            await self.rounds.resume()
        except BaseException:
            await self.store.close()  # its HTTP sessions too: nothing is left open on a failed start
            raise
        if self._coordinator.rank == 0:
            metrics.serve(self.config.metrics_port)
        self._worker = asyncio.create_task(self._work(), name="pulsesync-publisher")
        if self.config.retention is not None and self._key is not None:  # the retention worker, on rank 0
            trusted = signing.trusted_keys([self._key.public_key()])
            worker = RetentionWorker(self.store, self.config.retention, trusted)
            self._retention = asyncio.create_task(worker.run(self._stop_retention), name="pulsesync-retention")

    async def flush(self) -> None:
        """Wait until every accepted step is committed or failed, background anchors included."""
        assert self._cond is not None, "call start() first"
        async with self._cond:
            await self._cond.wait_for(lambda: self._stopped is not None or (not self._pending and not self._busy))
        await self.rounds.drain()
        self._raise_fatal()

    async def close(self) -> None:
        """Flush, save the baseline to cache_dir (if set) and release the store."""
        try:
            if self._worker is not None:
                await self.flush()
        finally:
            self._stop_retention.set()
            if self._retention is not None:
                await self._retention
            if self._worker is not None:
                self._worker.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await self._worker
            await self.store.close()
        await self.rounds.close()

    async def __aenter__(self) -> AsyncPublisher:
        await self.start()
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.close()

    # --- the trainer's side ------------------------------------------------------------------------
    async def publish(self, step: int, state: State, files: FileSource | None = None) -> None:
        """Snapshot a state to host memory and queue it; committing happens in the background."""
        self.check_step(step)
        if self.rounds.copies_when_idle:
            await self.flush()
        await self.submit(await asyncio.to_thread(self.host_copy, step, state, files))

    def host_copy(self, step: int, state: State, files: FileSource | None = None) -> HostCopy:
        """Copy what this rank publishes of a state to host memory (blocking; any thread)."""
        return self.rounds.copy(step, state, read_files(files))

    @property
    def last_step(self) -> int:
        """Newest step accepted by publish() or found in the store at start (-1 if none)."""
        return self._last_step

    def check_step(self, step: int) -> None:
        """ConflictError unless step is newer than every step accepted or found in the store."""
        self._raise_fatal()
        if step <= self._last_step:
            raise ConflictError(
                f"step {step} is not newer than step {self._last_step}, already published to {self.store.url}; "
                "steps must strictly increase"
            )
        layout.step_name(step)  # range check

    async def submit(self, snap: HostCopy) -> None:
        """Queue a host copy: drop the oldest queued one (skip) or wait for room (block) when full."""
        assert self._cond is not None, "call start() first"
        self.check_step(snap.step)
        self._last_step = snap.step
        async with self._cond:
            if self.config.on_backpressure == "block":
                await self._cond.wait_for(
                    lambda: self._stopped is not None or len(self._pending) < self.config.max_pending
                )
                self._raise_fatal()
            elif len(self._pending) >= self.config.max_pending:
                dropped = self._pending.popleft()
                self.rounds.pool.release(dropped.state)
                snap.files = dropped.files | snap.files
                self.skipped += 1
                metrics.SKIPPED_STEPS.inc()
                log.warning("step %d skipped: uploads are behind, publishing newer steps first", dropped.step)
            self._pending.append(snap)
            self._cond.notify_all()

    def _raise_fatal(self) -> None:
        if self._stopped is not None:
            raise self._stopped

    @property
    def _stopped(self) -> BaseException | None:
        """What stopped publishing: a conflict, a bug, a rank's failure, or one the rounds met in the background."""
        return self._fatal or self.rounds.fatal

    def _record(self, report: StepReport) -> None:
        report.skipped_total = self.skipped
        self.reports.append(report)
        report.record()

    # --- the pipeline --------------------------------------------------------------------------
    async def _work(self) -> None:
        assert self._cond is not None
        while True:
            async with self._cond:
                await self._cond.wait_for(lambda: bool(self._pending))
                snap = self._pending.popleft()
                self._busy = True
                self._cond.notify_all()
            try:
                await self.rounds.publish(snap)
            except PulseSyncError as e:
                self.last_error = e
                if isinstance(e, ConflictError) or self.rounds.stops_on_failure:
                    self._fatal = e
                log.error("step %d: not published (%s: %s)", snap.step, type(e).__name__, e)
            except Exception as e:  # a bug, not a store failure: stop rather than publish on
                log.exception("step %d: publisher stopped", snap.step)
                self._fatal = e
            finally:
                if not self.rounds.holds(snap):
                    self.rounds.pool.release(snap.state)  # failed: nothing holds it
                async with self._cond:
                    self._busy = False
                    if self._stopped is not None:
                        self._pending.clear()
                    self._cond.notify_all()
            if self._stopped is not None:
                return


class Publisher:
    """Blocking wrapper of AsyncPublisher for training loops: its pipeline runs on its own thread.

    On a torch.distributed job of several ranks every rank constructs it and publishes its own
    `state_dict()`, each rank uploading what it owns (docs/sharding.md); `declared` names the
    owners of plain tensors there, and `group` is the process group its collectives use (default:
    a new gloo group of its own). `sharded=False` keeps one process publishing a whole state it
    gathered (constructed on that rank alone).
    """

    def __init__(
        self,
        config: PublisherConfig,
        *,
        store: Store | None = None,
        signing_key: Ed25519PrivateKey | None = None,
        declared: Mapping[str, Ownership] | None = None,
        sharded: bool | None = None,
        group: Any = None,
    ) -> None:
        self._loop = LoopThread("pulsesync-publisher-loop")
        try:
            sharded = sharded if sharded is not None else multi_rank()
            coordinator = GlooGroup(config.sharding.timeout_seconds, group) if sharded else WorldOfOne()
            self._async = AsyncPublisher(
                config, store=store, signing_key=signing_key, coordinator=coordinator, declared=declared
            )
            self._loop.run(self._async.__aenter__())
        except BaseException:
            self._loop.stop()
            raise

    @property
    def reports(self) -> deque[StepReport]:
        """Reports of the object sets published so far (newest last)."""
        return self._async.reports

    @property
    def skipped(self) -> int:
        """Steps dropped because uploads fell behind."""
        return self._async.skipped

    @property
    def last_error(self) -> PulseSyncError | None:
        """Why the newest step that failed was not published."""
        return self._async.last_error

    @property
    def run_id(self) -> str:
        """This run's id, part of every payload key it writes."""
        return self._async.run_id

    @property
    def rounds(self) -> Rounds:
        """What this rank publishes of each step."""
        return self._async.rounds

    def publish(self, step: int, state: State, files: FileSource | None = None) -> None:
        """Copy the state to host memory on this thread and queue it; returns as soon as the copy is done."""
        self._async.check_step(step)
        if self._async.rounds.copies_when_idle:
            self.flush()
        self._loop.run(self._async.submit(self._async.host_copy(step, state, files)))

    def flush(self) -> None:
        """Block until every published step is committed or failed."""
        self._loop.run(self._async.flush())

    def close(self) -> None:
        """Flush and stop the pipeline."""
        if self._loop.closed:
            return
        try:
            self._loop.run(self._async.close())
        finally:
            self._loop.stop()

    def __enter__(self) -> Publisher:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()
