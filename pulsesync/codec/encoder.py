"""Patch encoder: bitwise diff of two states -> self-describing, checksummed patch bytes (pure)."""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, replace
from functools import partial

import numpy as np
import torch
import zstandard

from pulsesync.codec import bits
from pulsesync.codec.format import (
    PatchHeader,
    RecordHeader,
    RecordKind,
    ValueCoding,
    encode_header,
    encode_record_header,
    payload_hash,
    raw_len_for,
)
from pulsesync.codec.params import CodecParams
from pulsesync.digest import StateDigest, state_digest
from pulsesync.dtypes import DTypeInfo, State, dtype_info, flat_bits
from pulsesync.errors import ConfigError
from pulsesync.threads import parallel_map

_local = threading.local()


def _compressor(level: int) -> zstandard.ZstdCompressor:
    """A per-thread compressor (zstandard compressors are not thread-safe)."""
    cached = getattr(_local, "compressor", None)
    if cached is None or cached[0] != level:
        cached = (level, zstandard.ZstdCompressor(level=level, write_checksum=True, write_content_size=True))
        _local.compressor = cached
    return cached[1]


@dataclass(frozen=True)
class _Record:
    data: bytes
    changed: int
    raw_len: int


def _record(params: CodecParams, head: RecordHeader, parts: list[bytes]) -> _Record:
    """Compress a record's payload parts and prepend its header (sizes and payload hash filled in)."""
    raw_len = raw_len_for(
        head.kind, head.coding, head.info.width, head.length, head.count, head.escapes, head.value_escapes
    )
    assert raw_len == sum(len(p) for p in parts)
    payload = b""
    if raw_len:
        stream = _compressor(params.zstd_level).compressobj(size=raw_len)
        payload = b"".join([stream.compress(p) for p in parts] + [stream.flush()])
    head = replace(head, raw_len=raw_len, comp_len=len(payload), payload_hash=payload_hash(payload))
    return _Record(encode_record_header(head) + payload, head.count, raw_len)


def _changed_positions(old: torch.Tensor, new: torch.Tensor) -> np.ndarray:
    """Sorted positions where two flat integer tensors differ bitwise, as host int64."""
    if old.device.type != "cpu":
        return torch.nonzero(old != new).view(-1).cpu().numpy()
    return bits.changed_positions(old.numpy(), new.numpy())  # numpy: ~2-4x torch's ne + nonzero on CPU


def _host(t: torch.Tensor) -> np.ndarray:
    return t.cpu().numpy() if t.device.type != "cpu" else t.numpy()


def _encode_chunk(
    params: CodecParams,
    name: str,
    info: DTypeInfo,
    shape: tuple[int, ...],
    old: torch.Tensor,
    new: torch.Tensor,
    start: int,
) -> _Record | None:
    """SPARSE or DENSE record for one chunk of flat bits, or None when it is unchanged."""
    positions = _changed_positions(old, new)
    count, length = positions.size, old.numel()
    if count == 0:
        return None
    coding = params.coding
    if count * (2 + info.width) < length * info.width:
        index = torch.from_numpy(positions).to(old.device)
        coded = _host(bits.encode_values(old.index_select(0, index), new.index_select(0, index), info, coding))
        gaps, escapes = bits.encode_positions(positions)
        value_parts, value_escapes = _value_parts(coded, coding, offset=1)
        parts = [bits.to_planes(gaps), escapes.astype("<u8").tobytes(), *value_parts]
        head = RecordHeader(
            RecordKind.SPARSE, name, info, shape, coding, start, length, count, escapes.size, value_escapes
        )
        return _record(params, head, parts)
    # Dense beats sparse before compression: code every element (unchanged ones code to zero).
    value_parts, value_escapes = _value_parts(_host(bits.encode_values(old, new, info, coding)), coding, offset=0)
    head = RecordHeader(RecordKind.DENSE, name, info, shape, coding, start, length, count, value_escapes=value_escapes)
    return _record(params, head, value_parts)


