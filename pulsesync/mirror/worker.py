"""The mirror: copies each committed step of one store (the origin, or another mirror) to another, in commit order.

Nothing the origin serves is trusted: each marker is verified (signature, step) and each object
it lists is checked against its signed size and SHA-256 before a byte of it is written to the
target, so a mirror never holds what a subscriber would refuse. A mirror copies one publishing
stream, pinned as a subscriber pins it: `stream_id` when set, else the stream of the target's
newest step, else (an empty target) that of the origin's newest anchor. Markers of any other
stream (a lying upstream offering another run signed with the same key) are skipped and
counted, and the target's own markers of another stream never decide where copying resumes, so
they cannot freeze it. A step is copied payloads
first, its marker last with put-if-absent, then the pointer: a crash at any point leaves the
target without that step's marker, and the next run copies the step again (copies are
idempotent: the same bytes under the same keys). The target's own retention, when configured,
runs after the copies; the mirror never copies a step older than the newest the target holds.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import logging
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

from pulsesync import metrics
from pulsesync.errors import ConfigError, ConflictError, IntegrityError, NotFoundError, PulseSyncError
from pulsesync.mirror.config import MirrorConfig
from pulsesync.mirror.plan import first_step, marker_step, to_copy
from pulsesync.protocol import layout
from pulsesync.protocol.chain import ChainClient
from pulsesync.protocol.manifest import MAX_MANIFEST_BYTES, ObjectRef, verify_manifest
from pulsesync.retention.worker import RetentionWorker
from pulsesync.store import Store

log = logging.getLogger("pulsesync.mirror")
_IN_MEMORY_BYTES = 8 << 20  # objects up to this are copied through memory; larger ones through a file (multipart)


@dataclass
class MirrorRun:
    """What one pass copied."""

    steps: list[int] = field(default_factory=list)  # steps whose commit was copied
    bytes_copied: int = 0  # payload and marker bytes written to the target
    copied: dict[str, int] = field(default_factory=dict)  # the marker keys written (key -> step)
    skipped: list[str] = field(default_factory=list)  # origin markers not copied, and why

    @property
    def markers(self) -> int:
        """Markers copied (commits and added anchors)."""
        return len(self.copied)

    def summary(self) -> str:
        """One line for the log and `--once`."""
        steps = f"steps {self.steps[0]}..{self.steps[-1]}" if self.steps else "no new step"
        skipped = f", {len(self.skipped)} skipped" if self.skipped else ""
        return f"copied {steps} ({self.markers} markers, {self.bytes_copied} bytes){skipped}"


class Mirror:
    """Follows an origin's chain and copies it to a target; `run_once()` is one pass, `run()` the daemon."""

    def __init__(
        self, origin: Store, target: Store, config: MirrorConfig, trusted: Mapping[str, Ed25519PublicKey]
    ) -> None:
        if not trusted:
            raise ConfigError("trusted_keys: a mirror verifies every marker and needs the publisher's public key")
        self.origin = ChainClient(
            origin, trusted, stream_id=config.stream_id, payload_wait_seconds=config.payload_wait_seconds
        )
        self.trusted = trusted
        self.target = target
        self._target_streams: dict[str, str | None] = {}  # target commit key -> its stream (None: does not verify)
        self.config = config
        self.retention = RetentionWorker(target, config.retention, trusted) if config.retention else None
        self.skipped: dict[str, str] = {}  # origin marker key -> why it is not copied (not tried again)
        self._retained_at: float | None = None

    async def _target_markers(self) -> dict[str, int]:
        """The target's ready markers (key -> step): what it holds, whatever wrote it."""
        held = {}
        for prefix in (layout.READY_PREFIX, layout.ANCHOR_READY_PREFIX):
            async for info in self.target.list(prefix):
                if (step := marker_step(info.key)) is not None:
                    held[info.key] = step
        return held

    async def _stream_held(self, key: str, step: int) -> str | None:
        """The stream of a target commit marker that verifies (read once: markers never change); None otherwise."""
        if key not in self._target_streams:
            try:
                data = await self.target.get(key, max_size=MAX_MANIFEST_BYTES)
                manifest = verify_manifest(data, self.trusted, name=f"{self.target.url}{key}")
                self._target_streams[key] = manifest.stream_id if manifest.step == step else None
            except (NotFoundError, IntegrityError):
                self._target_streams[key] = None
        return self._target_streams[key]

    async def _newest_held(self, held: Mapping[str, int]) -> int | None:
        """The target's newest step of the stream copied (pinned here from the target's newest, if not yet)."""
        commits = sorted(((s, k) for k, s in held.items() if k.startswith(layout.READY_PREFIX)), reverse=True)
        for step, key in commits:
            stream = await self._stream_held(key, step)
            if stream is not None and self.origin.stream_id in (None, stream):
                self.origin.pin_stream(stream)
                return step
        return None

    async def _origin_markers(self) -> dict[str, int]:
        await self.origin.refresh(anchors=True)
        return {key: step for key in self.origin.index.marker_keys if (step := marker_step(key)) is not None}

    async def _newest_anchor(self, origin: Mapping[str, int]) -> int | None:
        """The origin's newest step with an anchor that verifies: where an empty target starts."""
        added = {step for key, step in origin.items() if key.startswith(layout.ANCHOR_READY_PREFIX)}
        for step in sorted({s for k, s in origin.items() if k.startswith(layout.READY_PREFIX)}, reverse=True):
            try:
                manifest = await self.origin.commit_manifest(step)  # of the pinned stream, if one is pinned
            except (NotFoundError, IntegrityError) as e:
                log.debug("step %d: %s", step, e)
                continue
            if step in added or manifest.kind == "anchor":
                self.origin.pin_stream(manifest.stream_id)
                return step
        return max(added, default=None)

    async def run_once(self) -> MirrorRun:
        """List both stores, copy what the target lacks in commit order, then prune the target if configured."""
        done = MirrorRun()
        origin, held = await self._origin_markers(), await self._target_markers()
        newest_origin = max(origin.values(), default=None)
        newest_held = await self._newest_held(held)
        if newest_origin is not None:
            anchor = None if newest_held is not None else await self._newest_anchor(origin)
            start = first_step(newest_held, [] if anchor is None else [anchor], newest_origin)
            for key in to_copy(origin, held, start):
                if key in self.skipped:
                    continue
                try:
                    await self._copy_marker(key, origin[key], done)
                except (IntegrityError, ConflictError) as e:  # never copied: a subscriber would refuse it
                    self.skipped[key] = f"{type(e).__name__}: {e}"
                    done.skipped.append(key)
                    metrics.MIRROR_SKIPPED.inc()
                    log.warning("mirror: not copying %s%s: %s", self.origin.store.url, key, self.skipped[key])
                except NotFoundError as e:  # an object the marker lists: not yet (a replica), or pruned under it
                    log.warning("mirror: %s; the pass stops here, the next copies the step", e)
                    break
        await self._report_lag(origin, max([-1 if newest_held is None else newest_held, *done.steps]))
        await self._retain()
        if done.markers:
            log.info("mirror %s -> %s: %s", self.origin.store.url, self.target.url, done.summary())
        return done

    async def _copy_marker(self, key: str, step: int, done: MirrorRun) -> None:
        """Copy one marker's objects (each verified), then the marker itself, put-if-absent; then the pointer."""
        try:
            data, manifest = await self.origin.read_marker(step, key)
        except NotFoundError:  # removed by the origin's retention since the listing: nothing to copy
            log.info("mirror: %s%s is gone from the origin", self.origin.store.url, key)
            return
        for ref in manifest.objects:
            done.bytes_copied += await self._copy_object(ref)
        try:
            await self.target.put_if_absent(key, data)
        except ConflictError:
            there = await self.target.get(key, max_size=MAX_MANIFEST_BYTES)
            if there != data:
                raise ConflictError(f"{self.target.url}{key}: the target holds another marker under this key") from None
        done.bytes_copied += len(data)
        done.copied[key] = step
        metrics.MIRROR_BYTES.labels("out").inc(len(data))
        if key.startswith(layout.READY_PREFIX):
            done.steps.append(step)
            metrics.MIRROR_STEPS.inc()
            # A hint for subscribers polling the target (subscriber/poll.py); the marker decides as always.
            await self.target.put(layout.POINTER_KEY, layout.pointer_body(step))

    async def _copy_object(self, ref: ObjectRef) -> int:
        """One object a verified manifest lists, checked against its size and SHA-256, then written to the target."""
        if ref.size <= _IN_MEMORY_BYTES:
            data = await self.origin.fetcher.fetch(ref)
            metrics.MIRROR_BYTES.labels("in").inc(len(data))
            await self.target.put(ref.key, data)
        else:
            with tempfile.TemporaryDirectory(prefix="pulsesync-mirror-") as spool:
                path = Path(spool) / "object"
                store = self.origin.store
                await self.origin.fetcher.patiently(
                    ref.key,
                    lambda: store.download_file(ref.key, path, expected_sha256=ref.sha256, expected_size=ref.size),
                )
                metrics.MIRROR_BYTES.labels("in").inc(ref.size)
                await self.target.upload_file(ref.key, path)
        metrics.MIRROR_BYTES.labels("out").inc(ref.size)
        return ref.size

    async def _report_lag(self, origin: Mapping[str, int], newest_held: int) -> None:
        """Steps the target lacks, and seconds since the first of them was published (0 when caught up)."""
        commits = {s for k, s in origin.items() if k.startswith(layout.READY_PREFIX) and k not in self.skipped}
        missing = sorted(s for s in commits if s > newest_held)
        metrics.MIRROR_LAG_STEPS.set(len(missing))
        age = 0.0
        if missing:
            with contextlib.suppress(PulseSyncError):
                published = (await self.origin.commit_manifest(missing[0])).created
                age = (dt.datetime.now(dt.timezone.utc) - published).total_seconds()
        metrics.MIRROR_LAG_SECONDS.set(max(age, 0.0))

    async def _retain(self) -> None:
        if self.retention is None:
            return
        now = asyncio.get_running_loop().time()
        if self._retained_at is not None and now - self._retained_at < self.retention.policy.interval_seconds:
            return
        self._retained_at = now
        await self.retention.run_once()

    async def run(self, stop: asyncio.Event) -> None:
        """Copy every interval_seconds until stop is set; a failed pass is logged and tried again."""
        while not stop.is_set():
            try:
                await self.run_once()
            except PulseSyncError as e:
                log.error("mirror pass failed: %s: %s", type(e).__name__, e)
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(stop.wait(), self.config.interval_seconds)
