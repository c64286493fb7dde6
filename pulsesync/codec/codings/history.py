"""HISTORY records (format 2): a chunk's changes coded against the same chunk's in the reference patch, and
PREDICTED_CODES' prediction of a bf16 value from it (format 3).

The reference positions that change again cost a bit each; the rest are coded as gaps; each
value is a residual against the reference delta (Adam's momentum makes it mostly 0) or against
the bf16 nearest 2 * old - prev.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from pulsesync.codec import jit
from pulsesync.codec.jit import float_bits as _float_bits

HISTORY_BITMAP_MISMATCH = 6  # the reference bitmap does not mark count - new_count positions (padding: zero)
HISTORY_REPEATS = 7  # a new position repeats one of the reference's
REPEATS = "a new position repeats one of the reference's"
BITMAP_MISMATCH = "the reference bitmap does not mark {marked} positions"  # count - new_count
ERRORS = {HISTORY_REPEATS: REPEATS}  # (BITMAP_MISMATCH names the record's count: its callers word it)
END = 1 << 62  # closes a list of positions: above every position


def match_reference(
    positions: np.ndarray, ref_positions: np.ndarray, ref_deltas: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A HISTORY record's match of its sorted positions against the reference's (sorted, with their deltas):
    which reference positions change again (bool per reference position), the reference delta
    at each position (0 where it is new) and the new positions. One merge where numba is
    installed, else numpy's binary search."""
    again = np.zeros(ref_positions.size, bool)
    if jit.enabled and match_reference_kernel is not None:
        aligned, fresh = np.empty_like(ref_deltas, shape=positions.size), np.empty_like(positions)
        n = match_reference_kernel(positions, ref_positions, ref_deltas, again, aligned, fresh)
        return again, aligned, fresh[:n]
    at = np.minimum(np.searchsorted(ref_positions, positions), max(ref_positions.size - 1, 0))
    recurring = ref_positions[at] == positions if ref_positions.size else np.zeros(positions.size, bool)
    again[at[recurring]] = True
    aligned = np.zeros_like(ref_deltas, shape=positions.size)
    aligned[recurring] = ref_deltas[at[recurring]]
    return again, aligned, positions[~recurring]


def predicted_offsets(old: np.ndarray, reference_deltas: np.ndarray) -> np.ndarray:
    """PREDICTED_CODES' prediction per position, as ordered steps from old (int16; _predicted_offset's rule).

    The bf16 nearest 2 * old - prev (prev: reference_delta ordered steps below old), computed
    exactly and rounded once, ties to even; 0 where reference_delta is 0, either value is not
    finite, or their exponents are more than 30 apart. One numba pass where installed, else numpy.
    """
    out = np.empty(old.size, np.int16)
    if jit.enabled and predicted_offsets_kernel is not None:
        predicted_offsets_kernel(old, reference_deltas, out)
        return out
    o = old.astype(np.int64)
    ordered = o ^ ((o >> 15) & 0x7FFF)
    d = reference_deltas.astype(np.int64)
    p = ((ordered - d + 32768) & 0xFFFF) - 32768
    p = (p ^ ((p >> 15) & 0x7FFF)) & 0xFFFF
    o &= 0xFFFF

    def parts(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        exponent = (x >> 7) & 0xFF
        significand = np.where(exponent > 0, (x & 0x7F) | 0x80, x & 0x7F)
        return np.maximum(exponent, 1), np.where(x & 0x8000, -significand, significand)

    (eo, mo), (ep, mp) = parts(o), parts(p)
    low = np.minimum(eo, ep)
    skip = (d == 0) | ((o & 0x7F80) == 0x7F80) | ((p & 0x7F80) == 0x7F80) | (np.abs(eo - ep) > 30)
    total = 2 * (mo << np.minimum(eo - low, 30)) - (mp << np.minimum(ep - low, 30))
    magnitude = np.abs(total)
    length = np.where(magnitude > 0, np.frexp(magnitude.astype(np.float64))[1], 0)  # exact: below 2**41
    exponent = low + length - 8
    shift = np.where(exponent >= 1, length - 8, 1 - low)
    right = np.maximum(shift, 0)
    q = np.where(shift > 0, magnitude >> right, magnitude << np.maximum(-shift, 0))
    rest = magnitude & ((np.int64(1) << right) - 1)
    half = np.where(shift > 0, np.int64(1) << np.maximum(right - 1, 0), -1)
    q += (shift > 0) & ((rest > half) | ((rest == half) & (q & 1 == 1)))
    carry = (exponent >= 1) & (q == 256)
    exponent, q = exponent + carry, np.where(carry, 128, q)
    normal = np.where(exponent >= 255, 0x7F80, (exponent << 7) | (q & 0x7F))
    predicted = np.where(exponent >= 1, normal, q) | np.where(total < 0, 0x8000, 0)
    predicted = np.where(magnitude == 0, 0, predicted).astype(np.uint16).view(np.int16).astype(np.int64)
    offset = ((predicted ^ ((predicted >> 15) & 0x7FFF)) - ordered + 32768) % 65536 - 32768
    out[:] = np.where(skip, 0, offset)
    return out


def _match_reference(positions: Any, ref_positions: Any, ref_deltas: Any, again: Any, aligned: Any, fresh: Any) -> int:
    """match_reference in one merge of the two sorted position lists; how many positions are fresh."""
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


match_reference_kernel: Any = jit.kernel(_match_reference)


@jit.inline
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


@jit.compiled
def _rounded_prediction_offset(old: Any, reference_delta: Any) -> Any:
    """_predicted_offset computed in full: the prediction rounded to bf16.

    prev = the value reference_delta ordered steps below old (the value before the reference step).
    2 * old - prev is computed exactly in float64 (both significands span at most 40 of its 53
    bits when their exponents are at most 30 apart) and rounded to bf16 once, ties to even, from
    its bits: every encoder and decoder gets the same bits, whatever its floating-point
    environment (predicted_offsets computes it in integers; the tests compare both on every
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


@jit.inline
def _bf16_value(bits: Any, exponent: Any) -> Any:
    """A bf16's value in float64 (exact), from its bits and exponent field."""
    significand = (bits & 0x7F) | (np.int64(exponent > 0) << 7)
    return np.float64(significand - 2 * significand * ((bits >> 15) & 1)) * _SIGNIFICAND_SCALE[exponent]


# A bf16 of exponent field e (1 for subnormals) is its signed 8-bit significand times 2**(e - 134).
_SIGNIFICAND_SCALE = np.array([2.0 ** (max(e, 1) - 134) for e in range(256)])


def _predicted_offsets(old: Any, reference_deltas: Any, out: Any) -> None:
    """out[i] = _predicted_offset(old[i], reference_deltas[i]) (predicted_offsets)."""
    for i in range(old.size):
        out[i] = _predicted_offset(old[i], reference_deltas[i])


predicted_offsets_kernel: Any = jit.kernel(_predicted_offsets)


@jit.inline
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
    picked[m] = END
    n = fresh.size
    i = j = 0
    repeats = np.int64(0)
    for k in range(m + n):
        a = picked[i]
        b = fresh[j] if j < n else END
        take = np.int64(a < b)  # 1: from the reference
        mask = -take
        repeats |= np.int64(a == b)
        positions_out[k] = (a & mask) | (b & ~mask)
        ref_out[k] = picked_deltas[i] * take
        i += take
        j += 1 - take
    return bool(repeats == 0)


merge_history_kernel: Any = jit.kernel(_merge_history)
