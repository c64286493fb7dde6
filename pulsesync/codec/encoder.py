"""Patch encoder: bitwise diff of two states -> self-describing, checksummed patch bytes (pure)."""

from __future__ import annotations

import hashlib
import itertools
import threading
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from functools import cached_property, partial
from typing import Any

import numpy as np
import torch
import zstandard

from pulsesync import mixsum
from pulsesync.codec.codings.class_masks import CLASSES, class_masks_bits, encode_class_masks, magnitude_class
from pulsesync.codec.codings.gap_codes import encode_gap_codes
from pulsesync.codec.codings.gaps16 import encode_positions
from pulsesync.codec.codings.history import match_reference, predicted_offsets
from pulsesync.codec.codings.small_codes import pack_small
from pulsesync.codec.codings.value_codes import encode_value_codes
from pulsesync.codec.codings.values import encode_values, entropy_bytes, host, plane_list, wrapping_sub, zigzag
from pulsesync.codec.diff import changed_elements
from pulsesync.codec.format import (
    INDEXED,
    REFERENCE_PARTS,
    PatchHeader,
    PositionCoding,
    RecordHeader,
    RecordKind,
    ValueCoding,
    assemble,
    payload_hash,
    raw_len_for,
)
from pulsesync.codec.history import ChunkHistory, ChunkKey, PatchHistory
from pulsesync.codec.params import CodecParams
from pulsesync.codec.streams import MatchedStreams, SparseStreams, sparse_streams
from pulsesync.digest import INCREMENTAL, StateDigest, lane_change, state_digest, update_digest
from pulsesync.dtypes import DTypeInfo, State, dense_bytes, dtype_info, flat_bits
from pulsesync.errors import ConfigError
from pulsesync.sharding.layout import Piece
from pulsesync.threads import parallel_map

_local = threading.local()


def _compressor(params: CodecParams) -> zstandard.ZstdCompressor:
    """A per-thread compressor (zstandard compressors are not thread-safe).

    Frames carry a content checksum up to format 3; from format 4 on the record's payload hash,
    checked before decompressing, is the only one (the checksum cost 4 bytes a record).
    """
    key = (params.zstd_level, _checksummed(params))
    cached = getattr(_local, "compressor", None)
    if cached is None or cached[0] != key:
        compressor = zstandard.ZstdCompressor(level=key[0], write_checksum=key[1], write_content_size=True)
        cached = _local.compressor = (key, compressor)
    return cached[1]


def _checksummed(params: CodecParams) -> bool:
    return params.format_version < INDEXED


@dataclass(frozen=True)
class _Record:
    head: RecordHeader
    payload: bytes
    changed: int
    raw_len: int
    history: tuple[ChunkKey, ChunkHistory] | None = None
    coding: str = ""  # "KIND/CODING", for the manifest's summary
    wire: Counter[str] = field(default_factory=Counter)  # bytes of `payload` by role, framing aside (EncodedPatch.wire)
    digest_change: tuple[str, tuple[int, int]] | None = None  # (tensor, how its mixsum lanes moved)


@dataclass(frozen=True)
class EncodedPatch:
    """A patch and what it changed (the reference the next patch may be history-coded against)."""

    data: bytes
    history: PatchHistory
    codings: dict[str, int]  # records per "KIND/VALUES[/POSITIONS]" (e.g. "HISTORY/EXP_PLANES/GAP_CODES")
    digest: StateDigest  # of the new state
    # bytes of `data` by role, summing to len(data): "positions" (gaps, history bitmaps), "values",
    # "framing" (headers, zstd frame overhead); exact, counted as each part's blocks are written
    wire: dict[str, int]


def _compress(params: CodecParams, parts: list[bytes]) -> tuple[bytes, list[int]]:
    """One zstd frame of the parts, each ending a block, and the bytes each part's blocks take in it
    (the frame's header and end are neither part's).

    A block's Huffman tables then fit one part (a byte plane, the gap codes) instead of a mix
    (measured 3% smaller on real-like patches).
    """
    raw_len = sum(map(len, parts))
    if not raw_len:
        return b"", [0] * len(parts)
    stream = _compressor(params).compressobj(size=raw_len)
    out: list[bytes] = []
    sizes: list[int] = []
    for part in parts:
        if part:
            out += (stream.compress(part), stream.flush(zstandard.COMPRESSOBJ_FLUSH_BLOCK))
            sizes.append(len(out[-2]) + len(out[-1]))
        else:
            sizes.append(0)
    out.append(stream.flush())
    frame = b"".join(out)
    first = next(i for i, size in enumerate(sizes) if size)  # its blocks came out behind the frame header
    sizes[first] -= zstandard.frame_header_size(frame)
    return frame, sizes


