"""Patch decoder: streaming record parser and bit-exact, bounds-checked apply (pure).

Decoding never trusts a size it has not checked: every record's declared sizes must agree with
each other, with the patch header's declared total and with the tensor being patched before
anything is allocated, and every position is bounds-checked before it is written.
"""

from __future__ import annotations

import threading
from collections.abc import MutableMapping
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import cast

import numpy as np
import torch
import zstandard

from pulsesync.codec import bits, fused
from pulsesync.codec.format import (
    PatchHeader,
    RecordHeader,
    RecordKind,
    ValueCoding,
    parse_header,
    parse_record_header,
    payload_hash,
)
from pulsesync.digest import DigestAlgorithm, StateDigest, TensorDigest, root_digest, state_digest, tensor_digest
from pulsesync.dtypes import NP_INT_OF_WIDTH, NP_UINT_OF_WIDTH, describe
from pulsesync.errors import CorruptPatchError, IntegrityError
from pulsesync.threads import parallel_map, submit_beside

_local = threading.local()


def _decompressor() -> zstandard.ZstdDecompressor:
    """A per-thread decompressor (zstandard decompressors are not thread-safe)."""
    decompressor: zstandard.ZstdDecompressor | None = getattr(_local, "decompressor", None)
    if decompressor is None:
        decompressor = _local.decompressor = zstandard.ZstdDecompressor()
    return decompressor


@dataclass
class UndoLog:
    """What applying a patch overwrote: enough to restore the state it was applied to.

    Lets a caller patch its only copy of a state in place (no full clone) and still get the old
    state back, bit for bit, if the result does not verify. Also says which positions changed.
    """

    # (name, start, length, chunk-relative positions or None for the whole chunk, old bits)
    chunks: list[tuple[str, int, int, torch.Tensor | None, torch.Tensor]] = field(default_factory=list)
    tensors: list[tuple[str, torch.Tensor | None]] = field(default_factory=list)  # old tensor (None: added)

    def rollback(self, state: MutableMapping[str, torch.Tensor]) -> None:
        """Restore `state` to what it was before the patch."""
        for name, start, length, index, old in reversed(self.chunks):
            chunk = state[name].view(-1).view(old.dtype).narrow(0, start, length)
            if index is None:
                chunk.copy_(old)
            else:
                chunk.index_copy_(0, index, old)
        for name, tensor in reversed(self.tensors):
            if tensor is None:
                state.pop(name, None)
            else:
                state[name] = tensor

    def changed(self) -> dict[str, torch.Tensor | None]:
        """Flat positions each changed tensor changed at (sorted), or None where the whole tensor changed."""
        out: dict[str, torch.Tensor | None] = {name: None for name, _ in self.tensors}
        pieces: dict[str, list[torch.Tensor]] = {}
        for name, start, _, index, _ in self.chunks:
            if index is None or name in out:
                out[name] = None
            else:
                pieces.setdefault(name, []).append(index + start)
        for name, parts in pieces.items():
            if name not in out:
                out[name] = torch.cat(parts)
        return out


