"""Filesystem backend for file:///path: a local disk or a shared filesystem (NFS, Lustre, ...).

Writes are atomic (temp file in the same directory, fsync, rename, fsync the directory);
put_if_absent publishes with link(2), which fails if the name exists, also on NFS.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import errno
import os
import stat
from collections.abc import AsyncIterator, Callable, Iterable
from pathlib import Path
from typing import ParamSpec, TypeVar

from pulsesync.atomic_files import TEMP_MARK, write_file
from pulsesync.errors import ConflictError, NotFoundError
from pulsesync.store.base import ObjectInfo, Store, TransferResult, check_key, write_atomically
from pulsesync.store.progress import ProgressCallback, ProgressTracker
from pulsesync.store.retry import translate_error

P = ParamSpec("P")
R = TypeVar("R")


def _mtime(st: os.stat_result) -> dt.datetime:
    return dt.datetime.fromtimestamp(st.st_mtime, dt.timezone.utc)


class FileStore(Store):
    """Objects as files under a root directory; keys map to relative paths."""

    def __init__(self, root: Path | str) -> None:
        self.root = Path(root).absolute()
        self.url = self.root.as_uri() + "/"

    def _path(self, key: str) -> Path:
        return self.root / check_key(key)

    async def _io(self, op: str, key: str, fn: Callable[P, R], *args: P.args, **kwargs: P.kwargs) -> R:
        """Run blocking file I/O in a worker thread, translating OS errors for this key."""
        try:
            return await asyncio.to_thread(fn, *args, **kwargs)
        except (IsADirectoryError, NotADirectoryError):
            raise NotFoundError(f"{op} {self.url}{key}: no such object") from None
        except OSError as e:
            raise translate_error(e, op, f"{self.url}{key}") from e

    # --- reads ---------------------------------------------------------------------------------
    async def get(self, key: str) -> bytes:
        """Whole object."""
        return await self._io("get", key, self._path(key).read_bytes)

    async def get_range(self, key: str, start: int, end: int) -> bytes:
        """Bytes [start, end), clamped to the file's size."""
        if start < 0 or end < start:
            raise ValueError(f"bad range [{start}, {end})")

        def read() -> bytes:
            with open(self._path(key), "rb") as f:
                f.seek(start)
                return f.read(end - start)

        return await self._io("get_range", key, read)

    async def stream(self, key: str, chunk_size: int = 1 << 20) -> AsyncIterator[bytes]:
        """Chunks read in a worker thread."""
        f = await self._io("stream", key, open, self._path(key), "rb")
        try:
            while chunk := await asyncio.to_thread(f.read, chunk_size):
                yield chunk
        finally:
            f.close()

    async def head(self, key: str) -> ObjectInfo:
        """Size (and a modification-time etag)."""
        st = await self._io("head", key, os.stat, self._path(key))
        if not stat.S_ISREG(st.st_mode):  # a directory is a prefix, not an object
            raise NotFoundError(f"head {self.url}{key}: no such object")
        return ObjectInfo(key, st.st_size, f"{st.st_mtime_ns:x}-{st.st_size:x}", _mtime(st))

    def _list_sync(self, prefix: str, start_after: str | None) -> list[ObjectInfo]:
        # Walk only the directory the prefix points into; sort keys as strings (S3 order).
        base = self.root / prefix.rsplit("/", 1)[0] if "/" in prefix else self.root
        found = []
        for dirpath, _dirs, files in os.walk(base):
            rel_dir = os.path.relpath(dirpath, self.root)
            for name in files:
                if TEMP_MARK in name:
                    continue
                key = name if rel_dir == "." else f"{rel_dir}/{name}".replace(os.sep, "/")
                if key.startswith(prefix) and (start_after is None or key > start_after):
                    try:
                        st = os.stat(os.path.join(dirpath, name))
                        found.append(ObjectInfo(key, st.st_size, last_modified=_mtime(st)))
                    except FileNotFoundError:  # deleted while listing
                        continue
        found.sort(key=lambda o: o.key)
        return found

    async def list(self, prefix: str = "", start_after: str | None = None) -> AsyncIterator[ObjectInfo]:
        """Every key under prefix after start_after, lexicographic."""
        for info in await asyncio.to_thread(self._list_sync, prefix, start_after):
            yield info

    # --- writes --------------------------------------------------------------------------------
    async def put(self, key: str, data: bytes) -> None:
        """Atomic create or replace: temp file, fsync, rename, fsync directory."""
        await self._io("put", key, write_file, self._path(key), data)

    async def put_if_absent(self, key: str, data: bytes) -> None:
        """Atomic exclusive create: the complete temp file is linked to the key, which fails if it exists."""
        path = self._path(key)

        def write() -> None:
            try:
                write_file(path, data, exclusive=True)
            except FileExistsError:
                raise ConflictError(f"put_if_absent {self.url}{key}: the object already exists") from None

        await self._io("put_if_absent", key, write)

    async def delete_many(self, keys: Iterable[str]) -> None:
        """Unlink each key (missing ones are fine) and prune directories left empty."""
        paths = [self._path(k) for k in keys]

        def delete() -> None:
            parents = set()
            for p in paths:
                with contextlib.suppress(FileNotFoundError):
                    p.unlink()
                parents.add(p.parent)
            for d in sorted(parents, key=lambda d: len(d.parts), reverse=True):
                while d != self.root and d.is_relative_to(self.root):
                    try:
                        d.rmdir()
                    except OSError as e:
                        if e.errno not in (errno.ENOTEMPTY, errno.EEXIST, errno.ENOENT):
                            raise
                        break
                    d = d.parent

        await self._io("delete", ",".join(keys) if len(paths) < 4 else f"{len(paths)} keys", delete)

    # --- large objects -------------------------------------------------------------------------
    async def _copy_chunks(self, src: Path, tracker: ProgressTracker, chunk: int = 8 << 20) -> AsyncIterator[bytes]:
        with open(src, "rb") as f:
            while block := await asyncio.to_thread(f.read, chunk):
                tracker.add(len(block))
                yield block

    async def upload_file(self, key: str, path: Path, progress: ProgressCallback | None = None) -> TransferResult:
        """Copy a local file in atomically, hashing it."""
        size = os.path.getsize(path)
        return await write_atomically(
            key, self._path(key), self._copy_chunks(Path(path), ProgressTracker(key, size, progress)), size, None
        )

    async def download_file(
        self, key: str, path: Path, progress: ProgressCallback | None = None, expected_sha256: str | None = None
    ) -> TransferResult:
        """Copy an object out atomically, hashing it."""
        info = await self.head(key)
        chunks = self._copy_chunks(self._path(key), ProgressTracker(key, info.size, progress))
        return await write_atomically(key, Path(path), chunks, info.size, expected_sha256)
