"""The chain client: the trust in a prefix's chain. Which markers verify, which stream they are of, links.

Every manifest read is checked against the trusted keys and the stream pinned; what the listings
showed is the ready index (`ready_index.py`, no I/O), what is read is the fetcher's
(`fetcher.py`: bounded reads, objects checked against their manifest). Shared by the publisher,
the subscriber, retention, `pulsesync inspect` and `pulsesync verify`; states are built from
what it reads in `pulsesync.rebuild`.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import logging
from collections.abc import Callable, Mapping

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

from pulsesync.errors import (
    ForeignStreamError,
    IntegrityError,
    NotFoundError,
    ReplayError,
)
from pulsesync.metrics import MARKERS_REJECTED
from pulsesync.protocol import layout
from pulsesync.protocol.fetcher import Fetcher
from pulsesync.protocol.manifest import (
    AnchorManifest,
    PatchManifest,
    check_newer,
    verify_manifest,
)
from pulsesync.protocol.ready_index import ReadyIndex
from pulsesync.store import ObjectInfo, Store

log = logging.getLogger("pulsesync.chain")
_VERIFIED_KEPT = 16  # raw markers kept for verified_marker()


class ChainClient:
    """The one client of a prefix's chain: ready listing, verified manifests, stream pinning, link walking.

    Used by the subscriber, the publisher (second-publisher detection, resume), retention and
    `inspect`/`verify`. Ready markers are listed incrementally: each refresh lists only the keys
    after the last one seen (`index`). Objects are read through `fetcher`.
    """

    def __init__(
        self,
        store: Store,
        trusted: Mapping[str, Ed25519PublicKey],
        threads: int | None = 1,
        *,
        stream_id: str | None = None,
        speculate: bool = False,
        payload_wait_seconds: float = 0.0,
    ) -> None:
        self.store = store
        self.trusted = trusted
        self.fetcher = Fetcher(store, threads, payload_wait_seconds)
        self.index = ReadyIndex()
        self.stream_id = stream_id  # when set, manifests of any other stream are refused (ForeignStreamError)
        # Read a run's next patch beside its marker (protocol/speculation.py): a follower's fast path.
        self.speculate = speculate
        self.manifests_verified = 0
        self.published_at: dict[int, dt.datetime] = {}  # creation times of the recent manifests read
        self.rejected: dict[str, str] = {}  # ready key -> why its marker did not verify
        self.last_rejection: IntegrityError | None = None
        self._verified: dict[int, tuple[bytes, PatchManifest | AnchorManifest, str]] = {}

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
        index = self.index
        if from_start:
            index.clear()
        found = []
        async for info in self.store.list(layout.READY_PREFIX, start_after=index.last_key):
            if info.key not in self.rejected and (entry := index.listed(info.key)):
                found.append((entry, info))
        if anchors:
            async for info in self.store.list(layout.ANCHOR_READY_PREFIX, start_after=index.last_anchor_key):
                if info.key not in self.rejected and (step := index.listed_anchor(info.key)) is not None:
                    found.append((layout.ReadyEntry(step, "anchor"), info))
        return found

    async def resolve(self, step: int) -> None:
        """Learn the kind of a step's commit marker (one verified read; nothing to do once known)."""
        key = self.index.unresolved.get(step)
        if key is None:
            return
        manifest = await self._read_verified(step, key)
        if step in self.index.unresolved:
            self.index.resolved(step, manifest.kind, key)  # the commit decides the kind, also over a listed anchor

    async def newest_verified(self) -> int | None:
        """The newest ready step with a marker that verifies; None if there is none.

        A marker that does not verify (forged, malformed, another stream's, a replay) is skipped and
        remembered in `rejected`, so one bad key never blocks the steps below it. Store errors raise.
        """
        await self.refresh()
        for step in sorted(self.index.steps, reverse=True):
            if step in self._verified:  # markers never change: verified once is enough
                return step
            while (key := self.index.commit_key_of(step)) is not None:  # a legacy step's other marker after a bad one
                try:
                    await self.commit_manifest(step)
                    return step
                except NotFoundError:
                    continue
                except IntegrityError as e:
                    self.reject(key, e)
        return None

    async def commit_manifest(self, step: int) -> PatchManifest | AnchorManifest:
        """The verified manifest a step was committed with, whatever its kind."""
        await self.resolve(step)
        kinds = self.index.steps.get(step, set())
        if not kinds:
            raise NotFoundError(f"{self.store.url}: step {step} has no ready marker")
        return await self.manifest(step, "patch" if "patch" in kinds else "anchor")

    def reject(self, key: str, error: IntegrityError) -> None:
        """Forget a marker that does not verify; it is never listed again."""
        self.rejected[key] = f"{type(error).__name__}: {error}"
        self.last_rejection = error
        self.index.forget(key)
        self.index.list_again_after_kept()
        MARKERS_REJECTED.inc()
        log.warning("skipping ready marker %s%s: %s", self.store.url, key, self.rejected[key])

    def verified_marker(self, step: int) -> tuple[bytes, PatchManifest | AnchorManifest] | None:
        """The raw bytes and manifest of the last marker verified for a step (recent steps only)."""
        known = self._verified.get(step)
        return None if known is None else (known[0], known[1])

    async def ready(self) -> dict[int, set[layout.Kind]]:
        """Ready steps and the kinds known of each, anchors included, refreshed with listings after the last keys."""
        await self.refresh(anchors=True)
        return self.index.steps

    @property
    def listed(self) -> dict[int, set[layout.Kind]]:
        """Ready steps and the kinds known of each as of the last listing (no store request).

        A step committed under its commit key has no kind here until a manifest read tells it
        (`resolve`, `commit_manifest`, `manifest`, `walk`).
        """
        return self.index.steps

    # --- manifests -----------------------------------------------------------------------------
    async def marker(self, key: str) -> bytes:
        """The raw bytes of a ready marker, not yet verified; a marker gone since it was listed is forgotten."""
        try:
            return await self.fetcher.marker(key)
        except NotFoundError:  # removed by retention since it was listed
            self.index.forget(key)
            raise

    async def manifest(
        self, step: int, kind: layout.Kind, newer_than: int | None = None
    ) -> PatchManifest | AnchorManifest:
        """The verified manifest of a step's patch or anchor (a marker verified before is not read again)."""
        await self.resolve(step)
        if step not in self.index.steps:  # not listed (e.g. a publisher reading back what it wrote): found by name
            await self._find(step, kind)
        key = self.index.key_of(step, kind)
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
            self.index.learn(step, found.kind, key)
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
        before = max((s for s in self.index.steps if s < step), default=None)
        known = self._verified.get(before) if before is not None else None
        if known is None or known[1].kind != "patch" or len(known[1].objects) != 1:
            return
        last = known[1].objects[0]
        key = layout.next_patch_key(last.key, step)
        if key is None or self.fetcher.reading_ahead == key:
            return
        await self.fetcher.drop_read_ahead()
        # Bounded by the run's last patch: a much larger one (or anything put under the key) is read as usual.
        self.fetcher.read_ahead(key, max_size=4 * last.size + (1 << 20))

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
                if "patch" in self.index.steps.get(at, ()):
                    link = await self.manifest(at, "patch", newer_than)
                    assert isinstance(link, PatchManifest)
                    links.append(link)
                    base = link.base_step
                    if not stop_at(base):
                        await self.resolve(base)
                at = walker.send(base)
        except StopIteration as done:
            return done.value, links[::-1]
