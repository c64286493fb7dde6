"""Reused memory for the batch kernel's outputs (pure): a fast-path step touches no fresh pages.

Each step's positions, old values and deltas outlive the call that wrote them (the undo log, and
the history the next patch is coded against), so they cannot live on a stack. Fresh memory every
step cost a page fault per 4 KiB (or a 2 MiB huge-page fault) in the kernel's stores: ~3,500
faults, 5-20 ms a 1M-change step on the 2-core VM of docs/benchmarks.md, and the step-to-step
spread of bench/scale.py. A buffer is handed out again only once nothing refers to it: every view
of it (numpy slices, torch.from_numpy tensors) holds a reference to it, which CPython counts.
"""

from __future__ import annotations

import sys
import threading

import numpy as np

MIN_POOLED_BYTES = 1 << 20  # smaller buffers fault a few pages at most: not worth a held buffer
MAX_POOLED_BYTES = 64 << 20  # larger ones (a huge chain or slow-path patch) go back to the allocator
KEPT = 4  # buffers kept: a step's and its reference's are alive while the next one is applied
_GRAIN = 1 << 21  # sizes round up to 2 MiB (huge pages) plus an eighth, so steps of similar size share one


def _references(buffers: list[np.ndarray], index: int) -> int:
    """sys.getrefcount of a pooled buffer (the list's reference, the call's own where CPython counts one)."""
    return sys.getrefcount(buffers[index])


# What _references says of a buffer only the pool holds, measured rather than assumed: CPython
# versions differ in whether the argument itself is counted.
_UNREFERENCED = _references([np.empty(0, np.uint8)], 0)


class ArenaPool:
    """Byte buffers handed out as views and reused once every view of them is gone."""

    def __init__(self, kept: int = KEPT) -> None:
        self._buffers: list[np.ndarray] = []
        self._kept = kept
        self._lock = threading.Lock()
        self.reused = 0  # buffers handed out again (tests, benchmarks)

    def take(self, nbytes: int) -> np.ndarray:
        """A uint8 array of nbytes (contents undefined); it stays taken while any view of it lives."""
        if not MIN_POOLED_BYTES <= nbytes <= MAX_POOLED_BYTES:
            return np.empty(nbytes, np.uint8)
        with self._lock:
            view: np.ndarray | None = None
            for index in range(len(self._buffers)):
                if self._buffers[index].size >= nbytes and _references(self._buffers, index) == _UNREFERENCED:
                    self.reused += 1
                    view = self._buffers[index][:nbytes]
                    break
            if view is None:
                self._buffers.append(np.empty(-(-(nbytes + nbytes // 8) // _GRAIN) * _GRAIN, np.uint8))
                view = self._buffers[-1][:nbytes]
            self._trim()
            return view

    def _trim(self) -> None:
        """Drop the oldest unreferenced buffers beyond `kept` (referenced ones are dropped when their views go)."""
        free = [i for i in range(len(self._buffers)) if _references(self._buffers, i) == _UNREFERENCED]
        for index in reversed(free[: max(len(self._buffers) - self._kept, 0)]):
            del self._buffers[index]

    @property
    def pooled_bytes(self) -> int:
        """Bytes the pool holds (taken or not)."""
        return sum(b.size for b in self._buffers)
