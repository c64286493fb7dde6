"""When a polling subscriber lists the store: on a change of the publisher's pointer, else rarely.

LIST requests dominate a fleet's store bill (docs/scale.md): every subscriber lists `ready/`
every poll. The publisher rewrites a small pointer object after each commit
(`layout.POINTER_KEY`); a subscriber reads it with a conditional GET (`If-None-Match` on S3:
304, no body, while nothing changed) and lists only when it changed. The pointer is a hint and
nothing more: what it names is never served from it, the LIST and the signed marker decide as
always. A missing, unreadable, oversized or slow pointer means a LIST every poll (a read gets
`deadline` seconds, not the store's retries: a hung GET must not hold the daemon), and a pointer that
stops changing (a publisher that died between its marker and its pointer, or a forged, frozen
one) still gets a LIST every `list_every_seconds`.
"""

from __future__ import annotations

import asyncio
import logging
import time

from pulsesync.deadlines import within
from pulsesync.errors import PulseSyncError
from pulsesync.protocol import layout
from pulsesync.store import Store

log = logging.getLogger("pulsesync.subscriber")


class PointerPoll:
    """Decides, per poll, whether the store's ready markers are worth listing."""

    def __init__(self, store: Store, list_every_seconds: float, deadline: float) -> None:
        self.store = store
        self.list_every_seconds = list_every_seconds
        self.deadline = deadline
        self.etag: str | None = None  # of the pointer last read; None: not read yet (or gone)
        self.names: int | None = None  # the step the pointer last read names; None: unknown
        self._listed_at: float | None = None

    def listed(self) -> None:
        """Record that the ready markers were just listed."""
        self._listed_at = time.monotonic()

    async def _read(self) -> bool:
        """Read the pointer if it changed (a conditional GET); whether it changed or could not be read.

        Missing, oversized, unreachable or slow counts as changed: the caller lists instead.
        """
        try:
            read = self.store.get_if_changed(layout.POINTER_KEY, self.etag, layout.MAX_POINTER_BYTES)
            got = await within(self.deadline, read)
        except (PulseSyncError, asyncio.TimeoutError) as e:
            log.debug("pointer %s%s: %r; listing instead", self.store.url, layout.POINTER_KEY, e)
            self.etag = self.names = None
            return True
        if got is None:
            return False
        entry = layout.parse_ready_key(got[0].decode("utf-8", "replace"))
        self.etag, self.names = got[1], entry.step if entry is not None else None
        return True

    async def names_newer(self, step: int) -> bool:
        """Whether the pointer names a step newer than `step`: True where it cannot be read or parsed (ask the store).

        A hint like every pointer read: it decides only whether the store is asked, never what is served.
        """
        await self._read()
        return self.names is None or self.names > step

    async def worth_listing(self) -> bool:
        """False only while the pointer answers "not modified" and a LIST happened recently."""
        if self._listed_at is None or time.monotonic() - self._listed_at >= self.list_every_seconds:
            return True
        return await self._read()  # what it names is not trusted: the listing and the signed markers decide
