"""The kernels that span codings: every SPARSE and HISTORY record of a 2-byte float decoded and applied
in one call a run of records (`apply_batch`), and the per-record writers it shares (numba; None without it).

A sparse record of a 2-byte float (bf16, fp16) is most of every RL patch. With numpy its decode
and apply take some fifteen passes over the changed elements, two of them random accesses into
the tensor (gather, then scatter: a cache and TLB miss each). Here:
- `apply_delta_2byte` / `apply_planes_2byte` apply the order-preserving deltas in one
  read-modify-write per element, the element AHEAD places on prefetched, return the old values for
  the undo log, and update the mixsum-128 state digest from the old and new bits in a vectorized
  pass;
- `apply_batch` does all of that for a table of SPARSE and HISTORY records in one call (the
  subscriber runs one per thread), GAP_CODES positions decoded in the apply loop itself (for
  class-ordered values, in the gather of the old values that precedes their writes), each record's
  positions and values decoded by its coding's kernels (`codec.codings`).
Every position is checked before it is written, so a kernel only ever indexes inside its chunk.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from pulsesync.codec import diff, jit
from pulsesync.codec.codings import class_masks, gap_codes, gaps16, history, small_codes, value_codes
from pulsesync.codec.codings.class_masks import CLASSES
from pulsesync.codec.codings.class_masks import class_positions_kernel as _class_positions_k
from pulsesync.codec.codings.gap_codes import _check_gap_codes as _check_gap_codes_k
from pulsesync.codec.codings.gap_codes import _gap_at, _padded_gap_codes
from pulsesync.codec.codings.gaps16 import decode_positions_kernel as _decode_positions_k
from pulsesync.codec.codings.history import END as _END
from pulsesync.codec.codings.history import HISTORY_BITMAP_MISMATCH, HISTORY_REPEATS, _with_reference
from pulsesync.codec.codings.history import merge_history_kernel as _merge_history_k
from pulsesync.codec.codings.small_codes import VALUES_ESCAPES_MISMATCH, _packed_delta
from pulsesync.codec.codings.small_codes import count_escape_codes_kernel as _count_escape_codes_k
from pulsesync.codec.codings.status import POSITIONS_OK, POSITIONS_OUTSIDE, describe
from pulsesync.codec.codings.value_codes import _check_value_codes, _value_at, _value_code_planes
from pulsesync.codec.codings.values import _add_ordered, _plane_delta
from pulsesync.codec.format import PositionCoding, RecordHeader, RecordKind, ValueCoding
from pulsesync.codec.jit import carray as _carray
from pulsesync.codec.jit import pointer as _pointer
from pulsesync.codec.jit import prefetch as _prefetch
from pulsesync.mixsum import term_change

AHEAD = 64  # elements prefetched ahead of their update (of 16..256 on bench/scale.py's states: 64, 2.5% faster than 16)


@jit.inline
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


@jit.inline
def _write(chunk: Any, p: Any, delta: Any, i: int, old_out: Any, new_bits: Any) -> None:
    """chunk[p] moved by delta ordered steps; its old bits to old_out[i], its new ones to new_bits[i] (if kept)."""
    old = chunk[p]
    new = _add_ordered(np.int32(old), delta)
    chunk[p] = new
    old_out[i] = old
    if new_bits.size:
        new_bits[i] = new


@jit.inline
def _new_bits(new_out: Any, n: int, lanes: Any) -> Any:
    """Where a kernel keeps the new bits it writes: new_out, else a buffer of its own if the lanes need them."""
    return new_out if new_out.size else np.empty(n if lanes.size else 0, np.int16)


@jit.inline
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

    delta_i = unzigzag(code_i + 1), or unzigzag(escape + 1) for code 3, as small_codes.unpack_small_deltas;
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


apply_delta_2byte: Any = jit.kernel(_apply_delta_2byte)
_apply_delta_k: Any = apply_delta_2byte  # (the batch kernel's, whatever a test sets the public name to)


@jit.inline
def _decode_ahead(chunk: Any, payloads: Any, at: int, i: int, bit: Any, p: Any, positions_out: Any) -> tuple[Any, Any]:
    """Position i of GAP_CODES codes at payloads[at:] (its extra bits at `bit`), the one after p: into
    positions_out and prefetched if inside the chunk (the caller checks p < chunk.size); (bit, p) after it."""
    gap, bit = _gap_at(np.int64(payloads[at + i]), payloads, bit)
    p += gap + 1
    if p < chunk.size:
        positions_out[i] = p
        _prefetch(chunk, p)
    return bit, p


@jit.inline
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


_apply_delta_gap_codes_k: Any = jit.kernel(_apply_delta_gap_codes)


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
    magnitude-class order of the old values (a counting sort, stable, as class_masks.magnitude_order;
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


apply_planes_2byte: Any = jit.kernel(_apply_planes_2byte)
_apply_planes_k: Any = apply_planes_2byte


@jit.inline
def _by_class(coding: int) -> bool:
    """Whether a ValueCoding's values come in magnitude-class order of the old values (they are gathered first)."""
    return coding in (_EXP_PLANES, _EXP_CODES, _PREDICTED_CODES)


