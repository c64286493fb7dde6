"""Lossless sparse patch codec: bitwise diff, compact position/value coding, zstd, framed records.

Pure: no I/O. `encoder` writes patches, `parse` reads them, `apply` applies them; `format` is the
byte layout (docs/patch-format.md), `codings` the position and value codings (one module each,
its numba kernels beside its numpy code), `batch` the kernel that applies a run of records
across codings, `streams` the encoder's kernel across codings, `diff` where two chunks differ,
`jit` how kernels are compiled.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import lazy_loader

# Submodules load on first use: the settings (`config` modules) import without torch, numba or aiobotocore.
__getattr__, __dir__, __all__ = lazy_loader.attach(
    __name__,
    submod_attrs={
        "apply": ["UndoLog", "apply_parts", "apply_patch", "apply_record", "apply_records_of"],
        "changes": ["Changes"],
        "encoder": ["EncodedPart", "EncodedPatch", "encode", "encode_part", "encode_patch"],
        "format": ["FORMAT_VERSION", "PatchHeader", "RecordHeader", "RecordKind", "ValueCoding"],
        "history": ["ChunkHistory", "PatchHistory", "StepHistory"],
        "params": ["CodecParams"],
        "parse": ["PatchDecoder", "PatchRecord", "decode_record", "read_header"],
    },
)

if TYPE_CHECKING:
    from pulsesync.codec.apply import (
        UndoLog as UndoLog,
    )
    from pulsesync.codec.apply import (
        apply_parts as apply_parts,
    )
    from pulsesync.codec.apply import (
        apply_patch as apply_patch,
    )
    from pulsesync.codec.apply import (
        apply_record as apply_record,
    )
    from pulsesync.codec.apply import (
        apply_records_of as apply_records_of,
    )
    from pulsesync.codec.changes import Changes as Changes
    from pulsesync.codec.encoder import (
        EncodedPart as EncodedPart,
    )
    from pulsesync.codec.encoder import (
        EncodedPatch as EncodedPatch,
    )
    from pulsesync.codec.encoder import (
        encode as encode,
    )
    from pulsesync.codec.encoder import (
        encode_part as encode_part,
    )
    from pulsesync.codec.encoder import (
        encode_patch as encode_patch,
    )
    from pulsesync.codec.format import (
        FORMAT_VERSION as FORMAT_VERSION,
    )
    from pulsesync.codec.format import (
        PatchHeader as PatchHeader,
    )
    from pulsesync.codec.format import (
        RecordHeader as RecordHeader,
    )
    from pulsesync.codec.format import (
        RecordKind as RecordKind,
    )
    from pulsesync.codec.format import (
        ValueCoding as ValueCoding,
    )
    from pulsesync.codec.history import (
        ChunkHistory as ChunkHistory,
    )
    from pulsesync.codec.history import (
        PatchHistory as PatchHistory,
    )
    from pulsesync.codec.history import (
        StepHistory as StepHistory,
    )
    from pulsesync.codec.params import CodecParams as CodecParams
    from pulsesync.codec.parse import (
        PatchDecoder as PatchDecoder,
    )
    from pulsesync.codec.parse import (
        PatchRecord as PatchRecord,
    )
    from pulsesync.codec.parse import (
        decode_record as decode_record,
    )
    from pulsesync.codec.parse import (
        read_header as read_header,
    )
