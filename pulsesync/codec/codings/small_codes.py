"""DELTA and XOR values as 2-bit codes, four to a byte: codes 0-2 are the value less an offset, code 3
(SMALL_ESCAPE) says the value is in the escape planes that follow.

About 90% of RL updates move by exactly one ULP, so this reaches ~0.2 bytes per value where a
byte-wise entropy coder cannot go below 1 bit.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from pulsesync.codec import jit
from pulsesync.codec.codings.values import unzigzag
from pulsesync.dtypes import NP_INT_OF_WIDTH, NP_UINT_OF_WIDTH
from pulsesync.errors import CorruptPatchError

SMALL_ESCAPE = 3  # a 2-bit value code of this value means "the value is in the escape planes"
VALUES_ESCAPES_MISMATCH = 5


_VALUE_ESCAPES_MISMATCH = "escaped value count does not match the value codes"

ERRORS = {VALUES_ESCAPES_MISMATCH: _VALUE_ESCAPES_MISMATCH}


def pack_small(coded: np.ndarray, offset: int) -> tuple[np.ndarray, np.ndarray]:
    """Small unsigned values -> (2-bit codes, four per byte; escaped values).

    sym = value - offset; syms 0..2 become their code, larger ones code 3 plus an escape.
    Changed elements never code to 0 under DELTA/XOR, so sparse records use offset 1.
    ~90% of RL updates move by one ULP, so this gets close to the values' entropy where a
    byte-wise Huffman coder cannot go below 1 bit per value.
    """
    sym = coded.view(NP_UINT_OF_WIDTH[coded.itemsize]) - np.array(offset, NP_UINT_OF_WIDTH[coded.itemsize])
    big = sym >= SMALL_ESCAPE
    codes = np.minimum(sym, SMALL_ESCAPE).astype(np.uint8)
    codes = np.concatenate([codes, np.zeros(-codes.size % 4, np.uint8)]).reshape(-1, 4)
    packed = codes[:, 0] | (codes[:, 1] << 2) | (codes[:, 2] << 4) | (codes[:, 3] << 6)
    return packed, sym[big]


# Byte -> its four 2-bit codes, lowest first.
_CODES_OF_BYTE = (np.arange(256, dtype=np.uint8)[:, None] >> np.array([0, 2, 4, 6], np.uint8)) & 3


def _row_table(rows: np.ndarray) -> np.ndarray:
    """A (256, 4) table as 256 opaque rows: 1-D fancy indexing is ~7x faster than indexing 2-D rows."""
    rows = np.ascontiguousarray(rows)
    return rows.view(np.dtype((np.void, rows.itemsize * 4))).reshape(256)


def _lookup(table: np.ndarray, packed: np.ndarray, count: int, dtype: type[np.integer]) -> np.ndarray:
    """Four table values per packed byte, as a new writable array of `count` values."""
    values: np.ndarray = table[packed].view(dtype)[:count]
    return values


_CODE_TABLES = {width: _row_table(_CODES_OF_BYTE.astype(dtype)) for width, dtype in NP_UINT_OF_WIDTH.items()}


def _delta_rows(width: int) -> np.ndarray:
    deltas = unzigzag(_CODES_OF_BYTE.astype(NP_UINT_OF_WIDTH[width]) + 1, NP_INT_OF_WIDTH[width])
    deltas[_CODES_OF_BYTE == SMALL_ESCAPE] = 0
    return _row_table(deltas)


# Offset-1 delta codes straight to signed deltas (codes 0..2 -> unzigzag(1..3) = -1, 1, -2), and
# the escape code to 0, which no changed element codes to: one lookup, then fill in the escapes.
_DELTA_TABLES = {width: _delta_rows(width) for width in NP_UINT_OF_WIDTH}


def unpack_small(packed: np.ndarray, count: int, escapes: np.ndarray, offset: int, where: str) -> np.ndarray:
    """Inverse of pack_small: unsigned values of the escapes' dtype."""
    sym = _lookup(_CODE_TABLES[escapes.itemsize], packed, count, NP_UINT_OF_WIDTH[escapes.itemsize])
    big = sym == SMALL_ESCAPE
    if int(np.count_nonzero(big)) != escapes.size:
        raise CorruptPatchError(f"{where}: {_VALUE_ESCAPES_MISMATCH}")
    if escapes.size:
        sym[big] = escapes
    sym += np.array(offset, escapes.dtype)
    return sym


_ESCAPES_IN_BYTE = (_CODES_OF_BYTE == SMALL_ESCAPE).sum(axis=1).astype(np.int64)


def check_escape_count(packed: np.ndarray, count: int, escapes: int, where: str) -> None:
    """CorruptPatchError unless the first `count` codes hold exactly `escapes` escape codes."""
    if jit.enabled and count_escape_codes_kernel is not None:
        found = count_escape_codes_kernel(packed, count)
    else:
        found = int(_ESCAPES_IN_BYTE[packed[: count // 4]].sum())
        found += int(np.count_nonzero(_CODES_OF_BYTE[packed[count // 4 :]].reshape(-1)[: count % 4] == SMALL_ESCAPE))
    if found != escapes:
        raise CorruptPatchError(f"{where}: {_VALUE_ESCAPES_MISMATCH}")


def unpack_small_deltas(packed: np.ndarray, count: int, escapes: np.ndarray, offset: int, where: str) -> np.ndarray:
    """unzigzag(unpack_small(...)) as signed values; one table lookup when offset is 1 (sparse records)."""
    signed = NP_INT_OF_WIDTH[escapes.itemsize]
    if offset != 1:
        return unzigzag(unpack_small(packed, count, escapes, offset, where), signed)
    deltas = _lookup(_DELTA_TABLES[escapes.itemsize], packed, count, signed)
    big = deltas == 0
    if int(np.count_nonzero(big)) != escapes.size:
        raise CorruptPatchError(f"{where}: {_VALUE_ESCAPES_MISMATCH}")
    if escapes.size:
        deltas[big] = unzigzag(escapes + np.array(1, escapes.dtype), signed)
    return deltas


def _count_escape_codes(packed: Any, count: int) -> int:
    """How many of the first `count` 2-bit codes (four per byte, low bits first) are SMALL_ESCAPE."""
    found = 0
    for i in range(count):
        found += ((packed[i >> 2] >> (2 * (i & 3))) & 3) == SMALL_ESCAPE
    return found


count_escape_codes_kernel: Any = jit.kernel(_count_escape_codes)


@jit.inline
def _packed_delta(packed: Any, escapes: Any, i: int, k: int) -> tuple[Any, int]:
    """The i-th packed DELTA value (unzigzag(code + 1), or of the next escape for code 3); the next escape index."""
    code = (np.int32(packed[i >> 2]) >> (2 * (i & 3))) & 3
    if code == SMALL_ESCAPE:
        v = (np.int32(escapes[k]) + 1) & 0xFFFF
        k += 1
    else:
        v = code + 1
    return (v >> 1) ^ -(v & 1), k
