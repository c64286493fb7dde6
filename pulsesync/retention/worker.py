"""The retention worker: list a store, plan (pulsesync.retention.plan), execute; once or on an interval.

Execution order is the protocol's: a tombstone is written before its ready marker is removed, and
payload objects are deleted only after the grace period, tombstone last, so a crash at any point
leaves a state the next run finishes. Deleting is idempotent: objects already gone are fine.
Nothing in the store is trusted: ready markers are verified with the publisher's keys, tombstones
carry the signed marker they replace and are verified the same way, and an object that does not
verify or parse (a forged marker or tombstone, a stray key) is a counted, logged skip: it neither
keeps nor deletes anything, and never stops a run.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import hashlib
import logging
from collections.abc import Mapping

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

from pulsesync import metrics
from pulsesync.errors import ConfigError, IntegrityError, NotFoundError, PulseSyncError, StoreError
from pulsesync.protocol import layout
from pulsesync.protocol.chain import ChainClient
from pulsesync.protocol.fleet import read_fleet
from pulsesync.protocol.manifest import MAX_MANIFEST_BYTES, PatchManifest, parse_manifest, verify_manifest
from pulsesync.retention.plan import Entry, Plan, Published, StoreListing, Tombstone, plan
from pulsesync.retention.policy import RetentionPolicy
from pulsesync.store import ObjectInfo, Store
from pulsesync.store.base import check_key

log = logging.getLogger("pulsesync.retention")


class RetentionWorker:
    """Runs retention against one store; remembers what it has verified, never more than the store holds.

    A run costs what the store holds and what it deletes, not the run's history: a marker or
    tombstone is read and verified once, and the caches hold one entry per live object (no raw
    markers: a marker is read again when its tombstone is written).
    """

    def __init__(self, store: Store, policy: RetentionPolicy, trusted: Mapping[str, Ed25519PublicKey]) -> None:
        if not trusted:
            raise ConfigError("trusted_keys: retention verifies every marker and needs the publisher's public key")
        self.store = store
        self.policy = policy
        self.chain = ChainClient(store, trusted)
        self.skipped: dict[str, str] = {}  # key -> why it was not trusted (markers, tombstones, payload keys)
        self._manifests: dict[Entry, Published] = {}  # the ready markers the store holds, verified
        self._tombstones: dict[str, Tombstone] = {}  # by key, verified (without their marker bytes)

    def _skip(self, key: str, why: str) -> None:
        if key not in self.skipped:
            metrics.RETENTION_SKIPPED.inc()
            log.warning("retention: skipping %s%s (%s)", self.store.url, key, why)
        self.skipped[key] = why

    async def listing(self) -> StoreListing:
        """What the store holds now, every marker and tombstone authenticated; untrusted objects skipped."""
        # Every ready key, every run: an anchor's marker is written after later patches' (it uploads
        # in the background), so a listing after the newest key seen would miss it. Deleted keys
        # cost nothing in a listing: this is O(the markers kept), not O(history).
        listed = await self.chain.refresh(from_start=True, anchors=True)
        present = self.chain.index.marker_keys
        self._manifests = {e: p for e, p in self._manifests.items() if p.marker_key in present}
        known = {p.marker_key: p for p in self._manifests.values()}
        for entry, info in listed:
            if (kept := known.get(info.key)) is not None:  # verified in an earlier run: its kind is known
                self.chain.index.resolved(kept.step, kept.kind, info.key)
                continue
            try:
                # A commit key says its kind only in its manifest; a legacy or anchor key says it in its name.
                if entry.kind is None:
                    manifest = await self.chain.commit_manifest(entry.step)
                else:
                    manifest = await self.chain.manifest(entry.step, entry.kind)
                data = self.chain.verified_marker(entry.step)[0]  # type: ignore[index]
            except NotFoundError:
                continue  # removed since the listing
            except IntegrityError as e:
                self._skip(info.key, f"{type(e).__name__}: {e}")
                continue
            if self.chain.index.key_of(entry.step, manifest.kind) != info.key:
                continue  # a second anchor of a step whose commit is one: the commit is the anchor kept
            base = manifest.base_step if isinstance(manifest, PatchManifest) else None
            objects = tuple((ref.key, ref.size) for ref in manifest.objects)
            sha = hashlib.sha256(data).hexdigest()
            published = Published(entry.step, manifest.kind, base, objects, info.size, sha, info.key)
            self._manifests[published.entry] = published
        tombstones: dict[str, Tombstone] = {}
        async for info in self.store.list(layout.TOMBSTONE_PREFIX):
            try:
                stone = self._tombstones.get(info.key) or await read_tombstone(self.store, info.key, self.chain.trusted)
                tombstones[info.key] = stone
            except NotFoundError:
                continue
            except (PulseSyncError, ValueError) as e:
                self._skip(info.key, f"tombstone not trusted: {type(e).__name__}: {e}")
        self._tombstones = tombstones
        payloads: list[ObjectInfo] = []
        for prefix in ("patches/", "anchors/"):
            async for info in self.store.list(prefix):
                try:
                    payloads.append(ObjectInfo(check_key(info.key), info.size, info.etag, info.last_modified))
                except StoreError as e:
                    self._skip(info.key, str(e))
        fleet = await read_fleet(self.store) if self.policy.fleet_ttl_seconds else []
        now = dt.datetime.now(dt.timezone.utc)
        return StoreListing(dict(self._manifests), list(tombstones.values()), payloads, now, fleet)

    async def _marker(self, published: Published) -> bytes | None:
        """The signed marker retention verified for an entry, read again for its tombstone; None if gone or changed."""
        key = published.marker_key
        try:
            data = await self.store.get(key, max_size=MAX_MANIFEST_BYTES)
        except NotFoundError:
            return None
        if hashlib.sha256(data).hexdigest() != published.marker_sha256:
            self._skip(key, "the marker changed since it was verified")
            return None
        return data

    async def plan(self) -> Plan:
        """The plan for the store as it is now."""
        return plan(await self.listing(), self.policy)

    async def execute(self, todo: Plan) -> None:
        """Carry out a plan: tombstone then marker; due payloads then their tombstone; orphans."""
        now = dt.datetime.now(dt.timezone.utc)
        for p in todo.unmark:
            marker = await self._marker(p)
            if marker is not None:
                tombstone = Tombstone(p.step, p.kind, p.objects, now, marker)
                await self.store.put(tombstone.key, tombstone.to_bytes())
                await self.store.delete_many([p.marker_key])
                metrics.RETENTION_DELETED_OBJECTS.labels("marker").inc()
            self._manifests.pop(p.entry, None)
            if (key := self.chain.index.key_of(p.step, p.kind)) is not None:
                self.chain.index.forget(key)
        for t in todo.purge:
            await self.store.delete_many([key for key, _ in t.objects])
            _count_deleted("payload", len(t.objects), sum(size for _, size in t.objects))
            await self.store.delete_many([t.key])
            metrics.RETENTION_DELETED_OBJECTS.labels("tombstone").inc()
        if todo.orphans:
            await self.store.delete_many([o.key for o in todo.orphans])
            _count_deleted("orphan", len(todo.orphans), sum(o.size for o in todo.orphans))

    async def run_once(self, dry_run: bool | None = None) -> Plan:
        """Plan and (unless dry-run) execute once; logs a summary."""
        todo = await self.plan()
        if self.policy.dry_run if dry_run is None else dry_run:
            log.info("retention (dry run): %s", todo.summary())
            return todo
        await self.execute(todo)
        log.info("retention: %s", todo.summary())
        return todo

    async def run(self, stop: asyncio.Event) -> None:
        """Run every interval_seconds until stop is set; a failed run is logged and retried next time."""
        while not stop.is_set():
            try:
                await self.run_once()
            except PulseSyncError as e:
                log.error("retention run failed: %s: %s", type(e).__name__, e)
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(stop.wait(), self.policy.interval_seconds)


async def read_tombstone(store: Store, key: str, trusted: Mapping[str, Ed25519PublicKey] | None) -> Tombstone:
    """A tombstone, authenticated by the signed marker it carries, which must be the one its key names.

    Any bytes in the store raise ValueError or a PulseSyncError, never anything else. With
    `trusted` None the marker is parsed, not verified: for display only (`inspect` without keys).
    """
    entry = layout.parse_tombstone_key(key)
    if entry is None:
        raise ValueError("not a tombstone key")
    name = f"{store.url}{key}"
    marker, removed_at = Tombstone.parse(await store.get(key, max_size=2 * MAX_MANIFEST_BYTES))
    manifest = parse_manifest(marker, name) if trusted is None else verify_manifest(marker, trusted, name=name)
    if (manifest.step, manifest.kind) != entry:
        raise IntegrityError(f"{name}: it holds the {manifest.kind} manifest of step {manifest.step}")
    return Tombstone(*entry, tuple((ref.key, ref.size) for ref in manifest.objects), removed_at)


def _count_deleted(kind: str, objects: int, size: int) -> None:
    metrics.RETENTION_DELETED_OBJECTS.labels(kind).inc(objects)
    metrics.RETENTION_DELETED_BYTES.labels(kind).inc(size)
