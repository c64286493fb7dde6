"""The subscriber daemon and in-process API: fast, chain and slow paths, verified, delivered to sinks."""

from pulsesync.subscriber.config import SubscriberConfig
from pulsesync.subscriber.subscriber import Subscriber, SubscriberStatus, SyncResult

__all__ = ["Subscriber", "SubscriberConfig", "SubscriberStatus", "SyncResult"]
