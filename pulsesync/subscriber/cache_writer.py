"""Keeping cache_dir holding the served state, so a restart resumes without a download.

After each sync that patched the state in place, the patches it applied are appended to the
cache's journal; a new state (slow path, cold start), or a journal that outgrew
`cache_journal_ratio` times the state, is written whole as the new base. A compaction (a journal
outgrown) runs in the background; the next sync waits for it. A failed write (LocalWriteError) is
retried at the next sync: the served state never depends on it.
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

from pulsesync import metrics, state_cache
from pulsesync.dtypes import dense_bytes
from pulsesync.errors import LocalWriteError
from pulsesync.protocol.manifest import PatchManifest
from pulsesync.subscriber.held import HeldState
from pulsesync.threads import in_thread_to_completion
from pulsesync.verified import VerifiedState

log = logging.getLogger("pulsesync.subscriber")


class CacheWriter:
    """What cache_dir holds of the served state, and what it still lacks."""

    def __init__(self, cache_dir: Path, journal_ratio: float, held: HeldState) -> None:
        self.cache_dir = cache_dir
        self.journal_ratio = journal_ratio
        self.held = held  # read whole while a base is written: it is not patched meanwhile
        self.unsaved = False  # the served state is not in cache_dir yet (the last save failed)
        self.bytes_written = 0
        # Patches applied since the state in cache_dir, to journal; None: the whole state must be written.
        self._journal: list[tuple[PatchManifest, bytes]] | None = None
        self._journal_bytes = 0  # what cache_dir's journal holds
        self._compacting: asyncio.Task[None] | None = None

    async def resumed(self) -> None:
        """The served state was resumed from cache_dir: later patches are journaled after what it holds."""
        self._journal = []
        self._journal_bytes = await asyncio.to_thread(state_cache.journal_bytes, self.cache_dir)

    def served(self, patches: list[tuple[PatchManifest, bytes]] | None) -> None:
        """A new state is served: the patches that led to it from the one before, or None for a new state."""
        self.unsaved = True
        self._journal = None if patches is None or self._journal is None else [*self._journal, *patches]

    async def wait(self) -> None:
        """Wait for a compaction to finish (it reads the held state); a failed one is retried at the next save."""
        if self._compacting is not None:
            try:
                await self._compacting
            except LocalWriteError as e:
                log.error("%s; retried at the next sync", e)
            finally:
                self._compacting = None

    async def save(self, served: VerifiedState, marker: bytes | None) -> None:
        """Persist the served state: journal the patches since the cached state, or write it as the new base.

        A new base (cold start, slow path) is written before this returns; a compaction in the
        background, reading the held state until it is written.
        """
        journal = self._journal
        held = dense_bytes(served.state)
        if journal:
            added = sum(len(data) for _, data in journal)
            if self._journal_bytes + added <= self.journal_ratio * held:
                while journal:  # what was journaled before a failure is not written again
                    manifest, data = journal[0]
                    written = await asyncio.to_thread(
                        state_cache.append, self.cache_dir, manifest.step, manifest.to_bytes(), data
                    )
                    self._count("journal", written)
                    self._journal_bytes += written
                    journal.pop(0)
                self.unsaved = False
                return
        self.unsaved, background, self._journal = False, journal is not None, []
        if not background:
            await self._write_base(served, marker, held)
            return
        self._compacting = asyncio.ensure_future(self._write_base(served, marker, held))

    async def _write_base(self, served: VerifiedState, marker: bytes | None, held: int) -> None:
        """Write the served state as the new base, holding it (not patched while it is written out)."""
        async with self.held.reading():
            try:
                self._journal_bytes = 0  # save() clears the journal first
                await in_thread_to_completion(state_cache.save, self.cache_dir, served, marker)  # the lease outlasts it
                self._count("base", held)
            except LocalWriteError:
                self.unsaved, self._journal = True, None
                raise

    def _count(self, kind: str, written: int) -> None:
        self.bytes_written += written
        metrics.CACHE_BYTES_WRITTEN.labels(kind).inc(written)
