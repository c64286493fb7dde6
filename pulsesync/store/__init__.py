"""Object stores: one async Store ABC, an S3-compatible backend and a filesystem backend."""

from __future__ import annotations

from urllib.parse import urlparse

from pulsesync.errors import ConfigError
from pulsesync.progress import ProgressCallback, TransferProgress
from pulsesync.store.base import ObjectInfo, Store, TransferResult
from pulsesync.store.config import StoreConfig
from pulsesync.store.fs import FileStore
from pulsesync.store.retry import RetryPolicy
from pulsesync.store.s3 import S3Store

__all__ = [
    "FileStore",
    "ObjectInfo",
    "ProgressCallback",
    "RetryPolicy",
    "S3Store",
    "StoreConfig",
    "Store",
    "TransferProgress",
    "TransferResult",
    "open_store",
]


def open_store(config: StoreConfig) -> Store:
    """The store a config names: s3://bucket/prefix or file:///path."""
    if not config.url:
        raise ConfigError("no store configured: pass --store s3://bucket/prefix or file:///path")
    parsed = urlparse(config.url)
    if parsed.scheme == "file":
        return FileStore(parsed.path, timeout=config.retry.attempt_timeout)
    return S3Store(
        parsed.netloc,
        parsed.path,
        endpoint_url=config.endpoint_url,
        region=config.region,
        addressing_style=config.addressing_style,
        part_size=config.part_size,
        concurrency=config.concurrency,
        retry=config.retry,
    )
