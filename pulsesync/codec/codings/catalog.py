"""Every coding, numbered as a record header stores it (docs/patch-format.md): its value coding and, for
SPARSE and HISTORY records, its position coding. Which format versions allow which is `codec.format`'s."""

from __future__ import annotations

import enum


class ValueCoding(enum.IntEnum):
    """How changed values are stored; the decoder always produces absolute new values."""

    RAW = 0  # the new bit patterns themselves (what the PULSE paper stores), in byte planes
    DELTA = 1  # zigzag of the difference of order-preserving bit patterns (one ULP = 1), packed
    XOR = 2  # new bits XOR old bits, packed
    PLANES = 3  # (v2) zigzag of the ordered difference, full width, in byte planes
    EXP_PLANES = 4  # (v2, floats) as PLANES, the values sorted (stably) by the old value's top magnitude byte
    # (v3, 2-byte floats) as EXP_PLANES, each negated where the old value is negative, as one
    # symbol byte (2 * the GAP_CODES code of |v| + sign) and |v|'s extra bits in a stream of their own
    EXP_CODES = 5
    # (v3, HISTORY records of bf16) as EXP_CODES, each residual taken against the bf16 nearest
    # 2 * old - prev (a float-space prediction) instead of the reference's ordered delta
    PREDICTED_CODES = 6

    @property
    def packed(self) -> bool:
        """Small-integer codings are stored as 2-bit codes plus escaped full values."""
        return self in (ValueCoding.DELTA, ValueCoding.XOR)


class PositionCoding(enum.IntEnum):
    """How a SPARSE or HISTORY record stores its changed positions (as gaps: p_i - p_(i-1) - 1)."""

    GAPS16 = 0  # u16 gaps in two byte planes; gaps >= ESCAPE also in full in a u64 escape list (format 1)
    GAP_CODES = 1  # (v2) one byte per gap: its bit length and top bits; its low bits in an extra-bits stream
    # (v3, SPARSE records of 2-byte floats) per magnitude class of the old values: none, every
    # element, or those a bitmap marks changed (the decoder scans the chunk's old values)
    CLASS_MASKS = 2
