"""A fused kernel for the common record, compiled with numba when installed (`pulsesync[fast]`).

A sparse delta record of a 2-byte float (bf16, fp16) is most of every RL patch. With numpy its
apply takes some ten passes over the changed elements, two of them random accesses into the
tensor (gather, then scatter: a cache and TLB miss each). This kernel reads each value code,
gathers the old value, applies the order-preserving delta and writes the new value in one loop,
so a changed element costs one miss, and it returns the old values for the undo log. Positions
and escape counts are decoded and checked beforehand (decoder.py), so the kernel only ever
indexes inside the chunk. Without numba, or for other records, the numpy path runs: the results
are bit-identical, which the tests check by running both.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

try:
    import numba
except ImportError:  # pragma: no cover - exercised where numba is not installed
    numba = None  # type: ignore[assignment]


def _apply_delta_2byte(chunk: Any, positions: Any, packed: Any, escapes: Any, old_out: Any) -> None:
    """chunk[p_i] = from_ordered(to_ordered(chunk[p_i]) + delta_i); old values into old_out.

    delta_i = unzigzag(code_i + 1), or unzigzag(escape + 1) for code 3, as bits.unpack_small_deltas.
    """
    k = 0
    for i in range(positions.size):
        code = (np.int32(packed[i >> 2]) >> (2 * (i & 3))) & 3
        if code == 3:
            v = (np.int32(escapes[k]) + 1) & 0xFFFF
            k += 1
        else:
            v = code + 1
        delta = (v >> 1) ^ -(v & 1)
        p = positions[i]
        old_out[i] = chunk[p]
        old = np.int32(chunk[p])
        ordered = old ^ ((old >> 15) & 0x7FFF)  # sign-magnitude -> value order (its own inverse)
        s = ((ordered + delta + 32768) & 0xFFFF) - 32768  # int16 addition, wrapping
        chunk[p] = np.int16(s ^ ((s >> 15) & 0x7FFF))


apply_delta_2byte: Callable[[Any, Any, Any, Any, Any], None] | None = (
    numba.njit(cache=True, nogil=True, boundscheck=False)(_apply_delta_2byte) if numba is not None else None
)
enabled = apply_delta_2byte is not None  # tests switch it off to compare with the numpy path
