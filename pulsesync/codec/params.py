"""Codec settings (validated; the wire-relevant ones are recorded in every patch header)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from pulsesync.codec.format import ValueCoding
from pulsesync.digest import DEFAULT_ALGORITHM, DigestAlgorithm

ValueCodingName = Literal["delta", "raw", "xor"]


class CodecParams(BaseModel):
    """How patches are encoded. Decoding needs none of this: patches are self-describing."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    value_coding: ValueCodingName = Field(
        "delta",
        description="delta: zigzag of the ordered bit-pattern difference (smallest); "
        "raw: the new values themselves, as the PULSE paper stores them; xor: new XOR old",
    )
    zstd_level: int = Field(1, ge=-7, le=22, description="zstd level; 1 is the speed/ratio sweet spot")
    chunk_elements: int = Field(
        1 << 22, ge=1 << 10, le=1 << 30, description="elements per record: the unit of parallelism and streaming"
    )
    digest_algorithm: DigestAlgorithm = Field(DEFAULT_ALGORITHM, description="state digest: xxh3-128 or sha256")
    threads: int | None = Field(None, ge=1, description="worker threads; default: every available CPU")

    @property
    def coding(self) -> ValueCoding:
        """The value coding as its wire enum."""
        return ValueCoding[self.value_coding.upper()]