@jit.compiled
def _gather_classes(chunk: Any, positions: Any, old_out: Any, next_in_class: Any) -> None:
    """old_out[i] = chunk[positions[i]]; next_in_class[c] = where class c's values start in class order."""
    n = positions.size
    for i in range(n):
        if i + AHEAD < n:
            _prefetch(chunk, positions[i + AHEAD])
        old_out[i] = chunk[positions[i]]
        next_in_class[((np.int32(old_out[i]) >> 7) & 0xFF) + 1] += 1
    _class_starts(next_in_class)


@jit.compiled
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
        if raw:  # new bits: how far they are from the old ones in value order (as values.to_ordered_)
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

_GAP_CODES = int(PositionCoding.GAP_CODES)  # (numba compares plain ints)

_RAW, _DELTA, _EXP_PLANES = int(ValueCoding.RAW), int(ValueCoding.DELTA), int(ValueCoding.EXP_PLANES)

_EXP_CODES, _PREDICTED_CODES = int(ValueCoding.EXP_CODES), int(ValueCoding.PREDICTED_CODES)

_CLASS_MASKS = int(PositionCoding.CLASS_MASKS)

_HISTORY = int(RecordKind.HISTORY)


@jit.compiled
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


@jit.compiled
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


@jit.compiled
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


_apply_history_known_k: Any = jit.kernel(_apply_history_known)


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


apply_batch: Any = jit.kernel(_apply_batch)


@jit.compiled
def _value_planes(payloads: Any, at: int, n: int, extra_bytes: int, coding: int) -> tuple[int, Any]:
    """A record's values as the byte planes _apply_planes_2byte reads (EXP_CODES decoded into them); a status."""
    if coding != _EXP_CODES and coding != _PREDICTED_CODES:
        return POSITIONS_OK, payloads[at : at + 2 * n]
    planes = np.empty(2 * n, np.uint8)
    return _value_code_planes(payloads, at, n, extra_bytes, planes), planes


@jit.inline
def _positions_len(n: int, escapes: int, coding: int) -> int:
    """Bytes of n coded positions in PositionCoding `coding` (format.positions_len)."""
    if coding == _CLASS_MASKS:
        return CLASSES + escapes
    return n + escapes if coding == _GAP_CODES else 2 * n + 8 * escapes


@jit.compiled
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


_EMPTY_REF = np.empty(0, np.int16)


def warm_up() -> None:
    """Load (or compile) every kernel a subscriber runs, and the encoder's diff: a first call otherwise costs
    ~0.5 s inside a sync."""
    if not jit.enabled or apply_batch is None:
        return
    # Payload buffers are read-only views of the decompressed bytes: numba compiles those apart.
    planes, escapes, positions = np.frombuffer(bytes(2), np.uint8), np.zeros(0, np.uint64), np.zeros(1, np.int64)
    gaps16.decode_positions_kernel(planes, 1, escapes, 1, positions)
    gap_codes.decode_gap_codes_kernel(planes[:1], planes[:0], 1, positions)
    gap_codes.encode_gap_codes_kernel(positions, np.empty(1, np.uint8), np.empty(5, np.uint8))
    for width, kernel in diff.changed_words.items():
        elements = np.empty(8, f"u{width}")
        kernel(np.zeros(1, np.uint64), np.zeros(1, np.uint64), np.empty(8, np.int64), elements, elements.copy())
    small_codes.count_escape_codes_kernel(planes, 1)
    chunk, old, deltas = np.zeros(1, np.int16), np.empty(1, np.int16), np.empty(1, np.int16)
    value_codes.encode_value_codes_kernel(deltas, old, positions, np.empty(1, np.uint8), np.empty(3, np.uint8))
    class_masks.class_positions_kernel(chunk, np.zeros(CLASSES, np.uint8), planes[:0], positions[:0])
    history.predicted_offsets_kernel(old, deltas, np.empty(1, np.int16))
    history.match_reference_kernel(positions, positions, deltas, np.zeros(1, bool), deltas.copy(), positions.copy())
    for lanes in (np.zeros(2, np.uint64), np.zeros(0, np.uint64)):
        apply_delta_2byte(chunk, positions, planes[:1], np.zeros(0, np.uint16), old, deltas, 0, lanes, old[:0])
        apply_planes_2byte(chunk, positions, planes, _EXP_PLANES, old[:0], old, deltas, 0, lanes, old[:0])
    history.merge_history_kernel(positions, deltas, np.ones(1, bool), positions[:0], positions.copy(), deltas.copy())
    for columns in (2, 0):  # its payloads are a writable arena (codec.apply._apply_batch), not a read-only view
        table = np.zeros((0, ROW_COLUMNS), np.int64)
        apply_batch(np.zeros(8, np.uint8), table, positions, old, deltas, old.copy(), np.zeros((0, columns), np.uint64))


def kernel_error(status: int, h: RecordHeader) -> str:
    """What apply_batch's status says of record h, worded as the per-record decoders word it."""
    if status == HISTORY_BITMAP_MISMATCH:
        return history.BITMAP_MISMATCH.format(marked=h.count - h.new_count)
    positions = gap_codes.ERRORS if h.positions == PositionCoding.GAP_CODES else gaps16.ERRORS
    errors = (positions, class_masks.ERRORS, small_codes.ERRORS, value_codes.ERRORS, history.ERRORS)
    return describe(status, h.length, *errors)
