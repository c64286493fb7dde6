"""When a polling subscriber lists the store: on a change of the publisher's pointer, else rarely.

LIST requests dominate a fleet's store bill (docs/scale.md): every subscriber lists `ready/`
every poll. The publisher rewrites a small pointer object after each commit
(`layout.POINTER_KEY`); a subscriber reads it with a conditional GET (`If-None-Match` on S3:
304, no body, while nothing changed) and lists only when it changed. The pointer is a hint and
nothing more: what it names is never served from it, the LIST and the signed marker decide as
always. A missing, unreadable or oversized pointer means a LIST every poll, and a pointer that
stops changing (a publisher that died between its marker and its pointer, or a forged, frozen
one) still gets a LIST every `list_every_seconds`.
"""

from __future__ import annotations

import logging
import time

from pulsesync.errors import PulseSyncError
from pulsesync.protocol import layout
from pulsesync.store import Store

log = logging.getLogger("pulsesync.subscriber")


class PointerPoll:
    """Decides, per poll, whether the store's ready markers are worth listing."""

    def __init__(self, store: Store, list_every_seconds: float) -> None:
        self.store = store
        self.list_every_seconds = list_every_seconds
        self.etag: str | None = None  # of the pointer last read; None: not read yet (or gone)
        self._listed_at: float | None = None

    def listed(self) -> None:
        """Record that the ready markers were just listed."""
        self._listed_at = time.monotonic()

    async def worth_listing(self) -> bool:
        """False only while the pointer answers "not modified" and a LIST happened recently."""
        if self._listed_at is None or time.monotonic() - self._listed_at >= self.list_every_seconds:
            return True
        try:
            got = await self.store.get_if_changed(layout.POINTER_KEY, self.etag, layout.MAX_POINTER_BYTES)
        except PulseSyncError as e:  # missing, oversized, unreachable: list, and let the sync report errors
            log.debug("pointer %s%s: %s; listing instead", self.store.url, layout.POINTER_KEY, e)
            self.etag = None
            return True
        if got is None:
            return False
        self.etag = got[1]  # what it names is not read: the listing and the signed markers decide
        return True
