"""A step's patch history as bytes an anchor carries, so the patch after the anchor is history-coded (pure).

A subscriber that starts from an anchor has applied no patch, so it holds no reference for the
next, history-coded patch; the anchor of a step committed as a patch carries that patch's history
(one object per patch object: a sharded step's parts each have theirs). Layout: a zstd frame of a
safetensors file whose metadata lists, per patch, its SHA-256 and its chunk keys, and whose
tensors hold each chunk's positions as gaps (uint32: the first position, then the distance to the
one before; chunks are far below 2**32 elements) and its deltas. Everything is checked before it
is used (the decoder kernels index a chunk by these positions): positions strictly increasing and
inside the chunk, one delta each, of a signed integer width the codec writes.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import numpy as np
import zstandard
from safetensors import SafetensorError
from safetensors.numpy import load, save

from pulsesync.codec.history import ChunkHistory, StepHistory
from pulsesync.errors import IntegrityError

HISTORY_FILE = "patch-history-{part:05d}.safetensors.zst"  # an anchor's object: the history of its step's part
ZSTD_LEVEL = 3
DELTA_DTYPES = (np.int8, np.int16, np.int32, np.int64)
_META = "pulsesync.history"


def history_bytes(history: StepHistory) -> bytes:
    """The bytes of `history` (every patch it holds)."""
    tensors: dict[str, np.ndarray] = {}
    patches = []
    for p, patch in enumerate(history.patches.values()):
        for i, chunk in enumerate(patch.chunks.values()):
            positions = chunk.positions.astype(np.int64, copy=False)
            tensors[f"{p}.{i}.gaps"] = np.diff(positions, prepend=0).astype(np.uint32)
            tensors[f"{p}.{i}.deltas"] = np.ascontiguousarray(chunk.deltas)
        patches.append({"sha256": patch.sha256, "chunks": [list(key) for key in patch.chunks]})
    raw = save(tensors, metadata={_META: json.dumps({"patches": patches})})
    return zstandard.ZstdCompressor(level=ZSTD_LEVEL).compress(raw)


def read_history(data: bytes, where: str, max_bytes: int, tensors: Mapping[str, tuple[int, int]]) -> StepHistory:
    """The history in `data`, every chunk checked; IntegrityError naming `where` for anything malformed.

    `max_bytes` bounds what the frame may decompress to (the caller's bound: a few bytes per element
    of the state the history is of); `tensors` gives each tensor of that state as (elements, bytes
    per element): a chunk lies inside its tensor and its deltas are as wide as its elements.
    """
    try:
        raw = zstandard.ZstdDecompressor().decompress(data, max_output_size=max_bytes)
    except zstandard.ZstdError as e:
        raise IntegrityError(f"{where}: not a zstd frame within {max_bytes} bytes ({e})") from None
    if len(raw) > max_bytes:
        raise IntegrityError(f"{where}: decompresses to over {max_bytes} bytes")
    try:
        arrays = load(raw)
        with_meta = _metadata(raw)
        listed = json.loads(with_meta[_META])["patches"]
        history = StepHistory()
        for p, saved in enumerate(listed):
            patch = history.add(_text(saved["sha256"]))
            for i, key in enumerate(saved["chunks"]):
                name, start, elements = _text(key[0]), _count(key[1]), _count(key[2])
                numel, width = tensors[name]
                if start + elements > numel:
                    raise ValueError(f"chunk {start}+{elements} of {name!r} is past its {numel} elements")
                gaps, deltas = arrays.pop(f"{p}.{i}.gaps"), arrays.pop(f"{p}.{i}.deltas")
                if deltas.dtype.itemsize != width:
                    raise ValueError(f"deltas of {deltas.dtype} for {name!r}, whose elements are {width} bytes")
                patch.chunks[(name, start, elements)] = _chunk(gaps, deltas, elements)
    except (SafetensorError, ValueError, KeyError, TypeError, IndexError) as e:
        raise IntegrityError(f"{where}: not a patch history ({type(e).__name__}: {str(e)[:200]})") from None
    if arrays:
        raise IntegrityError(f"{where}: not a patch history (array {sorted(arrays)[0]!r} is in no chunk)")
    return history


def _metadata(raw: bytes) -> dict[str, str]:
    """The safetensors header's __metadata__ (the numpy loader drops it)."""
    size = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8 : 8 + size])
    meta = header.get("__metadata__") if isinstance(header, dict) else None
    if not isinstance(meta, dict) or not isinstance(meta.get(_META), str):
        raise ValueError("no history metadata")
    return meta


def _text(value: Any) -> str:
    if not isinstance(value, str):
        raise ValueError(f"{str(value)[:40]} is not a string")
    return value


def _count(value: Any) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value < 1 << 62:
        raise ValueError(f"{str(value)[:40]} is not a count")
    return value


def _chunk(gaps: np.ndarray, deltas: np.ndarray, elements: int) -> ChunkHistory:
    """A chunk's history from its stored arrays, or ValueError where the decoder could not trust it."""
    if gaps.dtype != np.uint32 or gaps.ndim != 1 or deltas.ndim != 1 or len(gaps) != len(deltas):
        raise ValueError("a chunk's positions and deltas do not pair up")
    if deltas.dtype.type not in DELTA_DTYPES:
        raise ValueError(f"deltas of {deltas.dtype} are not a signed integer width the codec writes")
    positions = np.cumsum(gaps, dtype=np.int64)
    if len(gaps) and ((gaps[1:] == 0).any() or positions[-1] >= elements):
        raise ValueError("a chunk's positions are not increasing inside it")
    return ChunkHistory(positions, np.ascontiguousarray(deltas))
