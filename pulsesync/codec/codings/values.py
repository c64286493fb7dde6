"""Values as bit patterns: RAW (the new bits), DELTA (the difference of order-preserving integers), XOR,
their zigzag, and byte planes (pure; device-agnostic torch, numpy on the host).

Values are bit patterns held in signed integer tensors of the dtype's width. All arithmetic is
modulo 2**bits, so every transform is a bijection and decoding is bit-exact by construction.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from pulsesync.codec import jit
from pulsesync.codec.codings.catalog import ValueCoding
from pulsesync.dtypes import NP_UINT_OF_WIDTH, DTypeInfo

ENTROPY_SAMPLE = 4096  # the encoder estimates a byte plane's entropy from this many of its bytes


def _wrapping(op: str, a: torch.Tensor, b: torch.Tensor, info: DTypeInfo) -> torch.Tensor:
    """a + b or a - b modulo 2**bits, in the dtype's signed integer type.

    1- and 2-byte ints promote to int and narrow back (modular on every torch backend); 4-byte
    ints go through int64 to stay clear of signed overflow; int64 arithmetic wraps at 64 bits.
    """
    if info.width == 4:
        a, b = a.to(torch.int64), b.to(torch.int64)
    result = a + b if op == "+" else a - b
    return result.to(info.int_dtype)


def to_ordered(bits: torch.Tensor, info: DTypeInfo) -> torch.Tensor:
    """Map sign-magnitude float bits to integers in value order (one ULP up is +1).

    The map is its own inverse. Integer dtypes are already ordered and pass through.
    """
    if not info.is_float:
        return bits
    return to_ordered_(bits.clone(), info)


def to_ordered_(bits: torch.Tensor, info: DTypeInfo) -> torch.Tensor:
    """In-place to_ordered (one temporary instead of three)."""
    if not info.is_float:
        return bits
    top = 8 * info.width - 1
    if bits.device.type == "cpu":  # numpy's small-int kernels are ~3x torch's on CPU; same memory
        a = bits.numpy()
        a ^= _order_flip(a)
        return bits
    flip = bits >> top
    flip &= (1 << top) - 1
    bits ^= flip
    return bits


def encode_values(old: torch.Tensor, new: torch.Tensor, info: DTypeInfo, coding: ValueCoding) -> torch.Tensor:
    """Code new bit patterns relative to old ones (same shape, the dtype's int type, same device).

    DELTA yields the signed ordered difference; zigzag() turns it into a small unsigned value.
    """
    if coding == ValueCoding.RAW:
        return new
    if coding == ValueCoding.XOR:
        return old ^ new
    if old.device.type == "cpu" and new.device.type == "cpu":  # numpy: a few small ops instead of torch's eight
        return torch.from_numpy(ordered_delta(old.numpy(), new.numpy(), info))
    return _wrapping("-", to_ordered(new, info), to_ordered(old, info), info)


def _order_flip(a: np.ndarray) -> np.ndarray:
    """What to_ordered xors into sign-magnitude float bits held in a signed integer array: every bit
    below the sign where it is set, nothing elsewhere."""
    top = np.array(8 * a.itemsize - 1, a.dtype)
    flip: np.ndarray = (a >> top) & np.array((1 << (8 * a.itemsize - 1)) - 1, a.dtype)
    return flip


def ordered_delta(old: np.ndarray, new: np.ndarray, info: DTypeInfo) -> np.ndarray:
    """encode_values' DELTA of host arrays: to_ordered(new) - to_ordered(old), wrapping (numpy integers wrap)."""
    if not info.is_float:
        difference: np.ndarray = new - old
        return difference
    delta: np.ndarray = (new ^ _order_flip(new)) - (old ^ _order_flip(old))
    return delta


def decode_values_(old: torch.Tensor, coded: torch.Tensor, info: DTypeInfo, coding: ValueCoding) -> torch.Tensor:
    """Inverse of encode_values, in place: overwrites `old` with the new bit patterns and returns it."""
    if coding == ValueCoding.RAW:
        return old.copy_(coded)
    if coding == ValueCoding.XOR:
        return old.bitwise_xor_(coded)
    to_ordered_(old, info)
    if old.device.type == "cpu":
        a = old.numpy()
        a += coded.numpy().view(a.dtype)  # numpy integer addition wraps at every width
    elif info.width == 4:
        old.copy_(_wrapping("+", old, coded, info))
    else:
        old += coded  # 1-, 2- and 8-byte integer addition wraps (see _wrapping)
    return to_ordered_(old, info)


def host(t: torch.Tensor) -> np.ndarray:
    """A tensor's values as a numpy array on the host (no copy for a CPU tensor)."""
    return t.cpu().numpy() if t.device.type != "cpu" else t.numpy()


def zigzag(signed: np.ndarray) -> np.ndarray:
    """0, -1, 1, -2, ... -> 0, 1, 2, 3, ... (unsigned of the same width; exact, modular)."""
    u = signed.view(NP_UINT_OF_WIDTH[signed.itemsize])
    sign = signed >> np.array(8 * signed.itemsize - 1, signed.dtype)  # 0 or -1, same dtype
    zigzagged: np.ndarray = (u << np.array(1, u.dtype)) ^ sign.view(u.dtype)
    return zigzagged


def unzigzag(u: np.ndarray, signed: type[np.integer]) -> np.ndarray:
    """Inverse of zigzag: signed values of dtype `signed`."""
    one = np.array(1, u.dtype)
    values: np.ndarray = ((u >> one) ^ (np.zeros_like(u) - (u & one))).view(signed)
    return values


def wrapping_add(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """a + b modulo 2**bits (numpy integer addition wraps; same dtype)."""
    out: np.ndarray = a + b.view(a.dtype)
    return out


def wrapping_sub(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """a - b modulo 2**bits."""
    out: np.ndarray = a - b.view(a.dtype)
    return out


def fold_by_sign(values: np.ndarray, old: np.ndarray) -> np.ndarray:
    """Each value negated (wrapping) where the old value at its place is negative: its own inverse.

    An AdamW step moves a near-zero weight by about the learning rate in the direction it moved
    the step before, which puts it on the side of zero it moved to: EXP_CODES's sign then repeats.
    """
    folded: np.ndarray = np.where(old < 0, -values, values).astype(values.dtype)
    return folded


def to_planes(values: np.ndarray) -> bytes:
    """Byte-plane layout: all lowest bytes, then all next bytes, ... (compresses far better)."""
    return b"".join(plane_list(values))


def plane_list(values: np.ndarray) -> list[bytes]:
    """to_planes as one bytes object per plane (the encoder compresses each in a block of its own)."""
    width = values.dtype.itemsize
    if width == 1:
        return [values.tobytes()]
    planes = values.view(np.uint8).reshape(-1, width)
    return [planes[:, j].tobytes() for j in range(width)]


def entropy_bytes(planes: list[bytes], sample: int = ENTROPY_SAMPLE) -> float:
    """Order-0 entropy of each plane's bytes, summed, in bytes: about what zstd's Huffman stage makes of them.

    Estimated from an even sample of up to `sample` bytes per plane (a sample sees fewer
    distinct bytes, so the estimate errs low).
    """
    sizes = [len(plane) for plane in planes if plane]
    if not sizes:
        return 0.0
    # One histogram of every plane's sample, plane j's bytes counted at 256 * j + byte.
    picked = [np.frombuffer(p, np.uint8)[:: -(-len(p) // sample)].astype(np.intp) for p in planes if p]
    counts = np.bincount(np.concatenate([p + 256 * j for j, p in enumerate(picked)]), minlength=256 * len(picked))
    return sampled_entropy_bytes(counts.reshape(len(picked), 256), [p.size for p in picked], sizes)


def sampled_entropy_bytes(counts: np.ndarray, seen: list[int], sizes: list[int]) -> float:
    """entropy_bytes from each plane's histogram (a row of 256 counts) of `seen` of its `sizes` bytes."""
    frequencies = counts.astype(np.float64)
    with np.errstate(divide="ignore", invalid="ignore"):
        terms = np.where(frequencies > 0, frequencies * np.log2(frequencies), 0.0).sum(axis=1)
    sampled = np.array(seen, np.float64)
    bits_each = np.log2(sampled) - terms / sampled
    return float((bits_each * np.array(sizes)).sum()) / 8


def from_planes(buf: np.ndarray, count: int, dtype: type[np.integer]) -> np.ndarray:
    """Inverse of to_planes for `count` values of `dtype` from a uint8 buffer (a new, writable array)."""
    out = np.empty(count, dtype)
    out_bytes = out.view(np.uint8).reshape(count, out.itemsize)
    for j in range(out.itemsize):  # plane by plane: ~10x faster than a transposed copy
        out_bytes[:, j] = buf[j * count : (j + 1) * count]
    return out


@jit.inline
def _add_ordered(old: Any, delta: Any) -> Any:
    """The 2-byte float whose order-preserving integer is old's plus delta (wrapping), as int16."""
    ordered = old ^ ((old >> 15) & 0x7FFF)  # sign-magnitude -> value order (its own inverse)
    s = ((ordered + delta + 32768) & 0xFFFF) - 32768  # int16 addition, wrapping
    return np.int16(s ^ ((s >> 15) & 0x7FFF))


@jit.inline
def _plane_delta(planes: Any, n: int, j: Any, old: Any, fold: bool) -> Any:
    """Value j of n in two byte planes, unzigzagged; negated where `fold` (EXP_CODES, PREDICTED_CODES) and old < 0."""
    z = np.int32(planes[j]) | (np.int32(planes[n + j]) << 8)
    delta = (z >> 1) ^ -(z & 1)
    return -delta if fold and old < 0 else delta
