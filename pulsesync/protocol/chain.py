"""The chain client: ready listing, verified manifests and objects, link walking.

Everything read is checked before use: manifests against trusted keys, objects against the size
and SHA-256 their manifest lists. Shared by the publisher, the subscriber, retention, `pulsesync
inspect` and `pulsesync verify`; states are built from what it reads in `pulsesync.rebuild`.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import hashlib
import logging
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import TypeVar

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey
from tenacity import AsyncRetrying, retry_if_exception_type, stop_after_delay, wait_exponential

from pulsesync.digest import StateDigest
from pulsesync.errors import (
    ForeignStreamError,
    IntegrityError,
    NotFoundError,
    ReplayError,
)
from pulsesync.metrics import MARKERS_REJECTED, PAYLOAD_WAITS
from pulsesync.protocol import layout
from pulsesync.protocol.manifest import (
    MAX_MANIFEST_BYTES,
    AnchorManifest,
    ObjectRef,
    PatchManifest,
    check_newer,
    verify_manifest,
)
from pulsesync.protocol.speculation import Speculation
from pulsesync.store import ObjectInfo, Store

log = logging.getLogger("pulsesync.chain")
_VERIFIED_KEPT = 16  # raw markers kept for verified_marker()
_WAITS_KEPT = 1024  # payload keys whose wait deadline is remembered
T = TypeVar("T")


@dataclass
class ChainClient:
    """The one client of a prefix's chain: incremental ready listing, verified reads, link walking, rebuilds.

    Used by the subscriber, the publisher (second-publisher detection, resume), retention and
    `inspect`/`verify`. Ready markers are listed incrementally: each refresh lists only the keys
    after the last one seen.
    """

    store: Store
    trusted: Mapping[str, Ed25519PublicKey]
    threads: int | None = 1
    bytes_downloaded: int = 0
    manifests_verified: int = 0
    published_at: dict[int, dt.datetime] = field(default_factory=dict)  # creation times of the recent manifests read
    stream_id: str | None = None  # when set, manifests of any other stream are refused (ForeignStreamError)
    rejected: dict[str, str] = field(default_factory=dict)  # ready key -> why its marker did not verify
    last_rejection: IntegrityError | None = None
    # Read a run's next patch beside its marker (protocol/speculation.py): a follower's fast path.
    speculate: bool = False
    # A replica that copies objects in any order (S3 replication, rclone, filer.sync) can show a marker
    # before its payload: a payload not found is read again, with backoff, for this long before it counts.
    payload_wait_seconds: float = 0.0
    _ahead: Speculation | None = None
    _ready: dict[int, set[layout.Kind]] = field(default_factory=dict)  # the kinds known of each listed step
    _keys: dict[tuple[int, layout.Kind], str] = field(default_factory=dict)  # the marker key of each (step, kind)
    _unresolved: dict[int, str] = field(default_factory=dict)  # commit keys whose kind no manifest read told yet
    _last_key: str | None = None
    _last_anchor_key: str | None = None
    _verified: dict[int, tuple[bytes, PatchManifest | AnchorManifest, str]] = field(default_factory=dict)
    _wait_ends: dict[str, float] = field(default_factory=dict)  # payload key -> monotonic end of its one wait

    # --- the ready listing ---------------------------------------------------------------------
    def pin_stream(self, stream_id: str) -> None:
        """Follow this stream from now on, unless one is pinned already: later manifests must be of it."""
        if self.stream_id is None and stream_id:
            self.stream_id = stream_id
            log.info("following publishing stream %s", stream_id)

    async def refresh(
        self, *, from_start: bool = False, anchors: bool = False
    ) -> list[tuple[layout.ReadyEntry, ObjectInfo]]:
        """List the ready markers after the last key seen (every one with from_start); returns those found.

        Commit keys (`ready/{step}.json`) are listed with kind None until a manifest read tells it.
        With `anchors`, the anchors added to patch steps (`ready-anchors/`) are listed too: only the
        slow path, the publisher's resume, retention and inspect need them, not a follower's poll.
        """
        if from_start:
            self._ready, self._keys, self._unresolved = {}, {}, {}
            self._last_key = self._last_anchor_key = None
        found = []
        async for info in self.store.list(layout.READY_PREFIX, start_after=self._last_key):
            # Only a marker advances the position: a stray key (notes.txt, _SUCCESS) sorts after
            # every step and would hide the markers published after it.
            if (entry := layout.parse_ready_key(info.key)) and info.key not in self.rejected:
                self._last_key = info.key
                self._ready.setdefault(entry.step, set())
                if entry.kind is None:
                    self._unresolved[entry.step] = info.key
                else:
                    self._learn(entry.step, entry.kind, info.key)
                found.append((entry, info))
        if anchors:
            async for info in self.store.list(layout.ANCHOR_READY_PREFIX, start_after=self._last_anchor_key):
                step = layout.parse_anchor_ready_key(info.key)
                if step is not None and info.key not in self.rejected:
                    self._last_anchor_key = info.key
                    self._ready.setdefault(step, set())
                    if (step, "anchor") not in self._keys:  # an anchor that is the step's commit comes first
                        self._learn(step, "anchor", info.key)
                    found.append((layout.ReadyEntry(step, "anchor"), info))
        return found

    def _learn(self, step: int, kind: layout.Kind, key: str) -> None:
        self._keys[(step, kind)] = key
        self._ready.setdefault(step, set()).add(kind)

    def learned(self, step: int, kind: layout.Kind, key: str) -> None:
        """Record the kind of a listed marker the caller verified before (retention keeps what it verified)."""
        if self._unresolved.get(step) == key:
            del self._unresolved[step]
        self._learn(step, kind, key)

    async def resolve(self, step: int) -> None:
        """Learn the kind of a step's commit marker (one verified read; nothing to do once known)."""
        key = self._unresolved.get(step)
        if key is None:
            return
        manifest = await self._read_verified(step, key)
        if self._unresolved.pop(step, None) is not None:
            self._learn(step, manifest.kind, key)  # the commit decides the kind, also over a listed anchor

    async def newest_verified(self) -> int | None:
        """The newest ready step with a marker that verifies; None if there is none.

        A marker that does not verify (forged, malformed, another stream's, a replay) is skipped and
        remembered in `rejected`, so one bad key never blocks the steps below it. Store errors raise.
        """
        await self.refresh()
        for step in sorted(self._ready, reverse=True):
            if step in self._verified:  # markers never change: verified once is enough
                return step
            while (key := self.commit_key_of(step)) is not None:  # a legacy step's other marker after a bad one
                try:
                    await self.commit_manifest(step)
                    return step
                except NotFoundError:
                    continue
                except IntegrityError as e:
                    self.reject(key, e)
        return None

    def commit_key_of(self, step: int) -> str | None:
        """The key of the marker that commits a step: its commit key, or in legacy prefixes its patch marker
        (else its anchor marker); None if none is listed."""
        if step in self._unresolved:
            return self._unresolved[step]
        return self._keys.get((step, "patch")) or self._keys.get((step, "anchor"))

    async def commit_manifest(self, step: int) -> PatchManifest | AnchorManifest:
        """The verified manifest a step was committed with, whatever its kind."""
        await self.resolve(step)
        kinds = self._ready.get(step, set())
        if not kinds:
            raise NotFoundError(f"{self.store.url}: step {step} has no ready marker")
        return await self.manifest(step, "patch" if "patch" in kinds else "anchor")

    def reject(self, key: str, error: IntegrityError) -> None:
        """Forget a marker that does not verify; it is never listed again."""
        self.rejected[key] = f"{type(error).__name__}: {error}"
        self.last_rejection = error
        self._forget_key(key)
        # Markers published after a forged far-future one sort before it: list again from the newest kept.
        kept = [*self._keys.values(), *self._unresolved.values()]
        self._last_key = max((k for k in kept if k.startswith(layout.READY_PREFIX)), default=None)
        self._last_anchor_key = max((k for k in kept if k.startswith(layout.ANCHOR_READY_PREFIX)), default=None)
        MARKERS_REJECTED.inc()
        log.warning("skipping ready marker %s%s: %s", self.store.url, key, self.rejected[key])

    def verified_marker(self, step: int) -> tuple[bytes, PatchManifest | AnchorManifest] | None:
        """The raw bytes and manifest of the last marker verified for a step (recent steps only)."""
        known = self._verified.get(step)
        return None if known is None else (known[0], known[1])

    @property
    def last_listed(self) -> str | None:
        """The last key the ready listing has passed (markers up to it are known)."""
        return self._last_key

    async def ready(self) -> dict[int, set[layout.Kind]]:
        """Ready steps and the kinds known of each, anchors included, refreshed with listings after the last keys."""
        await self.refresh(anchors=True)
        return self._ready

    @property
    def listed(self) -> dict[int, set[layout.Kind]]:
        """Ready steps and the kinds known of each as of the last listing (no store request).

        A step committed under its commit key has no kind here until a manifest read tells it
        (`resolve`, `commit_manifest`, `manifest`, `walk`).
        """
        return self._ready

    @property
    def ready_keys(self) -> set[str]:
        """The marker keys of the last listing (no store request)."""
        return {*self._keys.values(), *self._unresolved.values()}

    def key_of(self, step: int, kind: layout.Kind) -> str | None:
        """The key of a step's marker of a kind, as listed; None if none is known."""
        return self._keys.get((step, kind))

    def forget(self, step: int, kind: layout.Kind) -> None:
        """Drop a marker from the listing (retention removed it)."""
        if (key := self._keys.get((step, kind))) is not None:
            self._forget_key(key)

    def _forget_key(self, key: str) -> None:
        for (step, kind), known in list(self._keys.items()):
            if known == key:
                del self._keys[(step, kind)]
                self._ready.get(step, set()).discard(kind)
        for step, known in list(self._unresolved.items()):
            if known == key:
                del self._unresolved[step]
        for step in {s for s, kinds in self._ready.items() if not kinds and s not in self._unresolved}:
            del self._ready[step]

    # --- manifests -----------------------------------------------------------------------------
    async def marker(self, key: str) -> bytes:
        """The raw bytes of a ready marker, not yet verified; a marker gone since it was listed is forgotten."""
        try:
            data = await self.store.get(key, max_size=MAX_MANIFEST_BYTES)
        except NotFoundError:  # removed by retention since it was listed
            self._forget_key(key)
            raise
        self.bytes_downloaded += len(data)
        return data

    async def manifest(
        self, step: int, kind: layout.Kind, newer_than: int | None = None
    ) -> PatchManifest | AnchorManifest:
        """The verified manifest of a step's patch or anchor (a marker verified before is not read again)."""
        await self.resolve(step)
        if step not in self._ready:  # not listed (e.g. a publisher reading back what it wrote): found by name
            await self._find(step, kind)
        key = self._keys.get((step, kind))
        if key is None:
            raise NotFoundError(f"{self.store.url}: step {step} has no ready {kind} marker")
        known = self._verified.get(step)
        if known is not None and known[2] == key:  # markers never change (put-if-absent): no second GET
            manifest = known[1]
            check_newer(manifest, newer_than, f"{self.store.url}{key}")
        else:
            manifest = await self._read_verified(step, key, newer_than)
        if manifest.kind != kind:
            raise IntegrityError(f"{self.store.url}{key}: holds the {manifest.kind} manifest of step {manifest.step}")
        return manifest

    async def read_marker(self, step: int, key: str) -> tuple[bytes, PatchManifest | AnchorManifest]:
        """A listed marker of a step read and verified (signature, step, stream), with its raw bytes."""
        manifest = await self._read_verified(step, key)
        return self._verified[step][0], manifest

    async def _find(self, step: int, kind: layout.Kind) -> None:
        """Learn the markers of a step no listing showed, by their names: its commit, and an anchor's own key."""
        names = [layout.commit_key(step), layout.legacy_ready_key(step, kind)]
        if kind == "anchor":
            names.insert(1, layout.anchor_ready_key(step))
        for key in names:
            try:
                found = await self._read_verified(step, key)
            except NotFoundError:
                continue
            self._learn(step, found.kind, key)
            if found.kind == kind:
                return

    async def _read_verified(
        self, step: int, key: str, newer_than: int | None = None
    ) -> PatchManifest | AnchorManifest:
        """Read and verify the marker at `key`, listed for `step`: signature, step, stream."""
        if self.speculate and not key.startswith(layout.ANCHOR_READY_PREFIX):  # a commit is mostly a patch
            await self._read_ahead(step)
        data = await self.marker(key)
        # In a thread: a patch read ahead is hashed meanwhile (the event loop hands it over).
        name = f"{self.store.url}{key}"
        manifest = await asyncio.to_thread(verify_manifest, data, self.trusted, newer_than=newer_than, name=name)
        self.manifests_verified += 1
        if manifest.step < step:  # an old, validly signed manifest put back under a newer key
            raise ReplayError(f"{name}: holds the manifest of the older step {manifest.step} (replay)")
        if manifest.step != step:
            raise IntegrityError(f"{name}: holds the {manifest.kind} manifest of step {manifest.step}")
        if key.startswith(layout.ANCHOR_READY_PREFIX) and manifest.kind != "anchor":
            raise IntegrityError(f"{name}: holds the {manifest.kind} manifest of step {manifest.step}")
        if self.stream_id is not None and manifest.stream_id != self.stream_id:
            raise ForeignStreamError(
                f"{name}: signed for stream {manifest.stream_id!r}, this chain is stream "
                f"{self.stream_id!r} (copied from another run or prefix)"
            )
        self.published_at[step] = manifest.created
        self._verified[step] = (data, manifest, key)
        while len(self._verified) > _VERIFIED_KEPT:  # bounded: a long run does not grow the client
            oldest = min(s for s in self._verified if s != step)
            del self._verified[oldest]
            self.published_at.pop(oldest, None)
        return manifest

    async def _read_ahead(self, step: int) -> None:
        """Start reading step's patch under the key its run would give it, if the step listed before it is a
        verified one-object patch (a follower one step behind; a chain walk guesses only for its first link)."""
        before = max((s for s in self._ready if s < step), default=None)
        known = self._verified.get(before) if before is not None else None
        if known is None or known[1].kind != "patch" or len(known[1].objects) != 1:
            return
        last = known[1].objects[0]
        key = layout.next_patch_key(last.key, step)
        if key is None or (self._ahead is not None and self._ahead.key == key):
            return
        await self.drop_read_ahead()
        # Bounded by the run's last patch: a much larger one (or anything put under the key) is read as usual.
        self._ahead = Speculation(self.store, key, max_size=4 * last.size + (1 << 20))

    async def drop_read_ahead(self) -> None:
        """Stop a patch read ahead that no fetch has taken."""
        if self._ahead is not None:
            ahead, self._ahead = self._ahead, None
            await ahead.cancel()
            self.bytes_downloaded += ahead.read_bytes

    async def walk(
        self, start: int, stop_at: Callable[[int], bool], newer_than: int | None = None
    ) -> tuple[layout.Walk, list[PatchManifest]]:
        """Follow base_step links from `start` (layout.walk_links) with verified patch manifests.

        A commit whose kind is not known yet is read before `stop_at` is asked of it, unless
        `stop_at` holds of its step already (a follower's held step costs no read).
        Returns the walk and the manifests passed through, oldest first (the order to apply them).
        """
        walker = layout.walk_links(start, stop_at)
        links: list[PatchManifest] = []
        await self.resolve(start)
        try:
            at = next(walker)
            while True:
                base = None
                if "patch" in self._ready.get(at, ()):
                    link = await self.manifest(at, "patch", newer_than)
                    assert isinstance(link, PatchManifest)
                    links.append(link)
                    base = link.base_step
                    if not stop_at(base):
                        await self.resolve(base)
                at = walker.send(base)
        except StopIteration as done:
            return done.value, links[::-1]

    async def fetch(self, ref: ObjectRef) -> bytes:
        """An object's bytes, checked against the size and SHA-256 its manifest lists."""
        if self._ahead is not None and self._ahead.key == ref.key:
            ahead, self._ahead = self._ahead, None
            read_ahead = await ahead.take(ref)
            self.bytes_downloaded += ahead.read_bytes
            if read_ahead is not None:
                return read_ahead
        # A larger object stops at size + 1 bytes.
        data = await self.patiently(ref.key, lambda: self.store.get(ref.key, max_size=ref.size))
        self.bytes_downloaded += len(data)
        await asyncio.to_thread(check_object, ref, data, f"{self.store.url}{ref.key}")
        return data

    async def patiently(self, key: str, read: Callable[[], Awaitable[T]]) -> T:
        """`read()` of a payload a verified marker lists, a NotFoundError tried again for payload_wait_seconds.

        On a replica that keeps no order the payload is "not yet", not gone: waiting for it here
        keeps a subscriber on its fast path (no slow-path storm when a fleet sees a marker early).
        An object is waited for once: its wait ends payload_wait_seconds after the first read that
        missed it, so a fast path that waited and the slow path after it (or a later sync) do not
        wait again for an object that was deleted, not delayed.
        """
        if self.payload_wait_seconds <= 0:
            return await read()
        try:
            return await read()
        except NotFoundError:
            now = time.monotonic()
            ends = self._wait_ends.setdefault(key, now + self.payload_wait_seconds)
            while len(self._wait_ends) > _WAITS_KEPT:  # bounded: the oldest waits are long over
                del self._wait_ends[next(iter(self._wait_ends))]
            if ends <= now:
                raise

        def waited(state: object) -> None:
            PAYLOAD_WAITS.inc()
            log.info("%s%s: listed by a verified marker, not there yet; reading it again", self.store.url, key)

        retrying = AsyncRetrying(
            stop=stop_after_delay(max(ends - time.monotonic(), 0.0)),
            wait=wait_exponential(multiplier=0.05, max=2.0),
            retry=retry_if_exception_type(NotFoundError),
            before_sleep=waited,
            reraise=True,
        )
        async for attempt in retrying:
            with attempt:
                found = await read()
                self._wait_ends.pop(key, None)
                return found
        raise AssertionError("unreachable")  # pragma: no cover

    async def fetch_patch(self, manifest: PatchManifest) -> bytes:
        """A patch's bytes: its one object, or a sharded step's parts concatenated (split_parts splits them)."""
        if len(manifest.objects) == 1:
            return await self.fetch(manifest.objects[0])
        return b"".join(await asyncio.gather(*map(self.fetch, manifest.objects)))


