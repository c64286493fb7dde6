"""Binary layout of a patch (pure; no I/O). See docs/patch-format.md.

    patch    = preamble header_json header_checksum index payload*          (version 4)
    patch    = preamble header_json header_checksum record* end_record      (versions 1-3)
    preamble = MAGIC(8) version:u16 flags:u16 header_len:u32
    index    = one zstd frame of every record's entry (fixed name shape), in record order
    record   = magic fixed name shape checksum:u32 payload
    payload  = comp_len bytes: one zstd frame, or empty

All integers little-endian. The patch header carries an xxh3-64 checksum and, in version 4, the
index's size and xxh3-64; each record's fields carry the xxh3-64 of its compressed payload (and
in versions 1-3 an xxh32 of their own and a zstd content checksum): a flipped byte anywhere is
caught while parsing, before anything is written.

Version 4 only moves the records' fields: one compressed index instead of a header before each
payload, which costs ~20 bytes a record instead of ~150 (names and fields compress, the magic
and per-record checksums go) and makes a sharded publish's parts, which split every tensor into
one record per rank, cost what an unsharded patch costs (docs/sharding.md).
"""

from __future__ import annotations

import enum
import json
import math
import struct
from typing import Annotated, NamedTuple

import xxhash
import zstandard
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from pulsesync.codec.codings.catalog import PositionCoding as PositionCoding  # (re-exported: the format names them)
from pulsesync.codec.codings.catalog import ValueCoding as ValueCoding
from pulsesync.codec.codings.class_masks import CLASSES
from pulsesync.codec.codings.gap_codes import MAX_GAP_BITS
from pulsesync.digest_algorithms import DigestAlgorithm
from pulsesync.dtypes import DTypeInfo, dtype_by_code
from pulsesync.errors import CorruptPatchError, UnsupportedVersionError

MAGIC = b"PULSEPT\x00"
FORMAT_VERSION = 5  # what the encoder writes by default; the decoder reads every SUPPORTED_VERSIONS
SUPPORTED_VERSIONS = (1, 2, 3, 4, 5)
INDEXED = 4  # the first version whose record fields are in an index
REFERENCE_PARTS = 5  # the first version whose parts may be coded against several parts of the step before
PREAMBLE = struct.Struct("<8sHHI")
HEADER_CHECKSUM = struct.Struct("<Q")
RECORD_MAGIC = b"PR"
# magic kind dtype ndim coding name_len start length count escapes value_escapes raw_len comp_len payload_hash
RECORD_FIXED_V1 = struct.Struct("<2sBBBBHQQQQQQQQ")
# version 2 appends ref_count new_count (HISTORY records; zero in every other kind) and the position coding
RECORD_FIXED_V2 = struct.Struct("<2sBBBBHQQQQQQQQQQB")
RECORD_FIXED = {1: RECORD_FIXED_V1, 2: RECORD_FIXED_V2, 3: RECORD_FIXED_V2}  # version 3 adds codings, no fields
RECORD_CHECKSUM = struct.Struct("<I")
INDEX_ENTRY = struct.Struct("<BBBBHQQQQQQQQQQB")  # (version 4) RECORD_FIXED_V2 without the magic

# Sanity limits: generous for any real model, small enough that a lying header cannot make the
# decoder allocate or loop without bound.
MAX_HEADER_BYTES = 1 << 20
MAX_NAME_BYTES = 4096
MAX_NDIM = 32
_SHAPES = [struct.Struct(f"<{ndim}Q") for ndim in range(MAX_NDIM + 1)]  # a record's shape, by its ndim
MAX_INDEX_ENTRY = INDEX_ENTRY.size + MAX_NAME_BYTES + 8 * MAX_NDIM
MAX_INDEX_BYTES = 1 << 28  # a decompressed index: ~1.7M records of 150 bytes
MAX_NUMEL = 1 << 50


class RecordKind(enum.IntEnum):
    """What a record does to its tensor."""

    END = 0  # closes the patch; `count` repeats the number of records before it
    SPARSE = 1  # changed positions + coded values inside [start, start+length)
    DENSE = 2  # every value of [start, start+length), coded
    ADD = 3  # a tensor absent from the base: dtype, shape, raw values
    REPLACE = 4  # a tensor whose dtype or shape changed: new dtype, shape, raw values
    REMOVE = 5  # a tensor absent from the new state
    HISTORY = 6  # (v2) changed positions and values coded against the reference patch's same chunk


