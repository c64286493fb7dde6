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
        parts.append(
            struct.pack("<H", len(encoded)) + encoded + struct.pack("<QB", pos.size, np.dtype(index_dtype).itemsize)
        )
        parts.append(gaps.astype(index_dtype).tobytes())
        parts.append(b[pos].tobytes())  # new values, not deltas
    return zstandard.ZstdCompressor(level=1, threads=-1).compress(b"".join(parts))


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
