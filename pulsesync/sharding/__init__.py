"""Sharded trainers (pure): which piece of each tensor a rank owns, checked across ranks (docs/sharding.md).

`layout` describes pieces and validates them; `config` is the `sharding:` settings. The rank's
publisher that uses them is `pulsesync.publisher.sharded`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import lazy_loader

# Submodules load on first use: the settings (`config` modules) import without torch, numba or aiobotocore.
__getattr__, __dir__, __all__ = lazy_loader.attach(
    __name__,
    submod_attrs={
        "layout": ["Assembly", "Ownership", "Piece", "Rows", "local_pieces", "validate"],
    },
)

if TYPE_CHECKING:
    from pulsesync.sharding.layout import (
        Assembly as Assembly,
    )
    from pulsesync.sharding.layout import (
        Ownership as Ownership,
    )
    from pulsesync.sharding.layout import (
        Piece as Piece,
    )
    from pulsesync.sharding.layout import (
        Rows as Rows,
    )
    from pulsesync.sharding.layout import (
        local_pieces as local_pieces,
    )
    from pulsesync.sharding.layout import (
        validate as validate,
    )