CODES = (ValueCoding.EXP_CODES, ValueCoding.PREDICTED_CODES)  # values as symbols and extra bits, folded by sign
V2_CODINGS = (ValueCoding.PLANES, ValueCoding.EXP_PLANES, *CODES)
BY_CLASS = (ValueCoding.EXP_PLANES, *CODES)  # values stored sorted by the old values' magnitude class
V2_KINDS = (RecordKind.HISTORY,)
# Field values to members: a dict lookup per record, where the enum constructors cost ~1 us each.
_KINDS = {k.value: k for k in RecordKind}
_CODINGS = {c.value: c for c in ValueCoding}
_POSITION_CODINGS = {c.value: c for c in PositionCoding}


class PatchHeader(BaseModel):
    """The JSON header of a patch: codec parameters, digests and declared sizes."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    value_coding: str
    zstd_level: int
    chunk_elements: int = Field(gt=0)
    digest_algorithm: DigestAlgorithm
    base_digest: str
    state_digest: str
    records: int = Field(ge=0)
    decoded_bytes: int = Field(ge=0)  # sum of every record's raw_len: the decoder's allocation bound
    changed_elements: int = Field(ge=0)
    dense_bytes: int = Field(ge=0)  # bytes of the resulting state, dense
    # v2: SHA-256 of the patch whose records HISTORY records are coded against (None: no HISTORY records)
    reference_sha256: str | None = Field(None, pattern=r"^[0-9a-f]{64}$")
    # v2, sharded publishing: this patch is part `part` of a step's parts (docs/sharding.md); its
    # state_digest is empty, the step's manifest holds the digest the parts compose to. Omitted
    # from the JSON when None, so every other patch reads as before.
    part: int | None = Field(None, ge=0)
    # v5, a part made on another layout than the step before's (a sharded job relaunched on another
    # world size): the SHA-256 of each part of the step before whose history its HISTORY records are
    # coded against, together, by global position (`StepHistory.joined`). Omitted when None.
    reference_parts: list[Annotated[str, Field(pattern=r"^[0-9a-f]{64}$")]] | None = Field(None, min_length=1)
    # v4: the record index that follows the header: its compressed bytes, their xxh3-64 and its
    # decompressed bytes. Omitted from the JSON of versions 1-3.
    index_bytes: int | None = Field(None, ge=0)
    index_hash: int | None = Field(None, ge=0, lt=1 << 64)
    index_raw_bytes: int | None = Field(None, ge=0, le=MAX_INDEX_BYTES)

    @property
    def indexed(self) -> bool:
        """Whether the header carries a record index (version 4)."""
        return self.index_bytes is not None


_INDEX_FIELDS = ("index_bytes", "index_hash", "index_raw_bytes")


class RecordHeader(NamedTuple):
    """One record's fields (validated for internal consistency when parsed).

    A named tuple: a subscriber parses every record of every patch (~400 in a 0.6B model's), and
    a tuple is built in a sixth of a frozen dataclass's time (0.3 vs 1.7 us here).
    """

    kind: RecordKind
    name: str
    dtype: DTypeInfo | None  # None only for END and REMOVE records
    shape: tuple[int, ...] = ()
    coding: ValueCoding = ValueCoding.RAW
    start: int = 0
    length: int = 0
    count: int = 0  # type: ignore[assignment]  # changed elements (END: records before it); hides tuple.count
    # GAPS16: gaps too large for u16; GAP_CODES: bytes of the extra-bits stream; CLASS_MASKS: of the bitmap
    escapes: int = 0
    value_escapes: int = 0  # packed values too large for a 2-bit code; EXP_CODES: bytes of the extra-bits stream
    raw_len: int = 0
    comp_len: int = 0
    payload_hash: int = 0  # xxh3-64 of the compressed payload
    ref_count: int = 0  # HISTORY: changed positions of the reference's chunk (bits of the "again" bitmap)
    new_count: int = 0  # HISTORY: changed positions not in the reference (coded as gaps)
    positions: PositionCoding = PositionCoding.GAPS16  # (v2) SPARSE, HISTORY: how the gaps are stored

    @property
    def info(self) -> DTypeInfo:
        """The dtype of a record that carries values."""
        if self.dtype is None:
            raise CorruptPatchError(f"{self.kind.name} record for {self.name!r} has no dtype")
        return self.dtype

    @property
    def numel(self) -> int:
        """Elements of the whole tensor the record belongs to."""
        return math.prod(self.shape)


def encode_header(header: PatchHeader, version: int = FORMAT_VERSION) -> bytes:
    """Preamble, canonical JSON header and its checksum."""
    exclude = {"reference_sha256"} if version == 1 else set()
    exclude |= {name for name in ("part", "reference_parts", *_INDEX_FIELDS) if getattr(header, name) is None}
    fields = header.model_dump(exclude=exclude)
    body = json.dumps(fields, sort_keys=True, separators=(",", ":")).encode()
    head = PREAMBLE.pack(MAGIC, version, 0, len(body)) + body
    return head + HEADER_CHECKSUM.pack(xxhash.xxh3_64_intdigest(head))


def parse_header(buf: bytes | bytearray | memoryview) -> tuple[PatchHeader, int, int] | None:
    """Parse the patch header from the start of buf; None if more bytes are needed.

    Returns the header, the number of bytes it occupies and the format version.
    """
    if len(buf) < PREAMBLE.size:
        if bytes(buf[: len(MAGIC)]) != MAGIC[: len(buf)]:
            raise CorruptPatchError("not a pulsesync patch: bad magic bytes")
        return None
    magic, version, _flags, header_len = PREAMBLE.unpack_from(buf, 0)
    if magic != MAGIC:
        raise CorruptPatchError("not a pulsesync patch: bad magic bytes")
    if version not in SUPPORTED_VERSIONS:
        raise UnsupportedVersionError(
            f"patch format version {version} is not supported (this pulsesync reads {SUPPORTED_VERSIONS})"
        )
    if header_len > MAX_HEADER_BYTES:
        raise CorruptPatchError(f"patch header declares {header_len} bytes (limit {MAX_HEADER_BYTES})")
    end = PREAMBLE.size + header_len
    total = end + HEADER_CHECKSUM.size
    if len(buf) < total:
        return None
    (checksum,) = HEADER_CHECKSUM.unpack_from(buf, end)
    if xxhash.xxh3_64_intdigest(bytes(buf[:end])) != checksum:
        raise CorruptPatchError("patch header checksum mismatch (corrupted header)")
    try:
        header = PatchHeader.model_validate_json(bytes(buf[PREAMBLE.size : end]))
    except ValidationError as e:
        raise CorruptPatchError(f"patch header is invalid: {e.errors()[0]['msg']}") from None
    if version == 1 and (header.reference_sha256 is not None or header.part is not None):
        raise CorruptPatchError("patch header is invalid: a version 1 patch names a reference or a part")
    if header.reference_parts is not None and (
        version < REFERENCE_PARTS or header.part is None or header.reference_sha256 is not None
    ):
        raise CorruptPatchError(
            f"patch header is invalid: reference_parts in a format-{version} "
            + ("part that also names reference_sha256" if header.part is not None else "patch that is not a part")
        )
    indexed = [getattr(header, name) is not None for name in _INDEX_FIELDS]
    if indexed != [version >= INDEXED] * len(_INDEX_FIELDS):
        raise CorruptPatchError(f"patch header is invalid: the record index fields do not fit format {version}")
    if header.index_raw_bytes is not None and header.index_raw_bytes > header.records * MAX_INDEX_ENTRY:
        raise CorruptPatchError(
            f"patch header is invalid: a record index of {header.index_raw_bytes} bytes for {header.records} records"
        )
    return header, total, version


def values_len(coding: ValueCoding, width: int, n: int, value_escapes: int) -> int:
    """Bytes of n coded values: byte planes, 2-bit codes + escaped values' planes, or symbols + extra bits."""
    if coding in CODES:
        return n + value_escapes
    return (n + 3) // 4 + width * value_escapes if coding.packed else width * n


def positions_len(h: RecordHeader, gaps: int) -> int:
    """Bytes of `gaps` coded position gaps (CLASS_MASKS: the class table and the bitmap)."""
    if h.positions == PositionCoding.CLASS_MASKS:
        return CLASSES + h.escapes
    return gaps + h.escapes if h.positions == PositionCoding.GAP_CODES else 2 * gaps + 8 * h.escapes


_EXTRA_BYTES = (MAX_GAP_BITS - 3 + 7) // 8  # most extra-bit bytes of one GAP_CODES gap or EXP_CODES value


def escapes_per_value(coding: ValueCoding) -> int:
    """Most extra-bit bytes a value takes: EXP_CODES's MAX_GAP_BITS - 3 extra bits (other byte-plane codings: none)."""
    return _EXTRA_BYTES if coding in CODES else 0


def raw_len_for(h: RecordHeader) -> int:
    """Exact decompressed payload size a record's fields imply."""
    kind, coding, width, count = h.kind, h.coding, h.info.width if h.dtype else 0, h.count
    if kind == RecordKind.SPARSE:
        return positions_len(h, count) + values_len(coding, width, count, h.value_escapes)
    if kind == RecordKind.HISTORY:
        return (
            (h.ref_count + 7) // 8 + positions_len(h, h.new_count) + values_len(coding, width, count, h.value_escapes)
        )
    if kind in (RecordKind.DENSE, RecordKind.ADD, RecordKind.REPLACE):
        return values_len(coding, width, h.length, h.value_escapes)
    return 0


def _fixed_fields(h: RecordHeader, name_bytes: bytes) -> tuple[int, ...]:
    """A record's fixed fields after the magic, as every version from 2 on lays them out."""
    return (
        h.kind, h.dtype.code if h.dtype else 0, len(h.shape), h.coding, len(name_bytes), h.start, h.length, h.count,
        h.escapes, h.value_escapes, h.raw_len, h.comp_len, h.payload_hash, h.ref_count, h.new_count, h.positions,
    )  # fmt: skip


def encode_record_header(h: RecordHeader, version: int = FORMAT_VERSION) -> bytes:
    """Magic, fixed fields, name, shape and checksum of one record (versions 1-3)."""
    name_bytes = h.name.encode("utf-8")
    fields = _fixed_fields(h, name_bytes)
    fixed = RECORD_FIXED[version].pack(RECORD_MAGIC, *(fields if version >= 2 else fields[:-3]))
    body = fixed + name_bytes + _SHAPES[len(h.shape)].pack(*h.shape)
    return body + RECORD_CHECKSUM.pack(xxhash.xxh32_intdigest(body))


def encode_index(headers: list[RecordHeader]) -> bytes:
    """The decompressed record index of a version 4 patch: each record's fixed fields, name and shape."""
    entries: list[bytes] = []
    for h in headers:
        name_bytes = h.name.encode("utf-8")
        entries += (INDEX_ENTRY.pack(*_fixed_fields(h, name_bytes)), name_bytes, _SHAPES[len(h.shape)].pack(*h.shape))
    return b"".join(entries)


def assemble(
    header: PatchHeader,
    records: list[tuple[RecordHeader, bytes]],
    version: int = FORMAT_VERSION,
    end_count: int | None = None,
) -> bytes:
    """A patch's bytes: its header, its records' headers and compressed payloads laid out as `version` lays them
    (4: the index's fields filled into the header; 1-3: `end_count` in the end record, the records' by default)."""
    if version >= INDEXED:
        raw = encode_index([h for h, _ in records])
        index = zstandard.ZstdCompressor(level=header.zstd_level, write_checksum=False).compress(raw)
        sized = {"index_bytes": len(index), "index_hash": xxhash.xxh3_64_intdigest(index), "index_raw_bytes": len(raw)}
        return b"".join([encode_header(header.model_copy(update=sized), version), index, *(p for _, p in records)])
    count = len(records) if end_count is None else end_count
    end = encode_record_header(RecordHeader(RecordKind.END, "", None, count=count), version)
    return b"".join([encode_header(header, version), *(encode_record_header(h, version) + p for h, p in records), end])


def parse_index(raw: bytes, records: int) -> list[RecordHeader]:
    """The `records` checked record headers of a decompressed version 4 index (CorruptPatchError: it holds others)."""
    out: list[RecordHeader] = []
    offset = 0
    for i in range(records):
        if len(raw) - offset < INDEX_ENTRY.size:
            raise CorruptPatchError(f"record index ends inside entry {i} of {records}")
        kind, dcode, ndim, coding, name_len, *sizes = INDEX_ENTRY.unpack_from(raw, offset)
        if name_len > MAX_NAME_BYTES or ndim > MAX_NDIM:
            raise CorruptPatchError(f"record index entry {i}: name length {name_len} or ndim {ndim} out of range")
        name_start = offset + INDEX_ENTRY.size
        offset = name_start + name_len + 8 * ndim
        if offset > len(raw):
            raise CorruptPatchError(f"record index ends inside entry {i} of {records}")
        shape = _SHAPES[ndim].unpack_from(raw, name_start + name_len)
        out.append(_record_header(raw[name_start : name_start + name_len], kind, dcode, coding, shape, sizes, INDEXED))
    if offset != len(raw):
        raise CorruptPatchError(f"record index has {len(raw) - offset} bytes after its {records} entries")
    return out


def payload_hash(payload: bytes | memoryview) -> int:
    """The hash a record header keeps of its compressed payload (0 for none)."""
    return xxhash.xxh3_64_intdigest(payload) if len(payload) else 0


def parse_record_header(
    buf: bytes | bytearray | memoryview, offset: int, version: int = FORMAT_VERSION
) -> tuple[RecordHeader, int] | None:
    """Parse and validate the record header at offset; None if more bytes are needed.

    Returns the header and the offset where its payload starts.
    """
    fixed_struct = RECORD_FIXED[version]
    if len(buf) - offset < fixed_struct.size:
        return None
    (magic, kind, dcode, ndim, coding, name_len, *sizes) = fixed_struct.unpack_from(buf, offset)
    if version == 1:
        sizes.append(PositionCoding.GAPS16)
    if magic != RECORD_MAGIC:
        raise CorruptPatchError(f"record at byte {offset}: bad record magic (corrupted or misaligned patch)")
    if name_len > MAX_NAME_BYTES or ndim > MAX_NDIM:
        raise CorruptPatchError(f"record at byte {offset}: name length {name_len} or ndim {ndim} out of range")
    body_end = offset + fixed_struct.size + name_len + 8 * ndim
    if len(buf) < body_end + RECORD_CHECKSUM.size:
        return None
    (checksum,) = RECORD_CHECKSUM.unpack_from(buf, body_end)
    if xxhash.xxh32_intdigest(memoryview(buf)[offset:body_end]) != checksum:
        raise CorruptPatchError(f"record at byte {offset}: record header checksum mismatch (corrupted record)")
    # From here on the fields are what the encoder wrote; checks below catch lying encoders.
    name_start = offset + fixed_struct.size
    shape = _SHAPES[ndim].unpack_from(buf, name_start + name_len)
    name_bytes = bytes(buf[name_start : name_start + name_len])
    return _record_header(name_bytes, kind, dcode, coding, shape, sizes, version), body_end + RECORD_CHECKSUM.size


def _record_header(
    name_bytes: bytes, kind: int, dcode: int, coding: int, shape: tuple[int, ...], sizes: list[int], version: int
) -> RecordHeader:
    """A record header from its fields (`sizes`: start .. payload_hash, then in version 2 on ref_count, new_count,
    and the position coding), checked."""
    try:
        name = name_bytes.decode("utf-8")
    except UnicodeDecodeError:
        raise CorruptPatchError(f"record named {name_bytes[:80]!r}: tensor name is not UTF-8") from None
    position_coding = sizes.pop()
    rkind, rcoding, rpositions = _KINDS.get(kind), _CODINGS.get(coding), _POSITION_CODINGS.get(position_coding)
    if (
        rkind is None
        or rcoding is None
        or rpositions is None
        or (version == 1 and (kind in V2_KINDS or coding in V2_CODINGS))
        or (version == 2 and (coding in CODES or position_coding == PositionCoding.CLASS_MASKS))
        or (version >= INDEXED and rkind is RecordKind.END)
    ):
        raise CorruptPatchError(
            f"record for tensor {name!r}: unknown record kind {kind}, value coding {coding} or position coding "
            f"{position_coding} (format {version})"
        )
    info = dtype_by_code(dcode)
    if info is None and rkind not in (RecordKind.END, RecordKind.REMOVE):
        raise CorruptPatchError(f"record for tensor {name!r}: unknown dtype code {dcode}")
    start, length, count, escapes, value_escapes, raw_len, comp_len, hashed, *history = sizes
    ref_count, new_count = history or (0, 0)  # v2 only
    header = RecordHeader(
        rkind, name, info, shape, rcoding, start, length, count, escapes, value_escapes, raw_len, comp_len, hashed,
        ref_count, new_count, rpositions,
    )  # fmt: skip
    _check_record(header)
    return header


_NO_PAYLOAD = (RecordKind.END, RecordKind.REMOVE)
_WHOLE = (RecordKind.ADD, RecordKind.REPLACE)
_SPARSE_KINDS = (RecordKind.SPARSE, RecordKind.HISTORY)


def _check_record(h: RecordHeader) -> None:
    """Reject records whose declared sizes disagree with each other.

    Runs once per record of every patch a subscriber applies (~400 in a 0.6B model's): the fields
    are read into locals and enum members compared by identity.
    """
    kind, coding, positions, count = h.kind, h.coding, h.positions, h.count
    if kind in _NO_PAYLOAD:
        if h.raw_len or h.comp_len:
            raise CorruptPatchError(f"{_label(h)}: {kind.name} record must carry no payload")
        return
    numel = math.prod(h.shape)
    if numel > MAX_NUMEL:
        raise CorruptPatchError(f"{_label(h)}: shape {list(h.shape)} has {numel} elements (limit {MAX_NUMEL})")
    packed = coding is ValueCoding.DELTA or coding is ValueCoding.XOR
    if kind in _WHOLE and (h.start != 0 or h.length != numel or packed):
        raise CorruptPatchError(f"{_label(h)}: {kind.name} record must hold the whole tensor, raw")
    if h.start + h.length > numel:
        raise CorruptPatchError(
            f"{_label(h)}: chunk [{h.start}, {h.start + h.length}) is outside the tensor of {numel} elements"
        )
    sparse = kind in _SPARSE_KINDS
    # GAP_CODES: at most MAX_GAP_BITS - 3 extra bits per gap; GAPS16: at most one escape per gap;
    # CLASS_MASKS: at most one bit per element of the chunk
    escapes_per_gap = _EXTRA_BYTES if positions is PositionCoding.GAP_CODES else 1
    most_escapes = (h.length + 7) // 8 if positions is PositionCoding.CLASS_MASKS else escapes_per_gap * count
    if sparse and not (0 < count <= h.length and h.escapes <= most_escapes):
        raise CorruptPatchError(
            f"{_label(h)}: {count} changed elements / {h.escapes} escapes do not fit a chunk of {h.length}"
        )
    if positions is not PositionCoding.GAPS16 and not sparse:
        raise CorruptPatchError(f"{_label(h)}: a {kind.name} record has no positions to code")
    info = h.info
    two_byte_float = info.is_float and info.width == 2
    if positions is PositionCoding.CLASS_MASKS and not (kind is RecordKind.SPARSE and two_byte_float):
        raise CorruptPatchError(f"{_label(h)}: CLASS_MASKS positions in a {kind.name} record of {info.name}")
    if coding is ValueCoding.EXP_CODES and not two_byte_float:
        raise CorruptPatchError(f"{_label(h)}: EXP_CODES coding for dtype {info.name} (2-byte floats only)")
    if coding is ValueCoding.PREDICTED_CODES and not (kind is RecordKind.HISTORY and info.name == "BF16"):
        raise CorruptPatchError(f"{_label(h)}: PREDICTED_CODES in a {kind.name} record of {info.name}")
    if kind is RecordKind.HISTORY:
        counts_fit = h.escapes <= escapes_per_gap * h.new_count and h.new_count <= count <= h.new_count + h.ref_count
        if coding not in V2_CODINGS or not counts_fit:
            raise CorruptPatchError(
                f"{_label(h)}: HISTORY record with coding {coding.name}, {count} changed, "
                f"{h.new_count} new, {h.ref_count} reference positions, {h.escapes} escapes is inconsistent"
            )
        if h.ref_count > h.length:
            raise CorruptPatchError(f"{_label(h)}: {h.ref_count} reference positions in a chunk of {h.length}")
    elif h.ref_count or h.new_count:
        raise CorruptPatchError(f"{_label(h)}: only HISTORY records carry reference counts")
    if coding is ValueCoding.EXP_PLANES and not (info.is_float and info.width >= 2):
        raise CorruptPatchError(f"{_label(h)}: EXP_PLANES coding for dtype {info.name} (floats of 2+ bytes only)")
    coded = count if sparse else h.length
    most_value_escapes = coded if packed else escapes_per_value(coding) * coded
    if h.value_escapes > most_value_escapes:
        raise CorruptPatchError(f"{_label(h)}: {h.value_escapes} escaped values for {coded} {coding.name} values")
    expected = raw_len_for(h)
    if h.raw_len != expected:
        raise CorruptPatchError(f"{_label(h)}: declares {h.raw_len} decoded bytes, its fields imply {expected}")
    if (h.comp_len == 0) != (h.raw_len == 0):
        raise CorruptPatchError(f"{_label(h)}: compressed size {h.comp_len} for {h.raw_len} decoded bytes")


def _label(h: RecordHeader) -> str:
    """How _check_record's errors name a record (built only when one is raised)."""
    return f"record for tensor {h.name!r}"
