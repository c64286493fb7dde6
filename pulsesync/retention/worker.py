"""The retention worker: list a store, plan (pulsesync.retention.plan), execute; once or on an interval.

Execution order is the protocol's: a tombstone is written before its ready marker is removed, and
payload objects are deleted only after the grace period, tombstone last, so a crash at any point
leaves a state the next run finishes. Deleting is idempotent: objects already gone are fine.
Manifests are parsed, not authenticated (retention only reads the chain's shape); if one does not
parse, the run deletes nothing and says why: a chain it cannot read is a chain it cannot prove safe.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import logging

from pulsesync.errors import NotFoundError, PulseSyncError
from pulsesync.protocol import layout
from pulsesync.protocol.chain import ChainClient
from pulsesync.protocol.manifest import PatchManifest, parse_manifest
from pulsesync.retention.plan import Entry, Plan, Published, StoreListing, Tombstone, plan
from pulsesync.retention.policy import RetentionPolicy
from pulsesync.store import ObjectInfo, Store

log = logging.getLogger("pulsesync.retention")


class RetentionWorker:
    """Runs retention against one store; remembers the manifests it has read (they never change)."""

    def __init__(self, store: Store, policy: RetentionPolicy) -> None:
        self.store = store
        self.policy = policy
        self.chain = ChainClient(store, {})  # retention only parses manifests: it reads the chain's shape
        self._manifests: dict[str, Published] = {}  # by ready key

    async def listing(self) -> StoreListing:
        """What the store holds now; ManifestError if a manifest does not parse (then nothing is planned)."""
        published: dict[Entry, Published] = {}
        for entry, info in await self.chain.refresh(from_start=True):
            known = self._manifests.get(info.key)
            if known is None:
                try:
                    data = await self.chain.marker(entry.step, entry.kind)
                except NotFoundError:
                    continue  # removed since the listing
                manifest = parse_manifest(data, f"{self.store.url}{info.key}")
                base = manifest.base_step if isinstance(manifest, PatchManifest) else None
                objects = tuple((ref.key, ref.size) for ref in manifest.objects)
                known = self._manifests[info.key] = Published(entry.step, entry.kind, base, objects, info.size)
            published[(entry.step, entry.kind)] = known
        tombstones = []
        async for info in self.store.list(layout.TOMBSTONE_PREFIX):
            try:
                tombstones.append(Tombstone.from_bytes(await self.store.get(info.key)))
            except NotFoundError:
                continue
            except (ValueError, KeyError, TypeError) as e:
                log.warning("retention: ignoring malformed tombstone %s%s (%s)", self.store.url, info.key, e)
        payloads: list[ObjectInfo] = []
        for prefix in ("patches/", "anchors/"):
            payloads += [info async for info in self.store.list(prefix)]
        return StoreListing(published, tombstones, payloads, dt.datetime.now(dt.timezone.utc))

    async def plan(self) -> Plan:
        """The plan for the store as it is now."""
        return plan(await self.listing(), self.policy)

    async def execute(self, todo: Plan) -> None:
        """Carry out a plan: tombstone then marker; due payloads then their tombstone; orphans."""
        now = dt.datetime.now(dt.timezone.utc)
        for p in todo.unmark:
            tombstone = Tombstone(p.step, p.kind, p.objects, now)
            await self.store.put(tombstone.key, tombstone.to_bytes())
            await self.store.delete_many([layout.ready_key(p.step, p.kind)])
            self._manifests.pop(layout.ready_key(p.step, p.kind), None)
        for t in todo.purge:
            await self.store.delete_many([key for key, _ in t.objects])
            await self.store.delete_many([t.key])
        if todo.orphans:
            await self.store.delete_many([o.key for o in todo.orphans])

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
