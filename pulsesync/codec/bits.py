"""Exact integer transforms behind the codec (pure; device-agnostic torch, numpy on the host).

Values are bit patterns held in signed integer tensors of the dtype's width. All arithmetic is
modulo 2**bits, so every transform is a bijection and decoding is bit-exact by construction.
"""

from __future__ import annotations

import mmap
import threading
from dataclasses import dataclass

import numpy as np
import torch

from pulsesync.codec import fused
from pulsesync.codec.format import (
    CLASS_ALL,
    CLASS_MARKED,
    CLASS_NONE,
    CLASSES,
    ENTROPY_SAMPLE,
    ESCAPE,
    GAP_DIRECT,
    MAX_GAP_CODE,
    SMALL_ESCAPE,
    ValueCoding,
)
from pulsesync.dtypes import NP_INT_OF_WIDTH, NP_UINT_OF_WIDTH, DTypeInfo
from pulsesync.errors import CorruptPatchError


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
_VALUE_ESCAPES_MISMATCH = "escaped value count does not match the value codes"
_GAP_ESCAPES_MISMATCH = "escape count does not match the gap stream"
_OUTSIDE = "a position is outside the chunk of {length}"  # both position decoders, both paths


def check_escape_count(packed: np.ndarray, count: int, escapes: int, where: str) -> None:
    """CorruptPatchError unless the first `count` codes hold exactly `escapes` escape codes."""
    if fused.enabled and fused.count_escape_codes is not None:
        found = fused.count_escape_codes(packed, count)
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


SCRATCH_ELEMENTS = 1 << 22  # changed_elements' scratch holds at least a chunk of this many elements, a thread
SCRATCH_KEPT = 1 << 18  # and is kept while no call has filled more than this many of its entries (~3 MB of bf16)
_scratch = threading.local()


