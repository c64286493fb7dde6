"""Fused kernels for the common record, compiled with numba when installed (`pulsesync[fast]`).

A sparse delta record of a 2-byte float (bf16, fp16) is most of every RL patch. With numpy its
decode and apply take some fifteen passes over the changed elements, two of them random accesses
into the tensor (gather, then scatter: a cache and TLB miss each). Here:
- `decode_positions` turns the two gap byte planes (and escaped gaps) into positions in one pass,
  checking every position lies inside the chunk;
- `count_escape_codes` counts the value codes that say "escaped" (checked against the record);
- `apply_delta_2byte` gathers a block of old values (independent loads the CPU overlaps), then
  applies the order-preserving deltas from cache, and returns the old values for the undo log.
bits.decode_positions and bits.check_escape_count run the first two and check their results
before the apply kernel runs, so it only ever indexes inside the chunk. Without numba the numpy
path runs: the results (errors included) are bit-identical, which the tests check by running
both.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from pulsesync.codec.format import ESCAPE, SMALL_ESCAPE

try:
    import numba
except ImportError:  # pragma: no cover - exercised where numba is not installed
    numba = None  # type: ignore[assignment]


POSITIONS_OK, POSITIONS_ESCAPES_MISMATCH, POSITIONS_GAP_OUTSIDE, POSITIONS_OUTSIDE = 0, 1, 2, 3


def _decode_positions(planes: Any, count: int, escapes: Any, length: int, out: Any) -> int:
    """out[i] = p_i = p_{i-1} + gap_i + 1 (p_{-1} = -1) from u16 gap planes; a status code.

    As bits.decode_positions: gap ESCAPE takes the next escaped gap. POSITIONS_GAP_OUTSIDE when
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


def _count_escape_codes(packed: Any, count: int) -> int:
    """How many of the first `count` 2-bit codes (four per byte, low bits first) are SMALL_ESCAPE."""
    found = 0
    for i in range(count):
        found += ((packed[i >> 2] >> (2 * (i & 3))) & 3) == SMALL_ESCAPE
    return found


_BLOCK = 256  # elements gathered ahead of their update: their cache lines fit in L1


def _apply_delta_2byte(chunk: Any, positions: Any, packed: Any, escapes: Any, old_out: Any) -> None:
    """chunk[p_i] = from_ordered(to_ordered(chunk[p_i]) + delta_i); old values into old_out.

    delta_i = unzigzag(code_i + 1), or unzigzag(escape + 1) for code 3, as bits.unpack_small_deltas.
    Each block's old values are gathered first, in a loop of independent loads the CPU overlaps
    (the miss per element is the cost), then updated from cache.
    """
    k = 0
    n = positions.size
    for start in range(0, n, _BLOCK):
        end = min(n, start + _BLOCK)
        for i in range(start, end):
            old_out[i] = chunk[positions[i]]
        for i in range(start, end):
            code = (np.int32(packed[i >> 2]) >> (2 * (i & 3))) & 3
            if code == SMALL_ESCAPE:
                v = (np.int32(escapes[k]) + 1) & 0xFFFF
                k += 1
            else:
                v = code + 1
            delta = (v >> 1) ^ -(v & 1)
            old = np.int32(old_out[i])
            ordered = old ^ ((old >> 15) & 0x7FFF)  # sign-magnitude -> value order (its own inverse)
            s = ((ordered + delta + 32768) & 0xFFFF) - 32768  # int16 addition, wrapping
            chunk[positions[i]] = np.int16(s ^ ((s >> 15) & 0x7FFF))


_njit = numba.njit(cache=True, nogil=True, boundscheck=False) if numba is not None else None
apply_delta_2byte: Callable[[Any, Any, Any, Any, Any], None] | None = _njit(_apply_delta_2byte) if _njit else None
decode_positions: Callable[[Any, int, Any, int, Any], int] | None = _njit(_decode_positions) if _njit else None
count_escape_codes: Callable[[Any, int], int] | None = _njit(_count_escape_codes) if _njit else None
enabled = numba is not None  # tests switch it off to compare with the numpy path


def warm_up() -> None:
    """Load (or compile) every kernel now: their first call otherwise costs ~0.5 s inside a sync."""
    if not enabled or apply_delta_2byte is None or decode_positions is None or count_escape_codes is None:
        return
    planes, escapes, positions = np.zeros(2, np.uint8), np.zeros(0, np.uint64), np.empty(1, np.int64)
    decode_positions(planes, 1, escapes, 1, positions)
    count_escape_codes(planes, 1)
    apply_delta_2byte(np.zeros(1, np.int16), positions, planes[:1], np.zeros(0, np.uint16), np.empty(1, np.int16))
