"""Lossless sparse patch codec: bitwise diff, compact position/value coding, zstd, framed records.

Pure: no I/O. `encoder` writes patches, `parse` reads them, `apply` applies them; `format` is the
byte layout (docs/patch-format.md), `bits` the position and value coding, `fused` its numba kernels.
"""

from pulsesync.codec.apply import UndoLog, apply_parts, apply_patch, apply_record
from pulsesync.codec.encoder import EncodedPart, EncodedPatch, encode, encode_part, encode_patch
from pulsesync.codec.format import FORMAT_VERSION, PatchHeader, RecordHeader, RecordKind, ValueCoding
from pulsesync.codec.history import ChunkHistory, PatchHistory, StepHistory
from pulsesync.codec.params import CodecParams
from pulsesync.codec.parse import PatchDecoder, PatchRecord, decode_record, read_header

__all__ = [
    "FORMAT_VERSION",
    "ChunkHistory",
    "CodecParams",
    "EncodedPart",
    "EncodedPatch",
    "PatchHistory",
    "StepHistory",
    "PatchDecoder",
    "PatchHeader",
    "PatchRecord",
    "RecordHeader",
    "RecordKind",
    "ValueCoding",
    "UndoLog",
    "apply_parts",
    "apply_patch",
    "apply_record",
    "decode_record",
    "encode",
    "encode_part",
    "encode_patch",
    "read_header",
]
