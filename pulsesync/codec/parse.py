"""Patch parsing (pure): the streaming record parser and record decoding, every declared size checked.

Decoding never trusts a size it has not checked: every record's declared sizes must agree with
each other and with the patch header's declared total before anything is allocated. Applying
the decoded records is codec.apply's job.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import xxhash
import zstandard

from pulsesync.codec import batch, jit
from pulsesync.codec.codings import history as history_coding
from pulsesync.codec.codings.class_masks import CLASSES
from pulsesync.codec.codings.gap_codes import decode_gap_codes
from pulsesync.codec.codings.gaps16 import decode_positions
from pulsesync.codec.codings.small_codes import check_escape_count, unpack_small, unpack_small_deltas
from pulsesync.codec.codings.value_codes import decode_value_codes
from pulsesync.codec.codings.values import from_planes, unzigzag
from pulsesync.codec.format import (
    CODES,
    FORMAT_VERSION,
    INDEXED,
    V2_CODINGS,
    PatchHeader,
    PositionCoding,
    RecordHeader,
    RecordKind,
    ValueCoding,
    parse_header,
    parse_index,
    parse_record_header,
    payload_hash,
    positions_len,
)
from pulsesync.dtypes import NP_INT_OF_WIDTH, NP_UINT_OF_WIDTH
from pulsesync.errors import CorruptPatchError

if TYPE_CHECKING:
    from pulsesync.codec.history import ChunkHistory

_local = threading.local()


def _decompressor() -> zstandard.ZstdDecompressor:
    """A per-thread decompressor (zstandard decompressors are not thread-safe)."""
    decompressor: zstandard.ZstdDecompressor | None = getattr(_local, "decompressor", None)
    if decompressor is None:
        decompressor = _local.decompressor = zstandard.ZstdDecompressor()
    return decompressor


@dataclass(frozen=True)
class PatchRecord:
    """One decoded record: chunk-relative positions and coded values, ready to apply."""

    header: RecordHeader
    positions: np.ndarray | None  # SPARSE only: int64 positions in [0, header.length)
    values: np.ndarray | None  # coded values (SPARSE/DENSE) or raw bits (ADD/REPLACE)
    # SPARSE delta records of 2-byte floats: the packed value codes and escapes, left for the
    # compiled kernel (values is None; they are decoded here only for a target off the CPU).
    packed: tuple[np.ndarray, np.ndarray] | None = None
    # HISTORY records: each position's delta in the reference patch (0 where it is new), added to
    # the decoded residuals once they are back in position order.
    ref_deltas: np.ndarray | None = None
    # Format-2 PLANES/EXP_PLANES records of 2-byte floats: the zigzag byte planes, left for the
    # compiled kernel (values is None, as for `packed`).
    planes: np.ndarray | None = None
    # CLASS_MASKS records: the class table and bitmap (positions is None until codec.apply decodes
    # them against the chunk's old values).
    class_masks: tuple[np.ndarray, np.ndarray] | None = None

    @property
    def name(self) -> str:
        """Name of the tensor this record changes."""
        return self.header.name


def decode_record(
    h: RecordHeader, payload: bytes | memoryview, version: int = FORMAT_VERSION, reference: ChunkHistory | None = None
) -> PatchRecord:
    """Decompress and unpack one record's payload (sizes are exact or CorruptPatchError).

    A HISTORY record needs `reference`: the same chunk's changes in the patch it was coded against.
    """
    if h.raw_len == 0:  # END/REMOVE, or an added/replaced empty tensor
        empty = np.empty(0, NP_INT_OF_WIDTH[h.info.width]) if h.kind in (RecordKind.ADD, RecordKind.REPLACE) else None
        return PatchRecord(h, None, empty)
    where = record_where(h)
    buf = np.frombuffer(decompress_payload(h, payload), np.uint8)
    if h.kind == RecordKind.HISTORY:
        return _decode_history(buf, h, reference, where)
    if h.kind != RecordKind.SPARSE:
        return PatchRecord(h, None, _decode_value_stream(buf, h, h.length, 0, where))
    n = h.count
    masks = None
    if h.positions == PositionCoding.CLASS_MASKS:
        positions, masks = None, (buf[:CLASSES], buf[CLASSES : CLASSES + h.escapes])
    else:
        positions = _decode_positions(buf, h, n, where)
    values = buf[positions_len(h, n) :]
    if _fused_planes(h):
        return PatchRecord(h, positions, None, planes=values, class_masks=masks)
    if jit.enabled and h.coding == ValueCoding.DELTA and h.info.is_float and h.info.width == 2:
        packed_len = (n + 3) // 4
        escaped = from_planes(values[packed_len:], h.value_escapes, np.uint16)
        check_escape_count(values[:packed_len], n, escaped.size, where)
        return PatchRecord(h, positions, None, (values[:packed_len], escaped), class_masks=masks)
    return PatchRecord(h, positions, _decode_value_stream(values, h, n, 1, where), class_masks=masks)


def record_where(h: RecordHeader) -> str:
    """How errors name a record."""
    return f"record for tensor {h.name!r} at element {h.start}"


def decompress_payload(h: RecordHeader, payload: bytes | memoryview) -> bytes:
    """A record's payload decompressed: exactly the raw_len bytes its header declares, or CorruptPatchError."""
    return _decompress_exact(payload, h.raw_len, f"{record_where(h)}: payload")


