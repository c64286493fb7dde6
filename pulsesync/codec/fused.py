"""Fused kernels for the common records, compiled with numba when installed (`pulsesync[fast]`).

A sparse record of a 2-byte float (bf16, fp16) is most of every RL patch. With numpy its decode
and apply take some fifteen passes over the changed elements, two of them random accesses into
the tensor (gather, then scatter: a cache and TLB miss each). Here:
- `decode_positions` / `decode_gap_codes` turn a record's gaps into positions in one pass,
  checking every position lies inside the chunk;
- `count_escape_codes` counts the value codes that say "escaped" (checked against the record);
- `apply_delta_2byte` / `apply_planes_2byte` apply the order-preserving deltas in one
  read-modify-write per element, the element AHEAD places on prefetched, return the old values for
  the undo log, and update the mixsum-128 state digest from the old and new bits in a vectorized
  pass;
- `apply_batch` does all of that for a table of SPARSE and HISTORY records in one call (the
  subscriber runs one per thread), GAP_CODES positions decoded in the apply loop itself (for
  class-ordered values, in the gather of the old values that precedes their writes);
- format 3: `class_positions` decodes CLASS_MASKS in one pass over a chunk's old values,
  `encode_value_codes` / the batch's `_value_code_planes` code and decode EXP_CODES, and
  `predicted_offsets` is PREDICTED_CODES' prediction (integer arithmetic, as bits' numpy version);
- the encoder's: `changed_words` diffs two chunks 64 bits at a time (keeping each change's old and
  new element), `match_reference` merges a record's positions with its reference's,
  `encode_gap_codes` writes GAP_CODES, and `sparse_streams` makes all of a sparse record's streams
  in one call (one hand-over of the GIL a record, not some thirty).
Every position is checked before it is written, so a kernel only ever indexes inside its chunk.
Without numba the numpy path runs: the results (errors included) are bit-identical, which the
tests check by running both.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable
from typing import Any

import numpy as np

from pulsesync.codec.format import (
    CLASS_MARKED,
    CLASS_NONE,
    CLASSES,
    ENTROPY_SAMPLE,
    ESCAPE,
    GAP_DIRECT,
    MAX_GAP_CODE,
    SMALL_ESCAPE,
    PositionCoding,
    RecordKind,
    ValueCoding,
)
from pulsesync.mixsum import term_change

try:
    import numba
except ImportError:  # pragma: no cover - exercised where numba is not installed
    numba = None  # type: ignore[assignment]


def _element_address(context: Any, builder: Any, signature: Any, args: Any) -> Any:
    """In an intrinsic's codegen for (array, index) arguments: the element's address (no wraparound)."""
    from numba.core import cgutils

    array_type = signature.args[0]
    array = context.make_array(array_type)(context, builder, args[0])
    return cgutils.get_item_pointer(context, builder, array_type, array, [args[1]])  # type: ignore[no-untyped-call]


def _prefetch_intrinsic() -> Any:
    """numba's prefetch(chunk, index): llvm.prefetch of the element's address, for writing, into every cache level."""
    from llvmlite import binding, ir
    from numba.core import cgutils
    from numba.extending import intrinsic

    # LLVM 15 made pointers opaque, and the intrinsic's name followed.
    name = "llvm.prefetch.p0" if binding.llvm_version_info >= (15,) else "llvm.prefetch.p0i8"

    @intrinsic
    def prefetch(typingctx: Any, chunk: Any, index: Any) -> Any:
        def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
            address = _element_address(context, builder, signature, args)
            i8p, i32 = ir.IntType(8).as_pointer(), ir.IntType(32)
            fn = cgutils.get_or_insert_function(  # type: ignore[no-untyped-call]
                builder.module, ir.FunctionType(ir.VoidType(), [i8p, i32, i32, i32]), name
            )
            write, locality, data = ir.Constant(i32, 1), ir.Constant(i32, 3), ir.Constant(i32, 1)
            builder.call(fn, [builder.bitcast(address, i8p), write, locality, data])
            return context.get_dummy_value()

        return numba.types.void(chunk, index), codegen

    return prefetch


def _load_le64(payloads: Any, j: Any) -> Any:
    """The 8 bytes payloads[j : j + 8] as a little-endian int64 (numba: one unaligned load)."""
    return np.int64(int.from_bytes(bytes(payloads[j : j + 8]), "little", signed=True))


def _load_le64_intrinsic() -> Any:
    """numba's _load_le64: one load of 8 bytes at any address, where five byte loads and their shifts took
    a third of a bit reader's time (byte-swapped on a big-endian host)."""
    from llvmlite import ir
    from numba.extending import intrinsic

    @intrinsic
    def load_le64(typingctx: Any, payloads: Any, j: Any) -> Any:
        def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
            address = _element_address(context, builder, signature, args)
            i64 = ir.IntType(64)
            value = builder.load(builder.bitcast(address, i64.as_pointer()), align=1)
            if sys.byteorder == "big":
                value = builder.call(builder.module.declare_intrinsic("llvm.bswap", [i64]), [value])
            return value

        return numba.types.int64(payloads, j), codegen

    return load_le64


def _pointer_intrinsic() -> Any:
    """numba's pointer(address): an int64 address as a void pointer (for numba.carray)."""
    from llvmlite import ir
    from numba.extending import intrinsic

    @intrinsic
    def pointer(typingctx: Any, address: Any) -> Any:
        def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
            return builder.inttoptr(args[0], ir.IntType(8).as_pointer())

        return numba.types.voidptr(address), codegen

    return pointer


POSITIONS_OK, POSITIONS_ESCAPES_MISMATCH, POSITIONS_GAP_OUTSIDE, POSITIONS_OUTSIDE = 0, 1, 2, 3
POSITIONS_GAP_CODE_INVALID = 4
VALUES_ESCAPES_MISMATCH = 5  # (apply_batch) the value codes' escapes do not match value_escapes
# (6 and 7: apply_batch's HISTORY statuses, below)
VALUES_CODE_INVALID, VALUES_EXTRA_MISMATCH = 8, 9  # EXP_CODES: a symbol above the last code; the extra bits
CLASS_TABLE_INVALID, CLASS_BITMAP_MISMATCH, CLASS_COUNT_MISMATCH = 10, 11, 12  # CLASS_MASKS


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


def _check_gap_codes(codes: Any, extra: Any) -> int:
    """POSITIONS_OK if every code is valid and the codes need exactly the extra bytes (zero padding)."""
    total = invalid = 0
    for i in range(codes.size):  # without a branch on the data: vectorized
        code = np.int64(codes[i])
        invalid |= code > MAX_GAP_CODE
        total += max(code - GAP_DIRECT + 4, 0) >> 2  # (code - GAP_DIRECT) // 4 + 1 extra bits, from GAP_DIRECT on
    if invalid:
        return POSITIONS_GAP_CODE_INVALID
    if (total + 7) // 8 != extra.size or (total % 8 != 0 and (np.int64(extra[extra.size - 1]) >> (total % 8)) != 0):
        return POSITIONS_ESCAPES_MISMATCH
    return POSITIONS_OK


def _decode_gap_codes(codes: Any, extra: Any, length: int, out: Any) -> int:
    """out[i] = p_i from GAP_CODES (as bits.decode_gap_codes); a status code.

    First every code is checked and the extra bits they need counted against the stream (its size
    and zero padding): POSITIONS_GAP_CODE_INVALID, POSITIONS_ESCAPES_MISMATCH. Then one pass reads
    the extra bits LSB first; POSITIONS_OUTSIDE when a position is not below `length`.
    """
    status = _check_gap_codes(codes, extra)
    if status != POSITIONS_OK:
        return status
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


_BIT_LENGTH = np.array([v.bit_length() for v in range(4096)], np.int64)  # of the values most gaps and moves take


def _bit_length(value: Any) -> Any:
    """int.bit_length of a non-negative value below 2**53 (a table lookup for most, else frexp, exact there)."""
    return _BIT_LENGTH[value] if value < _BIT_LENGTH.size else math.frexp(float(value))[1]


def _extra_bits(value: Any) -> Any:
    """Low bits of a non-negative value its GAP_CODES code leaves to the extra-bits stream (0 below GAP_DIRECT)."""
    return _bit_length(value) - 3 if value >= GAP_DIRECT else 0


def _length_code(value: Any, nbits: Any) -> Any:
    """The GAP_CODES code of a non-negative value of _extra_bits(value) = nbits."""
    return GAP_DIRECT + 4 * (nbits - 1) + ((value >> nbits) & 3) if nbits else value


