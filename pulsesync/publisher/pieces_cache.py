"""A rank's local copies of what it uploaded since its last committed anchor (`cache_dir` of a sharded publisher).

Under `{cache_dir}/rank-{rank:05d}/`, by store key (a `FileStore`): the anchor's pieces file of the
rank (moved there after its upload, so an anchor writes nothing twice), its part history, and each
patch part it uploaded since. A relaunched job's rank reads these first (`pieces_rebuild.PieceReader`)
and the store only for what is missing or does not match the signed manifest's SHA-256; on the same
layout it reads nothing but markers from the store. Nothing here is trusted either: the ranks'
rebuilt pieces are proven together against the signed digest, and a cache that does not prove is
passed over for the store. A cache that cannot be written is a warning, never a failed step.
"""

from __future__ import annotations

import asyncio
import logging
import shutil
from pathlib import Path

from pulsesync.errors import PulseSyncError
from pulsesync.protocol.fetcher import Fetcher
from pulsesync.store import FileStore
from pulsesync.store.base import check_key

log = logging.getLogger("pulsesync.publisher")


class PiecesCache:
    """One rank's cache: `keep` what it uploads, `prune` all but a committed anchor's at that anchor."""

    def __init__(self, cache_dir: Path, rank: int, threads: int | None) -> None:
        self.root = cache_dir / f"rank-{rank:05d}"
        self.store = FileStore(self.root)
        self.threads = threads

    def fetcher(self) -> Fetcher:
        """A reader of the cached objects (sizes and SHA-256 checked against the manifests, as the store's)."""
        return Fetcher(self.store, self.threads)

    async def keep(self, key: str, data: bytes) -> None:
        """A copy of an object this rank uploaded."""
        try:
            await self.store.put(key, data)
        except PulseSyncError as e:
            log.warning("cache %s: cannot keep %s (%s)", self.root, key, e)

    async def adopt(self, key: str, path: Path) -> None:
        """Move a file this rank uploaded as `key` into the cache (a rename where both are on one filesystem)."""
        try:
            dest = self.root / check_key(key)
            await asyncio.to_thread(dest.parent.mkdir, parents=True, exist_ok=True)
            await asyncio.to_thread(shutil.move, path, dest)
        except (OSError, PulseSyncError) as e:
            log.warning("cache %s: cannot keep %s (%s)", self.root, key, e)

    async def prune(self, kept: set[str]) -> None:
        """Remove every cached object but `kept` (a committed anchor's): nothing before it is read again."""
        try:
            doomed = [info.key async for info in self.store.list() if info.key not in kept]
            await self.store.delete_many(doomed)
        except PulseSyncError as e:
            log.warning("cache %s: cannot prune (%s)", self.root, e)
