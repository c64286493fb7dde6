"""The publisher pipeline: a host copy on the trainer's thread; diff, encode, upload and commit in the background.

Commit protocol per step: upload the payload (under a key unique to this publisher run), then
write the signed manifest as the ready marker with put-if-absent, and only then advance the
baseline. A failed publish leaves the baseline at the last committed state, so the next patch is
computed against what subscribers can actually hold. Anchors: the first publish after a start
(unless resuming), every `anchor_interval` published steps or past `anchor_bytes_budget`, in the
background after the step's patch; and in place of a patch that could not be published.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import shutil
import tempfile
import time
from collections import deque
from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path
from types import TracebackType
from typing import Any

import torch
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from pulsesync import metrics, state_cache
from pulsesync.codec import PatchHistory, StepHistory, encode, read_header
from pulsesync.digest import INCREMENTAL, StateDigest, state_digest
from pulsesync.dtypes import State, dense_bytes
from pulsesync.errors import (
    ConfigError,
    ConflictError,
    PulseSyncError,
)
from pulsesync.model_dir import WEIGHT_SUFFIX, write_model_dir
from pulsesync.protocol import layout, signing
from pulsesync.protocol.chain import ChainClient
from pulsesync.protocol.manifest import AnchorManifest, ObjectRef, PatchManifest
from pulsesync.publisher.commit import anchor_manifest, marker_key, patch_manifest, write_ready_marker
from pulsesync.publisher.config import PublisherConfig
from pulsesync.publisher.host_copy import FileSource, HostCopy, HostCopyPool, read_files
from pulsesync.publisher.ownership import PrefixGuard, newest_own
from pulsesync.publisher.report import StepReport, StepTiming
from pulsesync.publisher.resume import resume_baseline
from pulsesync.publisher.schedule import AnchorSchedule
from pulsesync.retention import RetentionWorker
from pulsesync.sharding.layout import Ownership
from pulsesync.store import Store, open_store
from pulsesync.threads import LoopThread
from pulsesync.verified import VerifiedState

log = logging.getLogger("pulsesync.publisher")


class AsyncPublisher:
    """Publishes states into a store; `publish()` returns once the state is copied to host memory."""

    def __init__(
        self,
        config: PublisherConfig,
        *,
        store: Store | None = None,
        signing_key: Ed25519PrivateKey | None = None,
    ) -> None:
        if signing_key is None:
            if config.signing_key is None:
                raise ConfigError("signing_key: a publisher needs an Ed25519 private key (pulsesync keygen)")
            signing_key = signing.load_private_key(config.signing_key)
        self.config = config
        self.store = store or open_store(config.store)
        self.run_id = secrets.token_hex(4)  # payload keys unique to this run: nothing is ever overwritten
        self.stream_id = secrets.token_hex(8)  # signed into every manifest; a restart adopts the prefix's
        self.reports: deque[StepReport] = deque(maxlen=1000)
        self.skipped = 0
        self.last_error: PulseSyncError | None = None  # of the newest step that failed
        self._key = signing_key
        self._files = read_files({p.name: p for p in config.extra_files})
        self._pool = HostCopyPool(keep=config.max_pending + 1)
        self._pending: deque[HostCopy] = deque()
        self._cond: asyncio.Condition | None = None
        self._worker: asyncio.Task[None] | None = None
        self._background: asyncio.Task[None] | None = None
        self._busy = False
        self._fatal: BaseException | None = None
        self._base: VerifiedState | None = None  # the last committed state: what every subscriber can hold
        # What the base step's patch changed, and that patch: the reference of the next patch. None
        # after an anchor, so a subscriber that starts from the anchor decodes its successor.
        self._history: PatchHistory | None = None
        self._history_ref: ObjectRef | None = None
        self._schedule = AnchorSchedule(config.anchor_interval, config.anchor_bytes_budget)
        self._last_step = -1  # newest step accepted, ours or found in the store
        trusted = signing.trusted_keys([signing_key.public_key()])
        self._chain = ChainClient(self.store, trusted, config.codec.threads or 1)
        self._guard = PrefixGuard(self._chain)
        self._retention: asyncio.Task[None] | None = None
        self._stop_retention = asyncio.Event()

    # --- lifecycle -------------------------------------------------------------------------------
    async def start(self) -> None:
        """Read the prefix's ready markers, resume the baseline if configured, start the pipeline."""
        if self._worker is not None:
            return
        self._cond = asyncio.Condition()
        await self._guard.scan()
        newest, self._last_step = await newest_own(self._chain, self.config.take_over_prefix, self.stream_id)
        ready = {s: k for s, k in (await self._chain.ready()).items() if newest is not None and s <= newest}
        if newest is not None:
            found = self._chain.verified_marker(newest)
            assert found is not None
            self.stream_id = found[1].stream_id or self.stream_id  # the prefix's stream goes on
        self._chain.stream_id = self.stream_id
        if ready:
            self._last_step = max(ready)
            if self.config.resume:
                self._base = await resume_baseline(self._chain, ready, self.config.cache_dir, self.config.codec.threads)
                if self._base is not None:
                    with contextlib.suppress(PulseSyncError):  # the kinds since the last anchor, for the schedule
                        await self._chain.walk(max(ready), lambda s: "anchor" in ready.get(s, ()))
                    self._schedule.resume(ready)
                await self._resume_history()
        metrics.serve(self.config.metrics_port)
        self._worker = asyncio.create_task(self._work(), name="pulsesync-publisher")
        if self.config.retention is not None:  # the retention worker, in this process
            worker = RetentionWorker(self.store, self.config.retention, self._chain.trusted)
            self._retention = asyncio.create_task(worker.run(self._stop_retention), name="pulsesync-retention")

    async def _resume_history(self) -> None:
        """Take up the history of the baseline's patch (rebuilt, or cached beside the state), so the next patch
        is history-coded as an uninterrupted publisher codes it; a history that is not that patch's is dropped."""
        history = self._base.history if self._base is not None else None
        if history is None or self._base is None:
            return
        last_patch = await self._chain.manifest(self._base.step, "patch")
        own = history.get(last_patch.objects[0].sha256) if len(last_patch.objects) == 1 else None
        if own is not None:
            self._history, self._history_ref = own, last_patch.objects[0]
        else:
            log.warning(
                "step %d: the cached patch history is not its patch's; the next patch is coded without it",
                self._base.step,
            )

    async def flush(self) -> None:
        """Wait until every accepted step is committed or failed, background anchors included."""
        assert self._cond is not None, "call start() first"
        async with self._cond:
            await self._cond.wait_for(lambda: self._fatal is not None or (not self._pending and not self._busy))
        if self._background is not None:
            await self._background
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
        if self.config.cache_dir is not None and self._base is not None:
            history = StepHistory.of(self._history) if self._history is not None else None
            await asyncio.to_thread(state_cache.save, self.config.cache_dir, replace(self._base, history=history))

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
        await self.submit(await asyncio.to_thread(self.host_copy, step, state, files))

    def host_copy(self, step: int, state: State, files: FileSource | None = None) -> HostCopy:
        """Copy a state to host memory (blocking; any thread)."""
        t0 = time.perf_counter()
        buffers = self._pool.copy(state)
        return HostCopy(step, buffers, time.perf_counter() - t0, read_files(files))

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
                    lambda: self._fatal is not None or len(self._pending) < self.config.max_pending
                )
                self._raise_fatal()
            elif len(self._pending) >= self.config.max_pending:
                dropped = self._pending.popleft()
                self._pool.release(dropped.state)
                snap.files = dropped.files | snap.files
                self.skipped += 1
                metrics.SKIPPED_STEPS.inc()
                log.warning("step %d skipped: uploads are behind, publishing newer steps first", dropped.step)
            self._pending.append(snap)
            self._cond.notify_all()

    def _raise_fatal(self) -> None:
        if self._fatal is not None:
            raise self._fatal

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
                await self._publish_step(snap)
            except PulseSyncError as e:
                self.last_error = e
                if isinstance(e, ConflictError):
                    self._fatal = e
                log.error("step %d: not published (%s: %s)", snap.step, type(e).__name__, e)
            except Exception as e:  # a bug, not a store failure: stop rather than publish on
                log.exception("step %d: publisher stopped", snap.step)
                self._fatal = e
            finally:
                if self._base is None or self._base.state is not snap.state:
                    self._pool.release(snap.state)  # failed: nothing holds it
                async with self._cond:
                    self._busy = False
                    if self._fatal is not None:
                        self._pending.clear()
                    self._cond.notify_all()
            if self._fatal is not None:
                return

    async def _publish_step(self, snap: HostCopy) -> None:
        self._files |= snap.files
        t0 = time.perf_counter()
        algorithm = self.config.codec.digest_algorithm
        digest: StateDigest | None = None
        if self._base is None or algorithm not in INCREMENTAL or self._base.digest.algorithm != algorithm:
            digest = await self._full_digest(snap.state)
        # else: the encoder updates the baseline's digest from the changed elements (O(patch))
        timing = StepTiming(snap.seconds, time.perf_counter() - t0)
        await self._guard.check(snap.step)
        if self._base is None:
            assert digest is not None
            return await self._anchor_instead(snap, digest, timing)
        try:
            report, digest = await self._publish_patch(snap, digest, timing)
        except ConflictError:
            raise
        except PulseSyncError as e:
            log.warning("step %d: the patch failed (%s); publishing an anchor for this step instead", snap.step, e)
            return await self._anchor_instead(snap, await self._full_digest(snap.state), timing)
        self._advance(snap, digest)
        self._schedule.patch_committed(report.wire_bytes)
        if self._schedule.due and (self._background is None or self._background.done()):
            self._schedule.anchor_started()
            self._history = None
            self._pool.retain(snap.state)  # released when the anchor is done
            self._background = asyncio.create_task(self._background_anchor(snap.step, snap.state, digest))

    async def _full_digest(self, state: State) -> StateDigest:
        codec = self.config.codec
        return await asyncio.to_thread(state_digest, state, codec.digest_algorithm, codec.threads)

    async def _anchor_instead(self, snap: HostCopy, digest: StateDigest, timing: StepTiming) -> None:
        """Publish the step as an anchor (no baseline yet, or its patch failed) and advance to it."""
        await self._publish_anchor(snap.step, snap.state, digest, timing)
        self._advance(snap, digest)
        self._schedule.anchor_started()
        self._history = None

    def _advance(self, snap: HostCopy, digest: StateDigest) -> None:
        """Move the baseline to a committed step (never called before the ready marker is written)."""
        old, self._base = self._base, VerifiedState(snap.step, snap.state, digest)
        if old is not None:
            self._pool.release(old.state)

    async def _publish_patch(
        self, snap: HostCopy, digest: StateDigest | None, timing: StepTiming
    ) -> tuple[StepReport, StateDigest]:
        """Encode, upload and commit a step's patch; returns its report and the new state's digest."""
        base = self._base
        assert base is not None
        report = StepReport(snap.step, "patch", snapshot_s=timing.snapshot_s, digest_s=timing.digest_s)
        report.dense_bytes = dense_bytes(snap.state)
        report.elements = sum(t.numel() for t in snap.state.values())
        key = layout.patch_key(snap.step, self.run_id)
        try:
            t0 = time.perf_counter()
            report.started = time.time()
            params = self.config.codec
            reference = self._history
            encoded = await asyncio.to_thread(
                encode, base.state, snap.state, params, base_digest=base.digest, new_digest=digest, reference=reference
            )
            patch, digest = encoded.data, encoded.digest
            ref = ObjectRef(key=key, size=len(patch), sha256=encoded.history.sha256)
            header = read_header(patch)
            report.changed_elements, report.wire_bytes = header.changed_elements, len(patch)
            t1 = time.perf_counter()
            await self.store.put(key, patch)
            t2 = time.perf_counter()
            coded_against = self._history_ref if header.reference_sha256 is not None else None
            manifest = patch_manifest(
                snap.step,
                base,
                self._schedule.anchor_step,
                [ref],
                digest,
                report.sizes(),
                params,
                coded_against,
                encoded.codings,
            )
            await self._commit(manifest)
            self._history, self._history_ref = encoded.history, ref
            report.encode_s, report.upload_s, report.commit_s = t1 - t0, t2 - t1, time.perf_counter() - t2
            report.ok = True
            return report, digest
        except PulseSyncError as e:
            report.error = f"{type(e).__name__}: {e}"
            raise
        finally:
            report.skipped_total = self.skipped
            self._report(report)

    async def _anchor_digest(self, step: int, state: State, kept: StateDigest) -> StateDigest:
        """The full digest of an anchor's state; one differing from the incrementally kept digest is reported.

        A mismatch means the baseline diverged from what was published (memory corruption, a bug):
        the patches since the last anchor do not verify at subscribers (they fall back), and this
        anchor, with its fully computed digest, starts a sound chain again.
        """
        if kept.algorithm not in INCREMENTAL:
            return kept  # computed in full already
        full = await self._full_digest(state)
        metrics.SCRUBBED_BYTES.labels("publisher").inc(dense_bytes(state))
        ok = full.root == kept.root
        metrics.SCRUBS.labels("publisher", "ok" if ok else "mismatch").inc()
        if not ok:
            log.error(
                "anchor %d: the state digest kept incrementally (%s) differs from the full one (%s; %s): the baseline "
                "diverged; publishing the anchor with the full digest",
                step,
                kept.root,
                full.root,
                full.describe_mismatch(kept),
            )
        return full

    async def _publish_anchor(
        self, step: int, state: State, digest: StateDigest, timing: StepTiming, step_committed: bool = False
    ) -> None:
        """Write, upload and commit an anchor: the step's commit, or (`step_committed`) an anchor added to it."""
        report = StepReport(step, "anchor", snapshot_s=timing.snapshot_s, digest_s=timing.digest_s)
        report.dense_bytes = dense_bytes(state)
        report.elements = report.changed_elements = sum(t.numel() for t in state.values())
        spool = Path(tempfile.mkdtemp(prefix=f"pulsesync-anchor-{step}-", dir=self.config.spool_dir))
        try:
            t0 = time.perf_counter()
            report.started = time.time()
            try:
                names = await asyncio.to_thread(
                    write_model_dir, state, spool, self.config.shard_size, dict(self._files)
                )
            except OSError as e:  # e.g. the spool disk is full: this anchor fails, the publisher goes on
                raise PulseSyncError(f"anchor {step}: cannot write its shards to {spool} ({e})") from e
            digest = await self._anchor_digest(step, state, digest)
            t1 = time.perf_counter()
            prefix = layout.anchor_dir(step, self.run_id)
            refs = []
            for name in names:
                done = await self.store.upload_file(prefix + name, spool / name)
                refs.append(ObjectRef(key=done.key, size=done.size, sha256=done.sha256))
            t2 = time.perf_counter()
            report.wire_bytes = sum(r.size for r in refs)
            shards = sum(1 for n in names if n.endswith(WEIGHT_SUFFIX))
            await self._commit(anchor_manifest(step, refs, digest, report.sizes(), shards), step_committed)
            report.encode_s, report.upload_s, report.commit_s = t1 - t0, t2 - t1, time.perf_counter() - t2
            report.ok = True
            self._schedule.anchor_committed(step)
        except PulseSyncError as e:
            report.error = f"{type(e).__name__}: {e}"
            raise
        finally:
            shutil.rmtree(spool, ignore_errors=True)
            report.skipped_total = self.skipped
            self._report(report)

    async def _background_anchor(self, step: int, state: dict[str, torch.Tensor], digest: StateDigest) -> None:
        """The anchor of a step whose patch is committed; the chain goes on while it uploads."""
        try:
            await self._publish_anchor(step, state, digest, StepTiming(0.0, 0.0), step_committed=True)
        except ConflictError as e:
            self._fatal = e
            log.error("anchor %d: %s", step, e)
        except PulseSyncError as e:
            self._schedule.anchor_failed()
            log.error("anchor %d: not published (%s: %s); retrying at the next step", step, type(e).__name__, e)
        finally:
            self._pool.release(state)

    def _report(self, report: StepReport) -> None:
        self.reports.append(report)
        report.record()

    async def _commit(self, manifest: PatchManifest | AnchorManifest, step_committed: bool = False) -> None:
        """Write the signed manifest as a ready marker (the step's commit unless `step_committed`); never overwrites."""
        self._guard.wrote(marker_key(manifest, step_committed))
        signed = manifest.model_copy(update={"stream_id": self.stream_id})
        await write_ready_marker(self.store, signed, self._key, step_committed)


