"""The PULSE paper's default patch encoding (Algorithm 1 with delta-coded positions, downcasting, zstd-1).

The baseline every codec benchmark compares against, and the bound the format-2 encoder never
exceeds by more than its fixed per-record framing (tests/test_codec_v2.py). Pure; 2-byte dtypes.
"""

from __future__ import annotations

import struct

import numpy as np
import torch
import zstandard

State = dict[str, torch.Tensor]


def pulse_encode(old: State, new: State) -> bytes:
    """Per tensor: sorted changed positions, delta-encoded, narrowest uint; raw new values; zstd-1."""
    return _zstd1(b"".join(part for _, part in _pulse_parts(old, new)))


def pulse_wire(old: State, new: State, patch: bytes) -> dict[str, int]:
    """The patch's bytes by role ("positions", "values", "framing": the per-tensor headers), estimated:
    PULSE compresses them as one stream, so it is split in proportion to each role compressed alone."""
    parts = _pulse_parts(old, new)
    alone = {role: len(_zstd1(b"".join(p for r, p in parts if r == role))) for role in ("positions", "values")}
    total = sum(alone.values()) + sum(len(p) for r, p in parts if r == "framing")
    wire = {role: len(patch) * size // total for role, size in alone.items()}
    return {**wire, "framing": len(patch) - sum(wire.values())}


def _zstd1(data: bytes) -> bytes:
    return zstandard.ZstdCompressor(level=1, threads=-1).compress(data)


def _pulse_parts(old: State, new: State) -> list[tuple[str, bytes]]:
    """The uncompressed stream in order, each piece with its role."""
    parts = []
    for name in sorted(new):
        a = old[name].reshape(-1).view(torch.int16).numpy()
        b = new[name].reshape(-1).view(torch.int16).numpy()
        pos = np.flatnonzero(a != b)
        if pos.size == 0:
            continue
        gaps = np.diff(pos, prepend=0)  # first index as is, then differences
        index_dtype = next(d for d in (np.uint8, np.uint16, np.uint32, np.uint64) if gaps.max() <= np.iinfo(d).max)
        encoded = name.encode()
        head = struct.pack("<H", len(encoded)) + encoded + struct.pack("<QB", pos.size, np.dtype(index_dtype).itemsize)
        parts.append(("framing", head))
        parts.append(("positions", gaps.astype(index_dtype).tobytes()))
        parts.append(("values", b[pos].tobytes()))  # new values, not deltas
    return parts


def pulse_apply(state: State, patch: bytes) -> None:
    """Decompress, upcast, prefix-sum the positions, overwrite values in place."""
    raw = memoryview(zstandard.ZstdDecompressor().decompress(patch))
    offset = 0
    while offset < len(raw):
        (name_len,) = struct.unpack_from("<H", raw, offset)
        name = bytes(raw[offset + 2 : offset + 2 + name_len]).decode()
        n, width = struct.unpack_from("<QB", raw, offset + 2 + name_len)
        offset += 2 + name_len + 9
        gaps = np.frombuffer(raw, {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}[width], n, offset)
        offset += n * width
        values = np.frombuffer(raw, np.int16, n, offset)
        offset += 2 * n
        flat = state[name].view(-1).view(torch.int16)
        flat.index_copy_(0, torch.from_numpy(np.cumsum(gaps, dtype=np.int64)), torch.from_numpy(values.copy()))