def _decompress_exact(frame: bytes | memoryview, size: int, what: str) -> bytes:
    """One zstd frame decompressed to exactly `size` bytes, its declared size checked before anything is allocated."""
    try:
        declared = zstandard.frame_content_size(frame)
        if declared != size:
            raise CorruptPatchError(f"{what}: zstd frame declares {declared} bytes, expected {size}")
        raw = _decompressor().decompress(frame, max_output_size=size)
    except zstandard.ZstdError as e:
        raise CorruptPatchError(f"{what} does not decompress ({e})") from None
    if len(raw) != size:
        raise CorruptPatchError(f"{what} decompressed to {len(raw)} bytes, expected {size}")
    return raw


def _decode_history(buf: np.ndarray, h: RecordHeader, reference: ChunkHistory | None, where: str) -> PatchRecord:
    """Positions (the reference's that changed again, merged with new ones) and residual values of a HISTORY record."""
    if reference is None or reference.positions.size != h.ref_count:
        held = "none" if reference is None else f"{reference.positions.size} positions"
        raise CorruptPatchError(f"{where}: coded against {h.ref_count} reference positions, the reference holds {held}")
    bitmap_len = (h.ref_count + 7) // 8
    again = np.unpackbits(buf[:bitmap_len], count=bitmap_len * 8, bitorder="little").view(bool)
    if again[h.ref_count :].any() or int(np.count_nonzero(again)) != h.count - h.new_count:
        raise CorruptPatchError(f"{where}: {history_coding.BITMAP_MISMATCH.format(marked=h.count - h.new_count)}")
    again = again[: h.ref_count]
    fresh = _decode_positions(buf[bitmap_len:], h, h.new_count, where)
    values = buf[bitmap_len + positions_len(h, h.new_count) :]
    if reference.deltas.dtype != NP_INT_OF_WIDTH[h.info.width]:
        raise CorruptPatchError(f"{where}: the reference chunk holds {reference.deltas.dtype} deltas for {h.info.name}")
    if jit.enabled and history_coding.merge_history_kernel is not None:
        positions, ref_deltas = np.empty(h.count, np.int64), np.empty(h.count, reference.deltas.dtype)
        merged = history_coding.merge_history_kernel(
            reference.positions, reference.deltas, again, fresh, positions, ref_deltas
        )
    else:
        positions = np.concatenate([reference.positions[again], fresh])
        order = np.argsort(positions, kind="stable")
        positions = positions[order]
        merged = positions.size < 2 or bool((positions[1:] > positions[:-1]).all())
        ref_deltas = np.concatenate([reference.deltas[again], np.zeros(h.new_count, reference.deltas.dtype)])[order]
    if not merged:
        raise CorruptPatchError(f"{where}: {history_coding.REPEATS}")
    if _fused_planes(h):
        return PatchRecord(h, positions, None, ref_deltas=ref_deltas, planes=values)
    return PatchRecord(h, positions, _decode_value_stream(values, h, h.count, 0, where), ref_deltas=ref_deltas)


