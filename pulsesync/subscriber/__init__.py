"""The subscriber daemon and in-process API: fast, chain and slow paths, verified, delivered to sinks."""

from pulsesync.subscriber.config import SubscriberConfig
from pulsesync.subscriber.paths import SyncPath, SyncResult
from pulsesync.subscriber.status import SubscriberStatus
from pulsesync.subscriber.subscriber import Subscriber

__all__ = ["Subscriber", "SubscriberConfig", "SubscriberStatus", "SyncPath", "SyncResult"]
