"""The fetcher: a prefix's objects read, bounded by and checked against what a verified manifest lists.

Reads (markers up to the manifest cap, objects at their listed size), a patch read ahead beside
its marker (`speculation.py`), the one wait for a payload a replica shows late, and the bytes
downloaded. It trusts nothing and decides nothing: which object to read, and whether a manifest
is to be believed, is the chain client's (`chain.py`); states are built from what it reads in
`pulsesync.rebuild`.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

from tenacity import AsyncRetrying, retry_if_exception_type, stop_after_delay, wait_exponential

from pulsesync.digest import StateDigest
from pulsesync.errors import IntegrityError, NotFoundError
from pulsesync.metrics import PAYLOAD_WAITS
from pulsesync.progress import ProgressCallback
from pulsesync.protocol.manifest import MAX_MANIFEST_BYTES, ObjectRef, PatchManifest
from pulsesync.protocol.speculation import Speculation
from pulsesync.store import Store
from pulsesync.store.base import TransferResult

log = logging.getLogger("pulsesync.chain")
_WAITS_KEPT = 1024  # payload keys whose wait deadline is remembered
T = TypeVar("T")


@dataclass
class Fetcher:
    """Reads one store's markers and objects, each bounded and (objects) checked; counts what it downloads."""

    store: Store
    threads: int | None = 1  # hashing and decoding threads for what is read
    # A replica that copies objects in any order (S3 replication, rclone, filer.sync) can show a marker
    # before its payload: a payload not found is read again, with backoff, for this long before it counts.
    payload_wait_seconds: float = 0.0
    bytes_downloaded: int = 0
    _ahead: Speculation | None = None
    _wait_ends: dict[str, float] = field(default_factory=dict)  # payload key -> monotonic end of its one wait

    async def marker(self, key: str) -> bytes:
        """A ready marker's raw bytes (at most MAX_MANIFEST_BYTES), not verified."""
        data = await self.store.get(key, max_size=MAX_MANIFEST_BYTES)
        self.bytes_downloaded += len(data)
        return data

    def read_ahead(self, key: str, max_size: int) -> None:
        """Start reading (and hashing) an object no verified manifest asked for yet (`speculation.py`)."""
        self._ahead = Speculation(self.store, key, max_size)

    @property
    def reading_ahead(self) -> str | None:
        """The key being read ahead, if any."""
        return None if self._ahead is None else self._ahead.key

    async def drop_read_ahead(self) -> None:
        """Stop an object read ahead that no fetch has taken."""
        if self._ahead is not None:
            ahead, self._ahead = self._ahead, None
            await ahead.cancel()
            self.bytes_downloaded += ahead.read_bytes

    async def fetch(self, ref: ObjectRef) -> bytes:
        """An object's bytes, checked against the size and SHA-256 its manifest lists."""
        if self._ahead is not None and self._ahead.key == ref.key:
            ahead, self._ahead = self._ahead, None
            read_ahead = await ahead.take(ref)
            self.bytes_downloaded += ahead.read_bytes
            if read_ahead is not None:
                return read_ahead
        # A larger object stops at size + 1 bytes.
        data = await self.patiently(ref.key, lambda: self.store.get(ref.key, max_size=ref.size))
        self.bytes_downloaded += len(data)
        await asyncio.to_thread(check_object, ref, data, f"{self.store.url}{ref.key}")
        return data

    async def fetch_patch(self, manifest: PatchManifest) -> bytes:
        """A patch's bytes: its one object, or a sharded step's parts concatenated (split_parts splits them)."""
        if len(manifest.objects) == 1:
            return await self.fetch(manifest.objects[0])
        return b"".join(await asyncio.gather(*map(self.fetch, manifest.objects)))

    async def download(self, ref: ObjectRef, path: Path, progress: ProgressCallback | None = None) -> TransferResult:
        """An object streamed to a local file, its size and SHA-256 checked on the way (an anchor's shard)."""
        done = await self.patiently(
            ref.key,
            lambda: self.store.download_file(
                ref.key, path, progress=progress, expected_sha256=ref.sha256, expected_size=ref.size
            ),
        )
        self.bytes_downloaded += done.size
        return done

    async def patiently(self, key: str, read: Callable[[], Awaitable[T]]) -> T:
        """`read()` of a payload a verified marker lists, a NotFoundError tried again for payload_wait_seconds.

        On a replica that keeps no order the payload is "not yet", not gone: waiting for it here
        keeps a subscriber on its fast path (no slow-path storm when a fleet sees a marker early).
        An object is waited for once: its wait ends payload_wait_seconds after the first read that
        missed it, so a fast path that waited and the slow path after it (or a later sync) do not
        wait again for an object that was deleted, not delayed.
        """
        if self.payload_wait_seconds <= 0:
            return await read()
        try:
            return await read()
        except NotFoundError:
            now = time.monotonic()
            ends = self._wait_ends.setdefault(key, now + self.payload_wait_seconds)
            while len(self._wait_ends) > _WAITS_KEPT:  # bounded: the oldest waits are long over
                del self._wait_ends[next(iter(self._wait_ends))]
            if ends <= now:
                raise

        def waited(state: object) -> None:
            PAYLOAD_WAITS.inc()
            log.info("%s%s: listed by a verified marker, not there yet; reading it again", self.store.url, key)

        retrying = AsyncRetrying(
            stop=stop_after_delay(max(ends - time.monotonic(), 0.0)),
            wait=wait_exponential(multiplier=0.05, max=2.0),
            retry=retry_if_exception_type(NotFoundError),
            before_sleep=waited,
            reraise=True,
        )
        async for attempt in retrying:
            with attempt:
                found = await read()
                self._wait_ends.pop(key, None)
                return found
        raise AssertionError("unreachable")  # pragma: no cover


def split_parts(manifest: PatchManifest, data: bytes) -> list[bytes]:
    """A patch's bytes split into its objects' bytes by the sizes its signed manifest lists (checked by fetch)."""
    if len(data) != sum(ref.size for ref in manifest.objects):
        raise IntegrityError(
            f"patch {manifest.step}: {len(data)} bytes, its manifest lists {len(manifest.objects)} objects"
        )
    parts, at = [], 0
    for ref in manifest.objects:
        parts.append(data[at : at + ref.size])
        at += ref.size
    return parts


def check_patch(manifest: PatchManifest, data: bytes, where: str) -> None:
    """IntegrityError unless `data` is the patch's objects, each of the size and SHA-256 the manifest lists."""
    if len(manifest.objects) == 1:
        return check_object(manifest.objects[0], data, where)
    for ref, part in zip(manifest.objects, split_parts(manifest, data), strict=True):
        check_object(ref, part, f"{where} ({ref.key})")


def check_object(ref: ObjectRef, data: bytes, where: str) -> None:
    """IntegrityError unless `data` has the size and SHA-256 its manifest lists."""
    if len(data) != ref.size:
        raise IntegrityError(f"{where}: {len(data)} bytes, its manifest lists {ref.size}")
    sha = hashlib.sha256(data).hexdigest()
    if sha != ref.sha256:
        raise IntegrityError(f"{where}: SHA-256 {sha} does not match its manifest ({ref.sha256})")


def check_digest(actual: StateDigest, expected: StateDigest, what: str) -> None:
    """IntegrityError naming the differing tensors unless two state digests agree."""
    if actual.root != expected.root:
        raise IntegrityError(
            f"{what}: state digest {actual.root} does not match the manifest's {expected.root} "
            f"({actual.describe_mismatch(expected)})"
        )