def _fused_planes(h: RecordHeader) -> bool:
    """Whether batch.apply_planes_2byte applies this record's byte planes (format-2 values of a 2-byte float)."""
    kernel = jit.enabled and batch.apply_planes_2byte is not None
    return kernel and h.coding in _PLANE_CODINGS and h.info.is_float and h.info.width == 2


_PLANE_CODINGS = (ValueCoding.PLANES, ValueCoding.EXP_PLANES)


def _decode_positions(buf: np.ndarray, h: RecordHeader, n: int, where: str) -> np.ndarray:
    """The first n positions coded at the start of buf, in the record's position coding (each checked < length)."""
    if h.positions == PositionCoding.GAP_CODES:
        return decode_gap_codes(buf[:n], n, buf[n : n + h.escapes], h.length, where)
    return decode_positions(buf[: 2 * n], n, buf[2 * n : 2 * n + 8 * h.escapes].view("<u8"), h.length, where)


def decode_planes(planes: np.ndarray, h: RecordHeader) -> np.ndarray:
    """Signed deltas (in stored order) from a PLANES/EXP_PLANES record's byte planes."""
    width = h.info.width
    return unzigzag(from_planes(planes, h.count, NP_UINT_OF_WIDTH[width]), NP_INT_OF_WIDTH[width])


