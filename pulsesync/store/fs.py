"""Filesystem backend for file:///path: a local disk or a shared filesystem (NFS, Lustre, ...).

Writes are atomic (temp file in the same directory, fsync, rename, fsync the directory);
put_if_absent publishes with link(2), which fails if the name exists, also on NFS.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import errno
import itertools
import logging
import os
import stat
from collections.abc import AsyncIterator, Callable, Iterable
from pathlib import Path
from typing import BinaryIO, ParamSpec, TypeVar

from pulsesync import metrics
from pulsesync.atomic_files import TEMP_MARK, write_file
from pulsesync.deadlines import within
from pulsesync.errors import ConflictError, NotFoundError, PulseSyncError, StoreError
from pulsesync.progress import ProgressCallback, ProgressTracker
from pulsesync.store.base import (
    ObjectInfo,
    Store,
    TransferResult,
    check_key,
    check_size,
    is_key,
    oversized,
    write_atomically,
)
from pulsesync.store.retry import translate_error

log = logging.getLogger("pulsesync.store")
P = ParamSpec("P")
R = TypeVar("R")


def _mtime(st: os.stat_result) -> dt.datetime:
    return dt.datetime.fromtimestamp(st.st_mtime, dt.timezone.utc)


class FileStore(Store):
    """Objects as files under a root directory; keys map to relative paths."""

    def __init__(self, root: Path | str, timeout: float = 300.0, max_list_entries: int = 10_000_000) -> None:
        self.root = Path(root).absolute()
        self.max_list_entries = max_list_entries
        self._real_root = Path(os.path.realpath(self.root))
        self.url = self.root.as_uri() + "/"
        self.timeout = timeout

    def _path(self, key: str) -> Path:
        path = self.root / check_key(key)
        # A symlinked folder must not lead a read, or retention's delete, outside the root.
        if not Path(os.path.realpath(path.parent)).is_relative_to(self._real_root):
            raise StoreError(f"{self.url}{key}: its folder resolves outside the store root (a symlink)")
        return path

    def _open(self, key: str) -> BinaryIO:
        """Open a key for reading: regular files only, never through a symlink (a FIFO or /dev/zero is no object)."""
        fd = os.open(self._path(key), os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC)
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):  # listings skip these too
                raise NotFoundError(f"{self.url}{key}: not a regular file, so no object")
            return os.fdopen(fd, "rb")
        except BaseException:
            os.close(fd)
            raise

    async def _io(self, op: str, key: str, fn: Callable[P, R], *args: P.args, **kwargs: P.kwargs) -> R:
        """Run blocking file I/O in a worker thread with a deadline, translating OS errors for this key."""
        try:
            return await within(self.timeout, asyncio.to_thread(fn, *args, **kwargs))
        except asyncio.TimeoutError:
            raise StoreError(f"{op} {self.url}{key}: no answer within {self.timeout:g} s (hung filesystem?)") from None
        except (IsADirectoryError, NotADirectoryError):
            raise NotFoundError(f"{op} {self.url}{key}: no such object") from None
        except OSError as e:
            if e.errno == errno.ELOOP:  # O_NOFOLLOW met a symlink; listings skip these too
                raise NotFoundError(f"{op} {self.url}{key}: a symlink, so no object") from None
            raise translate_error(e, op, f"{self.url}{key}") from e
        except PulseSyncError:
            raise
        except Exception as e:  # a bug or a tree shape nobody foresaw: a store error, never a dead daemon
            raise translate_error(e, op, f"{self.url}{key}") from e

    # --- reads ---------------------------------------------------------------------------------
    async def get(self, key: str, max_size: int | None = None) -> bytes:
        """Whole object (IntegrityError past max_size)."""

        def read() -> bytes:
            with self._open(key) as f:
                if max_size is None:
                    return f.read()
                # As many bytes as the file holds (+1 to see it grew): read(n) allocates all n bytes
                # first, and a follower's patch read ahead under a 4x bound took 1.1 ms instead of 0.1.
                want = min(os.fstat(f.fileno()).st_size, max_size) + 1
                data = f.read(want)
                if len(data) == want <= max_size:  # it grew since: read on up to the bound
                    data += f.read(max_size + 1 - want)
            if max_size is not None and len(data) > max_size:
                raise oversized(f"get {self.url}{key}", max_size)
            return data

        return await self._io("get", key, read)

    async def get_range(self, key: str, start: int, end: int) -> bytes:
        """Bytes [start, end), clamped to the file's size."""
        if start < 0 or end < start:
            raise ValueError(f"bad range [{start}, {end})")

        def read() -> bytes:
            with self._open(key) as f:
                f.seek(start)
                return f.read(end - start)

        return await self._io("get_range", key, read)

    async def stream(self, key: str, chunk_size: int = 1 << 20) -> AsyncIterator[bytes]:
        """Chunks read in a worker thread."""
        f = await self._io("stream", key, self._open, key)
        try:
            while chunk := await self._io("stream", key, f.read, chunk_size):
                yield chunk
        finally:
            f.close()

    async def head(self, key: str) -> ObjectInfo:
        """Size (and a modification-time etag)."""
        st = await self._io("head", key, os.lstat, self._path(key))
        if not stat.S_ISREG(st.st_mode):  # a directory is a prefix, not an object; nor is a symlink
            raise NotFoundError(f"head {self.url}{key}: no such object")
        return ObjectInfo(key, st.st_size, f"{st.st_mtime_ns:x}-{st.st_size:x}", _mtime(st))

    def _list_sync(self, prefix: str, start_after: str | None) -> list[ObjectInfo]:
        """Every object under prefix, walked without recursion and only where a key can be.

        The tree is untrusted: anyone who can write to the directory can nest folders past any
        recursion limit, loop symlinks, or leave FIFOs. A folder is entered only if keys under it can
        match the prefix and are short enough to be keys (check_key's byte bound caps the depth);
        symlinks are never followed; a folder that cannot be read is skipped, logged and counted; more
        than max_list_entries entries seen is a StoreError, not unbounded work.
        """
        folder, _, _ = prefix.rpartition("/")
        found = []
        pending = [(self.root / folder, f"{folder}/" if folder else "")]
        seen = 0
        while pending:
            path, rel = pending.pop()
            try:
                with os.scandir(path) as entries:
                    listing = list(itertools.islice(entries, self.max_list_entries - seen + 1))
            except (FileNotFoundError, NotADirectoryError):  # removed while listing, or the prefix names a file
                continue
            except OSError as e:
                metrics.STORE_FOLDERS_SKIPPED.inc()
                log.warning("list %s%s: folder %s skipped (%s)", self.url, prefix, rel or ".", e)
                continue
            seen += len(listing)
            if seen > self.max_list_entries:
                raise StoreError(f"list {self.url}{prefix}: more than {self.max_list_entries} entries; refused")
            for entry in listing:
                key = rel + entry.name
                if TEMP_MARK in entry.name or not is_key(key):
                    continue
                if entry.is_dir(follow_symlinks=False):
                    below = key + "/"
                    if below.startswith(prefix) or prefix.startswith(below):
                        pending.append((Path(entry.path), below))
                    continue
                if not key.startswith(prefix) or (start_after is not None and key <= start_after):
                    continue
                try:
                    st = entry.stat(follow_symlinks=False)
                except FileNotFoundError:  # deleted while listing
                    continue
                if stat.S_ISREG(st.st_mode):  # a symlink, FIFO or device is no object
                    found.append(ObjectInfo(key, st.st_size, last_modified=_mtime(st)))
        found.sort(key=lambda o: o.key)
        return found

    async def list(self, prefix: str = "", start_after: str | None = None) -> AsyncIterator[ObjectInfo]:
        """Every key under prefix after start_after, lexicographic."""
        for info in await self._io("list", prefix, self._list_sync, prefix, start_after):
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
        """Unlink each key (missing ones are fine) and prune directories left empty.

        A key whose folder resolves outside the root (a symlink) is left alone, logged and counted;
        the rest of the batch is still deleted.
        """
        keys = list(keys)
        paths = []
        for key in keys:
            try:
                paths.append(self._path(key))
            except StoreError as e:
                metrics.STORE_DELETES_REFUSED.inc()
                log.warning("delete: %s; left alone", e)

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
    async def _copy_chunks(self, src: BinaryIO, tracker: ProgressTracker, chunk: int = 8 << 20) -> AsyncIterator[bytes]:
        with src as f:
            while block := await self._io("copy", tracker.key, f.read, chunk):
                tracker.add(len(block))
                yield block

    async def upload_file(self, key: str, path: Path, progress: ProgressCallback | None = None) -> TransferResult:
        """Copy a local file in atomically, hashing it."""
        size = os.path.getsize(path)
        chunks = self._copy_chunks(open(path, "rb"), ProgressTracker(key, size, progress))  # noqa: SIM115 - closed by _copy_chunks
        return await write_atomically(key, self._path(key), chunks, size, None)

    async def download_file(
        self,
        key: str,
        path: Path,
        progress: ProgressCallback | None = None,
        expected_sha256: str | None = None,
        expected_size: int | None = None,
    ) -> TransferResult:
        """Copy an object out atomically, hashing it."""
        info = await self.head(key)
        check_size(f"download {self.url}{key}", info.size, expected_size)
        src = await self._io("download", key, self._open, key)
        chunks = self._copy_chunks(src, ProgressTracker(key, info.size, progress))
        return await write_atomically(key, Path(path), chunks, info.size, expected_sha256)
