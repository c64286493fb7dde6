"""Where two chunks differ: the changed elements' positions and their old and new values (the encoder's first pass)."""

from __future__ import annotations

import mmap
import threading
from collections.abc import Callable
from typing import Any

import numpy as np

from pulsesync.codec import jit

SCRATCH_ELEMENTS = 1 << 22  # changed_elements' scratch holds at least a chunk of this many elements, a thread

SCRATCH_KEPT = 1 << 18  # and is kept while no call has filled more than this many of its entries (~3 MB of bf16)

_scratch = threading.local()


def changed_elements(
    old: np.ndarray, new: np.ndarray, step: int = 1 << 20
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Sorted positions where two equal-length integer arrays differ bitwise (int64), and the elements there in each.

    numba's kernel where installed (changed_words: ~1.8x numpy on a 72 MB state, the
    elements kept as it finds them), else numpy's compare + flatnonzero on cache-sized slices
    (~2x torch's ne + nonzero on CPU) and a gather.
    """
    words = old.size * old.itemsize // 8
    kernel = changed_words.get(old.itemsize) if jit.enabled else None
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


def _changed_words_kernel(lanes: int) -> Callable[[Any, Any, Any, Any, Any], tuple[Any, Any, Any]]:
    """The kernel for elements `lanes` to a 64-bit word (compiled apart for each: its lane loop unrolls)."""
    width = np.uint64(64 // lanes)
    mask = np.uint64(0xFFFFFFFFFFFFFFFF) >> np.uint64(64 - 64 // lanes)

    def changed_words(old: Any, new: Any, out: Any, old_out: Any, new_out: Any) -> tuple[Any, Any, Any]:
        """Positions (in elements) where two arrays of words differ, and the old and new elements there
        (unsigned, of the element's width), found into out, old_out and new_out (room for every
        element: a caller's scratch, its pages already in memory) and returned as copies.

        One pass at memory speed: a word is compared whole and split into lanes only where it
        differs (some 1% of them in an RL patch), its elements kept while they are in registers
        (a gather after the scan cost ~6% of encode time, a cache miss a change).
        """
        n = 0
        for w in range(old.size):
            a, b = old[w], new[w]
            x = a ^ b
            if x:
                for lane in range(lanes):
                    shift = width * np.uint64(lane)
                    if (x >> shift) & mask:
                        out[n] = w * lanes + lane
                        old_out[n] = (a >> shift) & mask
                        new_out[n] = (b >> shift) & mask
                        n += 1
        return out[:n].copy(), old_out[:n].copy(), new_out[:n].copy()

    return changed_words


# Per element width (1, 2, 4, 8 bytes): the kernel for the lanes of a 64-bit word.
changed_words: dict[int, Callable[[Any, Any, Any, Any, Any], tuple[Any, Any, Any]]] = (
    {w: jit.kernel(_changed_words_kernel(8 // w)) for w in (1, 2, 4, 8)} if jit.numba is not None else {}
)