@dataclass
class _Section:
    """One candidate coding of part of a record's payload: its header fields and parts."""

    params: CodecParams
    role: str  # "positions" or "values": what EncodedPatch.wire counts its bytes as
    fields: dict[str, Any]
    parts: list[bytes]

    measured: int | None = None  # its size, once measured (_measure)

    @property
    def size(self) -> int:
        """About the bytes it adds to a record, compressed (_measure)."""
        if self.measured is None:
            _measure(self.params, [self])
        assert self.measured is not None
        return self.measured


def _measure(params: CodecParams, sections: list[_Section]) -> None:
    """Measure the sections not yet measured: every part compressed in one call, each as a frame of its own.

    A section's size is its parts' frames less their headers and checksums (about the blocks
    each part takes in a record's frame, where parts end blocks of their own), plus one frame's.
    One call a record instead of a frame a section, each of whose compress and flush calls let
    the GIL go: on two threads those hand-overs made encoding slower than on one (docs/benchmarks.md).
    """
    todo = [section for section in sections if section.measured is None]
    parts: list[bytes | bytearray | memoryview] = [part for section in todo for part in section.parts if part]
    frames = iter(_compressor(params).multi_compress_to_buffer(parts) if parts else [])
    trailer = 4 if _checksummed(params) else 0  # a zstd frame's checksum
    for section in todo:
        own = [next(frames).tobytes() for part in section.parts if part]
        headers = [zstandard.frame_header_size(frame) for frame in own]
        blocks = sum(len(frame) - header - trailer for frame, header in zip(own, headers, strict=True))
        section.measured = blocks + headers[0] + trailer if own else 0


def _section(params: CodecParams, role: str, parts: list[bytes], **fields: Any) -> _Section:
    return _Section(params, role, fields, parts)


def _smallest(sections: list[_Section]) -> _Section:
    _measure(sections[0].params, sections)
    return min(sections, key=lambda section: section.size)


def _record(
    params: CodecParams,
    sections: list[_Section],
    history: tuple[ChunkKey, ChunkHistory] | None = None,
    digest_change: tuple[str, tuple[int, int]] | None = None,
    **fields: Any,
) -> _Record:
    """Compress a record's sections and prepend its header: `fields` and the sections' fields, its sizes
    and payload hash filled in."""
    parts = [part for section in sections for part in section.parts]
    for section in sections:
        fields |= section.fields
    payload, part_sizes = _compress(params, parts)
    raw_len = sum(map(len, parts))
    head = RecordHeader(**fields, raw_len=raw_len, comp_len=len(payload), payload_hash=payload_hash(payload))
    assert raw_len == raw_len_for(head)
    coding = f"{head.kind.name}/{head.coding.name}"
    if params.format_version >= 2 and head.kind in (RecordKind.SPARSE, RecordKind.HISTORY):
        coding += f"/{head.positions.name}"
    wire: Counter[str] = Counter()
    sizes = iter(part_sizes)
    for section in sections:
        wire[section.role] += sum(next(sizes) for _ in section.parts)
    return _Record(head, payload, head.count, raw_len, history, coding, wire, digest_change)


def _chunk_fields(chunk: _Chunk, kind: RecordKind, length: int, count: int) -> dict[str, Any]:
    """A chunk record's header fields that say which elements it covers."""
    return {
        "kind": kind,
        "name": chunk.name,
        "dtype": chunk.info,
        "shape": chunk.shape,
        "start": chunk.start,
        "length": length,
        "count": count,
    }


def _changed_elements(old: torch.Tensor, new: torch.Tensor) -> tuple[np.ndarray, torch.Tensor, torch.Tensor]:
    """Sorted positions where two flat integer tensors differ bitwise (host int64), and their elements there."""
    if old.device.type != "cpu":
        index = torch.nonzero(old != new).view(-1)
        return index.cpu().numpy(), old.index_select(0, index), new.index_select(0, index)
    positions, old_values, new_values = changed_elements(old.numpy(), new.numpy())  # ~2-4x torch's on CPU
    return positions, torch.from_numpy(old_values), torch.from_numpy(new_values)


@dataclass(frozen=True)
class _Chunk:
    name: str
    info: DTypeInfo
    shape: tuple[int, ...]
    start: int
    old: torch.Tensor
    new: torch.Tensor

    @property
    def key(self) -> ChunkKey:
        return (self.name, self.start, self.old.numel())


