"""What a patch changed, per chunk: the reference a history-coded (HISTORY) record is decoded against (pure).

Adam's momentum makes the same weights change again, in the same direction, step after step: a
record coded against the previous patch's positions and deltas of the same chunk is ~2x smaller
(docs/benchmarks.md). Both ends hold the `PatchHistory` of the last patch: the publisher from
encoding it, the subscriber from applying it, or from the anchor of the step, which carries it
(`history_file`): a subscriber that starts from an anchor holds the reference of the next patch. A sharded
step's parts each have their own (`StepHistory`): a rank codes its part against its own part of
the step before, and the chunks of strided pieces repeat across ranks. A part made on another
layout than the step before's (a job relaunched on another world size) is coded against the
histories of the step before's parts joined by global position and cut into its own chunks
(`StepHistory.joined`): both ends hold those parts' histories, so both cut the same reference.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np

from pulsesync.errors import IntegrityError

ChunkKey = tuple[str, int, int]  # tensor name, first element, elements


class ChunkHistory(NamedTuple):
    """Sorted chunk-relative positions a patch changed and their ordered deltas (new - old, modulo 2**bits)."""

    positions: np.ndarray  # int64
    deltas: np.ndarray  # signed integers of the dtype's width
    # Where the batch kernel wrote positions, deltas and values (contiguous, int64, int16 and
    # int16, kept alive by the arrays; 0: no values): it reads a reference chunk by address, and
    # numpy's `.ctypes.data` costs ~1.2 us a call, for each of the ~400 records of a 0.6B model's patch.
    addresses: tuple[int, int, int] | None = None
    # The new values the patch wrote there (the batch kernel's; None elsewhere): while nothing else
    # writes the state, the old values the next patch finds at these positions, which the kernel
    # then need not read before it writes (it checks them as it writes).
    values: np.ndarray | None = None


@dataclass
class PatchHistory:
    """The per-chunk changes of one patch, named by the patch's SHA-256."""

    sha256: str
    chunks: dict[ChunkKey, ChunkHistory] = field(default_factory=dict)
    # A joined reference's (`StepHistory.joined`): the SHA-256 of each part it joins, which a part coded
    # against it names (`reference_parts`) in place of one patch's SHA-256.
    parts: tuple[str, ...] = ()


@dataclass
class StepHistory:
    """The histories of one step's patch objects, by SHA-256: its one patch, or a sharded step's parts.

    What a subscriber holds for the next step: each of its objects (a part) names the one it is coded against.
    """

    patches: dict[str, PatchHistory] = field(default_factory=dict)

    @classmethod
    def of(cls, *histories: PatchHistory) -> StepHistory:
        """A step history of these objects' histories."""
        return cls({h.sha256: h for h in histories})

    def get(self, sha256: str | None) -> PatchHistory | None:
        """The history of the object of this SHA-256, if held."""
        return self.patches.get(sha256) if sha256 is not None else None

    def add(self, sha256: str) -> PatchHistory:
        """An empty history for the object of this SHA-256, held here (an apply fills it)."""
        return self.patches.setdefault(sha256, PatchHistory(sha256))

    def joined(self, parts: Sequence[str], keys: Iterable[ChunkKey]) -> PatchHistory | None:
        """The histories of `parts` (by SHA-256) joined by global position and cut into the chunks `keys`;
        None unless every one is held. IntegrityError if two of them changed the same element."""
        held = [self.patches.get(sha) for sha in parts]
        if any(h is None for h in held):
            return None
        return PatchHistory("", resliced([h for h in held if h is not None], keys), tuple(parts))


def resliced(histories: Sequence[PatchHistory], keys: Iterable[ChunkKey]) -> dict[ChunkKey, ChunkHistory]:
    """What `histories` changed, by global position, in each chunk of `keys` (those it changed elements in).

    A chunk (name, start, length) holds the changes at flat positions [start, start + length) of
    tensor `name`, whichever chunk of whichever history recorded them, in increasing order.
    """
    wanted: dict[str, list[ChunkKey]] = {}
    for key in keys:
        wanted.setdefault(key[0], []).append(key)
    found: dict[str, list[tuple[np.ndarray, np.ndarray]]] = {}
    for history in histories:
        for (name, start, _), chunk in history.chunks.items():
            if name in wanted:
                found.setdefault(name, []).append((start + chunk.positions.astype(np.int64), chunk.deltas))
    out: dict[ChunkKey, ChunkHistory] = {}
    for name, changes in found.items():
        positions = np.concatenate([p for p, _ in changes])
        deltas = np.concatenate([d for _, d in changes])
        order = np.argsort(positions, kind="stable")
        positions, deltas = positions[order], deltas[order]
        if positions.size > 1 and not (np.diff(positions) > 0).all():
            raise IntegrityError(f"tensor {name!r}: two parts of the step before changed the same element")
        for key in wanted[name]:
            _, start, length = key
            lo, hi = np.searchsorted(positions, [start, start + length])
            if hi > lo:
                out[key] = ChunkHistory(positions[lo:hi] - start, deltas[lo:hi])
    return out
