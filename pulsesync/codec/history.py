"""What a patch changed, per chunk: the reference a history-coded (HISTORY) record is decoded against (pure).

Adam's momentum makes the same weights change again, in the same direction, step after step: a
record coded against the previous patch's positions and deltas of the same chunk is ~2x smaller
(docs/benchmarks.md). Both ends hold the `PatchHistory` of the last patch: the publisher from
encoding it, the subscriber from applying it. The patch after an anchor is never history-coded,
so a subscriber that starts from an anchor needs no reference it has not applied itself.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np

ChunkKey = tuple[str, int, int]  # tensor name, first element, elements


class ChunkHistory(NamedTuple):
    """Sorted chunk-relative positions a patch changed and their ordered deltas (new - old, modulo 2**bits)."""

    positions: np.ndarray  # int64
    deltas: np.ndarray  # signed integers of the dtype's width
    # Where the batch kernel wrote both (contiguous, int64 and int16, kept alive by the arrays):
    # it reads a reference chunk by address, and numpy's `.ctypes.data` costs ~1.2 us a call,
    # twice for each of the ~400 records of a 0.6B model's patch.
    addresses: tuple[int, int] | None = None


@dataclass
class PatchHistory:
    """The per-chunk changes of one patch, named by the patch's SHA-256."""

    sha256: str
    chunks: dict[ChunkKey, ChunkHistory] = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        """Memory the history holds."""
        return sum(c.positions.nbytes + c.deltas.nbytes for c in self.chunks.values())