def multi_rank() -> bool:
    """Whether this process is one rank of a torch.distributed job of several."""
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


class Publisher:
    """Blocking wrapper of AsyncPublisher for training loops: its pipeline runs on its own thread.

    On a torch.distributed job of several ranks, `Publisher(...)` is a `ShardedPublisher`: every
    rank constructs it and publishes its own `state_dict()`, each rank uploading what it owns
    (docs/sharding.md); `declared` names the owners of plain tensors there, and `group` is the
    process group its collectives use (default: a new gloo group of its own). `sharded=False`
    keeps one process publishing a whole state it gathered (constructed on that rank alone).
    """

    def __new__(
        cls,
        config: PublisherConfig,
        *,
        store: Store | None = None,
        signing_key: Ed25519PrivateKey | None = None,
        declared: Mapping[str, Ownership] | None = None,
        sharded: bool | None = None,
        group: Any = None,
    ) -> Any:
        if cls is Publisher and (sharded if sharded is not None else multi_rank()):
            from pulsesync.publisher.sharded import ShardedPublisher

            return ShardedPublisher(config, store=store, signing_key=signing_key, declared=declared, group=group)
        return super().__new__(cls)

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
            self._async = AsyncPublisher(config, store=store, signing_key=signing_key)
            self._loop.run(self._async.start())
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
    def run_id(self) -> str:
        """This run's id, part of every payload key it writes."""
        return self._async.run_id

    def publish(self, step: int, state: State, files: FileSource | None = None) -> None:
        """Copy the state to host memory on this thread and queue it; returns as soon as the copy is done."""
        self._async.check_step(step)
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