def _encode_chunk(
    params: CodecParams, chunk: _Chunk, reference: ChunkHistory | None, by_classes: bool = False
) -> _Record | None:
    """SPARSE, HISTORY or DENSE record for one chunk of flat bits, or None when it is unchanged.

    Format 2 picks the smallest position coding and (adaptive) value coding, each candidate
    measured compressed (_measure: parts compress in blocks of their own, so the sizes add up),
    and compresses the winners as the record's frame.
    """
    old, new, info = chunk.old, chunk.new, chunk.info
    positions, old_values, new_values = _changed_elements(old, new)
    count, length = positions.size, old.numel()
    if count == 0:
        return None
    if count * (2 + info.width) >= length * info.width:
        return _encode_dense(params, chunk, count)
    return _sparse_record(params, chunk, length, positions, old_values, new_values, reference, by_classes)


CLASS_MASKS_SAMPLE = (8, 2048)  # _class_masks estimates the bitmap from 8 runs of 2,048 elements of the chunk
CLASS_MASKS_GAIN = 1.5  # and codes it only if it would be this much smaller than the gaps' ~8 bits a change


def _class_masks(params: CodecParams, chunk: _Chunk, positions: np.ndarray, classes: np.ndarray) -> _Section | None:
    """CLASS_MASKS positions of a chunk of 2-byte floats (`classes`: the changed elements' magnitude classes),
    where a sample says they pay.

    Their decoder scans the chunk's old values (O(chunk), not O(changes)): worth it only where
    the changed elements are nearly whole magnitude classes, as in the first patch after an
    anchor of a bf16 fine-tune (docs/benchmarks.md).
    """
    info = chunk.info
    if params.format_version < 3 or not (info.is_float and info.width == 2):
        return None
    old = host(chunk.old)
    if class_masks_bits(old, classes, *CLASS_MASKS_SAMPLE) * CLASS_MASKS_GAIN > 8 * positions.size:
        return None
    table, bitmap = encode_class_masks(old, positions)
    masks = [table.tobytes(), bitmap]
    return _section(params, "positions", masks, escapes=len(bitmap), positions=PositionCoding.CLASS_MASKS)


class _Changes:
    """What a sparse record codes of a chunk's changed elements, each part computed once, when first used.

    A record of 2-byte floats under format 3 or later gets them all from one compiled call where numba is
    installed (sparse_streams: the same bytes as the calls below, in one hand-over of the GIL).
    """

    def __init__(
        self,
        params: CodecParams,
        info: DTypeInfo,
        positions: np.ndarray,
        old_values: torch.Tensor,
        new_values: torch.Tensor,
        reference: ChunkHistory | None,
    ) -> None:
        self.info, self.positions, self.old_values, self.new_values = info, positions, old_values, new_values
        self.old = host(old_values)
        self.reference = reference if reference is not None and reference.deltas.dtype == self.old.dtype else None
        # bf16: each HISTORY residual against the bf16 nearest 2 * old - prev, which follows a move across
        # binades and zero that ordered deltas cannot (13% smaller values on the real LLM).
        residual = ValueCoding.PREDICTED_CODES if info.name == "BF16" else ValueCoding.EXP_CODES
        self.residual_coding = residual if params.format_version >= 3 else ValueCoding.EXP_PLANES
        self.coded = info.is_float and info.width == 2 and params.format_version >= 3  # EXP_CODES, PREDICTED_CODES
        self.streams: SparseStreams | None = None
        if self.coded:
            ref = (self.reference.positions, self.reference.deltas) if self.reference is not None else None
            predicted = self.residual_coding == ValueCoding.PREDICTED_CODES
            self.streams = sparse_streams(positions, self.old, host(new_values), ref, predicted)

    @cached_property
    def gap_codes(self) -> tuple[np.ndarray, bytes]:
        """GAP_CODES of the positions: (codes, extra bits)."""
        return (self.streams.gap_codes, self.streams.gap_extra) if self.streams else encode_gap_codes(self.positions)

    @cached_property
    def deltas(self) -> np.ndarray:
        """The ordered deltas (encode_values' DELTA), on the host."""
        if self.streams:
            return self.streams.deltas
        return host(encode_values(self.old_values, self.new_values, self.info, ValueCoding.DELTA))

    @cached_property
    def packed_deltas(self) -> tuple[np.ndarray, np.ndarray]:
        """DELTA's 2-bit codes of the zigzagged deltas and the escaped values (pack_small, offset 1)."""
        if self.streams:
            return self.streams.packed, self.streams.escaped
        return pack_small(zigzag(self.deltas), 1)

    @cached_property
    def classes(self) -> np.ndarray | None:
        """The old values' magnitude classes (floats of 2 bytes or more), else None."""
        if not (self.info.is_float and self.info.width >= 2):
            return None
        return self.streams.classes if self.streams else magnitude_class(self.old)

    @cached_property
    def order(self) -> np.ndarray | None:
        """The stable order of the classes (magnitude_order), or None."""
        if self.streams:
            return self.streams.order
        return np.argsort(self.classes, kind="stable") if self.classes is not None else None

    @cached_property
    def counts(self) -> np.ndarray:
        """Values per magnitude class (CLASSES of them)."""
        assert self.classes is not None
        return self.streams.counts if self.streams else np.bincount(self.classes, minlength=CLASSES)

    @cached_property
    def value_codes(self) -> tuple[np.ndarray, bytes]:
        """EXP_CODES of the deltas in class order: (symbols, extra bits)."""
        assert self.order is not None
        if self.streams:
            return self.streams.symbols, self.streams.value_extra
        return encode_value_codes(self.deltas, self.old, self.order)

    @cached_property
    def new_entropy(self) -> float:
        """entropy_bytes of the new values' byte planes."""
        return self.streams.new_entropy if self.streams else entropy_bytes(plane_list(host(self.new_values)))

    @cached_property
    def matched(self) -> MatchedStreams:
        """The positions and deltas matched against the reference chunk (MatchedStreams)."""
        reference = self.reference
        assert reference is not None
        if self.streams:
            assert self.streams.matched is not None
            return self.streams.matched
        again, ref_deltas, fresh = match_reference(self.positions, reference.positions, reference.deltas)
        if self.residual_coding == ValueCoding.PREDICTED_CODES:
            ref_deltas = predicted_offsets(self.old, ref_deltas)
        residuals = wrapping_sub(self.deltas, ref_deltas)
        bitmap = np.packbits(again, bitorder="little").tobytes()
        codes: tuple[np.ndarray, bytes] | None = None
        if self.coded:
            assert self.order is not None
            codes = encode_value_codes(residuals, self.old, self.order)
        return MatchedStreams(bitmap, fresh, encode_gap_codes(fresh), residuals, codes)