def changed_elements(
    old: np.ndarray, new: np.ndarray, step: int = 1 << 20
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Sorted positions where two equal-length integer arrays differ bitwise (int64), and the elements there in each.

    numba's kernel where installed (fused.changed_words: ~1.8x numpy on a 72 MB state, the
    elements kept as it finds them), else numpy's compare + flatnonzero on cache-sized slices
    (~2x torch's ne + nonzero on CPU) and a gather.
    """
    words = old.size * old.itemsize // 8
    kernel = fused.changed_words.get(old.itemsize) if fused.enabled else None
    if kernel is not None and words and old.ctypes.data % 8 == new.ctypes.data % 8 == 0:
        body = words * (8 // old.itemsize)
        out, old_out, new_out = _scratch_for(body, old.dtype)
        unsigned = f"u{old.itemsize}"
        found = kernel(
            old[:body].view(np.uint64), new[:body].view(np.uint64), out, old_out.view(unsigned), new_out.view(unsigned)
        )
        positions, old_found, new_found = found[0], found[1].view(old.dtype), found[2].view(old.dtype)
        if positions.size > SCRATCH_KEPT:  # a dense chunk: its pages of scratch are given back
            del _scratch.by_dtype[old.dtype]
        tail = np.flatnonzero(old[body:] != new[body:]) + body
        if not tail.size:
            return positions, old_found, new_found
        return (
            np.concatenate([positions, tail]),
            np.concatenate([old_found, old[tail]]),
            np.concatenate([new_found, new[tail]]),
        )
    found_at = [np.flatnonzero(old[s : s + step] != new[s : s + step]) + s for s in range(0, old.size, step)]
    positions = np.concatenate(found_at) if found_at else np.empty(0, np.int64)
    return positions, old[positions], new[positions]


def _scratch_for(size: int, dtype: np.dtype) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """This thread's scratch for changed_elements: room for `size` positions and elements of `dtype`.

    Reused: fresh arrays each call faulted their pages in (and unmapped them) again, ~0.35 ms of
    a 4M-element chunk's ~0.9. Its pages are committed only where written, 4 KB at a time: numpy
    advises huge pages for arrays this large, which kept 2 MB of each array a thread in memory.
    """
    if not hasattr(_scratch, "by_dtype"):
        _scratch.by_dtype = {}
    held: tuple[np.ndarray, np.ndarray, np.ndarray] | None = _scratch.by_dtype.get(dtype)
    if held is None or held[0].size < size:
        room = max(size, SCRATCH_ELEMENTS)
        held = _scratch.by_dtype[dtype] = (
            _small_pages(room, np.int64),
            _small_pages(room, dtype),
            _small_pages(room, dtype),
        )
    return held


def _small_pages(count: int, dtype: np.dtype | type[np.integer]) -> np.ndarray:
    """An uninitialised array in private anonymous memory of its own, in small pages (MADV_NOHUGEPAGE where Linux
    has it). Private: a shared mapping would be written by a forked child too, and never takes huge pages anyway."""
    memory = mmap.mmap(-1, max(1, count * np.dtype(dtype).itemsize), flags=mmap.MAP_PRIVATE)
    if hasattr(mmap, "MADV_NOHUGEPAGE"):
        memory.madvise(mmap.MADV_NOHUGEPAGE)
    return np.frombuffer(memory, dtype, count)


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
    """What the encoder codes of a sparse record of 2-byte floats (format 3), made in one compiled call."""

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
    None without numba (the encoder then makes each with the functions here, the same bytes)."""
    if not (fused.enabled and fused.sparse_streams is not None):
        return None
    ref_positions, ref_deltas = reference if reference is not None else (positions[:0], old[:0])
    streams, (symbols, extra), m = fused.sparse_streams(
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


def _gaps(positions: np.ndarray) -> np.ndarray:
    """p_i - p_{i-1} - 1 with p_{-1} = -1 (np.diff's prepend costs more than the subtraction on small records)."""
    gaps = np.empty_like(positions)
    if positions.size:
        gaps[0] = positions[0]
        np.subtract(positions[1:], positions[:-1], out=gaps[1:])
        gaps[1:] -= 1
    return gaps


def encode_positions(positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Sorted, distinct chunk-relative positions -> (u16 gaps, u64 escapes).

    gap_i = p_i - p_{i-1} - 1 (p_{-1} = -1); gaps >= ESCAPE are stored as ESCAPE in the u16
    stream and in full, in order, in the escape stream.
    """
    gaps = _gaps(positions)
    big = gaps >= ESCAPE
    return np.minimum(gaps, ESCAPE).astype(np.uint16), gaps[big].astype(np.uint64)


def decode_positions(planes: np.ndarray, count: int, escapes: np.ndarray, length: int, where: str) -> np.ndarray:
    """Inverse of encode_positions from the u16 gaps' byte planes, checking every position lies in [0, length).

    One pass of numba's kernel where installed (fused.decode_positions), else numpy.
    """
    if fused.enabled and fused.decode_positions is not None:
        positions = np.empty(count, np.int64)
        status = fused.decode_positions(planes, count, escapes, length, positions)
        if status != fused.POSITIONS_OK:
            raise CorruptPatchError(f"{where}: {kernel_error(status, length, gap_codes=False)}")
        return positions
    gaps16 = from_planes(planes, count, np.uint16)
    gaps = gaps16.astype(np.int64)
    if escapes.size:
        marks = gaps16 == ESCAPE
        if int(marks.sum()) != escapes.size:
            raise CorruptPatchError(f"{where}: {_GAP_ESCAPES_MISMATCH}")
        # Escaped gaps are < length, and all gaps sum to < length, so the cumsum cannot overflow.
        if int(escapes.max()) >= length or sum(int(e) for e in escapes) >= length:
            raise CorruptPatchError(f"{where}: escaped position gap exceeds the chunk of {length}")
        gaps[marks] = escapes.astype(np.int64)
    elif gaps16.size and bool((gaps16 == ESCAPE).any()):
        raise CorruptPatchError(f"{where}: {_GAP_ESCAPES_MISMATCH}")
    gaps += 1  # p_i = p_{i-1} + gap_i + 1: one cumulative sum, in place
    positions = np.cumsum(gaps, out=gaps)
    positions -= 1
    if positions.size and int(positions[-1]) >= length:
        raise CorruptPatchError(f"{where}: {_OUTSIDE.format(length=length)}")
    return positions


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


def _encode_length_codes(values: np.ndarray) -> tuple[np.ndarray, bytes]:
    """Non-negative int64 values below 2**32 -> (one u8 GAP_CODES code each, the extra-bits stream) (numpy).

    The codes carry each value's bit length and top bits (what zstd's Huffman stage can model);
    the low bits, close to uniform, are packed LSB first with no byte alignment (format.GAP_DIRECT).
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
    if fused.enabled and fused.encode_gap_codes is not None:
        codes, extra_bytes = np.empty(positions.size, np.uint8), np.empty(4 * positions.size + 1, np.uint8)
        used = fused.encode_gap_codes(positions, codes, extra_bytes)
        return codes, extra_bytes[:used].tobytes()
    return _encode_length_codes(_gaps(positions))


_GAP_CODE_INVALID = f"a position gap code is above {MAX_GAP_CODE}"
_GAP_EXTRA_MISMATCH = "the extra-bits stream does not match the gap codes"
_VALUE_CODE_INVALID = f"a value code is above {2 * MAX_GAP_CODE + 1}"
_VALUE_EXTRA_MISMATCH = "the extra-bits stream does not match the value codes"


def _decode_length_codes(codes: np.ndarray, extra: np.ndarray, invalid: str, mismatch: str) -> np.ndarray:
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
    if fused.enabled and fused.decode_gap_codes is not None:
        positions = np.empty(count, np.int64)
        status = fused.decode_gap_codes(codes, extra, length, positions)
        if status != fused.POSITIONS_OK:
            raise CorruptPatchError(f"{where}: {kernel_error(status, length, gap_codes=True)}")
        return positions
    try:
        gaps = _decode_length_codes(codes, extra, _GAP_CODE_INVALID, _GAP_EXTRA_MISMATCH)
    except CorruptPatchError as e:
        raise CorruptPatchError(f"{where}: {e}") from None
    # Every gap is below 2**32 and there are at most 2**30: the cumulative sum cannot overflow.
    gaps += 1
    positions = np.cumsum(gaps, out=gaps)
    positions -= 1
    if positions.size and int(positions[-1]) >= length:
        raise CorruptPatchError(f"{where}: {_OUTSIDE.format(length=length)}")
    return positions


def encode_value_codes(values: np.ndarray, old: np.ndarray, order: np.ndarray) -> tuple[np.ndarray, bytes]:
    """EXP_CODES of signed 2-byte values: each negated where `old` is negative (fold_by_sign), taken in `order`,
    as symbols (2 * the GAP_CODES code of |v| + (v < 0)) and |v|'s extra bits. One numba pass where installed."""
    if fused.enabled and fused.encode_value_codes is not None:
        symbols, extra_bytes = np.empty(order.size, np.uint8), np.empty(2 * order.size + 1, np.uint8)
        used = fused.encode_value_codes(values, old, order, symbols, extra_bytes)
        return symbols, extra_bytes[:used].tobytes()
    signed = fold_by_sign(values, old)[order].astype(np.int64)
    codes, extra = _encode_length_codes(np.abs(signed))
    codes <<= np.uint8(1)
    codes |= (signed < 0).view(np.uint8)
    return codes, extra


def decode_value_codes(symbols: np.ndarray, extra: np.ndarray, where: str) -> np.ndarray:
    """EXP_CODES symbols and extra bits -> the values as stored (folded, in stored order), int16 (wrapping);
    every symbol and the stream's size and padding checked. The caller unfolds and un-permutes them."""
    try:
        magnitudes = _decode_length_codes(symbols >> 1, extra, _VALUE_CODE_INVALID, _VALUE_EXTRA_MISMATCH)
    except CorruptPatchError as e:
        raise CorruptPatchError(f"{where}: {e}") from None
    signed = np.where(symbols & 1, -magnitudes, magnitudes)
    return signed.astype(np.int16)  # modulo 2**16


def fold_by_sign(values: np.ndarray, old: np.ndarray) -> np.ndarray:
    """Each value negated (wrapping) where the old value at its place is negative: its own inverse.

    An AdamW step moves a near-zero weight by about the learning rate in the direction it moved
    the step before, which puts it on the side of zero it moved to: EXP_CODES's sign then repeats.
    """
    folded: np.ndarray = np.where(old < 0, -values, values).astype(values.dtype)
    return folded


def match_reference(
    positions: np.ndarray, ref_positions: np.ndarray, ref_deltas: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A HISTORY record's match of its sorted positions against the reference's (sorted, with their deltas):
    which reference positions change again (bool per reference position), the reference delta
    at each position (0 where it is new) and the new positions. One merge where numba is
    installed, else numpy's binary search."""
    again = np.zeros(ref_positions.size, bool)
    if fused.enabled and fused.match_reference is not None:
        aligned, fresh = np.empty_like(ref_deltas, shape=positions.size), np.empty_like(positions)
        n = fused.match_reference(positions, ref_positions, ref_deltas, again, aligned, fresh)
        return again, aligned, fresh[:n]
    at = np.minimum(np.searchsorted(ref_positions, positions), max(ref_positions.size - 1, 0))
    recurring = ref_positions[at] == positions if ref_positions.size else np.zeros(positions.size, bool)
    again[at[recurring]] = True
    aligned = np.zeros_like(ref_deltas, shape=positions.size)
    aligned[recurring] = ref_deltas[at[recurring]]
    return again, aligned, positions[~recurring]


def predicted_offsets(old: np.ndarray, reference_deltas: np.ndarray) -> np.ndarray:
    """PREDICTED_CODES' prediction per position, as ordered steps from old (int16; fused._predicted_offset's rule).

    The bf16 nearest 2 * old - prev (prev: reference_delta ordered steps below old), computed
    exactly and rounded once, ties to even; 0 where reference_delta is 0, either value is not
    finite, or their exponents are more than 30 apart. One numba pass where installed, else numpy.
    """
    out = np.empty(old.size, np.int16)
    if fused.enabled and fused.predicted_offsets is not None:
        fused.predicted_offsets(old, reference_deltas, out)
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


_CLASS_TABLE_INVALID = f"a class-masks table entry is above {CLASS_MARKED}"
_CLASS_BITMAP_MISMATCH = "the class-masks bitmap does not match the chunk's marked classes"
_CLASS_COUNT_MISMATCH = "the class masks do not mark the record's count of positions"


def encode_class_masks(old: np.ndarray, positions: np.ndarray) -> tuple[np.ndarray, bytes]:
    """CLASS_MASKS of a chunk's changed positions: the class table and the bitmap of the marked classes' elements."""
    classes = magnitude_class(old)
    total = np.bincount(classes, minlength=CLASSES)
    changed = np.bincount(classes[positions], minlength=CLASSES)
    table = np.where(changed == 0, CLASS_NONE, np.where(changed == total, CLASS_ALL, CLASS_MARKED)).astype(np.uint8)
    mask = np.zeros(old.size, bool)
    mask[positions] = True
    return table, np.packbits(mask[table[classes] == CLASS_MARKED], bitorder="little").tobytes()


def class_masks_bits(old: np.ndarray, changed_classes: np.ndarray, blocks: int, block: int) -> float:
    """Estimated bits of a chunk's CLASS_MASKS bitmap: each class's changes (`changed_classes`: the magnitude
    classes of the changed elements' old values) against its size, estimated from `blocks` evenly spaced runs of
    `block` elements (contiguous runs read a few pages; a strided sample reads most of the chunk)."""
    starts = np.linspace(0, max(old.size - block, 0), blocks).astype(np.int64) if old.size > blocks * block else [0]
    sampled = np.zeros(CLASSES, np.float64)
    for start in dict.fromkeys(int(x) for x in starts):
        sampled += np.bincount(magnitude_class(old[start : start + block]), minlength=CLASSES)
    changed = np.bincount(changed_classes, minlength=CLASSES).astype(np.float64)
    total = np.maximum(sampled * (old.size / max(sampled.sum(), 1)), changed)
    p = np.divide(changed, total, out=np.zeros(CLASSES), where=total > 0)
    q = 1 - p
    entropy = -(p * np.log2(p, out=np.zeros(CLASSES), where=p > 0) + q * np.log2(q, out=np.zeros(CLASSES), where=q > 0))
    # zstd's Huffman stage codes bytes: a sparse bitmap costs it about twice its entropy
    return float((np.minimum(2 * entropy, 1.0) * total).sum())


def decode_class_masks(old: np.ndarray, table: np.ndarray, bitmap: np.ndarray, count: int, where: str) -> np.ndarray:
    """Inverse of encode_class_masks against the chunk's old values (2-byte floats), every part checked.

    One pass of numba's kernel where installed, else numpy.
    """
    if fused.enabled and fused.class_positions is not None:
        positions = np.empty(count, np.int64)
        status = fused.class_positions(old, table, bitmap, positions)
        if status != fused.POSITIONS_OK:
            raise CorruptPatchError(f"{where}: {kernel_error(status, old.size, gap_codes=False)}")
        return positions
    if int(table.max()) > CLASS_MARKED:
        raise CorruptPatchError(f"{where}: {_CLASS_TABLE_INVALID}")
    state = table[magnitude_class(old)]
    marked = np.flatnonzero(state == CLASS_MARKED)
    flags = np.unpackbits(bitmap, bitorder="little").view(bool)
    if (marked.size + 7) // 8 != bitmap.size or flags[marked.size :].any():
        raise CorruptPatchError(f"{where}: {_CLASS_BITMAP_MISMATCH}")
    changed = state == CLASS_ALL
    changed[marked[flags[: marked.size]]] = True
    positions = np.flatnonzero(changed)
    if positions.size != count:
        raise CorruptPatchError(f"{where}: {_CLASS_COUNT_MISMATCH}")
    return positions


_KERNEL_ERRORS = {
    fused.POSITIONS_GAP_CODE_INVALID: _GAP_CODE_INVALID,
    fused.VALUES_CODE_INVALID: _VALUE_CODE_INVALID,
    fused.VALUES_EXTRA_MISMATCH: _VALUE_EXTRA_MISMATCH,
    fused.CLASS_TABLE_INVALID: _CLASS_TABLE_INVALID,
    fused.CLASS_BITMAP_MISMATCH: _CLASS_BITMAP_MISMATCH,
    fused.CLASS_COUNT_MISMATCH: _CLASS_COUNT_MISMATCH,
    fused.POSITIONS_GAP_OUTSIDE: "escaped position gap exceeds the chunk of {length}",
    fused.POSITIONS_OUTSIDE: _OUTSIDE,
    fused.VALUES_ESCAPES_MISMATCH: _VALUE_ESCAPES_MISMATCH,
}


def kernel_error(status: int, length: int, gap_codes: bool) -> str:
    """What a fused kernel's status means, as the numpy path words it (a chunk of `length`)."""
    if status == fused.POSITIONS_ESCAPES_MISMATCH:
        return _GAP_EXTRA_MISMATCH if gap_codes else _GAP_ESCAPES_MISMATCH
    return _KERNEL_ERRORS[status].format(length=length)


def magnitude_class(old: np.ndarray) -> np.ndarray:
    """The 8 bits below the sign of each value (a float's exponent, for bf16 exactly), as uint8.

    EXP_PLANES stores values sorted by this class of the old value: one AdamW step moves a weight
    by about lr / ULP(w) ULPs, so values of one class have similar deltas and compress together.
    """
    shift = np.array(8 * old.itemsize - 9, old.dtype)
    classes: np.ndarray = ((old >> shift) & np.array(0xFF, old.dtype)).astype(np.uint8)
    return classes


def magnitude_order(old: np.ndarray) -> np.ndarray:
    """The stable permutation that sorts values by magnitude_class of their old values."""
    order: np.ndarray = np.argsort(magnitude_class(old), kind="stable")
    return order


def wrapping_add(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """a + b modulo 2**bits (numpy integer addition wraps; same dtype)."""
    out: np.ndarray = a + b.view(a.dtype)
    return out


def wrapping_sub(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """a - b modulo 2**bits."""
    out: np.ndarray = a - b.view(a.dtype)
    return out
