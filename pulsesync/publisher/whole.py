"""A world of one publishing the whole model: each step a patch against the last committed state, anchors as HF
model directories (every `anchor_interval` steps or past `anchor_bytes_budget`, in the background after the
step's patch; and in place of a patch that could not be published).

Commit protocol per step: upload the payload (under a key unique to this run), then write the
signed manifest as the ready marker with put-if-absent, and only then advance the baseline. A
failed publish leaves the baseline at the last committed state, so the next patch is computed
against what subscribers can actually hold.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import shutil
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import torch
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from pulsesync import metrics, state_cache
from pulsesync.codec import PatchHistory, StepHistory, encode, read_header
from pulsesync.codec.history_file import HISTORY_FILE, history_bytes
from pulsesync.digest import INCREMENTAL, StateDigest, state_digest
from pulsesync.dtypes import State, dense_bytes
from pulsesync.errors import ConflictError, PulseSyncError
from pulsesync.model_dir import WEIGHT_SUFFIX, write_model_dir
from pulsesync.progress import phase
from pulsesync.protocol import layout, signing
from pulsesync.protocol.chain import ChainClient
from pulsesync.protocol.manifest import AnchorManifest, ObjectRef, PatchManifest
from pulsesync.publisher.commit import anchor_manifest, marker_key, patch_manifest, write_ready_marker
from pulsesync.publisher.config import PublisherConfig
from pulsesync.publisher.host_copy import HostCopy, HostCopyPool, read_files
from pulsesync.publisher.ownership import PrefixGuard, newest_own
from pulsesync.publisher.report import StepReport, StepTiming
from pulsesync.publisher.resume import resume_baseline
from pulsesync.publisher.rounds import Record, Rounds
from pulsesync.publisher.schedule import AnchorSchedule
from pulsesync.store import Store
from pulsesync.verified import VerifiedState

log = logging.getLogger("pulsesync.publisher")


class WholeModelRounds(Rounds):
    """One process's rounds: the whole state, a patch or an anchor a step."""

    def __init__(self, config: PublisherConfig, store: Store, key: Ed25519PrivateKey, record: Record) -> None:
        self.config, self.store, self._key, self._record = config, store, key, record
        self.run_id = secrets.token_hex(4)
        self.stream_id = secrets.token_hex(8)
        self.pool = HostCopyPool(keep=config.max_pending + 1)
        self._files = read_files({p.name: p for p in config.extra_files})
        self._background: asyncio.Task[None] | None = None
        self._base: VerifiedState | None = None  # the last committed state: what every subscriber can hold
        self._ready: dict[int, set[layout.Kind]] = {}  # the prefix's commits up to our newest, from `scan`
        # What the base step's patch changed, and that patch: the reference of the next patch (an anchor added
        # to the step carries it). None after an anchor in place of a patch: there is no patch to code against.
        self._history: PatchHistory | None = None
        self._history_ref: ObjectRef | None = None
        self._schedule = AnchorSchedule(config.anchor_interval, config.anchor_bytes_budget)
        self.chain = ChainClient(store, signing.trusted_keys([key.public_key()]), config.codec.threads or 1)
        self._guard = PrefixGuard(self.chain)

    async def scan(self) -> int:
        """Read the prefix's ready markers: the stream to continue and the newest step."""
        await self._guard.scan()
        newest, last_step = await newest_own(self.chain, self.config.take_over_prefix, self.stream_id)
        ready = {s: k for s, k in (await self.chain.ready()).items() if newest is not None and s <= newest}
        if newest is not None:
            found = self.chain.verified_marker(newest)
            assert found is not None
            self.stream_id = found[1].stream_id or self.stream_id  # the prefix's stream goes on
        self.chain.stream_id = self.stream_id
        self._ready = ready
        return max(ready) if ready else last_step

    async def resume(self) -> None:
        ready = self._ready
        if not ready or not self.config.resume:
            return
        self._base = await resume_baseline(self.chain, ready, self.config.cache_dir, self.config.codec.threads)
        if self._base is not None:
            self._files = self._base.files | self._files  # what subscribers serve: a step's new files need an anchor
            with contextlib.suppress(PulseSyncError):  # the kinds since the last anchor, for the schedule
                await self.chain.walk(max(ready), lambda s: "anchor" in ready.get(s, ()))
            self._schedule.resume(ready)
        await self._resume_history()

    async def _resume_history(self) -> None:
        """Take up the history of the baseline's patch (rebuilt, or cached beside the state), so the next patch
        is history-coded as an uninterrupted publisher codes it; a history that is not that patch's is dropped."""
        history = self._base.history if self._base is not None else None
        if history is None or self._base is None:
            return
        last_patch = await self.chain.manifest(self._base.step, "patch")
        own = history.get(last_patch.objects[0].sha256) if len(last_patch.objects) == 1 else None
        if own is not None:
            self._history, self._history_ref = own, last_patch.objects[0]
        else:
            log.warning(
                "step %d: the cached patch history is not its patch's; the next patch is coded without it",
                self._base.step,
            )

    def copy(self, step: int, state: State, files: dict[str, bytes]) -> HostCopy:
        t0 = time.perf_counter()
        buffers = self.pool.copy(state)
        return HostCopy(step, buffers, time.perf_counter() - t0, files)

    def baseline(self) -> State:
        return self._base.state if self._base is not None else {}

    @property
    def owned_bytes(self) -> int:
        return dense_bytes(self._base.state) if self._base is not None else 0

    def holds(self, snap: HostCopy) -> bool:
        return self._base is not None and self._base.state is snap.state

    async def drain(self) -> None:
        if self._background is not None:
            await self._background

    async def close(self) -> None:
        if self.config.cache_dir is not None and self._base is not None:
            history = StepHistory.of(self._history) if self._history is not None else None
            await asyncio.to_thread(state_cache.save, self.config.cache_dir, replace(self._base, history=history))

    async def publish(self, snap: HostCopy) -> None:
        # Only anchors carry files: a step whose files changed (a LoRA adapter's new rank) is one.
        files_changed = any(self._files.get(name) != data for name, data in snap.files.items())
        self._files |= snap.files
        t0 = time.perf_counter()
        algorithm = self.config.codec.digest_algorithm
        digest: StateDigest | None = None
        base = self._base
        anchor = base is None or files_changed
        if base is None or anchor or algorithm not in INCREMENTAL or base.digest.algorithm != algorithm:
            digest = await self._full_digest(snap.state)
        # else: the encoder updates the baseline's digest from the changed elements (O(patch))
        timing = StepTiming(snap.seconds, time.perf_counter() - t0)
        await self._guard.check(snap.step)
        if anchor:
            assert digest is not None
            if base is not None:
                log.info("step %d: its files changed; published as an anchor, which carries them", snap.step)
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
            self.pool.retain(snap.state)  # released when the anchor is done
            # The anchor carries this step's patch history: the next patch is history-coded all the same.
            history = StepHistory.of(self._history) if self._history is not None else None
            self._background = asyncio.create_task(self._background_anchor(snap.step, snap.state, digest, history))

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
        old, self._base = self._base, VerifiedState(snap.step, snap.state, digest, dict(self._files))
        if old is not None:
            self.pool.release(old.state)

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
            self._record(report)

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
        self,
        step: int,
        state: State,
        digest: StateDigest,
        timing: StepTiming,
        step_committed: bool = False,
        history: StepHistory | None = None,
    ) -> None:
        """Write, upload and commit an anchor: the step's commit, or (`step_committed`) an anchor added to it,
        carrying the history of the step's patch."""
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
                if history is not None:
                    names.append(HISTORY_FILE.format(part=0))
                    (spool / names[-1]).write_bytes(await asyncio.to_thread(history_bytes, history))
            except OSError as e:  # e.g. the spool disk is full: this anchor fails, the publisher goes on
                raise PulseSyncError(f"anchor {step}: cannot write its shards to {spool} ({e})") from e
            digest = await self._anchor_digest(step, state, digest)
            t1 = time.perf_counter()
            prefix = layout.anchor_dir(step, self.run_id)
            refs = []
            with phase(f"anchor {step}: upload", sum((spool / name).stat().st_size for name in names)) as shown:
                for name in names:
                    done = await self.store.upload_file(prefix + name, spool / name, progress=shown.transfer)
                    refs.append(ObjectRef(key=done.key, size=done.size, sha256=done.sha256))
            t2 = time.perf_counter()
            report.wire_bytes = sum(r.size for r in refs)
            shards = sum(1 for n in names if n.endswith(WEIGHT_SUFFIX))
            histories = [prefix + HISTORY_FILE.format(part=0)] if history is not None else []
            manifest = anchor_manifest(step, refs, digest, report.sizes(), shards, histories)
            await self._commit(manifest, step_committed)
            report.encode_s, report.upload_s, report.commit_s = t1 - t0, t2 - t1, time.perf_counter() - t2
            report.ok = True
            self._schedule.anchor_committed(step)
        except PulseSyncError as e:
            report.error = f"{type(e).__name__}: {e}"
            raise
        finally:
            shutil.rmtree(spool, ignore_errors=True)
            self._record(report)

    async def _background_anchor(
        self, step: int, state: dict[str, torch.Tensor], digest: StateDigest, history: StepHistory | None
    ) -> None:
        """The anchor of a step whose patch is committed; the chain goes on while it uploads."""
        try:
            await self._publish_anchor(step, state, digest, StepTiming(0.0, 0.0), True, history)
        except ConflictError as e:
            self.fatal = e
            log.error("anchor %d: %s", step, e)
        except PulseSyncError as e:
            self._schedule.anchor_failed()
            log.error("anchor %d: not published (%s: %s); retrying at the next step", step, type(e).__name__, e)
        finally:
            self.pool.release(state)

    async def _commit(self, manifest: PatchManifest | AnchorManifest, step_committed: bool = False) -> None:
        """Write the signed manifest as a ready marker (the step's commit unless `step_committed`); never overwrites."""
        self._guard.wrote(marker_key(manifest, step_committed))
        signed = manifest.model_copy(update={"stream_id": self.stream_id})
        await write_ready_marker(self.store, signed, self._key, step_committed)
