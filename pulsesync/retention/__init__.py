"""Retention: prune old patches and anchors by policy without breaking a chain a subscriber may need."""

from __future__ import annotations

from typing import TYPE_CHECKING

import lazy_loader

# Submodules load on first use: the settings (`config` modules) import without torch, numba or aiobotocore.
__getattr__, __dir__, __all__ = lazy_loader.attach(
    __name__,
    submod_attrs={
        "plan": ["Plan", "Published", "StoreListing", "Tombstone", "kept_entries", "plan"],
        "policy": ["RetentionConfig", "RetentionPolicy"],
        "worker": ["RetentionWorker"],
    },
)

if TYPE_CHECKING:
    from pulsesync.retention.plan import (
        Plan as Plan,
    )
    from pulsesync.retention.plan import (
        Published as Published,
    )
    from pulsesync.retention.plan import (
        StoreListing as StoreListing,
    )
    from pulsesync.retention.plan import (
        Tombstone as Tombstone,
    )
    from pulsesync.retention.plan import (
        kept_entries as kept_entries,
    )
    from pulsesync.retention.plan import (
        plan as plan,
    )
    from pulsesync.retention.policy import RetentionConfig as RetentionConfig
    from pulsesync.retention.policy import RetentionPolicy as RetentionPolicy
    from pulsesync.retention.worker import RetentionWorker as RetentionWorker
