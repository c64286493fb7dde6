"""EXP_CODES values (format 3, 2-byte floats): each negated where the old value is negative, as a symbol
byte (2 * the GAP_CODES code of |v| + its sign) and |v|'s extra bits in a stream of their own.

PREDICTED_CODES stores its residuals the same way (codings.history makes them).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from pulsesync.codec import jit
from pulsesync.codec.codings.gap_codes import (
    GAP_DIRECT,
    MAX_GAP_CODE,
    _extra_bits,
    _gap_at,
    _length_code,
    _pack_bits,
    decode_length_codes,
    encode_length_codes,
)
from pulsesync.codec.codings.status import POSITIONS_OK
from pulsesync.codec.codings.values import fold_by_sign
from pulsesync.errors import CorruptPatchError

VALUES_CODE_INVALID, VALUES_EXTRA_MISMATCH = 8, 9  # a symbol above the last code; the extra bits


_VALUE_CODE_INVALID = f"a value code is above {2 * MAX_GAP_CODE + 1}"

_VALUE_EXTRA_MISMATCH = "the extra-bits stream does not match the value codes"

ERRORS = {VALUES_CODE_INVALID: _VALUE_CODE_INVALID, VALUES_EXTRA_MISMATCH: _VALUE_EXTRA_MISMATCH}


def encode_value_codes(values: np.ndarray, old: np.ndarray, order: np.ndarray) -> tuple[np.ndarray, bytes]:
    """EXP_CODES of signed 2-byte values: each negated where `old` is negative (fold_by_sign), taken in `order`,
    as symbols (2 * the GAP_CODES code of |v| + (v < 0)) and |v|'s extra bits. One numba pass where installed."""
    if jit.enabled and encode_value_codes_kernel is not None:
        symbols, extra_bytes = np.empty(order.size, np.uint8), np.empty(2 * order.size + 1, np.uint8)
        used = encode_value_codes_kernel(values, old, order, symbols, extra_bytes)
        return symbols, extra_bytes[:used].tobytes()
    signed = fold_by_sign(values, old)[order].astype(np.int64)
    codes, extra = encode_length_codes(np.abs(signed))
    codes <<= np.uint8(1)
    codes |= (signed < 0).view(np.uint8)
    return codes, extra


def decode_value_codes(symbols: np.ndarray, extra: np.ndarray, where: str) -> np.ndarray:
    """EXP_CODES symbols and extra bits -> the values as stored (folded, in stored order), int16 (wrapping);
    every symbol and the stream's size and padding checked. The caller unfolds and un-permutes them."""
    try:
        magnitudes = decode_length_codes(symbols >> 1, extra, _VALUE_CODE_INVALID, _VALUE_EXTRA_MISMATCH)
    except CorruptPatchError as e:
        raise CorruptPatchError(f"{where}: {e}") from None
    signed = np.where(symbols & 1, -magnitudes, magnitudes)
    return signed.astype(np.int16)  # modulo 2**16


def _encode_value_codes(values: Any, old: Any, order: Any, symbols: Any, extra: Any) -> int:
    """EXP_CODES of 2-byte values (encode_value_codes) in one pass; the bytes of extra used."""
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


encode_value_codes_kernel: Any = jit.kernel(_encode_value_codes)


@jit.inline
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


@jit.inline
def _value_at(payloads: Any, symbol_at: int, bit: Any) -> tuple[Any, Any]:
    """The value an EXP_CODES symbol stands for (int16, wrapping; its extra bits at `bit`), and the next bit offset."""
    symbol = np.int64(payloads[np.uint64(symbol_at)])
    magnitude, bit = _gap_at(symbol >> 1, payloads, bit)
    v = -magnitude if symbol & 1 else magnitude
    return ((v + 32768) & 0xFFFF) - 32768, bit


@jit.compiled
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
