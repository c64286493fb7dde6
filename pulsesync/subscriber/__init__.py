"""The subscriber daemon and in-process API: fast, chain and slow paths, verified, delivered to sinks."""

from __future__ import annotations

from typing import TYPE_CHECKING

import lazy_loader

# Submodules load on first use: the settings (`config` modules) import without torch, numba or aiobotocore.
__getattr__, __dir__, __all__ = lazy_loader.attach(
    __name__,
    submod_attrs={
        "config": ["SubscriberConfig"],
        "paths": ["SyncPath", "SyncResult"],
        "status": ["SubscriberStatus"],
        "subscriber": ["Subscriber"],
    },
)

if TYPE_CHECKING:
    from pulsesync.subscriber.config import SubscriberConfig as SubscriberConfig
    from pulsesync.subscriber.paths import SyncPath as SyncPath
    from pulsesync.subscriber.paths import SyncResult as SyncResult
    from pulsesync.subscriber.status import SubscriberStatus as SubscriberStatus
    from pulsesync.subscriber.subscriber import Subscriber as Subscriber
