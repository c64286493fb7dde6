"""Object stores: one async Store ABC, an S3-compatible backend and a filesystem backend."""

from __future__ import annotations

from typing import TYPE_CHECKING
from urllib.parse import urlparse

import lazy_loader

from pulsesync.errors import ConfigError
from pulsesync.progress import ProgressCallback, TransferProgress

if TYPE_CHECKING:
    from pulsesync.store.base import ObjectInfo as ObjectInfo
    from pulsesync.store.base import Store as Store
    from pulsesync.store.base import TransferResult as TransferResult
    from pulsesync.store.config import StoreConfig as StoreConfig
    from pulsesync.store.fs import FileStore as FileStore
    from pulsesync.store.retry import RetryPolicy as RetryPolicy
    from pulsesync.store.s3 import S3Store as S3Store

# Backends load on first use: the settings (`config` modules) import without aiobotocore.
__getattr__, __dir__, _lazy = lazy_loader.attach(
    __name__,
    submod_attrs={
        "base": ["ObjectInfo", "Store", "TransferResult"],
        "config": ["StoreConfig"],
        "fs": ["FileStore"],
        "retry": ["RetryPolicy"],
        "s3": ["S3Store"],
    },
)
__all__ = [*_lazy, "ProgressCallback", "TransferProgress", "open_store"]


def open_store(config: StoreConfig) -> Store:
    """The store a config names: s3://bucket/prefix or file:///path."""
    if not config.url:
        raise ConfigError("no store configured: pass --store s3://bucket/prefix or file:///path")
    from pulsesync.store.fs import FileStore
    from pulsesync.store.s3 import S3Store

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
