"""This subscriber's entry in the fleet: its status object, rewritten after each sync and as a heartbeat.

Best effort and advisory (`pulsesync.protocol.fleet`): a failed write is logged and serving goes
on; nothing reads it back but `pulsesync inspect` and retention's hint. A write gets `deadline`
seconds, not the store's retries: a hung PUT must not hold the daemon's poll loop.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import hashlib
import logging
import os
import re
import socket
import time
from pathlib import Path

from pulsesync.deadlines import within
from pulsesync.errors import StoreError
from pulsesync.protocol.fleet import FleetStatus
from pulsesync.store import Store

log = logging.getLogger("pulsesync.subscriber")


def default_subscriber_id(cache_dir: Path | None) -> str:
    """The host's name and a short hash of the cache directory (stable across restarts), else of the pid."""
    host = re.sub(r"[^A-Za-z0-9._-]", "-", socket.gethostname()).strip(".-_")[:40] or "host"
    anchor = str(cache_dir.resolve()) if cache_dir is not None else f"pid-{os.getpid()}"
    tag = hashlib.sha256(anchor.encode()).hexdigest()[:8]
    return f"{host}-{tag}"


class FleetReporter:
    """Writes `fleet/{subscriber}.json` after every sync that moved the state, and at least every `every_seconds`."""

    def __init__(self, store: Store, subscriber: str, every_seconds: float, deadline: float) -> None:
        self.store = store
        self.subscriber = subscriber
        self.every_seconds = every_seconds
        self.deadline = deadline
        self.last_path: str | None = None
        self.last_sync: dt.datetime | None = None
        self._written_at: float | None = None

    async def report(self, path: str | None, step: int, digest: str | None, newest: int) -> None:
        """After a sync (`path`: how it went) or an idle poll (None): write the status if it changed or is due.

        `step` and `digest` are what the subscriber serves (digest None: nothing yet), `newest` the newest ready step.
        """
        now = dt.datetime.now(dt.timezone.utc)
        if path is not None:
            self.last_sync = now
        moved = path not in (None, "up-to-date")
        if moved:
            self.last_path = path
        due = self._written_at is None or time.monotonic() - self._written_at >= self.every_seconds
        if not (moved or due) or digest is None:
            return
        status = FleetStatus(
            subscriber=self.subscriber,
            step=step,
            digest=digest,
            path=self.last_path,
            lag=max(0, newest - step),
            last_sync=self.last_sync,
            updated_at=now,
        )
        try:
            await within(self.deadline, self.store.put(status.key, status.to_bytes()))
            self._written_at = time.monotonic()
        except (StoreError, asyncio.TimeoutError) as e:
            log.warning("fleet status %s%s not written: %r", self.store.url, status.key, e)