@dataclass(frozen=True)
class PatchRecord:
    """One decoded record: chunk-relative positions and coded values, ready to apply."""

    header: RecordHeader
    positions: np.ndarray | None  # SPARSE only: int64 positions in [0, header.length)
    values: np.ndarray | None  # coded values (SPARSE/DENSE) or raw bits (ADD/REPLACE)
    # SPARSE delta records of 2-byte floats: the packed value codes and escapes, left for the
    # fused kernel (values is None; they are decoded here only for a target off the CPU).
    packed: tuple[np.ndarray, np.ndarray] | None = None

    @property
    def name(self) -> str:
        """Name of the tensor this record changes."""
        return self.header.name

    def apply(
        self, state: MutableMapping[str, torch.Tensor], device: torch.device | None = None, undo: UndoLog | None = None
    ) -> None:
        """Apply to `state` in place (a non-contiguous target is first replaced by a contiguous copy)."""
        h = self.header
        check_target(h, state)
        if undo is not None and (h.kind in (RecordKind.ADD, RecordKind.REPLACE, RecordKind.REMOVE)):
            undo.tensors.append((h.name, state.get(h.name)))
        if h.kind == RecordKind.REMOVE:
            del state[h.name]
        elif h.kind in (RecordKind.ADD, RecordKind.REPLACE):
            assert self.values is not None
            target = device or _state_device(state)
            if self.values.size == 0:  # views of empty buffers carry strides nothing can reinterpret
                state[h.name] = torch.empty(h.shape, dtype=h.info.torch_dtype, device=target)
            else:
                tensor = torch.from_numpy(self.values).view(h.info.torch_dtype).reshape(h.shape)
                state[h.name] = tensor.to(target)
        else:
            tensor = state[h.name]
            if not tensor.is_contiguous():
                if undo is not None:
                    undo.tensors.append((h.name, tensor))
                state[h.name] = tensor = tensor.contiguous()
            chunk = tensor.view(-1).view(h.info.int_dtype)[h.start : h.start + h.length]
            coded_values = self.values
            if self.packed is not None:
                assert self.positions is not None
                if chunk.device.type == "cpu" and fused.apply_delta_2byte is not None:
                    old = np.empty(self.positions.size, np.int16)
                    fused.apply_delta_2byte(chunk.detach().numpy(), self.positions, *self.packed, old)
                    if undo is not None:
                        index = torch.from_numpy(self.positions)
                        undo.chunks.append((h.name, h.start, h.length, index, torch.from_numpy(old)))
                    return
                coded_values = bits.unpack_small_deltas(self.packed[0], self.positions.size, self.packed[1], 1, h.name)
            assert coded_values is not None
            coded = torch.from_numpy(coded_values).to(chunk.device)
            if h.kind == RecordKind.DENSE:
                if undo is not None:
                    undo.chunks.append((h.name, h.start, h.length, None, chunk.clone()))
                bits.decode_values_(chunk, coded, h.info, h.coding)
            else:
                assert self.positions is not None
                index = torch.from_numpy(self.positions).to(chunk.device)
                values = chunk.index_select(0, index)
                if undo is not None:
                    undo.chunks.append((h.name, h.start, h.length, index, values.clone()))
                chunk.index_copy_(0, index, bits.decode_values_(values, coded, h.info, h.coding))


def _kept(base: StateDigest, state: MutableMapping[str, torch.Tensor], name: str) -> TensorDigest:
    """The digest of a tensor the patch did not touch: the base digest's entry (hashed if it has none)."""
    kept = base.tensors.get(name)
    return kept if kept is not None else tensor_digest(state[name], base.algorithm)


def _state_device(state: MutableMapping[str, torch.Tensor]) -> torch.device:
    for t in state.values():
        return t.device
    return torch.device("cpu")


def check_target(h: RecordHeader, state: MutableMapping[str, torch.Tensor]) -> None:
    """Raise CorruptPatchError unless the record fits `state` (done before any allocation)."""
    present = h.name in state
    if h.kind == RecordKind.ADD:
        if present:
            raise CorruptPatchError(f"record adds tensor {h.name!r}, which the state already has")
        return
    if not present:
        raise CorruptPatchError(f"record {h.kind.name} targets tensor {h.name!r}, which the state lacks")
    if h.kind in (RecordKind.SPARSE, RecordKind.DENSE):
        t = state[h.name]
        if t.dtype != h.info.torch_dtype or tuple(t.shape) != h.shape:
            raise CorruptPatchError(
                f"record for tensor {h.name!r} expects {h.info.name}{list(h.shape)}, the state has {describe(t)}"
            )


def decode_record(h: RecordHeader, payload: bytes | memoryview) -> PatchRecord:
    """Decompress and unpack one record's payload (sizes are exact or CorruptPatchError)."""
    if h.raw_len == 0:  # END/REMOVE, or an added/replaced empty tensor
        empty = np.empty(0, NP_INT_OF_WIDTH[h.info.width]) if h.kind in (RecordKind.ADD, RecordKind.REPLACE) else None
        return PatchRecord(h, None, empty)
    where = f"record for tensor {h.name!r} at element {h.start}"
    try:
        declared = zstandard.frame_content_size(payload)
        if declared != h.raw_len:
            raise CorruptPatchError(f"{where}: zstd frame declares {declared} bytes, record {h.raw_len}")
        raw = _decompressor().decompress(payload, max_output_size=h.raw_len)
    except zstandard.ZstdError as e:
        raise CorruptPatchError(f"{where}: payload does not decompress ({e})") from None
    if len(raw) != h.raw_len:
        raise CorruptPatchError(f"{where}: payload decompressed to {len(raw)} bytes, expected {h.raw_len}")
    buf = np.frombuffer(raw, np.uint8)
    if h.kind != RecordKind.SPARSE:
        return PatchRecord(h, None, _decode_value_stream(buf, h, h.length, 0, where))
    n, gaps_end = h.count, 2 * h.count
    escapes_end = gaps_end + 8 * h.escapes
    positions = bits.decode_positions(buf[:gaps_end], n, buf[gaps_end:escapes_end].view("<u8"), h.length, where)
    values = buf[escapes_end:]
    if fused.enabled and h.coding == ValueCoding.DELTA and h.info.is_float and h.info.width == 2:
        packed_len = (n + 3) // 4
        escaped = bits.from_planes(values[packed_len:], h.value_escapes, np.uint16)
        bits.check_escape_count(values[:packed_len], n, escaped.size, where)
        return PatchRecord(h, positions, None, (values[:packed_len], escaped))
    return PatchRecord(h, positions, _decode_value_stream(values, h, n, 1, where))


