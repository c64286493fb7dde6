"""Retention: prune old patches and anchors by policy without breaking a chain a subscriber may need."""

from pulsesync.retention.plan import Plan, Published, StoreListing, Tombstone, kept_entries, plan
from pulsesync.retention.policy import RetentionConfig, RetentionPolicy
from pulsesync.retention.worker import RetentionWorker

__all__ = [
    "Plan",
    "Published",
    "RetentionConfig",
    "RetentionPolicy",
    "RetentionWorker",
    "StoreListing",
    "Tombstone",
    "kept_entries",
    "plan",
]