def _sparse_record(
    params: CodecParams,
    chunk: _Chunk,
    length: int,
    positions: np.ndarray,
    old_values: torch.Tensor,
    new_values: torch.Tensor,
    reference: ChunkHistory | None,
    by_classes: bool = False,
) -> _Record:
    """SPARSE or HISTORY record of the changed elements at chunk-relative `positions` of a chunk of `length`.

    `chunk` holds the chunk's old and new values, or none (a sharded piece's strided record);
    `by_classes`: its positions may be coded as CLASS_MASKS (the first patch after an anchor).
    """
    info = chunk.info
    fields = _chunk_fields(chunk, RecordKind.SPARSE, length, positions.size)
    change = _digest_change(params, chunk, positions, old_values, new_values)
    if not params.adaptive:
        coding = params.coding
        coded = host(encode_values(old_values, new_values, info, coding))
        position = _position_coding(params, positions)
        return _record(params, [position, _value_section(params, coded, coding, offset=1)], None, change, **fields)
    changes = _Changes(params, info, positions, old_values, new_values, reference)
    position = _position_coding(params, positions, changes.gap_codes)
    history = ((chunk.name, chunk.start, length), ChunkHistory(positions, changes.deltas))
    values = [_delta_section(params, *changes.packed_deltas), _sorted_values(params, changes)]
    history_coded = _history_coding(params, changes) if changes.reference is not None else []
    _measure(params, [position, *values, *history_coded])  # every candidate in one call
    classes = changes.classes
    if by_classes and classes is not None and chunk.old.numel() == length:
        masks = _class_masks(params, chunk, positions, classes)
        position = position if masks is None else _smallest([position, masks])
    value = _smallest(values)
    if changes.new_entropy < RAW_TRY * value.size:  # new values simpler than their moves (a reset, a prune)
        raw = plane_list(host(new_values))
        value = _smallest([value, _section(params, "values", raw, coding=ValueCoding.RAW)])
    sections = [position, value]
    if changes.reference is not None and sum(s.size for s in history_coded) < position.size + value.size:
        sections = history_coded
        fields |= {"kind": RecordKind.HISTORY, "ref_count": changes.reference.positions.size}
    return _record(params, sections, history, change, **fields)


def _digest_change(
    params: CodecParams, chunk: _Chunk, positions: np.ndarray | None, old: torch.Tensor, new: torch.Tensor
) -> tuple[str, tuple[int, int]] | None:
    """How a chunk record moves its tensor's digest, where that is updated from it (an incremental algorithm).

    Computed in the record's task, also where the caller gave the new digest: deferred, the
    changed values stayed alive until the last record (a sharded rank's peak rose from 2.18x to
    2.23x its shard) for ~2% of encode time.
    """
    if params.digest_algorithm not in INCREMENTAL:
        return None
    return chunk.name, lane_change(old, new, chunk.start, positions)


