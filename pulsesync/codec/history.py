"""What a patch changed, per chunk: the reference a history-coded (HISTORY) record is decoded against (pure).

Adam's momentum makes the same weights change again, in the same direction, step after step: a
record coded against the previous patch's positions and deltas of the same chunk is ~2x smaller
(docs/benchmarks.md). Both ends hold the `PatchHistory` of the last patch: the publisher from
encoding it, the subscriber from applying it (or, for the patch at an anchor step, which never
needs a state to decode, from `patch_history`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from pulsesync.codec import bits
from pulsesync.codec.format import RecordKind, ValueCoding
from pulsesync.codec.parse import PatchDecoder, decode_record
from pulsesync.errors import CorruptPatchError

ChunkKey = tuple[str, int, int]  # tensor name, first element, elements


@dataclass(frozen=True)
class ChunkHistory:
    """Sorted chunk-relative positions a patch changed and their ordered deltas (new - old, modulo 2**bits)."""

    positions: np.ndarray  # int64
    deltas: np.ndarray  # signed integers of the dtype's width


@dataclass
class PatchHistory:
    """The per-chunk changes of one patch, named by the patch's SHA-256."""

    sha256: str
    chunks: dict[ChunkKey, ChunkHistory] = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        """Memory the history holds."""
        return sum(c.positions.nbytes + c.deltas.nbytes for c in self.chunks.values())


def standalone(coding: ValueCoding) -> bool:
    """Whether a SPARSE record of this coding yields its deltas without the state it patches."""
    return coding in (ValueCoding.DELTA, ValueCoding.PLANES)


def patch_history(patch: bytes | memoryview, sha256: str) -> PatchHistory:
    """The history of a patch read without its base state (the patch published at an anchor step).

    CorruptPatchError if a record needs the state to decode (the publisher never writes such a
    record into a patch at an anchor step).
    """
    decoder = PatchDecoder()
    history = PatchHistory(sha256)
    for h, payload in decoder.split(patch):
        if h.kind == RecordKind.HISTORY or (h.kind == RecordKind.SPARSE and not standalone(h.coding)):
            raise CorruptPatchError(
                f"record for tensor {h.name!r} ({h.kind.name}/{h.coding.name}) cannot be read without its base state"
            )
        if h.kind != RecordKind.SPARSE:
            continue
        record = decode_record(h, payload, decoder.version)
        assert record.positions is not None
        if record.packed is not None:
            packed, escapes = record.packed
            deltas = bits.unpack_small_deltas(packed, record.positions.size, escapes, 1, h.name)
        else:
            assert record.values is not None
            deltas = record.values
        history.chunks[(h.name, h.start, h.length)] = ChunkHistory(record.positions, deltas)
    decoder.finish()
    return history
