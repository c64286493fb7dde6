"""Transfer progress: callbacks with bytes/s and ETA, shown as a bar on a terminal or as log lines."""

from __future__ import annotations

import logging
import math
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TextIO

log = logging.getLogger("pulsesync.transfer")


@dataclass(frozen=True)
class TransferProgress:
    """A snapshot of one transfer."""

    key: str
    done: int
    total: int
    elapsed: float

    @property
    def rate(self) -> float:
        """Bytes per second so far."""
        return self.done / self.elapsed if self.elapsed > 0 else 0.0

    @property
    def eta(self) -> float | None:
        """Seconds left at the current rate, or None if unknown."""
        return (self.total - self.done) / self.rate if self.rate > 0 else None


ProgressCallback = Callable[[TransferProgress], None]


class ProgressTracker:
    """Counts bytes of one transfer and calls the callback (thread- and task-safe enough: += on ints)."""

    def __init__(self, key: str, total: int, callback: ProgressCallback | None) -> None:
        self.key, self.total, self.callback = key, total, callback
        self.done = 0
        self.started = time.monotonic()

    def add(self, n: int) -> None:
        """Record n more bytes."""
        self.done += n
        if self.callback is not None:
            self.callback(TransferProgress(self.key, self.done, self.total, time.monotonic() - self.started))


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return f"{n:.1f} TiB"  # pragma: no cover


def describe(p: TransferProgress) -> str:
    """One line: key, done/total, percent, rate, ETA."""
    pct = 100.0 * p.done / p.total if p.total else 100.0
    eta = f"{p.eta:.0f}s" if p.eta is not None else "?"
    return f"{p.key}: {_human(p.done)}/{_human(p.total)} ({pct:.0f}%) {_human(p.rate)}/s ETA {eta}"


def reporter(stream: TextIO | None = None, interval: float = 5.0) -> ProgressCallback:
    """A callback that redraws a bar on a terminal, or logs a line at most every `interval` s."""
    out = stream or sys.stderr
    last = [-math.inf]  # the first line is always logged (the monotonic clock may start near 0)
    if out.isatty():

        def bar(p: TransferProgress) -> None:
            width = 30
            filled = int(width * p.done / p.total) if p.total else width
            out.write(f"\r[{'#' * filled}{'.' * (width - filled)}] {describe(p)}\x1b[K")
            if p.done >= p.total:
                out.write("\n")
            out.flush()

        return bar

    def line(p: TransferProgress) -> None:
        now = time.monotonic()
        if p.done >= p.total or now - last[0] >= interval:
            last[0] = now
            log.info("transfer %s", describe(p))

    return line
