"""The additive element hash behind the `mixsum-128` state digest (pure): updatable in O(changed elements).

A tensor's digest is the sum, modulo 2**64 in each of two lanes, of one term per element:

    term_lane(i, v) = fmix64(((i + SEED_lane) * MUL_lane) mod 2**64  XOR  v)

where i is the element's flat C-order index and v its raw bits, zero-extended to 64 bits.
fmix64 is MurmurHash3's 64-bit finalizer, a bijection. So a change of the elements at some
positions changes the sum by sum(term(i, new)) - sum(term(i, old)) over those positions only,
and a change of any single element always changes both lanes (for a fixed i, the term is a
bijection of v). This is a multiset hash in the sense of Clarke et al. (MSet-Add-Hash, 2003)
with a fixed, public mixer instead of a keyed one: it detects divergence (reconstruction bugs,
memory or disk corruption), not forgery; authenticity comes from signed manifests
(docs/protocol.md, "State digests").

Numba-compiled where installed (`pulsesync[fast]`); the numpy path gives identical sums.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

try:
    import numba
except ImportError:  # pragma: no cover - exercised where numba is not installed
    numba = None  # type: ignore[assignment]

LANES = 2
_SEED0, _SEED1 = np.uint64(0x243F6A8885A308D3), np.uint64(0x13198A2E03707344)  # digits of pi
_MUL0, _MUL1 = np.uint64(0x9E3779B97F4A7C15), np.uint64(0xD6E8FEB86659FD93)  # odd: multiplying is a bijection
_F1, _F2, _S33 = np.uint64(0xFF51AFD7ED558CCD), np.uint64(0xC4CEB9FE1A85EC53), np.uint64(33)
_MASK = (1 << 64) - 1
_NUMPY_BLOCK = 1 << 18  # elements per numpy pass: bounded temporaries


def _mix(x: Any) -> Any:
    """fmix64 (MurmurHash3's finalizer) on a uint64 scalar or array."""
    x ^= x >> _S33
    x *= _F1
    x ^= x >> _S33
    x *= _F2
    return x ^ (x >> _S33)


_fmix = numba.njit(inline="always")(_mix) if numba is not None else _mix


def _sum_range(values: Any, first: int, out: Any) -> None:
    """out += the lane sums of values[k] at index first + k."""
    s0 = np.uint64(0)
    s1 = np.uint64(0)
    base = np.uint64(first)
    for k in range(values.size):
        i = base + np.uint64(k)
        v = np.uint64(values[k])
        s0 += _fmix(((i + _SEED0) * _MUL0) ^ v)
        s1 += _fmix(((i + _SEED1) * _MUL1) ^ v)
    out[0] += s0
    out[1] += s1


def _sum_at(values: Any, positions: Any, first: int, out: Any) -> None:
    """out += the lane sums of values[k] at index first + positions[k]."""
    s0 = np.uint64(0)
    s1 = np.uint64(0)
    base = np.uint64(first)
    for k in range(values.size):
        i = base + np.uint64(positions[k])
        v = np.uint64(values[k])
        s0 += _fmix(((i + _SEED0) * _MUL0) ^ v)
        s1 += _fmix(((i + _SEED1) * _MUL1) ^ v)
    out[0] += s0
    out[1] += s1


def _term_change(i: Any, new: Any, was: Any) -> tuple[Any, Any]:
    """Both lanes' term of bits `new` minus that of bits `was` at flat index i (uint64 scalars)."""
    a0, a1 = (i + _SEED0) * _MUL0, (i + _SEED1) * _MUL1
    return _fmix(a0 ^ new) - _fmix(a0 ^ was), _fmix(a1 ^ new) - _fmix(a1 ^ was)


# For the apply kernels (codec.batch), which update the digest as they write each element.
term_change = numba.njit(inline="always")(_term_change) if numba is not None else _term_change


_njit = numba.njit(cache=True, nogil=True, boundscheck=False) if numba is not None else None
_sum_range_kernel: Callable[[Any, int, Any], None] | None = _njit(_sum_range) if _njit else None
_sum_at_kernel: Callable[[Any, Any, int, Any], None] | None = _njit(_sum_at) if _njit else None
enabled = numba is not None  # tests switch it off to compare with the numpy path


def _numpy_sums(values: np.ndarray, indices: np.ndarray) -> np.ndarray:
    v = values.astype(np.uint64)
    lanes = np.empty(LANES, np.uint64)
    for lane, (seed, mul) in enumerate(((_SEED0, _MUL0), (_SEED1, _MUL1))):
        lanes[lane] = np.add.reduce(_mix(((indices + seed) * mul) ^ v), dtype=np.uint64)
    return lanes


def unsigned(values: np.ndarray) -> np.ndarray:
    """The raw bits of an integer array as the unsigned type of its width (a view)."""
    return values.view(np.dtype(f"u{values.dtype.itemsize}"))


def sum_range(values: np.ndarray, first: int = 0) -> tuple[int, int]:
    """Lane sums of the elements of a flat unsigned array, the first at flat index `first`."""
    out = np.zeros(LANES, np.uint64)
    if enabled and _sum_range_kernel is not None:
        _sum_range_kernel(values, first, out)
    else:
        for s in range(0, values.size, _NUMPY_BLOCK):
            block = values[s : s + _NUMPY_BLOCK]
            out += _numpy_sums(block, np.arange(first + s, first + s + block.size, dtype=np.uint64))
    return int(out[0]), int(out[1])


def sum_at(values: np.ndarray, positions: np.ndarray, first: int = 0) -> tuple[int, int]:
    """Lane sums of values[k] (flat unsigned) at flat index first + positions[k] (int64)."""
    out = np.zeros(LANES, np.uint64)
    if enabled and _sum_at_kernel is not None:
        _sum_at_kernel(values, positions, first, out)
    else:
        for s in range(0, values.size, _NUMPY_BLOCK):
            indices = positions[s : s + _NUMPY_BLOCK].astype(np.uint64) + np.uint64(first)
            out += _numpy_sums(values[s : s + _NUMPY_BLOCK], indices)
    return int(out[0]), int(out[1])


def change(old: np.ndarray, new: np.ndarray, first: int = 0, positions: np.ndarray | None = None) -> tuple[int, int]:
    """Lane sums of `new` minus those of `old` (flat unsigned, equal sizes) at first + positions[k], or first + k."""
    if positions is None:
        return add(sum_range(new, first), sum_range(old, first), -1)
    return add(sum_at(new, positions, first), sum_at(old, positions, first), -1)


def add(a: tuple[int, int], b: tuple[int, int], sign: int = 1) -> tuple[int, int]:
    """a + sign * b in each lane, modulo 2**64."""
    return (a[0] + sign * b[0]) & _MASK, (a[1] + sign * b[1]) & _MASK


def to_hex(lanes: tuple[int, int]) -> str:
    """The digest string: both lanes, 16 hex digits each."""
    return f"{lanes[0]:016x}{lanes[1]:016x}"


def from_hex(digest: str) -> tuple[int, int]:
    """The lanes of a digest string (ValueError if it is not 32 hex digits)."""
    if len(digest) != 32:
        raise ValueError(f"a mixsum-128 digest is 32 hex digits, got {len(digest)}")
    return int(digest[:16], 16), int(digest[16:], 16)


def warm_up() -> None:
    """Load (or compile) the kernels for every unsigned width now, not inside a sync."""
    if not enabled or _sum_range_kernel is None or _sum_at_kernel is None:
        return
    out, positions = np.zeros(LANES, np.uint64), np.zeros(1, np.int64)
    for width in (1, 2, 4, 8):
        values = np.zeros(1, np.dtype(f"u{width}"))
        _sum_range_kernel(values, 0, out)
        _sum_at_kernel(values, positions, 0, out)
