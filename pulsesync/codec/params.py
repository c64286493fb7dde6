"""Codec settings (validated; the wire-relevant ones are recorded in every patch header)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from pulsesync.digest_algorithms import DEFAULT_ALGORITHM, DigestAlgorithm

if TYPE_CHECKING:
    from pulsesync.codec.format import ValueCoding

ValueCodingName = Literal["adaptive", "delta", "raw", "xor"]


class CodecParams(BaseModel):
    """How patches are encoded. Decoding needs none of this: patches are self-describing."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    format_version: Literal[1, 2, 3, 4, 5] = Field(
        5,
        description="patch format to write: 5 (default); 4 for fleets with subscribers before a relaunched sharded "
        "job's parts could be coded against the step before's (docs/patch-format.md), "
        "3 before the record index, "
        "2 before CLASS_MASKS, EXP_CODES and PREDICTED_CODES; 1 before 0.2",
    )
    value_coding: ValueCodingName = Field(
        "adaptive",
        description="adaptive (format 2+): per record the smallest of the codings below, PLANES, EXP_PLANES "
        "(format 3+: EXP_CODES, PREDICTED_CODES, CLASS_MASKS) and HISTORY (delta under format 1); "
        "delta: 2-bit codes of the ordered bit-pattern difference; "
        "raw: the new values themselves, as the PULSE paper stores them; xor: new XOR old",
    )
    zstd_level: int = Field(1, ge=-7, le=22, description="zstd level; 1 is the speed/ratio sweet spot")
    chunk_elements: int = Field(
        1 << 22,
        ge=1 << 10,
        le=1 << 30,
        description="elements per record: the unit of parallelism and streaming (a tensor's tail under half "
        "of it joins its last chunk)",
    )
    digest_algorithm: DigestAlgorithm = Field(
        DEFAULT_ALGORITHM,
        description="state digest: mixsum-128 (default; updated in O(patch)), xxh3-128 or sha256 (changed tensors "
        "hashed whole); format 1 defaults to xxh3-128, which subscribers before 0.2 read",
    )
    threads: int | None = Field(None, ge=1, description="worker threads; default: every available CPU")

    @model_validator(mode="before")
    @classmethod
    def _format1_digest(cls, data: Any) -> Any:
        if isinstance(data, dict) and data.get("format_version") == 1 and "digest_algorithm" not in data:
            return {**data, "digest_algorithm": "xxh3-128"}
        return data

    @property
    def adaptive(self) -> bool:
        """Each record picks its smallest coding (format 2 only)."""
        return self.value_coding == "adaptive" and self.format_version >= 2

    @property
    def coding(self) -> ValueCoding:
        """The fixed value coding as its wire enum (adaptive under format 1: DELTA)."""
        from pulsesync.codec.format import ValueCoding  # the format's module loads torch: not for settings alone

        return ValueCoding.DELTA if self.value_coding == "adaptive" else ValueCoding[self.value_coding.upper()]
