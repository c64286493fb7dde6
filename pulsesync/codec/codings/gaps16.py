"""GAPS16 positions: each gap as a u16 in two byte planes, gaps of ESCAPE or more also in full in a u64 list.

gap_i = p_i - p_(i-1) - 1 (p_(-1) = -1). The first position coding (format 1); the encoder still
takes it where it is smaller, on short records.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from pulsesync.codec import jit
from pulsesync.codec.codings.status import (
    OUTSIDE,
    POSITIONS_ESCAPES_MISMATCH,
    POSITIONS_OK,
    POSITIONS_OUTSIDE,
    check,
)
from pulsesync.codec.codings.values import from_planes
from pulsesync.errors import CorruptPatchError

ESCAPE = 0xFFFF  # a u16 gap of this value means "the real gap is in the escape list"
POSITIONS_GAP_OUTSIDE = 2
_GAP_ESCAPES_MISMATCH = "escape count does not match the gap stream"
ERRORS = {
    POSITIONS_ESCAPES_MISMATCH: _GAP_ESCAPES_MISMATCH,
    POSITIONS_GAP_OUTSIDE: "escaped position gap exceeds the chunk of {length}",
    POSITIONS_OUTSIDE: OUTSIDE,
}


def gaps_of(positions: np.ndarray) -> np.ndarray:
    """p_i - p_{i-1} - 1 with p_{-1} = -1 (np.diff's prepend costs more than the subtraction on small records)."""
    gaps = np.empty_like(positions)
    if positions.size:
        gaps[0] = positions[0]
        np.subtract(positions[1:], positions[:-1], out=gaps[1:])
        gaps[1:] -= 1
    return gaps


def encode_positions(positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Sorted, distinct chunk-relative positions -> (u16 gaps, u64 escapes).

    gap_i = p_i - p_{i-1} - 1 (p_{-1} = -1); gaps >= ESCAPE are stored as ESCAPE in the u16
    stream and in full, in order, in the escape stream.
    """
    gaps = gaps_of(positions)
    big = gaps >= ESCAPE
    return np.minimum(gaps, ESCAPE).astype(np.uint16), gaps[big].astype(np.uint64)


def decode_positions(planes: np.ndarray, count: int, escapes: np.ndarray, length: int, where: str) -> np.ndarray:
    """Inverse of encode_positions from the u16 gaps' byte planes, checking every position lies in [0, length).

    One pass of numba's kernel where installed (decode_positions_kernel), else numpy.
    """
    if jit.enabled and decode_positions_kernel is not None:
        positions = np.empty(count, np.int64)
        check(decode_positions_kernel(planes, count, escapes, length, positions), length, where, ERRORS)
        return positions
    gaps16 = from_planes(planes, count, np.uint16)
    gaps = gaps16.astype(np.int64)
    if escapes.size:
        marks = gaps16 == ESCAPE
        if int(marks.sum()) != escapes.size:
            raise CorruptPatchError(f"{where}: {_GAP_ESCAPES_MISMATCH}")
        # Escaped gaps are < length, and all gaps sum to < length, so the cumsum cannot overflow.
        if int(escapes.max()) >= length or sum(int(e) for e in escapes) >= length:
            raise CorruptPatchError(f"{where}: escaped position gap exceeds the chunk of {length}")
        gaps[marks] = escapes.astype(np.int64)
    elif gaps16.size and bool((gaps16 == ESCAPE).any()):
        raise CorruptPatchError(f"{where}: {_GAP_ESCAPES_MISMATCH}")
    gaps += 1  # p_i = p_{i-1} + gap_i + 1: one cumulative sum, in place
    positions = np.cumsum(gaps, out=gaps)
    positions -= 1
    if positions.size and int(positions[-1]) >= length:
        raise CorruptPatchError(f"{where}: {OUTSIDE.format(length=length)}")
    return positions


def _decode_positions(planes: Any, count: int, escapes: Any, length: int, out: Any) -> int:
    """out[i] = p_i = p_{i-1} + gap_i + 1 (p_{-1} = -1) from u16 gap planes; a status code.

    As decode_positions: gap ESCAPE takes the next escaped gap. POSITIONS_GAP_OUTSIDE when
    an escaped gap, POSITIONS_OUTSIDE when a position, is not below `length`;
    POSITIONS_ESCAPES_MISMATCH when the marks and the escapes do not pair up. An escaped gap is
    checked < length before it is added, and every position is < length: the sum cannot overflow.
    """
    k = 0
    p = np.int64(-1)
    for i in range(count):
        gap = np.int64(planes[i]) | (np.int64(planes[count + i]) << 8)
        if gap == ESCAPE:
            if k == escapes.size:
                return POSITIONS_ESCAPES_MISMATCH
            if escapes[k] >= np.uint64(length):  # unsigned compare: no float conversion
                return POSITIONS_GAP_OUTSIDE
            gap = np.int64(escapes[k])
            k += 1
        p += gap + 1
        if p >= length:
            return POSITIONS_OUTSIDE
        out[i] = p
    return POSITIONS_OK if k == escapes.size else POSITIONS_ESCAPES_MISMATCH


decode_positions_kernel: Any = jit.kernel(_decode_positions)