def _pack_bits(values: Any, nbits: Any, extra: Any) -> int:
    """The low nbits[i] bits of each values[i], in order, lowest first, into extra (the last byte
    zero-padded); the bytes used.

    Under 32 bits wait in acc, stored four bytes at a time: a writer whose state an inlined helper
    returned as a tuple measured 3x slower.
    """
    acc, have, k = np.int64(0), 0, 0
    for i in range(values.size):
        acc |= (values[i] & ((np.int64(1) << nbits[i]) - 1)) << have
        have += nbits[i]
        if have >= 32:
            extra[k] = acc & 0xFF
            extra[k + 1] = (acc >> 8) & 0xFF
            extra[k + 2] = (acc >> 16) & 0xFF
            extra[k + 3] = (acc >> 24) & 0xFF
            acc >>= 32
            have -= 32
            k += 4
    while have > 0:
        extra[k] = acc & 0xFF
        acc >>= 8
        have -= 8
        k += 1
    return k


def _encode_gap_codes(positions: Any, codes: Any, extra: Any) -> int:
    """GAP_CODES of sorted positions into codes (one per position) and extra (bytes); the bytes of extra used."""
    gaps, nbits = np.empty(positions.size, np.int64), np.empty(positions.size, np.int64)
    previous = np.int64(-1)
    for i in range(positions.size):
        gaps[i] = positions[i] - previous - 1
        previous = positions[i]
        nbits[i] = _extra_bits(gaps[i])
        codes[i] = _length_code(gaps[i], nbits[i])
    return _pack_bits(gaps, nbits, extra)


