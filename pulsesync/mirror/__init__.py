"""The mirror: copies a chain from one store to another, verified, in commit order (untrusted relays)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import lazy_loader

# Submodules load on first use: the settings import without torch, numba or aiobotocore.
__getattr__, __dir__, __all__ = lazy_loader.attach(
    __name__,
    submod_attrs={
        "config": ["MirrorConfig"],
        "plan": ["first_step", "marker_step", "to_copy"],
        "worker": ["Mirror", "MirrorRun"],
    },
)

if TYPE_CHECKING:
    from pulsesync.mirror.config import MirrorConfig as MirrorConfig
    from pulsesync.mirror.plan import first_step as first_step
    from pulsesync.mirror.plan import marker_step as marker_step
    from pulsesync.mirror.plan import to_copy as to_copy
    from pulsesync.mirror.worker import Mirror as Mirror
    from pulsesync.mirror.worker import MirrorRun as MirrorRun