def _decode_value_stream(buf: np.ndarray, h: RecordHeader, n: int, offset: int, where: str) -> np.ndarray:
    """n coded values (signed ints of the dtype's width) from byte planes or packed codes.

    PLANES and EXP_PLANES values come back as signed deltas (unzigzagged), EXP_CODES and
    PREDICTED_CODES values as they are stored (folded by the old values' signs), in stored order.
    """
    if h.coding in CODES:
        return decode_value_codes(buf[:n], buf[n : n + h.value_escapes], where)
    if h.coding in V2_CODINGS:  # SPARSE and HISTORY records only: n is h.count
        return decode_planes(buf, h)
    np_int = NP_INT_OF_WIDTH[h.info.width]
    if not h.coding.packed:
        return from_planes(buf, n, np_int)
    packed_len = (n + 3) // 4
    escaped = from_planes(buf[packed_len:], h.value_escapes, NP_UINT_OF_WIDTH[h.info.width])
    if h.coding == ValueCoding.DELTA:
        return unpack_small_deltas(buf[:packed_len], n, escaped, offset, where)
    return unpack_small(buf[:packed_len], n, escaped, offset, where).view(np_int)


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
        self.version = FORMAT_VERSION  # of the patch being parsed, once its header is in
        self.done = False
        self._parsed_to = 0  # (_complete_records)
        self._index: list[RecordHeader] | None = None  # version 4: every record's header, once the index is in

    def feed(self, data: bytes | memoryview) -> list[PatchRecord]:
        """Consume bytes; return the records they complete, decoded."""
        return [decode_record(h, p, self.version) for h, p in self.split(data)]

    def split(self, data: bytes | memoryview) -> list[tuple[RecordHeader, memoryview]]:
        """Consume bytes; return the records they complete as (header, compressed payload)."""
        if self.done and len(data):
            raise CorruptPatchError("patch has trailing bytes after its end record")
        # With nothing buffered, records are parsed in `data` itself and their payloads are views
        # of it (no copy of the patch, nor of each payload); only an incomplete tail is kept.
        whole = not self._buf
        if not whole:
            self._buf += data
        out: list[tuple[RecordHeader, memoryview]] = []
        view = memoryview(data).cast("B") if whole else memoryview(self._buf)
        offset = 0
        try:
            if self.header is None:
                start = self._parse_header(view)
                if start is None:
                    if whole:
                        self._buf += view
                    return out
                offset = start
            out = list(self._complete_records(view, offset, whole))
            offset = self._parsed_to
        finally:
            if not whole:
                view.release()
        if whole:
            self._buf += view[offset:]
        else:
            del self._buf[:offset]
        return out

    def records(self, patch: bytes | memoryview) -> Iterator[tuple[RecordHeader, memoryview]]:
        """A whole patch's records, parsed as they are taken (its header now): split and finish in one pass.

        A caller can apply the first records while the next are parsed; a record that fails a check
        raises only when it is reached, so what its caller applied before it is not undone here.
        """
        if self.header is not None or self._buf:
            raise ValueError("records() parses a whole patch with a fresh decoder")
        view = memoryview(patch).cast("B")
        start = self._parse_header(view)
        if start is None:
            self.finish()  # truncated: raises
        return self._each_record(view, start or 0)

    def _each_record(self, view: memoryview, offset: int) -> Iterator[tuple[RecordHeader, memoryview]]:
        yield from self._complete_records(view, offset, True)
        self.finish()

    def _complete_records(
        self, view: memoryview, offset: int, whole: bool
    ) -> Iterator[tuple[RecordHeader, memoryview]]:
        """The complete records in view from offset, checked, up to the end record; then _parsed_to is where
        the bytes not parsed start."""
        if self._index is None and self.version >= INDEXED and not self.done:
            assert self.header is not None and self.header.index_bytes is not None
            end = offset + self.header.index_bytes
            if len(view) < end:
                self._parsed_to = offset
                return
            self._index = self._read_index(view[offset:end])
            offset = end
        while not self.done:
            parsed = self._next_record(view, offset, whole)
            if parsed is None:
                break
            h, payload, offset = parsed
            if payload is not None:
                yield h, payload
        if self.done and offset != len(view):
            raise CorruptPatchError("patch has trailing bytes after its end record")
        self._parsed_to = offset

    def _parse_header(self, view: memoryview) -> int | None:
        """Parse the patch header at the start of view; where its records start (None: more bytes needed)."""
        parsed = parse_header(view)
        if parsed is None:
            return None
        self.header, offset, self.version = parsed
        decoded = self.header.decoded_bytes + (self.header.index_raw_bytes or 0)
        if self._max_decoded is not None and decoded > self._max_decoded:
            raise CorruptPatchError(f"patch declares {decoded} decoded bytes, above the limit {self._max_decoded}")
        return offset

    def _read_index(self, index: memoryview) -> list[RecordHeader]:
        """A version 4 patch's record headers, from its index (checked against the patch header)."""
        header = self.header
        assert header is not None and header.index_raw_bytes is not None
        if xxhash.xxh3_64_intdigest(index) != header.index_hash:
            raise CorruptPatchError("patch record index checksum mismatch (corrupted index)")
        return parse_index(_decompress_exact(index, header.index_raw_bytes, "patch record index"), header.records)

    def _next_header(self, view: memoryview, offset: int) -> tuple[RecordHeader, int] | None:
        """The next record's header and where its payload starts (None: more bytes needed); after a version 4
        patch's last record, an end record."""
        if self._index is None:
            return parse_record_header(view, offset, self.version)
        if self._records < len(self._index):
            return self._index[self._records], offset
        return RecordHeader(RecordKind.END, "", None, count=len(self._index)), offset

    def _next_record(
        self, view: memoryview, offset: int, whole: bool
    ) -> tuple[RecordHeader, memoryview | None, int] | None:
        """The checked record at offset, its payload (None: the end record), where the next starts; None: incomplete."""
        parsed = self._next_header(view, offset)
        if parsed is None:
            return None
        h, payload_start = parsed
        end = payload_start + h.comp_len
        if len(view) < end:
            return None
        self._admit(h)
        if h.kind == RecordKind.END:
            return h, None, end
        payload = view[payload_start:end]
        if not whole:  # the buffer is trimmed: the payload needs its own bytes
            payload = memoryview(bytes(payload))
        if payload_hash(payload) != h.payload_hash:
            raise CorruptPatchError(f"record for tensor {h.name!r}: payload hash mismatch (corrupted)")
        return h, payload, end

    def _admit(self, h: RecordHeader) -> None:
        """Check a record against the header's totals and the records before it."""
        assert self.header is not None
        if h.kind == RecordKind.HISTORY and self.header.reference_sha256 is None and not self.header.reference_parts:
            raise CorruptPatchError(f"record for tensor {h.name!r} is history-coded, the patch names no reference")
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