def _changed_words_kernel(lanes: int) -> Callable[[Any, Any, Any, Any, Any], tuple[Any, Any, Any]]:
    """The kernel for elements `lanes` to a 64-bit word (compiled apart for each: its lane loop unrolls)."""
    width = np.uint64(64 // lanes)
    mask = np.uint64(0xFFFFFFFFFFFFFFFF) >> np.uint64(64 - 64 // lanes)

    def changed_words(old: Any, new: Any, out: Any, old_out: Any, new_out: Any) -> tuple[Any, Any, Any]:
        """Positions (in elements) where two arrays of words differ, and the old and new elements there
        (unsigned, of the element's width), found into out, old_out and new_out (room for every
        element: a caller's scratch, its pages already in memory) and returned as copies.

        One pass at memory speed: a word is compared whole and split into lanes only where it
        differs (some 1% of them in an RL patch), its elements kept while they are in registers
        (a gather after the scan cost ~6% of encode time, a cache miss a change).
        """
        n = 0
        for w in range(old.size):
            a, b = old[w], new[w]
            x = a ^ b
            if x:
                for lane in range(lanes):
                    shift = width * np.uint64(lane)
                    if (x >> shift) & mask:
                        out[n] = w * lanes + lane
                        old_out[n] = (a >> shift) & mask
                        new_out[n] = (b >> shift) & mask
                        n += 1
        return out[:n].copy(), old_out[:n].copy(), new_out[:n].copy()

    return changed_words


def _match_reference(positions: Any, ref_positions: Any, ref_deltas: Any, again: Any, aligned: Any, fresh: Any) -> int:
    """bits.match_reference in one merge of the two sorted position lists; how many positions are fresh."""
    j = 0
    n = 0
    for i in range(positions.size):
        p = positions[i]
        while j < ref_positions.size and ref_positions[j] < p:
            j += 1
        if j < ref_positions.size and ref_positions[j] == p:
            again[j] = True
            aligned[i] = ref_deltas[j]
        else:
            aligned[i] = 0
            fresh[n] = p
            n += 1
    return n


def _class_positions(chunk: Any, table: Any, bitmap: Any, out: Any) -> int:
    """out = the positions CLASS_MASKS code (bits.decode_class_masks), in one pass over the old values; a status.

    CLASS_TABLE_INVALID for a table entry above CLASS_MARKED; CLASS_COUNT_MISMATCH unless exactly
    out.size positions are found; CLASS_BITMAP_MISMATCH unless the marked classes' elements take
    exactly the bitmap's bytes, its padding bits zero.
    """
    for c in range(table.size):
        if table[c] > CLASS_MARKED:
            return CLASS_TABLE_INVALID
    limit = 8 * bitmap.size
    bit = 0
    k = 0
    for i in range(chunk.size):
        state = table[(np.int32(chunk[i]) >> 7) & 0xFF]
        if state == CLASS_NONE:
            continue
        if state == CLASS_MARKED:
            if bit == limit:
                return CLASS_BITMAP_MISMATCH
            flag = (bitmap[bit >> 3] >> (bit & 7)) & 1
            bit += 1
            if flag == 0:
                continue
        if k == out.size:
            return CLASS_COUNT_MISMATCH
        out[k] = i
        k += 1
    if k != out.size:
        return CLASS_COUNT_MISMATCH
    if (bit + 7) // 8 != bitmap.size or (bit % 8 != 0 and (np.int64(bitmap[bitmap.size - 1]) >> (bit % 8)) != 0):
        return CLASS_BITMAP_MISMATCH
    return POSITIONS_OK


def _value_code_planes(payloads: Any, at: int, n: int, extra_bytes: int, planes: Any) -> int:
    """EXP_CODES values (n symbols at payloads[at:], then extra_bytes of extra bits) into zigzag byte planes; a status.

    The symbols are checked first and the extra bits they need counted against the stream
    (_check_value_codes), so the reads end inside the record; payloads is padded past its last
    record for _gap_at's eight-byte reads.
    """
    status: int = _check_value_codes(payloads, at, n, extra_bytes)
    if status != POSITIONS_OK:
        return status
    bit = np.int64(8 * (at + n))
    for i in range(n):
        v, bit = _value_at(payloads, at + i, bit)
        z = ((v << 1) ^ (v >> 15)) & 0xFFFF
        planes[i] = z & 0xFF
        planes[n + i] = z >> 8
    return POSITIONS_OK


def _check_value_codes(payloads: Any, at: int, n: int, extra_bytes: int) -> int:
    """VALUES_CODE_INVALID or VALUES_EXTRA_MISMATCH unless n value symbols need exactly extra_bytes of extra bits."""
    total = 0
    for i in range(n):
        code = np.int64(payloads[np.uint64(at + i)]) >> 1
        if code > MAX_GAP_CODE:
            return VALUES_CODE_INVALID
        if code >= GAP_DIRECT:
            total += (code - GAP_DIRECT) // 4 + 1
    last = at + n + extra_bytes - 1
    if (total + 7) // 8 != extra_bytes or (total % 8 != 0 and (np.int64(payloads[last]) >> (total % 8)) != 0):
        return VALUES_EXTRA_MISMATCH
    return POSITIONS_OK


def _class_ordered_values(payloads: Any, at: int, n: int, extra_bytes: int, coding: int) -> tuple[int, Any]:
    """A class-ordered record's values as stored (int16; CODES: not yet folded by sign), for _apply_history_known.

    Its writing pass reads each value once, at the class's next slot: one load of an int16 here, where
    _value_planes' byte planes cost two loads and an unzigzag (25.9 -> 23.8 ms on one thread, the
    0.62B step of bench/scale.py). A status as _value_code_planes'.
    """
    values = np.empty(n, np.int16)
    if coding == _EXP_PLANES:
        planes = payloads[at : at + 2 * n]
        for i in range(n):
            values[i] = _plane_delta(planes, n, i, 0, False)
        return POSITIONS_OK, values
    status: int = _check_value_codes(payloads, at, n, extra_bytes)
    if status != POSITIONS_OK:
        return status, values
    bit = np.int64(8 * (at + n))
    for i in range(n):
        values[i], bit = _value_at(payloads, at + i, bit)
    return POSITIONS_OK, values


def _value_at(payloads: Any, symbol_at: int, bit: Any) -> tuple[Any, Any]:
    """The value an EXP_CODES symbol stands for (int16, wrapping; its extra bits at `bit`), and the next bit offset."""
    symbol = np.int64(payloads[np.uint64(symbol_at)])
    magnitude, bit = _gap_at(symbol >> 1, payloads, bit)
    v = -magnitude if symbol & 1 else magnitude
    return ((v + 32768) & 0xFFFF) - 32768, bit


def _encode_value_codes(values: Any, old: Any, order: Any, symbols: Any, extra: Any) -> int:
    """EXP_CODES of 2-byte values (bits.encode_value_codes) in one pass; the bytes of extra used."""
    magnitudes, nbits = np.empty(order.size, np.int64), np.empty(order.size, np.int64)
    for i in range(order.size):
        j = order[i]
        v = np.int64(values[j])
        if old[j] < 0:
            v = ((32768 - v) & 0xFFFF) - 32768  # -v, wrapping at 16 bits
        sign = 1 if v < 0 else 0
        magnitudes[i] = -v if sign else v
        nbits[i] = _extra_bits(magnitudes[i])
        symbols[i] = 2 * _length_code(magnitudes[i], nbits[i]) + sign
    return _pack_bits(magnitudes, nbits, extra)


def _sparse_streams(
    positions: Any, old: Any, new: Any, ref_positions: Any, ref_deltas: Any, history: bool, predicted: bool
) -> Any:
    """What the encoder codes of a sparse record of 2-byte floats (bits.sparse_streams), in one call.

    GAP_CODES of the positions; the ordered deltas, as packed DELTA codes and escapes; the old
    values' magnitude classes, their stable order and counts; the deltas' EXP_CODES; a histogram
    of a sample of the new values' byte planes (bits.entropy_bytes' sample). With
    `history`, the match against the reference chunk: its bitmap, the fresh positions' GAP_CODES
    and the residuals' codes (against the reference deltas, or their `predicted` offsets). One
    call instead of some thirty numpy and numba calls a record: each let the GIL go, and on two
    threads each hand-over woke the other core (docs/benchmarks.md).
    """
    n = positions.size
    gap_codes, gap_extra = np.empty(n, np.uint8), np.empty(4 * n + 1, np.uint8)
    gap_used = _encode_gap_codes_k(positions, gap_codes, gap_extra)
    deltas, packed, escaped = np.empty(n, np.int16), np.zeros((n + 3) // 4, np.uint8), np.empty(n, np.uint16)
    classes, counts = np.empty(n, np.uint8), np.zeros(CLASSES, np.int64)
    escapes = 0
    for i in range(n):
        o, w = np.int64(old[i]), np.int64(new[i])
        d = ((w ^ ((w >> 15) & 0x7FFF)) - (o ^ ((o >> 15) & 0x7FFF)) + 32768) % 65536 - 32768  # int16, wrapping
        deltas[i] = d
        symbol = ((((d << 1) ^ (d >> 15)) & 0xFFFF) + 0xFFFF) & 0xFFFF  # zigzag - 1, as uint16 (bits.pack_small)
        packed[i >> 2] |= np.uint8(min(symbol, SMALL_ESCAPE) << (2 * (i & 3)))
        if symbol >= SMALL_ESCAPE:
            escaped[escapes] = symbol
            escapes += 1
        c = (o >> 7) & 0xFF
        classes[i] = c
        counts[c] += 1
    order, at = np.empty(n, np.int64), np.zeros(CLASSES, np.int64)
    for c in range(1, CLASSES):
        at[c] = at[c - 1] + counts[c - 1]
    for i in range(n):  # a stable counting sort by class (np.argsort's kind="stable")
        order[at[classes[i]]] = i
        at[classes[i]] += 1
    symbols, value_extra = np.empty(n, np.uint8), np.empty(2 * n + 1, np.uint8)
    value_used = _encode_value_codes_k(deltas, old, order, symbols, value_extra)
    sampled = np.zeros((2, 256), np.int64)  # each byte plane of the new values, every stride-th (bits.entropy_bytes)
    for i in range(0, n, (n + ENTROPY_SAMPLE - 1) // ENTROPY_SAMPLE):
        sampled[0, np.int64(new[i]) & 0xFF] += 1
        sampled[1, (np.int64(new[i]) >> 8) & 0xFF] += 1
    streams = (gap_codes, gap_extra[:gap_used], deltas, packed, escaped[:escapes], classes, order, counts, sampled)
    streams_values = (symbols, value_extra[:value_used])
    if not history:
        nothing = np.empty(0, np.uint8)
        return streams, streams_values, (nothing, np.empty(0, np.int64), nothing, nothing, deltas[:0], nothing, nothing)
    again, aligned, fresh = np.zeros(ref_positions.size, np.bool_), np.empty(n, np.int16), np.empty(n, np.int64)
    m = _match_reference_k(positions, ref_positions, ref_deltas, again, aligned, fresh)
    bitmap = np.zeros((ref_positions.size + 7) // 8, np.uint8)
    for j in range(ref_positions.size):
        if again[j]:
            bitmap[j >> 3] |= np.uint8(1 << (j & 7))
    offsets = aligned
    if predicted:
        offsets = np.empty(n, np.int16)
        _predicted_offsets_k(old, aligned, offsets)
    residuals = np.empty(n, np.int16)
    for i in range(n):
        residuals[i] = (np.int64(deltas[i]) - np.int64(offsets[i]) + 32768) % 65536 - 32768
    fresh_codes, fresh_extra = np.empty(m, np.uint8), np.empty(4 * m + 1, np.uint8)
    fresh_used = _encode_gap_codes_k(fresh[:m], fresh_codes, fresh_extra)
    residual_symbols, residual_extra = np.empty(n, np.uint8), np.empty(2 * n + 1, np.uint8)
    residual_used = _encode_value_codes_k(residuals, old, order, residual_symbols, residual_extra)
    fresh_coded = (fresh[:m], fresh_codes, fresh_extra[:fresh_used])
    return streams, streams_values, (bitmap, *fresh_coded, residuals, residual_symbols, residual_extra[:residual_used])


def _count_escape_codes(packed: Any, count: int) -> int:
    """How many of the first `count` 2-bit codes (four per byte, low bits first) are SMALL_ESCAPE."""
    found = 0
    for i in range(count):
        found += ((packed[i >> 2] >> (2 * (i & 3))) & 3) == SMALL_ESCAPE
    return found


AHEAD = 64  # elements prefetched ahead of their update (of 16..256 on bench/scale.py's states: 64, 2.5% faster than 16)


def _prefetch(chunk: Any, index: Any) -> None:
    """A hint to load chunk[index] into the cache for writing (numba: llvm.prefetch; here nothing)."""


def _lanes_of(positions: Any, old: Any, new: Any, base: Any) -> tuple[Any, Any]:
    """How positions moving from old to new bits move the mixsum-128 lanes (the first element at index `base`).

    A loop of its own, without branches: the compiler vectorizes its 64-bit multiplies, which
    inline in the apply loop cost more than its memory accesses.
    """
    s0, s1 = np.uint64(0), np.uint64(0)
    for i in range(positions.size):
        d0, d1 = term_change(base + np.uint64(positions[i]), np.uint64(np.uint16(new[i])), np.uint64(np.uint16(old[i])))
        s0 += d0
        s1 += d1
    return s0, s1


def _add_ordered(old: Any, delta: Any) -> Any:
    """The 2-byte float whose order-preserving integer is old's plus delta (wrapping), as int16."""
    ordered = old ^ ((old >> 15) & 0x7FFF)  # sign-magnitude -> value order (its own inverse)
    s = ((ordered + delta + 32768) & 0xFFFF) - 32768  # int16 addition, wrapping
    return np.int16(s ^ ((s >> 15) & 0x7FFF))


def _packed_delta(packed: Any, escapes: Any, i: int, k: int) -> tuple[Any, int]:
    """The i-th packed DELTA value (unzigzag(code + 1), or of the next escape for code 3); the next escape index."""
    code = (np.int32(packed[i >> 2]) >> (2 * (i & 3))) & 3
    if code == SMALL_ESCAPE:
        v = (np.int32(escapes[k]) + 1) & 0xFFFF
        k += 1
    else:
        v = code + 1
    return (v >> 1) ^ -(v & 1), k


def _bf16_parts(bits: Any) -> tuple[Any, Any]:
    """A finite bf16's (effective biased exponent, signed significand): value = significand * 2**(exponent - 134)."""
    exponent = (bits >> 7) & 0xFF
    significand = (bits & 0x7F) | 0x80 if exponent > 0 else bits & 0x7F
    return max(exponent, 1), -significand if bits & 0x8000 else significand


def _predicted_offset(old: Any, reference_delta: Any) -> Any:
    """PREDICTED_CODES: how far, in ordered steps, the bf16 nearest 2 * old - prev is from old (0 where unpredicted).

    Where old, prev and old + reference_delta steps share a binade (sign and exponent), 2 * old -
    prev is exactly reference_delta ULPs from old, and nothing needs rounding. That shortcut (the
    binade of negative subnormals excepted: a zero result is +0 there) costs ~2 ns an element
    where the exact computation costs ~7 (tests/test_codec_v2.py compares the two on every bf16
    value). Moves of a few ULPs nearly always take it; a real fine-tune's larger ones often do
    not (41% of SmolLM2-135M's), and the branch then mispredicts: 9.1 ns an element there, 6.7
    without the shortcut (docs/benchmarks.md), which bench/scale.py's moves would pay 6.7 for.
    """
    s = np.int64(np.int16(np.int64(old) & 0xFFFF))
    ordered = s ^ ((s >> 15) & 0x7FFF)
    binade = ordered >> 7
    if (
        binade == (ordered - reference_delta) >> 7
        and binade == (ordered + reference_delta) >> 7
        and binade != 255  # Inf and NaN
        and binade != -256
        and binade != -1
    ):
        return np.int64(reference_delta)
    return _rounded_prediction_offset(old, reference_delta)


def _rounded_prediction_offset(old: Any, reference_delta: Any) -> Any:
    """_predicted_offset computed in full: the prediction rounded to bf16.

    prev = the value reference_delta ordered steps below old (the value before the reference step).
    2 * old - prev is computed exactly in float64 (both significands span at most 40 of its 53
    bits when their exponents are at most 30 apart) and rounded to bf16 once, ties to even, from
    its bits: every encoder and decoder gets the same bits, whatever its floating-point
    environment (bits.predicted_offsets computes it in integers; the tests compare both on every
    bf16 value). Old stays the prediction where reference_delta is 0 (a new position), either
    value is not finite, or their exponents are more than 30 apart. ~7 ns, where the integer
    rounding (its bit length from frexp, branches on the data) took ~25.
    """
    o = np.int64(old) & 0xFFFF
    ordered = np.int64(np.int16(o)) ^ ((np.int64(np.int16(o)) >> 15) & 0x7FFF)
    p = ((ordered - reference_delta + 32768) & 0xFFFF) - 32768  # prev, ordered
    p = (p ^ ((p >> 15) & 0x7FFF)) & 0xFFFF
    # Without a branch on the data (which of these hold is as random as the weights): each
    # condition and both roundings are computed, the results selected.
    eo, ep = (o >> 7) & 0xFF, (p >> 7) & 0xFF
    skip = (reference_delta == 0) | (eo == 0xFF) | (ep == 0xFF) | (abs(max(eo, 1) - max(ep, 1)) > 30)
    t = 2.0 * _bf16_value(o, eo) - _bf16_value(p, ep)
    bits = _float_bits(t)
    a = bits & 0x7FFFFFFFFFFFFFFF
    # A bf16 normal (float64 exponent 1023 - 126 and up): the top 7 significand bits, rounded to
    # nearest, ties to even (a carry moves the exponent), float64's exponent bias (1023) made
    # bf16's (127); beyond the largest finite: Inf.
    normal = min(((a + ((np.int64(1) << 44) - 1) + ((a >> 45) & 1)) >> 45) - (np.int64(896) << 7), np.int64(0x7F80))
    # A bf16 subnormal: t is a multiple of 2**-133 (both values are), so this count is exact (128:
    # the smallest normal).
    subnormal = np.int64(min(abs(t) * 2.0**133, 256.0))  # (capped: a normal t would not fit an int64)
    magnitude = normal if a >= np.int64(897) << 52 else subnormal
    predicted = (magnitude | ((bits >> 48) & 0x8000)) if a else np.int64(0)  # (t = -0.0: +0, as numpy)
    s = np.int64(np.int16(predicted))
    offset = (((s ^ ((s >> 15) & 0x7FFF)) - ordered + 32768) & 0xFFFF) - 32768
    return np.int64(0) if skip else offset


def _bf16_value(bits: Any, exponent: Any) -> Any:
    """A bf16's value in float64 (exact), from its bits and exponent field."""
    significand = (bits & 0x7F) | (np.int64(exponent > 0) << 7)
    return np.float64(significand - 2 * significand * ((bits >> 15) & 1)) * _SIGNIFICAND_SCALE[exponent]


# A bf16 of exponent field e (1 for subnormals) is its signed 8-bit significand times 2**(e - 134).
_SIGNIFICAND_SCALE = np.array([2.0 ** (max(e, 1) - 134) for e in range(256)])


def _float_bits(value: Any) -> Any:
    """A float64's bits as an int64 (numba: a bitcast)."""
    return np.int64(np.float64(value).view(np.int64))


def _float_bits_intrinsic() -> Any:
    """numba's _float_bits: the float64 reinterpreted, one instruction."""
    from llvmlite import ir
    from numba.extending import intrinsic

    @intrinsic
    def float_bits(typingctx: Any, value: Any) -> Any:
        def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
            return builder.bitcast(args[0], ir.IntType(64))

        return numba.types.int64(numba.types.float64), codegen

    return float_bits


def _predicted_offsets(old: Any, reference_deltas: Any, out: Any) -> None:
    """out[i] = _predicted_offset(old[i], reference_deltas[i]) (bits.predicted_offsets)."""
    for i in range(old.size):
        out[i] = _predicted_offset(old[i], reference_deltas[i])


def _write(chunk: Any, p: Any, delta: Any, i: int, old_out: Any, new_bits: Any) -> None:
    """chunk[p] moved by delta ordered steps; its old bits to old_out[i], its new ones to new_bits[i] (if kept)."""
    old = chunk[p]
    new = _add_ordered(np.int32(old), delta)
    chunk[p] = new
    old_out[i] = old
    if new_bits.size:
        new_bits[i] = new


def _new_bits(new_out: Any, n: int, lanes: Any) -> Any:
    """Where a kernel keeps the new bits it writes: new_out, else a buffer of its own if the lanes need them."""
    return new_out if new_out.size else np.empty(n if lanes.size else 0, np.int16)


def _add_lanes_of(lanes: Any, positions: Any, old: Any, new_bits: Any, first: int) -> None:
    """lanes += how the elements written moved the digest's lane sums (nothing if lanes is empty)."""
    if lanes.size:
        s0, s1 = _lanes_of(positions, old, new_bits, np.uint64(first))
        lanes[0] += s0
        lanes[1] += s1


def _apply_delta_2byte(
    chunk: Any,
    positions: Any,
    packed: Any,
    escapes: Any,
    old_out: Any,
    deltas_out: Any,
    first: int,
    lanes: Any,
    new_out: Any,
) -> None:
    """chunk[p_i] = from_ordered(to_ordered(chunk[p_i]) + delta_i); old values into old_out.

    delta_i = unzigzag(code_i + 1), or unzigzag(escape + 1) for code 3, as bits.unpack_small_deltas;
    into deltas_out unless it is empty (the subscriber's history). Unless `lanes` is empty, adds
    the change of the mixsum-128 lane sums there (the chunk's first element at flat index
    `first`). New values go to new_out unless it is empty. One read-modify-write per element, the
    element AHEAD places on prefetched: the misses overlap as in a bare loop of flips
    (bench/scale.py's floor), the arithmetic hides in them.
    """
    k = 0
    n = positions.size
    history = deltas_out.size > 0
    new_bits = _new_bits(new_out, n, lanes)
    for i in range(n):
        if i + AHEAD < n:
            _prefetch(chunk, positions[i + AHEAD])
        delta, k = _packed_delta(packed, escapes, i, k)
        _write(chunk, positions[i], delta, i, old_out, new_bits)
        if history:
            deltas_out[i] = delta
    _add_lanes_of(lanes, positions, old_out, new_bits, first)


def _gap_at(code: Any, payloads: Any, bit: Any) -> tuple[Any, Any]:
    """The gap a GAP_CODES code stands for, its extra bits read at bit offset `bit` of payloads; the next offset.

    Branch-free: eight bytes are read whatever the code needs (payloads is padded with 8 bytes past its end).
    """
    nbits = (code - GAP_DIRECT) // 4 + 1 if code >= GAP_DIRECT else np.int64(0)
    word = _load_le64(payloads, bit >> 3)
    low = (word >> (bit & 7)) & ((np.int64(1) << nbits) - 1)
    gap = ((4 + ((code - GAP_DIRECT) & 3)) << nbits) | low if code >= GAP_DIRECT else code
    return gap, bit + nbits


def _decode_ahead(chunk: Any, payloads: Any, at: int, i: int, bit: Any, p: Any, positions_out: Any) -> tuple[Any, Any]:
    """Position i of GAP_CODES codes at payloads[at:] (its extra bits at `bit`), the one after p: into
    positions_out and prefetched if inside the chunk (the caller checks p < chunk.size); (bit, p) after it."""
    gap, bit = _gap_at(np.int64(payloads[at + i]), payloads, bit)
    p += gap + 1
    if p < chunk.size:
        positions_out[i] = p
        _prefetch(chunk, p)
    return bit, p


def _class_starts(counts: Any) -> None:
    """counts[c + 1] (how many old values are of class c) -> counts[c]: where class c starts in class order."""
    for c in range(256):
        counts[c + 1] += counts[c]


def _apply_delta_gap_codes(
    chunk: Any,
    payloads: Any,
    at: int,
    n: int,
    packed: Any,
    escapes: Any,
    positions_out: Any,
    old_out: Any,
    deltas_out: Any,
    first: int,
    lanes: Any,
    new_out: Any,
) -> tuple[int, int]:
    """apply_delta_2byte of a record whose positions are GAP_CODES (n codes at payloads[at:], then the extra bits).

    Each position is decoded AHEAD elements before its update, checked inside the chunk and
    prefetched, so decoding hides in the misses. The codes must have passed _check_gap_codes.
    Returns (POSITIONS_OK, n), or (POSITIONS_OUTSIDE, elements already written: the undo log's).
    """
    length = chunk.size
    bit = np.int64(8 * (at + n))
    p = np.int64(-1)
    for i in range(min(n, AHEAD)):
        bit, p = _decode_ahead(chunk, payloads, at, i, bit, p, positions_out)
        if p >= length:
            return POSITIONS_OUTSIDE, 0
    k = 0
    history = deltas_out.size > 0
    new_bits = _new_bits(new_out, n, lanes)
    for i in range(n):
        ahead = i + AHEAD
        if ahead < n:
            bit, p = _decode_ahead(chunk, payloads, at, ahead, bit, p, positions_out)
            if p >= length:
                return POSITIONS_OUTSIDE, i
        delta, k = _packed_delta(packed, escapes, i, k)
        _write(chunk, positions_out[i], delta, i, old_out, new_bits)
        if history:
            deltas_out[i] = delta
    _add_lanes_of(lanes, positions_out[:n], old_out, new_bits, first)
    return POSITIONS_OK, n


def _apply_planes_2byte(
    chunk: Any,
    positions: Any,
    planes: Any,
    coding: int,
    ref_deltas: Any,
    old_out: Any,
    deltas_out: Any,
    first: int,
    lanes: Any,
    new_out: Any,
) -> None:
    """Byte-plane values of a 2-byte float chunk (ValueCoding `coding`): chunk[p_i] += delta_i in value order.

    PLANES: delta_i = unzigzag of the two byte planes; EXP_PLANES: the same, taken in
    magnitude-class order of the old values (a counting sort, stable, as bits.magnitude_order;
    the old values are gathered first); EXP_CODES (decoded to planes by _value_code_planes): as
    EXP_PLANES, negated where the old value is negative; RAW: the planes hold the new bits, delta_i is how far
    they are from the old ones in value order. Plus ref_deltas[i] when given (HISTORY records;
    empty otherwise). Old values go to old_out (undo log), deltas in position order to deltas_out (the
    subscriber's history), new values to new_out unless it is empty; the digest's lane sums change
    as in apply_delta_2byte.
    """
    next_in_class = np.zeros(257, np.int64)
    if _by_class(coding):
        _gather_classes(chunk, positions, old_out, next_in_class)
    _write_planes(
        chunk, positions, planes, coding, ref_deltas, old_out, deltas_out, first, lanes, next_in_class, new_out
    )


def _by_class(coding: int) -> bool:
    """Whether a ValueCoding's values come in magnitude-class order of the old values (they are gathered first)."""
    return coding in (_EXP_PLANES, _EXP_CODES, _PREDICTED_CODES)


def _gather_classes(chunk: Any, positions: Any, old_out: Any, next_in_class: Any) -> None:
    """old_out[i] = chunk[positions[i]]; next_in_class[c] = where class c's values start in class order."""
    n = positions.size
    for i in range(n):
        if i + AHEAD < n:
            _prefetch(chunk, positions[i + AHEAD])
        old_out[i] = chunk[positions[i]]
        next_in_class[((np.int32(old_out[i]) >> 7) & 0xFF) + 1] += 1
    _class_starts(next_in_class)


def _write_planes(
    chunk: Any,
    positions: Any,
    planes: Any,
    coding: int,
    ref_deltas: Any,
    old_out: Any,
    deltas_out: Any,
    first: int,
    lanes: Any,
    next_in_class: Any,
    new_out: Any,
) -> None:
    """_apply_planes_2byte's writing pass (class-ordered codings: after the gather that filled old_out)."""
    n = positions.size
    raw, predicted = coding == _RAW, coding == _PREDICTED_CODES
    fold = predicted or coding == _EXP_CODES
    by_class = _by_class(coding)
    new_bits = _new_bits(new_out, n, lanes)
    for i in range(n):
        p = positions[i]
        j = i
        if by_class:  # the old value was gathered: the chunk is only written (no load waits on a miss)
            old = old_out[i]
            c = (np.int32(old) >> 7) & 0xFF
            j = next_in_class[c]
            next_in_class[c] += 1
        else:
            if i + AHEAD < n:
                _prefetch(chunk, positions[i + AHEAD])
            old = chunk[p]
        if raw:  # new bits: how far they are from the old ones in value order (as bits.to_ordered_)
            new, was = np.int32(np.int16(np.int32(planes[j]) | (np.int32(planes[n + j]) << 8))), np.int32(old)
            delta = (new ^ ((new >> 15) & 0x7FFF)) - (was ^ ((was >> 15) & 0x7FFF))
        else:
            delta = _plane_delta(planes, n, j, old, fold)
        delta = _with_reference(delta, old, ref_deltas[i] if ref_deltas.size else 0, predicted)
        new = _add_ordered(np.int32(old), delta)
        chunk[p] = new
        old_out[i] = old
        if new_bits.size:
            new_bits[i] = new
        deltas_out[i] = delta
    _add_lanes_of(lanes, positions, old_out, new_bits, first)


def _plane_delta(planes: Any, n: int, j: Any, old: Any, fold: bool) -> Any:
    """Value j of n in two byte planes, unzigzagged; negated where `fold` (EXP_CODES, PREDICTED_CODES) and old < 0."""
    z = np.int32(planes[j]) | (np.int32(planes[n + j]) << 8)
    delta = (z >> 1) ^ -(z & 1)
    return -delta if fold and old < 0 else delta


def _with_reference(delta: Any, old: Any, reference_delta: Any, predicted: bool) -> Any:
    """A residual plus its reference delta (PREDICTED_CODES: the prediction's offset), as int16 (wrapping)."""
    delta += _predicted_offset(old, reference_delta) if predicted else np.int32(reference_delta)
    return ((delta + 32768) & 0xFFFF) - 32768


def _merge_history(
    ref_positions: Any, ref_deltas: Any, again: Any, fresh: Any, positions_out: Any, ref_out: Any
) -> bool:
    """Merge the reference positions that changed again with the new ones (both sorted) into
    positions_out, and their reference deltas (0 for new ones) into ref_out; False if a new
    position repeats a reference one.

    Without a branch on the data: which reference positions changed again, and which list the
    next position comes from, are as random as the weights' updates: a branch on them mispredicted
    about every other element (10.4 ns a merged position, 8.8 without the branches). The choice is
    made with masks, not a conditional expression, which the compiler left a branch (7.2 ns a
    merged position with the reference's compaction, 4.5-5.1 with masks).
    """
    # The reference positions that changed again, compacted (written always, kept where marked),
    # closed by a sentinel above every position.
    picked, picked_deltas = (
        np.empty(ref_positions.size + 1, np.int64),
        np.empty(ref_positions.size + 1, ref_deltas.dtype),
    )
    m = 0
    for i in range(ref_positions.size):
        picked[m], picked_deltas[m] = ref_positions[i], ref_deltas[i]
        m += np.int64(again[i])
    picked[m] = _END
    n = fresh.size
    i = j = 0
    repeats = np.int64(0)
    for k in range(m + n):
        a = picked[i]
        b = fresh[j] if j < n else _END
        take = np.int64(a < b)  # 1: from the reference
        mask = -take
        repeats |= np.int64(a == b)
        positions_out[k] = (a & mask) | (b & ~mask)
        ref_out[k] = picked_deltas[i] * take
        i += take
        j += 1 - take
    return bool(repeats == 0)


# The record table of apply_batch: one row per record, these columns.
(
    ROW_TARGET,  # address of the record's chunk: its first element (2 bytes each, contiguous, in memory)
    ROW_LENGTH,  # elements of the chunk
    ROW_PAYLOAD,  # offset of its decompressed payload in `payloads`
    ROW_COUNT,  # changed elements
    ROW_ESCAPES,  # escaped gaps (GAPS16: u64 each) or extra-bit bytes (GAP_CODES)
    ROW_VALUE_ESCAPES,  # escaped values (packed DELTA codes)
    ROW_POSITIONS,  # PositionCoding
    ROW_CODING,  # ValueCoding: RAW or DELTA (SPARSE only), PLANES or EXP_PLANES
    ROW_FIRST,  # flat index of the chunk's first element (the digest's)
    ROW_OUT,  # offset of its positions, old values and deltas in the output arrays
    ROW_NEW_COUNT,  # HISTORY: positions coded as gaps (SPARSE: ROW_COUNT)
    ROW_REF_COUNT,  # HISTORY: positions of the reference chunk (SPARSE: 0)
    ROW_REF_POSITIONS,  # HISTORY: address of the reference chunk's positions (int64)
    ROW_REF_DELTAS,  # HISTORY: address of the reference chunk's deltas (int16)
    ROW_KIND,  # RecordKind: SPARSE or HISTORY
    ROW_REF_VALUES,  # HISTORY: address of the new values the reference chunk wrote (int16), 0 where not kept
) = range(16)
ROW_COLUMNS = 16
_END = 1 << 62  # closes a list of positions: above every position
HISTORY_BITMAP_MISMATCH = 6  # the reference bitmap does not mark count - new_count positions (padding: zero)
HISTORY_REPEATS = 7  # a new position repeats one of the reference's
_GAP_CODES = int(PositionCoding.GAP_CODES)  # (numba compares plain ints)
_RAW, _DELTA, _EXP_PLANES = int(ValueCoding.RAW), int(ValueCoding.DELTA), int(ValueCoding.EXP_PLANES)
_EXP_CODES, _PREDICTED_CODES = int(ValueCoding.EXP_CODES), int(ValueCoding.PREDICTED_CODES)
_CLASS_MASKS = int(PositionCoding.CLASS_MASKS)
_HISTORY = int(RecordKind.HISTORY)


def _padded_gap_codes(payloads: Any, at: int, n: int, escapes: int, length: int, out: Any) -> int:
    """_decode_gap_codes of n codes at payloads[at:] (then their extra bits), with _gap_at's branch-free reads.

    1.7x faster here (2.8 ms a million, the check included). The codes are checked first, so the
    extra bits read end inside the record; payloads is padded past its last record, so the
    eight-byte reads stay inside it.
    """
    status: int = _check_gap_codes_k(payloads[at : at + n], payloads[at + n : at + n + escapes])
    if status != POSITIONS_OK:
        return status
    bit = np.int64(8 * (at + n))
    p = np.int64(-1)
    for i in range(n):
        gap, bit = _gap_at(np.int64(payloads[np.uint64(at + i)]), payloads, bit)
        p += gap + 1
        if p >= length:
            return POSITIONS_OUTSIDE
        out[i] = p
    return POSITIONS_OK


def _row_positions(payloads: Any, at: int, n: int, escapes: int, coding: int, chunk: Any, out: Any) -> int:
    """Decode n positions at payloads[at:] (PositionCoding `coding`) into out, each checked in the chunk; a status."""
    status: int
    length = chunk.size
    if coding == _GAP_CODES:
        status = _padded_gap_codes(payloads, at, n, escapes, length, out)
        return status
    if coding == _CLASS_MASKS:  # (chunk holds the old values: positions are decoded before any write)
        bitmap_at = at + CLASSES
        status = _class_positions_k(chunk, payloads[at:bitmap_at], payloads[bitmap_at : bitmap_at + escapes], out[:n])
        return status
    escaped = np.empty(escapes, np.uint64)
    for k in range(escapes):
        word = np.uint64(0)
        for b in range(8):
            word |= np.uint64(payloads[at + 2 * n + 8 * k + b]) << np.uint64(8 * b)
        escaped[k] = word
    status = _decode_positions_k(payloads[at : at + 2 * n], n, escaped, length, out)
    return status


def _history_positions(payloads: Any, at: int, row: Any, chunk: Any, fresh: Any, found: Any, ref_deltas: Any) -> int:
    """A HISTORY record's positions into `found` and each one's reference delta into ref_deltas; a status.

    As parse's HISTORY decoding: the bitmap marks the reference positions that changed again
    (exactly count - new_count, zero padding), the new positions (into `fresh`) are merged in.
    """
    status, again = _again_and_fresh(payloads, at, row, chunk, fresh)
    if status != POSITIONS_OK:
        return status
    ref_count = row[ROW_REF_COUNT]
    reference = _carray(_pointer(row[ROW_REF_POSITIONS]), ref_count, np.int64)
    reference_deltas = _carray(_pointer(row[ROW_REF_DELTAS]), ref_count, np.int16)
    if not _merge_history_k(reference, reference_deltas, again, fresh, found, ref_deltas):
        return HISTORY_REPEATS
    return POSITIONS_OK


def _again_and_fresh(payloads: Any, at: int, row: Any, chunk: Any, fresh: Any) -> tuple[int, Any]:
    """A HISTORY record's bitmap of the reference positions that changed again, and its new positions into fresh."""
    ref_count, n = row[ROW_REF_COUNT], row[ROW_NEW_COUNT]
    again = np.zeros(ref_count, np.bool_)
    marked = 0
    for i in range((ref_count + 7) // 8 * 8):
        bit = (payloads[at + (i >> 3)] >> (i & 7)) & 1
        if i >= ref_count and bit:
            return HISTORY_BITMAP_MISMATCH, again
        if i < ref_count:
            again[i] = bit == 1
            marked += bit
    if marked != row[ROW_COUNT] - n:
        return HISTORY_BITMAP_MISMATCH, again
    at += (ref_count + 7) // 8
    status: int = _row_positions(payloads, at, n, row[ROW_ESCAPES], row[ROW_POSITIONS], chunk, fresh)
    return status, again


def _apply_history_known(
    payloads: Any,
    at: int,
    row: Any,
    chunk: Any,
    found: Any,
    old_out: Any,
    deltas_out: Any,
    new_out: Any,
    lanes: Any,
) -> bool:
    """A class-ordered HISTORY record whose recurring positions' old values are known, in one random pass.

    Its values come in magnitude-class order of the old values, so every old value's class must be
    counted before the first write. At the positions that changed at the reference patch too (most:
    Adam's momentum), the old values are the new values that patch wrote, which its history keeps
    (ROW_REF_VALUES): only the new positions are read first. The merge of both lists then runs
    inside the writing pass, where _history_positions and _apply_planes_2byte take three passes
    (merge, gather, write): 29.4 -> 26.8 ms on one thread for a 0.62B step of bench/scale.py
    (docs/benchmarks.md). Each old value read is checked
    against the one its class was counted from. Only a record without fault is applied here: on a
    value that differs (the held state was changed outside patches), a repeated position or any
    undecodable part, what was written is restored and False returned, and the record goes the
    general way, which reports any fault as it always has. Indices are cast unsigned where numba
    cannot see they are not negative: for a signed one it adds the array's length to any negative
    value (boundscheck=False leaves that on), three instructions an access in the hot loops (32.30 ->
    30.82 ms on one thread and 18.48 -> 18.00 on two for the 0.62B step, the bit readers' casts included).
    """
    ref_count, n_new, n, coding = row[ROW_REF_COUNT], row[ROW_NEW_COUNT], row[ROW_COUNT], row[ROW_CODING]
    fresh = np.empty(n_new, np.int64)
    bitmap_len = (ref_count + 7) // 8  # read in the compaction below, not unpacked first (0.5 ms of 26.3)
    if ref_count & 7 and payloads[at + bitmap_len - 1] >> (ref_count & 7):
        return False
    status = _row_positions(payloads, at + bitmap_len, n_new, row[ROW_ESCAPES], row[ROW_POSITIONS], chunk, fresh)
    if status != POSITIONS_OK:
        return False
    values_at = at + bitmap_len + _positions_len(n_new, row[ROW_ESCAPES], row[ROW_POSITIONS])
    status, values = _class_ordered_values(payloads, values_at, n, row[ROW_VALUE_ESCAPES], coding)
    if status != POSITIONS_OK:
        return False
    reference = _carray(_pointer(row[ROW_REF_POSITIONS]), ref_count, np.int64)
    reference_deltas = _carray(_pointer(row[ROW_REF_DELTAS]), ref_count, np.int16)
    reference_values = _carray(_pointer(row[ROW_REF_VALUES]), ref_count, np.int16)
    # The recurring positions, compacted (as _merge_history), with their values' classes counted.
    picked = np.empty(ref_count + 1, np.int64)
    picked_deltas, picked_values = np.empty(ref_count + 1, np.int16), np.empty(ref_count + 1, np.int16)
    next_in_class = np.zeros(257, np.int64)
    m = 0
    for i in range(ref_count):
        value = reference_values[i]
        um = np.uint64(m)
        picked[um], picked_deltas[um], picked_values[um] = reference[i], reference_deltas[i], value
        again = np.int64((payloads[np.uint64(at + (i >> 3))] >> (i & 7)) & 1)
        next_in_class[((np.int32(value) >> 7) & 0xFF) + 1] += again
        m += again
    if m != n - n_new:  # (the general path names the fault)
        return False
    picked[m] = _END
    # The new positions' old values, read ahead of the pass (they are not known) and counted.
    fresh_old = np.zeros(n_new + 1, np.int16)
    for j in range(n_new):
        if j + AHEAD < n_new:
            _prefetch(chunk, fresh[j + AHEAD])
        value = chunk[np.uint64(fresh[j])]
        fresh_old[j] = value
        next_in_class[((np.int32(value) >> 7) & 0xFF) + 1] += 1
    _class_starts(next_in_class)
    predicted = coding == _PREDICTED_CODES
    fold = predicted or coding == _EXP_CODES
    new_bits = _new_bits(new_out, n, lanes)
    i = j = 0
    for k in range(n):
        if i + AHEAD < m:
            _prefetch(chunk, picked[np.uint64(i + AHEAD)])
        a = picked[np.uint64(i)]
        b = fresh[np.uint64(j)] if j < n_new else _END
        take = np.int64(a < b)  # 1: a recurring position (branch-free, as _merge_history)
        mask = -take
        p = (a & mask) | (b & ~mask)
        known = (np.int64(picked_values[np.uint64(i)]) & mask) | (np.int64(fresh_old[np.uint64(j)]) & ~mask)
        reference_delta = np.int64(picked_deltas[np.uint64(i)]) * take
        if a == b or chunk[np.uint64(p)] != known:
            for t in range(k):
                chunk[found[t]] = old_out[t]
            return False
        i += take
        j += 1 - take
        # From the value the class was counted from (equal to the one read, checked above): the read,
        # a cache miss at most recurring positions, then feeds only the check, and the pass runs on
        # without waiting for it (27.1 -> 25.7 ms on one thread, the 0.62B step of bench/scale.py).
        old = np.int16(known)
        c = (np.int32(old) >> 7) & 0xFF
        v = next_in_class[c]
        next_in_class[c] += 1
        stored = np.int32(values[np.uint64(v)])
        delta = _with_reference(-stored if fold and old < 0 else stored, old, reference_delta, predicted)
        new = _add_ordered(np.int32(old), delta)
        chunk[np.uint64(p)] = new
        found[k] = p
        old_out[k] = old
        if new_bits.size:
            new_bits[k] = new
        deltas_out[k] = delta
    _add_lanes_of(lanes, found, old_out, new_bits, np.int64(row[ROW_FIRST]))
    return True


def _apply_batch(
    payloads: Any, table: Any, positions: Any, old: Any, deltas: Any, news: Any, lanes: Any
) -> tuple[int, int, int]:
    """Decode and apply SPARSE and HISTORY records of 2-byte floats, one per row of `table`, in one call.

    Every record's codes are checked before it writes anything, and every position before it
    is written; a record's positions, old values, deltas and new values go to the output arrays at ROW_OUT,
    its digest change to lanes[row] (unless lanes has no columns). `payloads` is padded with 8
    zero bytes. Chunks and reference chunks are given by address (the caller keeps them alive and
    checked them against the records' dtypes, shapes and counts): a typed list of arrays cost
    ~10 us a record. Returns (-1, POSITIONS_OK, 0), or the first failing row, its status and how
    many of its elements it wrote (rows before it are applied). Per record this is what
    decode_record and apply_record do; in one call, the Python and dispatch per record are paid
    once a batch.
    """
    for r in range(table.shape[0]):
        row = table[r]
        chunk = _carray(_pointer(row[ROW_TARGET]), row[ROW_LENGTH], np.int16)
        at, n, escapes, out = row[ROW_PAYLOAD], row[ROW_COUNT], row[ROW_ESCAPES], row[ROW_OUT]
        coding, first, position_coding = row[ROW_CODING], row[ROW_FIRST], row[ROW_POSITIONS]
        gap_codes = position_coding == _GAP_CODES
        found, row_old, row_deltas = positions[out : out + n], old[out : out + n], deltas[out : out + n]
        row_news, row_lanes = news[out : out + n], lanes[r]
        if row[ROW_KIND] == _HISTORY:
            # Nearly every HISTORY record of an RL step: class-ordered, coded against a patch this kernel applied.
            known = row[ROW_REF_VALUES] != 0 and _by_class(coding)
            if known and _apply_history_known_k(
                payloads, at, row, chunk, found, row_old, row_deltas, row_news, row_lanes
            ):
                continue
            ref_deltas = np.empty(n, np.int16)
            fresh = np.empty(row[ROW_NEW_COUNT], np.int64)
            status = _history_positions(payloads, at, row, chunk, fresh, found, ref_deltas)
            if status != POSITIONS_OK:
                return r, status, 0
            values_at = at + (row[ROW_REF_COUNT] + 7) // 8
            values_at += _positions_len(row[ROW_NEW_COUNT], escapes, position_coding)
            status, planes = _value_planes(payloads, values_at, n, row[ROW_VALUE_ESCAPES], coding)
            if status != POSITIONS_OK:
                return r, status, 0
            _apply_planes_k(chunk, found, planes, coding, ref_deltas, row_old, row_deltas, first, row_lanes, row_news)
            continue
        values_at = at + _positions_len(n, escapes, position_coding)
        # Positions are decoded in a pass of their own, then gathered: decoded during the gather, as
        # DELTA records decode theirs during their one pass, they cost a class-ordered step 1.7 ms
        # more (880k changes here); DELTA records the other way round lose 0.7 ms a million.
        if coding != _DELTA:
            status = _row_positions(payloads, at, n, escapes, position_coding, chunk, found)
            if status != POSITIONS_OK:
                return r, status, 0
            status, planes = _value_planes(payloads, values_at, n, row[ROW_VALUE_ESCAPES], coding)
            if status != POSITIONS_OK:
                return r, status, 0
            _apply_planes_k(chunk, found, planes, coding, _EMPTY_REF, row_old, row_deltas, first, row_lanes, row_news)
            continue
        if gap_codes:
            status = _check_gap_codes_k(payloads[at : at + n], payloads[at + n : at + n + escapes])
        else:
            status = _row_positions(payloads, at, n, escapes, position_coding, chunk, found)
        if status != POSITIONS_OK:
            return r, status, 0
        packed_len, value_escapes = (n + 3) // 4, row[ROW_VALUE_ESCAPES]
        packed = payloads[values_at : values_at + packed_len]
        if _count_escape_codes_k(packed, n) != value_escapes:
            return r, VALUES_ESCAPES_MISMATCH, 0
        escaped = np.empty(value_escapes, np.uint16)
        low = values_at + packed_len
        for k in range(value_escapes):
            escaped[k] = np.uint16(payloads[low + k]) | (np.uint16(payloads[low + value_escapes + k]) << 8)
        if not gap_codes:
            _apply_delta_k(chunk, found, packed, escaped, row_old, row_deltas, first, row_lanes, row_news)
            continue
        status, done = _apply_delta_gap_codes_k(
            chunk, payloads, at, n, packed, escaped, found, row_old, row_deltas, first, row_lanes, row_news
        )
        if status != POSITIONS_OK:
            return r, status, done
    return -1, POSITIONS_OK, 0


def _value_planes(payloads: Any, at: int, n: int, extra_bytes: int, coding: int) -> tuple[int, Any]:
    """A record's values as the byte planes _apply_planes_2byte reads (EXP_CODES decoded into them); a status."""
    if coding != _EXP_CODES and coding != _PREDICTED_CODES:
        return POSITIONS_OK, payloads[at : at + 2 * n]
    planes = np.empty(2 * n, np.uint8)
    return _value_code_planes(payloads, at, n, extra_bytes, planes), planes


def _positions_len(n: int, escapes: int, coding: int) -> int:
    """Bytes of n coded positions in PositionCoding `coding` (format.positions_len)."""
    if coding == _CLASS_MASKS:
        return CLASSES + escapes
    return n + escapes if coding == _GAP_CODES else 2 * n + 8 * escapes


_EMPTY_REF = np.empty(0, np.int16)

_njit = numba.njit(cache=True, nogil=True, boundscheck=False) if numba is not None else None
if numba is not None:  # the kernels call these compiled, inlined
    _lanes_of = numba.njit(inline="always", boundscheck=False)(_lanes_of)
    _gap_at = numba.njit(inline="always", boundscheck=False)(_gap_at)
    _decode_ahead = numba.njit(inline="always", boundscheck=False)(_decode_ahead)
    _class_starts = numba.njit(inline="always", boundscheck=False)(_class_starts)
    _check_gap_codes = numba.njit(nogil=True, boundscheck=False)(_check_gap_codes)
    _add_ordered = numba.njit(inline="always")(_add_ordered)
    _packed_delta = numba.njit(inline="always", boundscheck=False)(_packed_delta)
    _write = numba.njit(inline="always", boundscheck=False)(_write)
    _bf16_parts = numba.njit(inline="always")(_bf16_parts)
    _bit_length = numba.njit(inline="always", boundscheck=False)(_bit_length)
    _extra_bits = numba.njit(inline="always")(_extra_bits)
    _length_code = numba.njit(inline="always")(_length_code)
    _pack_bits = numba.njit(boundscheck=False)(_pack_bits)
    _rounded_prediction_offset = numba.njit(boundscheck=False)(_rounded_prediction_offset)
    _bf16_value = numba.njit(inline="always", boundscheck=False)(_bf16_value)
    _predicted_offset = numba.njit(inline="always")(_predicted_offset)
    _add_lanes_of = numba.njit(inline="always", boundscheck=False)(_add_lanes_of)
    _new_bits = numba.njit(inline="always")(_new_bits)
    _plane_delta = numba.njit(inline="always", boundscheck=False)(_plane_delta)
    _with_reference = numba.njit(inline="always")(_with_reference)
    _by_class = numba.njit(inline="always")(_by_class)
    _gather_classes = numba.njit(boundscheck=False)(_gather_classes)
    _write_planes = numba.njit(boundscheck=False)(_write_planes)
    _prefetch, _pointer, _float_bits = _prefetch_intrinsic(), _pointer_intrinsic(), _float_bits_intrinsic()
    _load_le64 = _load_le64_intrinsic()
apply_delta_2byte: Callable[..., None] | None = _njit(_apply_delta_2byte) if _njit else None
decode_positions: Callable[[Any, int, Any, int, Any], int] | None = _njit(_decode_positions) if _njit else None
count_escape_codes: Callable[[Any, int], int] | None = _njit(_count_escape_codes) if _njit else None
decode_gap_codes: Callable[[Any, Any, int, Any], int] | None = _njit(_decode_gap_codes) if _njit else None
encode_gap_codes: Callable[[Any, Any, Any], int] | None = _njit(_encode_gap_codes) if _njit else None
# Per element width (1, 2, 4, 8 bytes): the lanes of a 64-bit word.
changed_words: dict[int, Callable[[Any, Any, Any, Any, Any], tuple[Any, Any, Any]]] = (
    {w: _njit(_changed_words_kernel(8 // w)) for w in (1, 2, 4, 8)} if _njit else {}
)
encode_value_codes: Callable[[Any, Any, Any, Any, Any], int] | None = _njit(_encode_value_codes) if _njit else None
apply_planes_2byte: Callable[..., None] | None = _njit(_apply_planes_2byte) if _njit else None
merge_history: Callable[..., bool] | None = _njit(_merge_history) if _njit else None
class_positions: Callable[[Any, Any, Any, Any], int] | None = _njit(_class_positions) if _njit else None
predicted_offsets: Callable[[Any, Any, Any], None] | None = _njit(_predicted_offsets) if _njit else None
match_reference: Callable[..., int] | None = _njit(_match_reference) if _njit else None
# The batch kernel calls the others compiled (numba resolves these globals when it compiles it).
_k: Any = _njit or (lambda f: None)
_decode_positions_k: Any = decode_positions
_count_escape_codes_k: Any = count_escape_codes
_apply_delta_k: Any = apply_delta_2byte
_apply_planes_k: Any = apply_planes_2byte
_merge_history_k: Any = merge_history
_class_positions_k: Any = class_positions
_check_gap_codes_k: Any = _check_gap_codes
_apply_delta_gap_codes_k: Any = _k(_apply_delta_gap_codes)
_encode_gap_codes_k: Any = encode_gap_codes
_encode_value_codes_k: Any = encode_value_codes
_match_reference_k: Any = match_reference
_predicted_offsets_k: Any = predicted_offsets
sparse_streams: Callable[..., Any] | None = _k(_sparse_streams)
_carray: Any = numba.carray if numba is not None else None  # type: ignore[attr-defined]
if numba is not None:
    _padded_gap_codes = numba.njit(boundscheck=False)(_padded_gap_codes)
    _row_positions = numba.njit(boundscheck=False)(_row_positions)
    _history_positions = numba.njit(boundscheck=False)(_history_positions)
    _again_and_fresh = numba.njit(boundscheck=False)(_again_and_fresh)
    _positions_len = numba.njit(inline="always")(_positions_len)
    _check_value_codes = numba.njit(inline="always", boundscheck=False)(_check_value_codes)
    _value_at = numba.njit(inline="always", boundscheck=False)(_value_at)
    _value_code_planes = numba.njit(boundscheck=False)(_value_code_planes)
    _class_ordered_values = numba.njit(boundscheck=False)(_class_ordered_values)
    _value_planes = numba.njit(boundscheck=False)(_value_planes)
_apply_history_known_k: Any = _k(_apply_history_known)
apply_batch: Callable[..., tuple[int, int, int]] | None = _k(_apply_batch)
enabled = numba is not None  # tests switch it off to compare with the numpy path


def warm_up() -> None:
    """Load (or compile) every kernel now: their first call otherwise costs ~0.5 s inside a sync."""
    if not enabled or numba is None:
        return
    assert apply_delta_2byte and decode_positions and count_escape_codes and decode_gap_codes and encode_gap_codes
    assert apply_planes_2byte and merge_history and apply_batch and encode_value_codes and class_positions
    assert predicted_offsets and changed_words and match_reference
    # Payload buffers are read-only views of the decompressed bytes: numba compiles those apart.
    planes, escapes, positions = np.frombuffer(bytes(2), np.uint8), np.zeros(0, np.uint64), np.zeros(1, np.int64)
    decode_positions(planes, 1, escapes, 1, positions)
    decode_gap_codes(planes[:1], planes[:0], 1, positions)
    encode_gap_codes(positions, np.empty(1, np.uint8), np.empty(5, np.uint8))
    for width, kernel in changed_words.items():
        elements = np.empty(8, f"u{width}")
        kernel(np.zeros(1, np.uint64), np.zeros(1, np.uint64), np.empty(8, np.int64), elements, elements.copy())
    count_escape_codes(planes, 1)
    chunk, old, deltas = np.zeros(1, np.int16), np.empty(1, np.int16), np.empty(1, np.int16)
    encode_value_codes(deltas, old, positions, np.empty(1, np.uint8), np.empty(3, np.uint8))
    class_positions(chunk, np.zeros(CLASSES, np.uint8), planes[:0], positions[:0])
    predicted_offsets(old, deltas, np.empty(1, np.int16))
    match_reference(positions, positions, deltas, np.zeros(1, bool), deltas.copy(), positions.copy())
    for lanes in (np.zeros(2, np.uint64), np.zeros(0, np.uint64)):
        apply_delta_2byte(chunk, positions, planes[:1], np.zeros(0, np.uint16), old, deltas, 0, lanes, old[:0])
        apply_planes_2byte(chunk, positions, planes, _EXP_PLANES, old[:0], old, deltas, 0, lanes, old[:0])
    merge_history(positions, deltas, np.ones(1, bool), positions[:0], positions.copy(), deltas.copy())
    for columns in (2, 0):  # its payloads are a writable arena (codec.apply._apply_batch), not a read-only view
        table = np.zeros((0, ROW_COLUMNS), np.int64)
        apply_batch(np.zeros(8, np.uint8), table, positions, old, deltas, old.copy(), np.zeros((0, columns), np.uint64))
