"""What a coding's kernel returns: 0, or a status its module words (each coding numbers its own).

The statuses every position decoder may return are here; a coding's own are in its module, in
its ERRORS beside their texts, and no two codings share a number (the batch kernel returns any).
"""

from __future__ import annotations

from collections.abc import Mapping

from pulsesync.errors import CorruptPatchError

POSITIONS_OK, POSITIONS_ESCAPES_MISMATCH, POSITIONS_OUTSIDE = 0, 1, 3
OUTSIDE = "a position is outside the chunk of {length}"  # every position decoder, both paths


def describe(status: int, length: int, *errors: Mapping[int, str]) -> str:
    """A kernel's status in the words of the first of `errors` that knows it (a chunk of `length`)."""
    for table in errors:
        if status in table:
            return table[status].format(length=length)
    raise KeyError(f"kernel status {status}")


def check(status: int, length: int, where: str, *errors: Mapping[int, str]) -> None:
    """CorruptPatchError naming `where` and what `status` means, unless it is POSITIONS_OK."""
    if status != POSITIONS_OK:
        raise CorruptPatchError(f"{where}: {describe(status, length, *errors)}")
