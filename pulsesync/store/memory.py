"""In-memory backend for memory://name: a dict of bytes, for fast tests above the store layer.

It passes the same conformance suite as the real backends (pulsesync.store.testing); nothing
persists beyond the object, so it is never a store a publisher and a subscriber could share
across processes.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import hashlib
from collections.abc import AsyncIterator, Iterable
from pathlib import Path

from pulsesync.errors import ConflictError, NotFoundError
from pulsesync.progress import ProgressCallback, ProgressTracker
from pulsesync.store.base import (
    ObjectInfo,
    Store,
    TransferResult,
    check_key,
    check_size,
    oversized,
    write_atomically,
)


class MemoryStore(Store):
    """Objects as bytes in a dict, with their write times."""

    def __init__(self, name: str = "test") -> None:
        self.url = f"memory://{name}/"
        self.objects: dict[str, tuple[bytes, dt.datetime]] = {}

    def _object(self, op: str, key: str) -> bytes:
        try:
            return self.objects[check_key(key)][0]
        except KeyError:
            raise NotFoundError(f"{op} {self.url}{key}: no such object") from None

    # --- reads ---------------------------------------------------------------------------------
    async def get(self, key: str, max_size: int | None = None) -> bytes:
        """Whole object (IntegrityError past max_size)."""
        data = self._object("get", key)
        if max_size is not None and len(data) > max_size:
            raise oversized(f"get {self.url}{key}", max_size)
        return data

    async def get_range(self, key: str, start: int, end: int) -> bytes:
        """Bytes [start, end), clamped to the object's size."""
        if start < 0 or end < start:
            raise ValueError(f"bad range [{start}, {end})")
        return self._object("get_range", key)[start:end]

    async def stream(self, key: str, chunk_size: int = 1 << 20) -> AsyncIterator[bytes]:
        """The object in chunks."""
        data = self._object("stream", key)
        for start in range(0, len(data), chunk_size):
            yield data[start : start + chunk_size]

    async def head(self, key: str) -> ObjectInfo:
        """Size, a content etag and the write time."""
        data = self._object("head", key)
        return ObjectInfo(key, len(data), hashlib.sha256(data).hexdigest()[:32], self.objects[key][1])

    async def list(self, prefix: str = "", start_after: str | None = None) -> AsyncIterator[ObjectInfo]:
        """Every key under prefix after start_after, lexicographic."""
        for key in sorted(k for k in self.objects if k.startswith(prefix) and (start_after is None or k > start_after)):
            if key in self.objects:  # deleted while listing
                data, written = self.objects[key]
                yield ObjectInfo(key, len(data), last_modified=written)

    # --- writes --------------------------------------------------------------------------------
    async def put(self, key: str, data: bytes) -> None:
        """Create or replace."""
        self.objects[check_key(key)] = (bytes(data), dt.datetime.now(dt.timezone.utc))

    async def put_if_absent(self, key: str, data: bytes) -> None:
        """Create only if absent (one event loop: the check and the write cannot interleave)."""
        if check_key(key) in self.objects:
            raise ConflictError(f"put_if_absent {self.url}{key}: the object already exists")
        await self.put(key, data)

    async def delete_many(self, keys: Iterable[str]) -> None:
        """Delete; missing keys are fine."""
        for key in keys:
            self.objects.pop(check_key(key), None)

    # --- large objects -------------------------------------------------------------------------
    async def upload_file(self, key: str, path: Path, progress: ProgressCallback | None = None) -> TransferResult:
        """Read a local file in."""
        data = await asyncio.to_thread(Path(path).read_bytes)
        ProgressTracker(key, len(data), progress).add(len(data))
        await self.put(key, data)
        return TransferResult(key, len(data), hashlib.sha256(data).hexdigest())

    async def download_file(
        self,
        key: str,
        path: Path,
        progress: ProgressCallback | None = None,
        expected_sha256: str | None = None,
        expected_size: int | None = None,
    ) -> TransferResult:
        """Write an object out atomically, hashing it."""
        data = self._object("download", key)
        check_size(f"download {self.url}{key}", len(data), expected_size)
        tracker = ProgressTracker(key, len(data), progress)

        async def chunks() -> AsyncIterator[bytes]:
            tracker.add(len(data))
            yield data

        return await write_atomically(key, Path(path), chunks(), len(data), expected_sha256)