CODES_BLOCK = 4096  # EXP_CODES: a magnitude class of this many values gets zstd blocks (Huffman tables) of its own


def _sorted_values(params: CodecParams, changes: _Changes, residuals: bool = False) -> _Section:
    """The deltas (or, `residuals`, the HISTORY residuals) by the old values' magnitude class where there are classes.

    2-byte floats (format 3 on): EXP_CODES, or PREDICTED_CODES for residuals against a prediction,
    each class of CODES_BLOCK values or more in zstd blocks of its own (the classes' moves differ
    by orders of magnitude: a Huffman table per class measured 3% smaller values on a real LLM).
    EXP_PLANES was smaller on no record of the real LLM: not worth compressing too. Wider floats
    and format 2: EXP_PLANES; other dtypes: PLANES.
    """
    order = changes.order
    if not changes.coded or order is None:
        zigzags = zigzag(changes.matched.residuals if residuals else changes.deltas)
        planes = plane_list(zigzags if order is None else zigzags[order])
        return _section(params, "values", planes, **_planes(order))
    codes = changes.matched.codes if residuals else changes.value_codes
    assert codes is not None
    symbols, extra = codes
    counts = changes.counts
    ends = np.cumsum(counts)
    big = np.flatnonzero(counts >= CODES_BLOCK).tolist()
    cuts = sorted({0, symbols.size, *(int(ends[c] - counts[c]) for c in big), *(int(ends[c]) for c in big)})
    parts = [symbols[a:b].tobytes() for a, b in itertools.pairwise(cuts)] + [extra]
    coding = changes.residual_coding if residuals else ValueCoding.EXP_CODES
    return _section(params, "values", parts, coding=coding, value_escapes=len(extra))


def _planes(order: np.ndarray | None) -> dict[str, Any]:
    """Header fields of values in byte planes: sorted by magnitude class where `order` is given."""
    return {"coding": ValueCoding.PLANES if order is None else ValueCoding.EXP_PLANES}


GAPS16_TRY = 1024  # GAPS16 is weighed against GAP_CODES only in records of this many changes or fewer
RAW_TRY = 1.25  # RAW values are compressed (weighed) only where their order-0 entropy is below this x the best's size


def _position_coding(
    params: CodecParams, positions: np.ndarray, gap_codes: tuple[np.ndarray, bytes] | None = None
) -> _Section:
    """The positions as u16 gaps (format 1) or, format 2, gap codes (`gap_codes` where already made), or the
    smaller of both in a small record.

    GAPS16 was smaller in no record of over 400 changes (synthetic, real-like and a real LLM's
    patches), and by 0.1% of their bytes at most: weighing it in larger ones cost ~8% of encode time.
    """
    if params.format_version < 2 or positions.size <= GAPS16_TRY:
        gaps, escapes = encode_positions(positions)
        coding = {"positions": PositionCoding.GAPS16} if params.format_version >= 2 else {}  # (format 1: no field)
        planes = [*plane_list(gaps), escapes.astype("<u8").tobytes()]
        gaps16 = _section(params, "positions", planes, escapes=escapes.size, **coding)
        if params.format_version < 2:
            return gaps16
    codes, extra = gap_codes or encode_gap_codes(positions)
    gap_codes_section = _section(
        params, "positions", [codes.tobytes(), extra], escapes=len(extra), positions=PositionCoding.GAP_CODES
    )
    return gap_codes_section if positions.size > GAPS16_TRY else _smallest([gaps16, gap_codes_section])


def _history_coding(params: CodecParams, changes: _Changes) -> list[_Section]:
    """The HISTORY record's sections: which reference positions changed again (a bitmap), the new
    ones' gaps, and each value as the difference to its reference delta (0 where new), or for
    bf16 to its prediction (PREDICTED_CODES)."""
    matched = changes.matched
    bitmap = _section(params, "positions", [matched.bitmap], new_count=matched.fresh.size)
    fresh = _position_coding(params, matched.fresh, matched.fresh_codes)
    return [bitmap, fresh, _sorted_values(params, changes, residuals=True)]


