"""Every stream the encoder weighs for a SPARSE record of 2-byte floats, made in one compiled call.

The kernel spans codings (GAP_CODES, DELTA's 2-bit codes, magnitude classes, EXP_CODES, the
match against the reference and PREDICTED_CODES' residuals): one hand-over of the GIL a record
instead of some thirty. Without numba the encoder makes each stream with the codings' numpy
functions, the same bytes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from pulsesync.codec import jit
from pulsesync.codec.codings.class_masks import CLASSES
from pulsesync.codec.codings.gap_codes import encode_gap_codes_kernel as _encode_gap_codes_k
from pulsesync.codec.codings.history import match_reference_kernel as _match_reference_k
from pulsesync.codec.codings.history import predicted_offsets_kernel as _predicted_offsets_k
from pulsesync.codec.codings.small_codes import SMALL_ESCAPE
from pulsesync.codec.codings.value_codes import encode_value_codes_kernel as _encode_value_codes_k
from pulsesync.codec.codings.values import ENTROPY_SAMPLE, sampled_entropy_bytes


@dataclass(frozen=True)
class MatchedStreams:
    """A sparse record's changes matched against its reference chunk's: what a HISTORY record codes."""

    bitmap: bytes  # which reference positions change again, a bit each (little-endian bit order)
    fresh: np.ndarray  # the positions that are not the reference's
    fresh_codes: tuple[np.ndarray, bytes]  # their GAP_CODES (codes, extra bits)
    residuals: np.ndarray  # each delta less its reference delta, or its prediction (int16, wrapping)
    codes: tuple[np.ndarray, bytes] | None  # the residuals' EXP_CODES in class order (2-byte floats, format 3)


@dataclass(frozen=True)
class SparseStreams:
    """What the encoder codes of a sparse record of 2-byte floats (format 3 on), made in one compiled call."""

    gap_codes: np.ndarray  # GAP_CODES of the positions
    gap_extra: bytes
    deltas: np.ndarray  # ordered deltas (encode_values' DELTA), int16
    packed: np.ndarray  # pack_small(zigzag(deltas), 1): 2-bit codes
    escaped: np.ndarray  # and the escaped values
    classes: np.ndarray  # magnitude_class of the old values
    order: np.ndarray  # their stable order
    counts: np.ndarray  # values per class (CLASSES)
    symbols: np.ndarray  # EXP_CODES of the deltas in that order
    value_extra: bytes
    new_entropy: float  # entropy_bytes of the new values' byte planes
    matched: MatchedStreams | None  # against the reference chunk, where there is one


def sparse_streams(
    positions: np.ndarray,
    old: np.ndarray,
    new: np.ndarray,
    reference: tuple[np.ndarray, np.ndarray] | None,
    predicted: bool,
) -> SparseStreams | None:
    """A sparse record's streams (old and new: the 2-byte floats' bits at `positions`; reference: the reference
    chunk's positions and deltas; predicted: residuals against PREDICTED_CODES' offsets) from numba's kernel;
    None without numba (the encoder then makes each with the codings' functions, the same bytes)."""
    if not (jit.enabled and sparse_streams_kernel is not None):
        return None
    ref_positions, ref_deltas = reference if reference is not None else (positions[:0], old[:0])
    streams, (symbols, extra), m = sparse_streams_kernel(
        positions, old, new, ref_positions, ref_deltas, reference is not None, predicted
    )
    codes, gap_extra, deltas, packed, escaped, classes, order, counts, sampled = streams
    seen = int(sampled[0].sum())  # values in the kernel's sample (each counted once a plane)
    matched = None
    if reference is not None:
        matched = MatchedStreams(m[0].tobytes(), m[1], (m[2], m[3].tobytes()), m[4], (m[5], m[6].tobytes()))
    return SparseStreams(
        gap_codes=codes,
        gap_extra=gap_extra.tobytes(),
        deltas=deltas,
        packed=packed,
        escaped=escaped,
        classes=classes,
        order=order,
        counts=counts,
        symbols=symbols,
        value_extra=extra.tobytes(),
        new_entropy=sampled_entropy_bytes(sampled, [seen] * 2, [new.size] * 2),
        matched=matched,
    )


def _sparse_streams(
    positions: Any, old: Any, new: Any, ref_positions: Any, ref_deltas: Any, history: bool, predicted: bool
) -> Any:
    """What the encoder codes of a sparse record of 2-byte floats (sparse_streams), in one call.

    GAP_CODES of the positions; the ordered deltas, as packed DELTA codes and escapes; the old
    values' magnitude classes, their stable order and counts; the deltas' EXP_CODES; a histogram
    of a sample of the new values' byte planes (entropy_bytes' sample). With
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
        symbol = ((((d << 1) ^ (d >> 15)) & 0xFFFF) + 0xFFFF) & 0xFFFF  # zigzag - 1, as uint16 (pack_small)
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
    sampled = np.zeros((2, 256), np.int64)  # each byte plane of the new values, every stride-th (entropy_bytes)
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


sparse_streams_kernel: Any = jit.kernel(_sparse_streams)
