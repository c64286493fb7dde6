"""Fused kernels for the common record, compiled with numba when installed (`pulsesync[fast]`).

A sparse delta record of a 2-byte float (bf16, fp16) is most of every RL patch. With numpy its
decode and apply take some fifteen passes over the changed elements, two of them random accesses
into the tensor (gather, then scatter: a cache and TLB miss each). Here:
- `decode_positions` turns the two gap byte planes (and escaped gaps) into positions in one pass,
  checking every position lies inside the chunk;
- `count_escape_codes` counts the value codes that say "escaped" (checked against the record);
- `apply_delta_2byte` gathers a block of old values (independent loads the CPU overlaps), then
  applies the order-preserving deltas from cache, returns the old values for the undo log, and
  updates the mixsum-128 state digest from the old and new bits it holds anyway.
bits.decode_positions and bits.check_escape_count run the first two and check their results
before the apply kernel runs, so it only ever indexes inside the chunk. Without numba the numpy
path runs: the results (errors included) are bit-identical, which the tests check by running
both.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import numpy as np

from pulsesync.codec.format import ESCAPE, GAP_DIRECT, MAX_GAP_CODE, SMALL_ESCAPE
from pulsesync.mixsum import term_change

try:
    import numba
except ImportError:  # pragma: no cover - exercised where numba is not installed
    numba = None  # type: ignore[assignment]


POSITIONS_OK, POSITIONS_ESCAPES_MISMATCH, POSITIONS_GAP_OUTSIDE, POSITIONS_OUTSIDE = 0, 1, 2, 3
POSITIONS_GAP_CODE_INVALID = 4


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


def _decode_gap_codes(codes: Any, extra: Any, length: int, out: Any) -> int:
    """out[i] = p_i from GAP_CODES (as bits.decode_gap_codes); a status code.

    First every code is checked and the extra bits they need counted against the stream (its size
    and zero padding): POSITIONS_GAP_CODE_INVALID, POSITIONS_ESCAPES_MISMATCH. Then one pass reads
    the extra bits LSB first; POSITIONS_OUTSIDE when a position is not below `length`.
    """
    total = 0
    for i in range(codes.size):
        code = np.int64(codes[i])
        if code > MAX_GAP_CODE:
            return POSITIONS_GAP_CODE_INVALID
        if code >= GAP_DIRECT:
            total += (code - GAP_DIRECT) // 4 + 1
    if (total + 7) // 8 != extra.size or (total % 8 != 0 and (np.int64(extra[extra.size - 1]) >> (total % 8)) != 0):
        return POSITIONS_ESCAPES_MISMATCH
    acc = np.int64(0)
    have = 0
    k = 0
    p = np.int64(-1)
    for i in range(codes.size):
        code = np.int64(codes[i])
        if code < GAP_DIRECT:
            gap = code
        else:
            nbits = (code - GAP_DIRECT) // 4 + 1
            while have < nbits:
                acc |= np.int64(extra[k]) << have
                k += 1
                have += 8
            gap = ((4 + ((code - GAP_DIRECT) & 3)) << nbits) | (acc & ((np.int64(1) << nbits) - 1))
            acc >>= nbits
            have -= nbits
        p += gap + 1
        if p >= length:
            return POSITIONS_OUTSIDE
        out[i] = p
    return POSITIONS_OK


def _encode_gap_codes(positions: Any, codes: Any, extra: Any) -> int:
    """GAP_CODES of sorted positions into codes (one per position) and extra (bytes); the bytes of extra used."""
    acc = np.int64(0)
    have = 0
    k = 0
    previous = np.int64(-1)
    for i in range(positions.size):
        gap = positions[i] - previous - 1
        previous = positions[i]
        if gap < GAP_DIRECT:
            codes[i] = gap
            continue
        nbits = math.frexp(float(gap))[1] - 3  # bit length - 3 (exact: gaps are far below 2**53)
        codes[i] = GAP_DIRECT + 4 * (nbits - 1) + ((gap >> nbits) & 3)
        acc |= (gap & ((np.int64(1) << nbits) - 1)) << have
        have += nbits
        while have >= 8:
            extra[k] = acc & 0xFF
            acc >>= 8
            have -= 8
            k += 1
    if have > 0:
        extra[k] = acc
        k += 1
    return k


def _count_escape_codes(packed: Any, count: int) -> int:
    """How many of the first `count` 2-bit codes (four per byte, low bits first) are SMALL_ESCAPE."""
    found = 0
    for i in range(count):
        found += ((packed[i >> 2] >> (2 * (i & 3))) & 3) == SMALL_ESCAPE
    return found


_BLOCK = 256  # elements gathered ahead of their update: their cache lines fit in L1


def _apply_delta_2byte(
    chunk: Any, positions: Any, packed: Any, escapes: Any, old_out: Any, deltas_out: Any, first: int, lanes: Any
) -> None:
    """chunk[p_i] = from_ordered(to_ordered(chunk[p_i]) + delta_i); old values into old_out.

    delta_i = unzigzag(code_i + 1), or unzigzag(escape + 1) for code 3, as bits.unpack_small_deltas;
    into deltas_out unless it is empty (the subscriber's history). Unless `lanes` is empty, adds
    the change of the mixsum-128 lane sums there (the chunk's first element at flat index
    `first`): the old and new bits are in registers, so the digest update costs no second pass.
    Each block's old values are gathered first, in a loop of independent loads the CPU overlaps
    (the miss per element is the cost), then updated from cache.
    """
    k = 0
    n = positions.size
    history, digest = deltas_out.size > 0, lanes.size > 0
    s0, s1, base = np.uint64(0), np.uint64(0), np.uint64(first)
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
            new = np.int16(s ^ ((s >> 15) & 0x7FFF))
            chunk[positions[i]] = new
            if history:
                deltas_out[i] = delta
            if digest:
                d0, d1 = term_change(
                    base + np.uint64(positions[i]), np.uint64(np.uint16(new)), np.uint64(np.uint16(old))
                )
                s0 += d0
                s1 += d1
    if digest:
        lanes[0] += s0
        lanes[1] += s1


def _apply_planes_2byte(
    chunk: Any,
    positions: Any,
    planes: Any,
    by_class: bool,
    ref_deltas: Any,
    old_out: Any,
    deltas_out: Any,
    first: int,
    lanes: Any,
) -> None:
    """Format 2's PLANES/EXP_PLANES values of a 2-byte float chunk: chunk[p_i] += delta_i in value order.

    delta_i = unzigzag of the two byte planes, taken in magnitude-class order of the old values
    where `by_class` (EXP_PLANES: a counting sort, stable, as bits.magnitude_order), plus
    ref_deltas[i] when given (HISTORY records; empty otherwise). Old values go to old_out (undo
    log), deltas in position order to deltas_out (the subscriber's history); the digest's lane
    sums change as in apply_delta_2byte.
    """
    n = positions.size
    for start in range(0, n, _BLOCK):  # gather ahead: independent loads the CPU overlaps
        for i in range(start, min(n, start + _BLOCK)):
            old_out[i] = chunk[positions[i]]
    next_in_class = np.zeros(257, np.int64)
    if by_class:
        for i in range(n):
            next_in_class[((np.int32(old_out[i]) >> 7) & 0xFF) + 1] += 1
        for c in range(256):
            next_in_class[c + 1] += next_in_class[c]
    digest = lanes.size > 0
    s0, s1, base = np.uint64(0), np.uint64(0), np.uint64(first)
    for i in range(n):
        j = i
        if by_class:
            c = (np.int32(old_out[i]) >> 7) & 0xFF
            j = next_in_class[c]
            next_in_class[c] += 1
        z = np.int32(planes[j]) | (np.int32(planes[n + j]) << 8)
        delta = (z >> 1) ^ -(z & 1)
        if ref_deltas.size:
            delta += np.int32(ref_deltas[i])
        delta = ((delta + 32768) & 0xFFFF) - 32768  # int16, wrapping
        deltas_out[i] = delta
        old = np.int32(old_out[i])
        ordered = old ^ ((old >> 15) & 0x7FFF)
        s = ((ordered + delta + 32768) & 0xFFFF) - 32768
        new = np.int16(s ^ ((s >> 15) & 0x7FFF))
        chunk[positions[i]] = new
        if digest:
            i64 = base + np.uint64(positions[i])
            d0, d1 = term_change(i64, np.uint64(np.uint16(new)), np.uint64(np.uint16(old)))
            s0 += d0
            s1 += d1
    if digest:
        lanes[0] += s0
        lanes[1] += s1


def _merge_history(
    ref_positions: Any, ref_deltas: Any, again: Any, fresh: Any, positions_out: Any, ref_out: Any
) -> bool:
    """Merge the reference positions that changed again with the new ones (both sorted) into
    positions_out, and their reference deltas (0 for new ones) into ref_out; False if a new
    position repeats a reference one."""
    i = j = k = 0
    while True:
        while i < ref_positions.size and not again[i]:
            i += 1
        if i < ref_positions.size and (j == fresh.size or ref_positions[i] < fresh[j]):
            positions_out[k], ref_out[k] = ref_positions[i], ref_deltas[i]
            i += 1
        elif j < fresh.size:
            if i < ref_positions.size and ref_positions[i] == fresh[j]:
                return False
            positions_out[k], ref_out[k] = fresh[j], 0
            j += 1
        else:
            return True
        k += 1


_njit = numba.njit(cache=True, nogil=True, boundscheck=False) if numba is not None else None
apply_delta_2byte: Callable[..., None] | None = _njit(_apply_delta_2byte) if _njit else None
decode_positions: Callable[[Any, int, Any, int, Any], int] | None = _njit(_decode_positions) if _njit else None
count_escape_codes: Callable[[Any, int], int] | None = _njit(_count_escape_codes) if _njit else None
decode_gap_codes: Callable[[Any, Any, int, Any], int] | None = _njit(_decode_gap_codes) if _njit else None
encode_gap_codes: Callable[[Any, Any, Any], int] | None = _njit(_encode_gap_codes) if _njit else None
apply_planes_2byte: Callable[..., None] | None = _njit(_apply_planes_2byte) if _njit else None
merge_history: Callable[..., bool] | None = _njit(_merge_history) if _njit else None
enabled = numba is not None  # tests switch it off to compare with the numpy path


def warm_up() -> None:
    """Load (or compile) every kernel now: their first call otherwise costs ~0.5 s inside a sync."""
    if not enabled or numba is None:
        return
    assert apply_delta_2byte and decode_positions and count_escape_codes and decode_gap_codes and encode_gap_codes
    assert apply_planes_2byte and merge_history
    # Payload buffers are read-only views of the decompressed bytes: numba compiles those apart.
    planes, escapes, positions = np.frombuffer(bytes(2), np.uint8), np.zeros(0, np.uint64), np.zeros(1, np.int64)
    decode_positions(planes, 1, escapes, 1, positions)
    decode_gap_codes(planes[:1], planes[:0], 1, positions)
    encode_gap_codes(positions, np.empty(1, np.uint8), np.empty(5, np.uint8))
    count_escape_codes(planes, 1)
    chunk, old, deltas = np.zeros(1, np.int16), np.empty(1, np.int16), np.empty(1, np.int16)
    for lanes in (np.zeros(2, np.uint64), np.zeros(0, np.uint64)):
        apply_delta_2byte(chunk, positions, planes[:1], np.zeros(0, np.uint16), old, deltas, 0, lanes)
        apply_planes_2byte(chunk, positions, planes, True, np.empty(0, np.int16), old, deltas, 0, lanes)
    merge_history(positions, deltas, np.ones(1, bool), positions[:0], positions.copy(), deltas.copy())