def _encode_dense(params: CodecParams, chunk: _Chunk, count: int) -> _Record:
    """DENSE record: every element coded (unchanged ones code to zero); adaptive: the smaller of DELTA and RAW."""
    fields = _chunk_fields(chunk, RecordKind.DENSE, chunk.old.numel(), count)
    change = _digest_change(params, chunk, None, chunk.old, chunk.new)
    codings = [params.coding] if not params.adaptive else [ValueCoding.DELTA, ValueCoding.RAW]
    values = [
        _value_section(params, host(encode_values(chunk.old, chunk.new, chunk.info, c)), c, offset=0) for c in codings
    ]
    return _record(params, [_smallest(values)], digest_change=change, **fields)


def _value_section(params: CodecParams, coded: np.ndarray, coding: ValueCoding, offset: int) -> _Section:
    """Coded values as a section: byte planes, or 2-bit codes plus escaped values' planes."""
    if not coding.packed:
        return _section(params, "values", plane_list(coded), coding=coding)
    if coding == ValueCoding.DELTA:
        coded = zigzag(coded)
    return _delta_section(params, *pack_small(coded, offset), coding=coding)


def _delta_section(
    params: CodecParams, packed: np.ndarray, escaped: np.ndarray, coding: ValueCoding = ValueCoding.DELTA
) -> _Section:
    """Packed 2-bit value codes and the escaped values' planes as a section."""
    parts = [packed.tobytes(), *plane_list(escaped)]
    return _section(params, "values", parts, coding=coding, value_escapes=escaped.size)


def _encode_whole(params: CodecParams, kind: RecordKind, name: str, t: torch.Tensor) -> _Record:
    """ADD or REPLACE record: the full tensor, raw bits."""
    values = host(flat_bits(t))
    section = _section(params, "values", plane_list(values), coding=ValueCoding.RAW)
    info, shape, n = dtype_info(t.dtype), tuple(t.shape), values.size
    return _record(params, [section], kind=kind, name=name, dtype=info, shape=shape, length=n, count=n)


def encode_patch(
    base: State,
    new: State,
    params: CodecParams | None = None,
    *,
    base_digest: StateDigest | None = None,
    new_digest: StateDigest | None = None,
) -> bytes:
    """Lossless, self-contained patch turning `base` into `new`; tensors may live on any device.

    Pass the states' digests when already known to skip hashing.
    """
    return encode(base, new, params, base_digest=base_digest, new_digest=new_digest).data


def encode(
    base: State,
    new: State,
    params: CodecParams | None = None,
    *,
    base_digest: StateDigest | None = None,
    new_digest: StateDigest | None = None,
    reference: PatchHistory | None = None,
) -> EncodedPatch:
    """Lossless patch turning `base` into `new`, and its history.

    With `reference` (the history of the patch that produced `base`), a record may be
    history-coded against it where that is smaller (format 2, adaptive coding). Without it (the
    first patch after an anchor) positions may be coded by magnitude class (CLASS_MASKS, format
    3), whose decoder scans each chunk: never in a patch with a reference, nor in a part. Without
    `new_digest`, an incremental digest algorithm updates `base_digest` from the changed elements
    (O(patch)); any other hashes the changed tensors.
    """
    params = params or CodecParams()
    reference = reference if params.adaptive else None  # history coding is part of adaptive coding
    base_digest = base_digest or state_digest(base, params.digest_algorithm, params.threads)
    if new_digest is None and params.digest_algorithm not in INCREMENTAL:
        new_digest = state_digest(new, params.digest_algorithm, params.threads)
    algorithms = {base_digest.algorithm} | ({new_digest.algorithm} if new_digest is not None else set())
    if algorithms != {params.digest_algorithm}:
        raise ConfigError(
            f"digest algorithms {'/'.join(sorted(algorithms))} differ from codec digest_algorithm "
            f"{params.digest_algorithm}"
        )

    tasks: list[Callable[[], _Record | None]] = []
    whole: list[str] = []  # tensors added or replaced: an incremental digest hashes them whole
    for name in sorted(set(base) | set(new)):
        if name not in new:
            tasks.append(partial(_removal, name))
        elif name not in base:
            tasks.append(partial(_encode_whole, params, RecordKind.ADD, name, new[name]))
            whole.append(name)
        elif base[name].dtype != new[name].dtype or base[name].shape != new[name].shape:
            tasks.append(partial(_encode_whole, params, RecordKind.REPLACE, name, new[name]))
            whole.append(name)
        else:
            tasks.extend(_chunk_tasks(params, name, base[name], new[name], reference, by_classes=reference is None))

    records = [r for r in parallel_map(lambda task: task(), tasks, params.threads) if r is not None]
    if new_digest is None:  # incremental: from what the chunk records overwrote, O(patch)
        moved = [r.digest_change for r in records if r.digest_change is not None]
        new_digest = update_digest(base_digest, new, moved, whole)
    # Name the reference only where a record uses it: a reader without it can still decode the rest.
    coded_against = reference if any(r.coding.startswith("HISTORY/") for r in records) else None
    data, codings, wire = _assemble(
        params,
        records,
        base_digest.root,
        new_digest.root,
        dense_bytes(new),
        reference_sha256=coded_against.sha256 if coded_against is not None else None,
    )
    history = PatchHistory(hashlib.sha256(data).hexdigest(), dict(r.history for r in records if r.history))
    return EncodedPatch(data, history, codings, new_digest, wire)


