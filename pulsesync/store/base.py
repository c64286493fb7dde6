"""The Store ABC: the only way pulsesync talks to storage (modelled on zarr-python v3's abc/store.py).

A store is a flat key space under a prefix. Keys are relative to the prefix, use "/" as the
separator and never start with "/" or contain "." or ".." segments. Every backend passes one
conformance suite (pulsesync.store.testing).
"""

from __future__ import annotations

import asyncio
import datetime as dt
import hashlib
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator, Iterable
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import BinaryIO

from pulsesync.atomic_files import AtomicFile
from pulsesync.errors import IntegrityError, NotFoundError, StoreError
from pulsesync.progress import ProgressCallback


@dataclass(frozen=True)
class ObjectInfo:
    """What a listing or head returns about one object."""

    key: str
    size: int
    etag: str | None = None
    last_modified: dt.datetime | None = None  # UTC


@dataclass(frozen=True)
class TransferResult:
    """Outcome of upload_file / download_file: size and the SHA-256 computed while streaming."""

    key: str
    size: int
    sha256: str


MAX_KEY_BYTES = 1024  # S3's limit on a key's UTF-8 length


def check_key(key: str) -> str:
    """Reject keys that could escape the prefix or alias another key; returns the key."""
    if any(part in ("", ".", "..") for part in key.split("/")):  # also "", "/abs" and "dir/"
        raise StoreError(f"invalid key {key!r}: keys are relative, '/'-separated, without '.' or '..' segments")
    if not key.isprintable() or len(key.encode("utf-8", "surrogatepass")) > MAX_KEY_BYTES:  # NUL, newlines, surrogates
        raise StoreError(f"invalid key {key[:200]!r}: control characters, lone surrogates or over 1024 bytes")
    return key


def is_key(key: str) -> bool:
    """Whether check_key accepts a key."""
    try:
        check_key(key)
    except StoreError:
        return False
    return True


class Store(ABC):
    """Async object store: backends implement the abstract methods and pass pulsesync.store.testing."""

    url: str

    @property
    def location(self) -> str:
        """Where the store is, for logs and metric labels: its URL (and, where it has one, its endpoint)."""
        return self.url

    # --- lifecycle -----------------------------------------------------------------------------
    async def close(self) -> None:  # noqa: B027 - optional hook; most backends hold nothing
        """Release connections; the store is unusable afterwards."""

    async def __aenter__(self) -> Store:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.close()

    # --- reads ---------------------------------------------------------------------------------
    @abstractmethod
    async def get(self, key: str, max_size: int | None = None) -> bytes:
        """Whole object; NotFoundError if absent.

        With max_size, reading stops past it (at most max_size + 1 bytes arrive) and an object
        larger than max_size is an IntegrityError: objects are untrusted, their sizes come from
        signed manifests, and a replaced object must not cost more memory than the one it replaced.
        """

    @abstractmethod
    async def get_range(self, key: str, start: int, end: int) -> bytes:
        """Bytes [start, end) of an object (clamped to its size); NotFoundError if absent."""

    @abstractmethod
    def stream(self, key: str, chunk_size: int = 1 << 20) -> AsyncIterator[bytes]:
        """The object in chunks, as they arrive; NotFoundError if absent."""

    @abstractmethod
    async def head(self, key: str) -> ObjectInfo:
        """Size (and etag) of an object; NotFoundError if absent."""

    @abstractmethod
    def list(self, prefix: str = "", start_after: str | None = None) -> AsyncIterator[ObjectInfo]:
        """Every object whose key starts with prefix, in lexicographic key order, after start_after."""

    async def get_if_changed(self, key: str, etag: str | None, max_size: int) -> tuple[bytes, str | None] | None:
        """The object and its etag, or None while its etag is still `etag`; NotFoundError if absent.

        Bounded as get(key, max_size). Backends with a conditional GET (S3's If-None-Match: one
        request, 304 and no body while unchanged) override this HEAD-then-GET.
        """
        info = await self.head(key)
        if etag is not None and info.etag == etag:
            return None
        return await self.get(key, max_size), info.etag

    async def exists(self, key: str) -> bool:
        """Whether an object exists."""
        try:
            await self.head(key)
        except NotFoundError:
            return False
        return True

    # --- writes --------------------------------------------------------------------------------
    @abstractmethod
    async def put(self, key: str, data: bytes) -> None:
        """Create or replace an object, atomically: readers see the old or the new object."""

    @abstractmethod
    async def put_if_absent(self, key: str, data: bytes) -> None:
        """Create an object only if no object has the key; ConflictError otherwise."""

    @abstractmethod
    async def delete_many(self, keys: Iterable[str]) -> None:
        """Delete objects; keys already gone are not an error."""

    # --- large objects -------------------------------------------------------------------------
    @abstractmethod
    async def upload_file(self, key: str, path: Path, progress: ProgressCallback | None = None) -> TransferResult:
        """Upload a local file (multipart where supported), hashing it while it streams."""

    @abstractmethod
    async def download_file(
        self,
        key: str,
        path: Path,
        progress: ProgressCallback | None = None,
        expected_sha256: str | None = None,
        expected_size: int | None = None,
    ) -> TransferResult:
        """Download to a local file atomically (temp file, fsync, rename), hashing while streaming.

        With expected_sha256, a mismatch raises IntegrityError and leaves no file at path; with
        expected_size, an object of another size is refused before a byte is written.
        """


def oversized(target: str, max_size: int) -> IntegrityError:
    """The error for an object larger than the size its reader expects."""
    return IntegrityError(f"{target}: larger than the expected {max_size} bytes (read stopped there)")


def check_size(target: str, size: int, expected_size: int | None) -> None:
    """IntegrityError unless an object's size is the one expected (None: any size)."""
    if expected_size is not None and size != expected_size:
        raise IntegrityError(f"{target}: {size} bytes, expected {expected_size}")


Chunks = AsyncIterator[bytes] | AsyncIterator[list[bytes]]  # in order; a list is one part's chunks


def _append(f: BinaryIO, sha: hashlib._Hash, chunks: bytes | list[bytes]) -> int:
    for chunk in [chunks] if isinstance(chunks, bytes) else chunks:
        f.write(chunk)
        sha.update(chunk)
    return len(chunks) if isinstance(chunks, bytes) else sum(map(len, chunks))


async def write_atomically(
    key: str,
    path: Path,
    chunks: Chunks,
    size: int,
    expected_sha256: str | None,
) -> TransferResult:
    """Write chunks to path atomically while hashing; size and hash are checked before the file appears."""
    out = AtomicFile(path)
    sha = hashlib.sha256()
    written = 0
    try:
        async for chunk in chunks:  # in order; hashing 16 MiB takes ~10 ms, so off the event loop
            written += await asyncio.to_thread(_append, out.file, sha, chunk)
            if written > size:  # an object that grew, or a server sending more than asked: stop here
                raise IntegrityError(f"download {key}: more than the {size} bytes expected")
        digest = sha.hexdigest()
        if written != size:
            raise IntegrityError(f"download {key}: got {written} bytes, the object has {size}")
        if expected_sha256 is not None and digest != expected_sha256:
            raise IntegrityError(f"download {key}: SHA-256 {digest} does not match the expected {expected_sha256}")
    except BaseException:
        out.discard()
        raise
    await asyncio.to_thread(out.commit)
    return TransferResult(key, size, digest)