def split_parts(manifest: PatchManifest, data: bytes) -> list[bytes]:
    """A patch's bytes split into its objects' bytes by the sizes its signed manifest lists (checked by fetch)."""
    if len(data) != sum(ref.size for ref in manifest.objects):
        raise IntegrityError(
            f"patch {manifest.step}: {len(data)} bytes, its manifest lists {len(manifest.objects)} objects"
        )
    parts, at = [], 0
    for ref in manifest.objects:
        parts.append(data[at : at + ref.size])
        at += ref.size
    return parts


def check_patch(manifest: PatchManifest, data: bytes, where: str) -> None:
    """IntegrityError unless `data` is the patch's objects, each of the size and SHA-256 the manifest lists."""
    if len(manifest.objects) == 1:
        return check_object(manifest.objects[0], data, where)
    for ref, part in zip(manifest.objects, split_parts(manifest, data), strict=True):
        check_object(ref, part, f"{where} ({ref.key})")


def check_object(ref: ObjectRef, data: bytes, where: str) -> None:
    """IntegrityError unless `data` has the size and SHA-256 its manifest lists."""
    if len(data) != ref.size:
        raise IntegrityError(f"{where}: {len(data)} bytes, its manifest lists {ref.size}")
    sha = hashlib.sha256(data).hexdigest()
    if sha != ref.sha256:
        raise IntegrityError(f"{where}: SHA-256 {sha} does not match its manifest ({ref.sha256})")


def check_digest(actual: StateDigest, expected: StateDigest, what: str) -> None:
    """IntegrityError naming the differing tensors unless two state digests agree."""
    if actual.root != expected.root:
        raise IntegrityError(
            f"{what}: state digest {actual.root} does not match the manifest's {expected.root} "
            f"({actual.describe_mismatch(expected)})"
        )
