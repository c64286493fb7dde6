"""Lossless sparse patch codec: bitwise diff, compact position/value coding, zstd, framed records.

Pure: no I/O. See docs/patch-format.md for the byte layout.
"""

from pulsesync.codec.decoder import PatchDecoder, PatchRecord, UndoLog, apply_patch, decode_record, read_header
from pulsesync.codec.encoder import encode_patch
from pulsesync.codec.format import FORMAT_VERSION, PatchHeader, RecordHeader, RecordKind, ValueCoding
from pulsesync.codec.params import CodecParams

__all__ = [
    "FORMAT_VERSION",
    "CodecParams",
    "PatchDecoder",
    "PatchHeader",
    "PatchRecord",
    "RecordHeader",
    "RecordKind",
    "ValueCoding",
    "UndoLog",
    "apply_patch",
    "decode_record",
    "encode_patch",
    "read_header",
]