def _decode_value_stream(buf: np.ndarray, h: RecordHeader, n: int, offset: int, where: str) -> np.ndarray:
    """n coded values (signed ints of the dtype's width) from byte planes or packed codes."""
    np_int = NP_INT_OF_WIDTH[h.info.width]
    if not h.coding.packed:
        return bits.from_planes(buf, n, np_int)
    packed_len = (n + 3) // 4
    escaped = bits.from_planes(buf[packed_len:], h.value_escapes, NP_UINT_OF_WIDTH[h.info.width])
    if h.coding == ValueCoding.DELTA:
        return bits.unpack_small_deltas(buf[:packed_len], n, escaped, offset, where)
    return bits.unpack_small(buf[:packed_len], n, escaped, offset, where).view(np_int)


class PatchDecoder:
    """Incremental patch parser: feed bytes as they arrive, get records as they complete.

    Validates framing (magic, version, checksums, declared sizes, record order) as it goes;
    `finish()` raises if the patch ended early. Memory held: at most one record's bytes.
    """

    def __init__(self, max_decoded_bytes: int | None = None) -> None:
        self.header: PatchHeader | None = None
        self._max_decoded = max_decoded_bytes
        self._buf = bytearray()
        self._records = 0
        self._decoded = 0
        self._last: tuple[str, int] | None = None  # (name, end) of the previous record
        self._whole: str | None = None  # name of the previous whole-tensor record
        self.done = False

    def feed(self, data: bytes | memoryview) -> list[PatchRecord]:
        """Consume bytes; return the records they complete, decoded."""
        return [decode_record(h, p) for h, p in self.split(data)]

    def split(self, data: bytes | memoryview) -> list[tuple[RecordHeader, memoryview]]:
        """Consume bytes; return the records they complete as (header, compressed payload)."""
        if self.done and len(data):
            raise CorruptPatchError("patch has trailing bytes after its end record")
        self._buf += data
        out: list[tuple[RecordHeader, memoryview]] = []
        view = memoryview(self._buf)
        offset = 0
        try:
            if self.header is None:
                parsed = parse_header(view)
                if parsed is None:
                    return out
                self.header, offset = parsed
                if self._max_decoded is not None and self.header.decoded_bytes > self._max_decoded:
                    raise CorruptPatchError(
                        f"patch declares {self.header.decoded_bytes} decoded bytes, above the limit {self._max_decoded}"
                    )
            while not self.done:
                parsed_record = parse_record_header(view, offset)
                if parsed_record is None:
                    break
                h, payload_start = parsed_record
                if len(view) < payload_start + h.comp_len:
                    break
                self._admit(h)
                if h.kind != RecordKind.END:
                    payload = bytes(view[payload_start : payload_start + h.comp_len])
                    if payload_hash(payload) != h.payload_hash:
                        raise CorruptPatchError(f"record for tensor {h.name!r}: payload hash mismatch (corrupted)")
                    out.append((h, memoryview(payload)))
                offset = payload_start + h.comp_len
            if self.done and offset != len(view):
                raise CorruptPatchError("patch has trailing bytes after its end record")
        finally:
            view.release()
        del self._buf[:offset]
        return out

    def _admit(self, h: RecordHeader) -> None:
        """Check a record against the header's totals and the records before it."""
        assert self.header is not None
        if h.kind == RecordKind.END:
            if h.count != self._records or self._records != self.header.records:
                raise CorruptPatchError(
                    f"patch end record counts {h.count} records, header {self.header.records}, found {self._records}"
                )
            self.done = True
            return
        self._records += 1
        self._decoded += h.raw_len
        if self._records > self.header.records or self._decoded > self.header.decoded_bytes:
            raise CorruptPatchError(
                f"record for tensor {h.name!r} exceeds the patch's declared "
                f"{self.header.records} records / {self.header.decoded_bytes} decoded bytes"
            )
        # Names ascend; chunks of one tensor ascend without overlap; whole-tensor records stand alone.
        whole = h.kind in (RecordKind.ADD, RecordKind.REPLACE, RecordKind.REMOVE)
        if self._last is not None:
            last_name, last_end = self._last
            if h.name < last_name or (h.name == last_name and (whole or self._whole == h.name or h.start < last_end)):
                raise CorruptPatchError(f"record for tensor {h.name!r} is out of order or overlaps the previous one")
        self._last = (h.name, h.start + h.length)
        self._whole = h.name if whole else None

    def finish(self) -> PatchHeader:
        """Assert the whole patch was seen; returns its header."""
        if not self.done or self.header is None:
            got = "no header" if self.header is None else f"{self._records} of {self.header.records} records"
            raise CorruptPatchError(f"patch is truncated: ended after {got} without its end record")
        return self.header


