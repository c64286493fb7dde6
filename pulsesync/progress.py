"""Progress of long work: anchor uploads, baseline rebuilds, slow-path downloads and applies, `store put/get`.

Library code opens a `phase` and advances it; how phases show is the process's choice, made once by the
CLI (`show_bars`): on a terminal a tqdm bar for each phase that lasts past `BAR_DELAY` (bytes, rate, ETA),
elsewhere a log line at most every `LOG_INTERVAL` seconds for a phase that lasts that long. Short work,
such as a fast-path step, shows nothing either way.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, TextIO

log = logging.getLogger("pulsesync.progress")

LOG_INTERVAL = 5.0  # seconds between a phase's log lines, and before its first
BAR_DELAY = 1.0  # seconds a phase runs before its bar appears

_terminal: TextIO | None = None


def show_bars(stream: TextIO | None) -> None:
    """Draw phases as bars on `stream` (a terminal) from now on; None: log lines."""
    global _terminal
    _terminal = stream


def showing_bars() -> bool:
    """Whether phases are drawn as bars (what else prints to the terminal then goes above them)."""
    return _terminal is not None


@dataclass(frozen=True)
class TransferProgress:
    """A snapshot of one transfer."""

    key: str
    done: int
    total: int
    elapsed: float


ProgressCallback = Callable[[TransferProgress], None]


class ProgressTracker:
    """Counts bytes of one transfer and calls the callback."""

    def __init__(self, key: str, total: int, callback: ProgressCallback | None) -> None:
        self.key, self.total, self.callback = key, total, callback
        self.done = 0
        self.started = time.monotonic()

    def add(self, n: int) -> None:
        """Record n more bytes."""
        self.done += n
        if self.callback is not None:
            self.callback(TransferProgress(self.key, self.done, self.total, time.monotonic() - self.started))


def human(n: float, unit: str = "B") -> str:
    """A count in binary multiples for bytes (12.5 MiB), as is for other units."""
    if unit != "B":
        return f"{n:.4g} {unit}"
    for prefix in ("", "Ki", "Mi", "Gi"):
        if n < 1024:
            return f"{n:.1f} {prefix}B" if prefix else f"{int(n)} B"
        n /= 1024
    return f"{n:.1f} TiB"


def describe(description: str, done: float, total: float | None, elapsed: float, unit: str = "B") -> str:
    """One line: what, done/total, percent, rate, ETA."""
    rate = done / elapsed if elapsed > 0 else 0.0
    if total is None:
        return f"{description}: {human(done, unit)} {human(rate, unit)}/s"
    pct = 100.0 * done / total if total else 100.0
    eta = f"{(total - done) / rate:.0f}s" if rate > 0 else "?"
    return f"{description}: {human(done, unit)}/{human(total, unit)} ({pct:.0f}%) {human(rate, unit)}/s ETA {eta}"


class Phase:
    """One long operation: `done` of `total` units (bytes unless said), shown as the process chose."""

    def __init__(self, description: str, total: int | None, unit: str = "B") -> None:
        self.description, self.total, self.unit = description, total, unit
        self.done = 0
        self.started = time.monotonic()
        self._logged_at: float | None = None
        self._transfers: dict[str, int] = {}
        self._lock = threading.Lock()  # transfers advance from the event loop and from worker threads
        self._bar: Any = None
        if _terminal is not None:
            from tqdm import tqdm

            self._bar = tqdm(
                desc=description,
                total=total,
                unit=unit,
                unit_scale=unit == "B",
                unit_divisor=1024,
                file=_terminal,
                delay=BAR_DELAY,
                dynamic_ncols=True,
            )

    def advance(self, n: int) -> None:
        """Record `n` more units done."""
        with self._lock:
            self.done += n
            if self._bar is not None:
                self._bar.update(n)
                return
            now = time.monotonic()
            since = now - (self._logged_at if self._logged_at is not None else self.started)
            if since >= LOG_INTERVAL and self.done != self.total:  # the end has its own line
                self._logged_at = now
                log.info("%s", describe(self.description, self.done, self.total, now - self.started, self.unit))

    def transfer(self, progress: TransferProgress) -> None:
        """A store's `ProgressCallback`: each transfer's running count, any number of them, added to the phase."""
        with self._lock:
            before = self._transfers.get(progress.key, 0)
            self._transfers[progress.key] = progress.done
            if self.total is None and len(self._transfers) == 1:  # a phase of one transfer learns its size
                self.total = progress.total
                if self._bar is not None:
                    self._bar.total = progress.total
        self.advance(progress.done - before)

    def close(self) -> None:
        """End the phase: the bar stays as its last state; a phase that lasted `LOG_INTERVAL` logs its end."""
        if self._bar is not None:
            self._bar.close()
            return
        elapsed = time.monotonic() - self.started
        if self._logged_at is not None or elapsed >= LOG_INTERVAL:
            line = describe(self.description, self.done, self.total, elapsed, self.unit)
            log.info("%s, done in %.1fs", line, elapsed)


@contextmanager
def phase(description: str, total: int | None, unit: str = "B") -> Iterator[Phase]:
    """A `Phase` for the block's duration."""
    shown = Phase(description, total, unit)
    try:
        yield shown
    finally:
        shown.close()
