"""CLASS_MASKS positions (SPARSE records of 2-byte floats, format 3): per magnitude class of the chunk's old
values, none of its elements changed, every one, or those a bitmap marks.

The decoder scans the chunk's old values; the encoder takes it where the bitmap is estimated well
below the gaps' ~8 bits a change (the first patch after an anchor, dense in some classes).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from pulsesync.codec import jit
from pulsesync.codec.codings.status import POSITIONS_OK, check
from pulsesync.errors import CorruptPatchError

CLASSES = 256  # magnitude classes: the 8 bits below the sign
CLASS_NONE, CLASS_ALL, CLASS_MARKED = 0, 1, 2  # a CLASS_MASKS table entry
CLASS_TABLE_INVALID, CLASS_BITMAP_MISMATCH, CLASS_COUNT_MISMATCH = 10, 11, 12


_CLASS_TABLE_INVALID = f"a class-masks table entry is above {CLASS_MARKED}"

_CLASS_BITMAP_MISMATCH = "the class-masks bitmap does not match the chunk's marked classes"

_CLASS_COUNT_MISMATCH = "the class masks do not mark the record's count of positions"

ERRORS = {
    CLASS_TABLE_INVALID: _CLASS_TABLE_INVALID,
    CLASS_BITMAP_MISMATCH: _CLASS_BITMAP_MISMATCH,
    CLASS_COUNT_MISMATCH: _CLASS_COUNT_MISMATCH,
}


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
    if jit.enabled and class_positions_kernel is not None:
        positions = np.empty(count, np.int64)
        check(class_positions_kernel(old, table, bitmap, positions), old.size, where, ERRORS)
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


def _class_positions(chunk: Any, table: Any, bitmap: Any, out: Any) -> int:
    """out = the positions CLASS_MASKS code (decode_class_masks), in one pass over the old values; a status.

    CLASS_TABLE_INVALID for a table entry above CLASS_MARKED; CLASS_COUNT_MISMATCH unless exactly
    out.size positions are found; CLASS_BITMAP_MISMATCH unless the marked classes' elements take
    exactly the bitmap's bytes, its padding bits zero.
    """
    for c in range(table.size):
        if table[c] > CLASS_MARKED:
            return CLASS_TABLE_INVALID
    limit = 8 * bitmap.size
    bit = 0
    k = 0
    for i in range(chunk.size):
        state = table[(np.int32(chunk[i]) >> 7) & 0xFF]
        if state == CLASS_NONE:
            continue
        if state == CLASS_MARKED:
            if bit == limit:
                return CLASS_BITMAP_MISMATCH
            flag = (bitmap[bit >> 3] >> (bit & 7)) & 1
            bit += 1
            if flag == 0:
                continue
        if k == out.size:
            return CLASS_COUNT_MISMATCH
        out[k] = i
        k += 1
    if k != out.size:
        return CLASS_COUNT_MISMATCH
    if (bit + 7) // 8 != bitmap.size or (bit % 8 != 0 and (np.int64(bitmap[bitmap.size - 1]) >> (bit % 8)) != 0):
        return CLASS_BITMAP_MISMATCH
    return POSITIONS_OK


class_positions_kernel: Any = jit.kernel(_class_positions)