@dataclass(frozen=True)
class EncodedPart:
    """One rank's part of a sharded step's patch (docs/sharding.md) and how it moves each tensor's digest."""

    data: bytes
    codings: dict[str, int]
    wire: dict[str, int]
    changed_elements: int
    lanes: dict[str, tuple[int, int]]  # tensor -> how the part's records moved its mixsum-128 lanes
    history: PatchHistory  # what it changed: the reference of this rank's next part


def encode_part(
    base: State,
    new: State,
    pieces: Mapping[str, Piece],
    params: CodecParams,
    *,
    part: int,
    base_root: str,
    dense_bytes_total: int,
    reference: PatchHistory | None = None,
) -> EncodedPart:
    """The part of a step's patch that covers `pieces`: `base`/`new` hold each piece's local tensor.

    Each piece is a contiguous run of its tensor's flat elements, so a chunk of the local tensor
    is a chunk of the global tensor at `piece.start` on: records carry global starts and the
    global shape, and apply to the whole tensor as any record does. A part is coded as a patch is:
    against `reference` (this rank's part of the step before, its history; after a relaunch on
    another layout, the step before's parts joined by position, `StepHistory.joined`) where that is smaller,
    else a contiguous piece's first part after an anchor by magnitude class (a strided piece's
    chunks hold other ranks' elements: never). Parts need an incremental digest: the step's
    digest is the base's moved by every part's lane changes.
    """
    if params.digest_algorithm not in INCREMENTAL:
        raise ConfigError(f"a sharded publish needs an incremental digest algorithm, not {params.digest_algorithm}")
    reference = reference if params.adaptive else None  # history coding is part of adaptive coding
    if reference is not None and reference.parts and params.format_version < REFERENCE_PARTS:
        reference = None  # parts joined by position: a format-5 header names them
    tasks: list[Callable[[], _Record | None]] = []
    for name in sorted(pieces):
        piece, old_t, new_t = pieces[name], base[name], new[name]
        if old_t.dtype != new_t.dtype or old_t.numel() != piece.length or new_t.numel() != piece.length:
            raise ConfigError(f"tensor {name!r}: its dtype or size changed since the last anchor; publish an anchor")
        if piece.runs == 1:
            by_classes = reference is None
            tasks.extend(_chunk_tasks(params, name, old_t, new_t, reference, piece.start, piece.shape, by_classes))
        else:
            tasks.extend(_strided_tasks(params, piece, old_t, new_t, reference))
    records = [r for r in parallel_map(lambda task: task(), tasks, params.threads) if r is not None]
    lanes: dict[str, tuple[int, int]] = {}
    for r in records:
        if r.digest_change is not None:
            name, moved = r.digest_change
            lanes[name] = mixsum.add(lanes.get(name, (0, 0)), moved)
    coded_against = reference if any(r.coding.startswith("HISTORY/") for r in records) else None
    named: dict[str, Any] = {}
    if coded_against is not None and coded_against.parts:
        named["reference_parts"] = list(coded_against.parts)
    elif coded_against is not None:
        named["reference_sha256"] = coded_against.sha256
    data, codings, wire = _assemble(params, records, base_root, "", dense_bytes_total, part=part, **named)
    history = PatchHistory(hashlib.sha256(data).hexdigest(), dict(r.history for r in records if r.history))
    return EncodedPart(data, codings, wire, sum(r.changed for r in records), lanes, history)


def _assemble(
    params: CodecParams,
    records: list[_Record],
    base_root: str,
    new_root: str,
    total_dense_bytes: int,
    **header_fields: Any,
) -> tuple[bytes, dict[str, int], dict[str, int]]:
    """The patch bytes (header, records, END), its codings per kind and its bytes by role."""
    version = params.format_version
    header = PatchHeader(
        value_coding=params.value_coding,
        zstd_level=params.zstd_level,
        chunk_elements=params.chunk_elements,
        digest_algorithm=params.digest_algorithm,
        base_digest=base_root,
        state_digest=new_root,
        records=len(records),
        decoded_bytes=sum(r.raw_len for r in records),
        changed_elements=sum(r.changed for r in records),
        dense_bytes=total_dense_bytes,
        **header_fields,
    )
    data = assemble(header, [(r.head, r.payload) for r in records], version)
    codings = dict(sorted(Counter(r.coding for r in records if r.coding).items()))
    wire = {"positions": 0, "values": 0}
    for r in records:
        for role, size in r.wire.items():
            wire[role] += size
    wire["framing"] = len(data) - wire["positions"] - wire["values"]  # headers or index, zstd frames
    return data, codings, wire