def read_header(patch: bytes | memoryview) -> PatchHeader:
    """The header of a patch (codec parameters, digests, declared sizes) without decoding it."""
    parsed = parse_header(patch)
    if parsed is None:
        raise CorruptPatchError(f"patch is truncated: {len(patch)} bytes is shorter than its header")
    return parsed[0]


def apply_patch(
    state: MutableMapping[str, torch.Tensor],
    patch: bytes | memoryview,
    *,
    base_digest: StateDigest | None = None,
    verify: bool = True,
    threads: int | None = 1,
    max_decoded_bytes: int | None = None,
    undo: UndoLog | None = None,
) -> StateDigest | None:
    """Apply a patch to `state` in place; bit-exact. Returns the new state's digest if verified.

    `base_digest` is the digest of `state` if already known (else it is computed); it must equal
    the patch's base digest. With `verify`, the result's digest must equal the patch's state digest:
    each tensor is re-hashed on another core as soon as its last record is applied (overlapping
    the decode of the next ones), and tensors the patch does not touch keep their base digest.
    On any error `state` may be partially patched: pass an `undo` log and roll it back, or apply
    to a working copy and discard it. Records decode on one thread by default: their many small
    array operations contend for the GIL, so more threads were slower on every machine measured
    (docs/benchmarks.md).
    """
    parser = PatchDecoder(max_decoded_bytes)
    raw_records = parser.split(patch)
    header = parser.finish()
    algorithm = cast(DigestAlgorithm, header.digest_algorithm)
    current = base_digest or state_digest(state, algorithm, threads)
    if current.root != header.base_digest:
        raise IntegrityError(
            f"patch was made against state digest {header.base_digest}, "
            f"but the state to patch has {current.algorithm} digest {current.root}"
        )
    for h, _ in raw_records:
        check_target(h, state)
        tensor = state[h.name] if h.kind in (RecordKind.SPARSE, RecordKind.DENSE) else None
        if tensor is not None and not tensor.is_contiguous():
            if undo is not None:
                undo.tensors.append((h.name, tensor))
            state[h.name] = tensor.contiguous()

    def decode_and_apply(item: tuple[RecordHeader, memoryview]) -> PatchRecord | None:
        record = decode_record(*item)
        if item[0].kind in (RecordKind.SPARSE, RecordKind.DENSE):
            record.apply(state, undo=undo)  # disjoint chunks: safe to write concurrently
            return None
        return record

    rehashed: dict[str, Future[TensorDigest]] = {}

    def rehash(name: str) -> None:
        if verify and name in state:
            rehashed[name] = submit_beside(tensor_digest, state[name], algorithm)

    device = _state_device(state)
    whole: list[PatchRecord] = []
    previous: str | None = None
    # In order: once a record of the next tensor has been applied, the previous tensor is final.
    for (h, _), record in zip(raw_records, parallel_map(decode_and_apply, raw_records, threads), strict=True):
        if previous is not None and h.name != previous:
            rehash(previous)
        previous = None if record is not None else h.name
        if record is not None:
            whole.append(record)
    if previous is not None:
        rehash(previous)
    for record in whole:  # whole-tensor records change the dict itself: after the concurrent part
        record.apply(state, device, undo)
        rehash(record.name)
    if not verify:
        return None
    tensors = {n: rehashed[n].result() if n in rehashed else _kept(current, state, n) for n in sorted(state)}
    result = StateDigest(algorithm=algorithm, root=root_digest(tensors, algorithm), tensors=tensors)
    if result.root != header.state_digest:
        raise IntegrityError(f"patched state has digest {result.root}, the patch promises {header.state_digest}")
    return result
