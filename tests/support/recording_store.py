"""A Store wrapper that records writes in order, counts every request, and fails or stalls chosen writes.

In-process fault injection: it wraps a real backend (filesystem or S3 over HTTP) and only decides,
per write, to raise, to stall, or to pass the call through. A real server cannot fail exactly
"the ready marker of step 5", which is what these tests need. `calls` counts requests by kind
(LIST, GET, HEAD, PUT, DELETE) and `bytes_read` the bytes read: what a sync costs the store
(tests, bench/scale.py).
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import AsyncIterator, Callable, Iterable
from pathlib import Path

from pulsesync.store import ObjectInfo, ProgressCallback, Store, TransferResult

Hook = Callable[[str, str], None]
"""hook(op, key): raise to fail the write, sleep to stall it; return to let it through."""


class RecordingStore(Store):
    """Delegates to a real store; `writes` lists (op, key) of every completed write in order, `reads` each get."""

    def __init__(self, inner: Store, hook: Hook | None = None) -> None:
        self.inner = inner
        self.url = inner.url
        self.hook = hook
        self.writes: list[tuple[str, str]] = []
        self.reads: list[str] = []
        self.calls: Counter[str] = Counter()
        self.bytes_read = 0

    def _before(self, op: str, key: str) -> None:
        self.calls["DELETE" if op == "delete" else "PUT"] += 1
        if self.hook is not None:
            self.hook(op, key)

    def _read(self, data: bytes) -> bytes:
        self.calls["GET"] += 1
        self.bytes_read += len(data)
        return data

    async def close(self) -> None:
        await self.inner.close()

    async def get(self, key: str, max_size: int | None = None) -> bytes:
        self.reads.append(key)
        return self._read(await self.inner.get(key, max_size))

    async def get_if_changed(self, key: str, etag: str | None, max_size: int) -> tuple[bytes, str | None] | None:
        """One conditional GET on S3 (the inner store's own), counted as GET, and as NOT_MODIFIED when it was."""
        self.calls["GET"] += 1  # also when it fails (404)
        got = await self.inner.get_if_changed(key, etag, max_size)
        if got is None:
            self.calls["NOT_MODIFIED"] += 1
        else:
            self.bytes_read += len(got[0])
        return got

    async def get_range(self, key: str, start: int, end: int) -> bytes:
        return self._read(await self.inner.get_range(key, start, end))

    def stream(self, key: str, chunk_size: int = 1 << 20) -> AsyncIterator[bytes]:
        self.calls["GET"] += 1
        return self.inner.stream(key, chunk_size)

    async def head(self, key: str) -> ObjectInfo:
        self.calls["HEAD"] += 1
        return await self.inner.head(key)

    def list(self, prefix: str = "", start_after: str | None = None) -> AsyncIterator[ObjectInfo]:
        self.calls["LIST"] += 1
        return self.inner.list(prefix, start_after)

    async def put(self, key: str, data: bytes) -> None:
        self._before("put", key)
        await self.inner.put(key, data)
        self.writes.append(("put", key))

    async def put_if_absent(self, key: str, data: bytes) -> None:
        self._before("put_if_absent", key)
        await self.inner.put_if_absent(key, data)
        self.writes.append(("put_if_absent", key))

    async def delete_many(self, keys: Iterable[str]) -> None:
        keys = list(keys)
        for key in keys:
            self._before("delete", key)
        await self.inner.delete_many(keys)
        self.writes.extend(("delete", k) for k in keys)

    async def upload_file(self, key: str, path: Path, progress: ProgressCallback | None = None) -> TransferResult:
        self._before("upload_file", key)
        done = await self.inner.upload_file(key, path, progress)
        self.writes.append(("upload_file", key))
        return done

    async def download_file(
        self,
        key: str,
        path: Path,
        progress: ProgressCallback | None = None,
        expected_sha256: str | None = None,
        expected_size: int | None = None,
    ) -> TransferResult:
        done = await self.inner.download_file(key, path, progress, expected_sha256, expected_size)
        self.calls["GET"] += 1
        self.bytes_read += done.size
        return done


def stall_forever(flag: Path) -> None:
    """Signal that the stall point is reached (creates flag), then block until the process is killed."""
    flag.write_text("reached")
    while True:
        time.sleep(60)