def _removal(name: str) -> _Record:
    return _Record(RecordHeader(RecordKind.REMOVE, name, None), b"", 0, 0)


def _strided_tasks(
    params: CodecParams, piece: Piece, old_t: torch.Tensor, new_t: torch.Tensor, reference: PatchHistory | None
) -> list[Callable[[], _Record | None]]:
    """SPARSE records of a piece of several runs (a split of dim 1 or later), one per global chunk it changed.

    The runs of other ranks lie between this piece's, so a record never codes a whole chunk
    (DENSE): it holds this piece's changed elements, at their global chunk positions.
    """
    info = dtype_info(old_t.dtype)
    old, new = flat_bits(old_t), flat_bits(new_t)
    local, old_values, new_values = _changed_elements(old, new)
    if local.size == 0:
        return []
    where = piece.global_positions(local)
    grid = np.array(chunk_bounds(piece.numel, params.chunk_elements))  # the global tensor's, as every rank cuts it
    chunk_of = np.searchsorted(grid, where, side="right") - 1
    bounds = np.flatnonzero(np.diff(chunk_of)) + 1
    tasks: list[Callable[[], _Record | None]] = []
    refs = reference.chunks if reference is not None else {}
    for lo, hi in zip([0, *bounds.tolist()], [*bounds.tolist(), local.size], strict=True):
        start, end = int(grid[chunk_of[lo]]), int(grid[chunk_of[lo] + 1])
        length = end - start
        # The record's identity (name, dtype, global shape, start); its changed elements are given.
        chunk = _Chunk(piece.name, info, piece.shape, start, old[:0], new[:0])
        positions = where[lo:hi] - start
        changed = (positions, old_values[lo:hi], new_values[lo:hi])
        tasks.append(partial(_sparse_record, params, chunk, length, *changed, refs.get((piece.name, start, length))))
    return tasks


def contiguous_chunks(pieces: Mapping[str, Piece], chunk_elements: int) -> list[ChunkKey]:
    """The chunks a part cuts its contiguous pieces into, by global position (a strided piece's are the
    global tensor's chunks it changed elements in: `_strided_tasks`)."""
    return [
        (name, p.start + lo, hi - lo)
        for name, p in sorted(pieces.items())
        if p.runs == 1
        for lo, hi in itertools.pairwise(chunk_bounds(p.length, chunk_elements))
    ]


def chunk_bounds(numel: int, step: int) -> list[int]:
    """Where a tensor's chunks start, and its end: every `step` elements, except that a last chunk of
    less than half a step joins the one before (at most 1.5 steps).

    Each record costs its subscriber ~30 us whatever its size: Qwen2.5's 896 x 4864 MLP matrices
    were a 4M chunk and a 164K one, a quarter of a 0.5B model's records.
    """
    starts = list(range(0, numel, step))
    if len(starts) > 1 and numel - starts[-1] < step // 2:
        starts.pop()
    return [*starts, numel] if starts else []


def _chunk_tasks(
    params: CodecParams,
    name: str,
    old_t: torch.Tensor,
    new_t: torch.Tensor,
    reference: PatchHistory | None,
    offset: int = 0,
    shape: tuple[int, ...] | None = None,
    by_classes: bool = False,
) -> list[Callable[[], _Record | None]]:
    """One task per chunk; a piece of a larger tensor (sharded) starts at `offset` of a tensor of `shape`.

    `by_classes`: a record may code its positions as CLASS_MASKS.
    """
    if old_t.device != new_t.device:
        new_t = new_t.to(old_t.device)
    info = dtype_info(old_t.dtype)
    old, new = flat_bits(old_t), flat_bits(new_t)
    shape = shape or tuple(old_t.shape)
    bounds = chunk_bounds(old.numel(), params.chunk_elements)
    chunks = [_Chunk(name, info, shape, offset + s, old[s:e], new[s:e]) for s, e in itertools.pairwise(bounds)]
    refs = reference.chunks if reference is not None else {}
    return [partial(_encode_chunk, params, c, refs.get(c.key), by_classes) for c in chunks]
