"""Sharded trainers (pure): which piece of each tensor a rank owns, checked across ranks (docs/sharding.md).

`layout` describes pieces and validates them; `config` is the `sharding:` settings. The rank's
publisher that uses them is `pulsesync.publisher.sharded`.
"""

from pulsesync.sharding.layout import Assembly, Ownership, Piece, Rows, local_pieces, validate

__all__ = ["Assembly", "Ownership", "Piece", "Rows", "local_pieces", "validate"]
