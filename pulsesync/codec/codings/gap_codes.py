"""GAP_CODES positions, and the length codes they are made of (EXP_CODES codes values with them too).

A value below GAP_DIRECT is its own code; a value of b >= 4 bits codes as GAP_DIRECT + 4 (b - 4)
+ its 2 bits below the top one, its low b - 3 bits following in the extra-bits stream (LSB first,
no byte alignment). The codes carry each value's bit length and top bits, what zstd's Huffman
stage can model; the low bits are close to uniform.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from pulsesync.codec import jit
from pulsesync.codec.codings.gaps16 import gaps_of
from pulsesync.codec.codings.status import (
    OUTSIDE,
    POSITIONS_ESCAPES_MISMATCH,
    POSITIONS_OK,
    POSITIONS_OUTSIDE,
    check,
)
from pulsesync.codec.jit import load_le64 as _load_le64
from pulsesync.errors import CorruptPatchError

GAP_DIRECT = 8
MAX_GAP_BITS = 32  # gaps are below a chunk's length (< 2**30)
MAX_GAP_CODE = GAP_DIRECT + 4 * (MAX_GAP_BITS - 4) + 3
POSITIONS_GAP_CODE_INVALID = 4


def _gap_code_tables() -> tuple[np.ndarray, np.ndarray]:
    """Per GAP_CODES code: its extra bits and the gap it codes with extra bits zero (codes past MAX_GAP_CODE: 0)."""
    extra, base = np.zeros(256, np.int64), np.zeros(256, np.int64)
    base[:GAP_DIRECT] = np.arange(GAP_DIRECT)
    for code in range(GAP_DIRECT, MAX_GAP_CODE + 1):
        bit_length, top = 4 + (code - GAP_DIRECT) // 4, (code - GAP_DIRECT) % 4
        extra[code], base[code] = bit_length - 3, (4 + top) << (bit_length - 3)
    return extra, base


GAP_EXTRA_BITS, GAP_BASE = _gap_code_tables()

_EXTRA_BYTES_SPANNED = 5  # MAX_GAP_BITS - 3 extra bits at a bit offset of up to 7 (the decoder's window)

_GAP_CODE_INVALID = f"a position gap code is above {MAX_GAP_CODE}"

_GAP_EXTRA_MISMATCH = "the extra-bits stream does not match the gap codes"

ERRORS = {
    POSITIONS_ESCAPES_MISMATCH: _GAP_EXTRA_MISMATCH,
    POSITIONS_GAP_CODE_INVALID: _GAP_CODE_INVALID,
    POSITIONS_OUTSIDE: OUTSIDE,
}


def encode_length_codes(values: np.ndarray) -> tuple[np.ndarray, bytes]:
    """Non-negative int64 values below 2**32 -> (one u8 GAP_CODES code each, the extra-bits stream) (numpy).

    The codes carry each value's bit length and top bits (what zstd's Huffman stage can model);
    the low bits, close to uniform, are packed LSB first with no byte alignment (this module's docstring).
    """
    bit_length = np.frexp(values.astype(np.float64))[1].astype(np.int64)  # exact below 2**53
    extra = np.maximum(bit_length - 3, 0)
    codes = np.where(values >= GAP_DIRECT, GAP_DIRECT + 4 * (bit_length - 4) + ((values >> extra) & 3), values)
    low = values & ((np.int64(1) << extra) - 1)
    ends = np.cumsum(extra)
    if not ends.size or not ends[-1]:
        return codes.astype(np.uint8), b""
    # Offsets only grow, so the fields starting in one 64-bit word are a run: OR each run together,
    # then OR in the high part of the (at most one) field that spills over from the word before.
    offsets = (ends - extra).view(np.uint64)
    word, shift = offsets >> np.uint64(6), offsets & np.uint64(63)
    low = low.view(np.uint64)
    words = np.zeros(int(word[-1]) + 2, np.uint64)
    runs = np.flatnonzero(np.diff(word, prepend=np.uint64(2**63)))
    words[word[runs]] = np.bitwise_or.reduceat(low << shift, runs)
    spill = shift + extra.view(np.uint64) > np.uint64(64)
    words[word[spill] + np.uint64(1)] |= low[spill] >> (np.uint64(64) - shift[spill])
    return codes.astype(np.uint8), words.view(np.uint8)[: (int(ends[-1]) + 7) // 8].tobytes()


def encode_gap_codes(positions: np.ndarray) -> tuple[np.ndarray, bytes]:
    """Sorted, distinct chunk-relative positions -> their gaps' GAP_CODES (codes, extra-bits stream).

    One pass of numba's kernel where installed, else numpy (the same bytes).
    """
    if jit.enabled and encode_gap_codes_kernel is not None:
        codes, extra_bytes = np.empty(positions.size, np.uint8), np.empty(4 * positions.size + 1, np.uint8)
        used = encode_gap_codes_kernel(positions, codes, extra_bytes)
        return codes, extra_bytes[:used].tobytes()
    return encode_length_codes(gaps_of(positions))


def decode_length_codes(codes: np.ndarray, extra: np.ndarray, invalid: str, mismatch: str) -> np.ndarray:
    """Inverse of encode_length_codes (numpy), checking every code and the stream's size and padding."""
    if codes.size and int(codes.max()) > MAX_GAP_CODE:
        raise CorruptPatchError(invalid)
    nbits = GAP_EXTRA_BITS[codes]
    ends = np.cumsum(nbits)
    total = int(ends[-1]) if ends.size else 0
    if (total + 7) // 8 != extra.size or (total % 8 and int(extra[-1]) >> (total % 8)):
        raise CorruptPatchError(mismatch)
    offsets = ends - nbits
    padded = np.concatenate([extra, np.zeros(_EXTRA_BYTES_SPANNED, np.uint8)]).astype(np.int64)
    byte = offsets >> 3
    window = padded[byte]
    for j in range(1, _EXTRA_BYTES_SPANNED):
        window |= padded[byte + j] << (8 * j)
    values: np.ndarray = GAP_BASE[codes] + ((window >> (offsets & 7)) & ((np.int64(1) << nbits) - 1))
    return values


def decode_gap_codes(codes: np.ndarray, count: int, extra: np.ndarray, length: int, where: str) -> np.ndarray:
    """Inverse of encode_gap_codes, checking every code, the stream's size and padding, and that every
    position lies in [0, length). One pass of numba's kernel where installed, else numpy."""
    codes = codes[:count]
    if jit.enabled and decode_gap_codes_kernel is not None:
        positions = np.empty(count, np.int64)
        check(decode_gap_codes_kernel(codes, extra, length, positions), length, where, ERRORS)
        return positions
    try:
        gaps = decode_length_codes(codes, extra, _GAP_CODE_INVALID, _GAP_EXTRA_MISMATCH)
    except CorruptPatchError as e:
        raise CorruptPatchError(f"{where}: {e}") from None
    # Every gap is below 2**32 and there are at most 2**30: the cumulative sum cannot overflow.
    gaps += 1
    positions = np.cumsum(gaps, out=gaps)
    positions -= 1
    if positions.size and int(positions[-1]) >= length:
        raise CorruptPatchError(f"{where}: {OUTSIDE.format(length=length)}")
    return positions


@jit.compiled
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
    """out[i] = p_i from GAP_CODES (as decode_gap_codes); a status code.

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


decode_gap_codes_kernel: Any = jit.kernel(_decode_gap_codes)

_BIT_LENGTH = np.array([v.bit_length() for v in range(4096)], np.int64)  # of the values most gaps and moves take


@jit.inline
def _bit_length(value: Any) -> Any:
    """int.bit_length of a non-negative value below 2**53 (a table lookup for most, else frexp, exact there)."""
    return _BIT_LENGTH[value] if value < _BIT_LENGTH.size else math.frexp(float(value))[1]


@jit.inline
def _extra_bits(value: Any) -> Any:
    """Low bits of a non-negative value its GAP_CODES code leaves to the extra-bits stream (0 below GAP_DIRECT)."""
    return _bit_length(value) - 3 if value >= GAP_DIRECT else 0


@jit.inline
def _length_code(value: Any, nbits: Any) -> Any:
    """The GAP_CODES code of a non-negative value of _extra_bits(value) = nbits."""
    return GAP_DIRECT + 4 * (nbits - 1) + ((value >> nbits) & 3) if nbits else value


@jit.compiled
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


encode_gap_codes_kernel: Any = jit.kernel(_encode_gap_codes)


@jit.inline
def _gap_at(code: Any, payloads: Any, bit: Any) -> tuple[Any, Any]:
    """The gap a GAP_CODES code stands for, its extra bits read at bit offset `bit` of payloads; the next offset.

    Branch-free: eight bytes are read whatever the code needs (payloads is padded with 8 bytes past its end).
    """
    nbits = (code - GAP_DIRECT) // 4 + 1 if code >= GAP_DIRECT else np.int64(0)
    word = _load_le64(payloads, bit >> 3)
    low = (word >> (bit & 7)) & ((np.int64(1) << nbits) - 1)
    gap = ((4 + ((code - GAP_DIRECT) & 3)) << nbits) | low if code >= GAP_DIRECT else code
    return gap, bit + nbits


@jit.compiled
def _padded_gap_codes(payloads: Any, at: int, n: int, escapes: int, length: int, out: Any) -> int:
    """_decode_gap_codes of n codes at payloads[at:] (then their extra bits), with _gap_at's branch-free reads.

    1.7x faster here (2.8 ms a million, the check included). The codes are checked first, so the
    extra bits read end inside the record; payloads is padded past its last record, so the
    eight-byte reads stay inside it.
    """
    status: int = _check_gap_codes(payloads[at : at + n], payloads[at + n : at + n + escapes])
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