def _value_parts(coded: np.ndarray, coding: ValueCoding, offset: int) -> tuple[list[bytes], int]:
    """Payload parts for coded values and the number of escaped ones."""
    if not coding.packed:
        return [bits.to_planes(coded)], 0
    if coding == ValueCoding.DELTA:
        coded = bits.zigzag(coded)
    packed, escaped = bits.pack_small(coded, offset)
    return [packed.tobytes(), bits.to_planes(escaped)], escaped.size


def _encode_whole(params: CodecParams, kind: RecordKind, name: str, t: torch.Tensor) -> _Record:
    """ADD or REPLACE record: the full tensor, raw bits."""
    values = _host(flat_bits(t))
    head = RecordHeader(kind, name, dtype_info(t.dtype), tuple(t.shape), ValueCoding.RAW, 0, values.size, values.size)
    return _record(params, head, [bits.to_planes(values)])


def encode_patch(
    base: State,
    new: State,
    params: CodecParams | None = None,
    *,
    base_digest: StateDigest | None = None,
    new_digest: StateDigest | None = None,
) -> bytes:
    """Lossless patch turning `base` into `new`; tensors may live on any device.

    Pass the states' digests when already known (the publisher has them) to skip hashing.
    """
    params = params or CodecParams()
    base_digest = base_digest or state_digest(base, params.digest_algorithm, params.threads)
    new_digest = new_digest or state_digest(new, params.digest_algorithm, params.threads)
    if {base_digest.algorithm, new_digest.algorithm} != {params.digest_algorithm}:
        raise ConfigError(
            f"digest algorithms {base_digest.algorithm}/{new_digest.algorithm} differ from "
            f"codec digest_algorithm {params.digest_algorithm}"
        )

    tasks: list[Callable[[], _Record | None]] = []
    for name in sorted(set(base) | set(new)):
        if name not in new:
            tasks.append(partial(_removal, name))
        elif name not in base:
            tasks.append(partial(_encode_whole, params, RecordKind.ADD, name, new[name]))
        elif base[name].dtype != new[name].dtype or base[name].shape != new[name].shape:
            tasks.append(partial(_encode_whole, params, RecordKind.REPLACE, name, new[name]))
        else:
            tasks.extend(_chunk_tasks(params, name, base[name], new[name]))

    records = [r for r in parallel_map(lambda task: task(), tasks, params.threads) if r is not None]
    header = PatchHeader(
        value_coding=params.value_coding,
        zstd_level=params.zstd_level,
        chunk_elements=params.chunk_elements,
        digest_algorithm=params.digest_algorithm,
        base_digest=base_digest.root,
        state_digest=new_digest.root,
        records=len(records),
        decoded_bytes=sum(r.raw_len for r in records),
        changed_elements=sum(r.changed for r in records),
        dense_bytes=sum(t.numel() * t.element_size() for t in new.values()),
    )
    end = encode_record_header(RecordHeader(RecordKind.END, "", None, count=len(records)))
    return b"".join([encode_header(header), *(r.data for r in records), end])


def _removal(name: str) -> _Record:
    return _Record(encode_record_header(RecordHeader(RecordKind.REMOVE, name, None)), 0, 0)


def _chunk_tasks(
    params: CodecParams, name: str, old_t: torch.Tensor, new_t: torch.Tensor
) -> list[Callable[[], _Record | None]]:
    if old_t.device != new_t.device:
        new_t = new_t.to(old_t.device)
    info = dtype_info(old_t.dtype)
    old, new = flat_bits(old_t), flat_bits(new_t)
    shape, step = tuple(old_t.shape), params.chunk_elements
    return [
        partial(_encode_chunk, params, name, info, shape, old[s : s + step], new[s : s + step], s)
        for s in range(0, old.numel(), step)
    ]
