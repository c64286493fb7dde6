"""S3-compatible backend on aiobotocore: AWS S3, Cloudflare R2, MinIO, SeaweedFS, any endpoint_url.

Credentials come from the standard AWS chain (environment, profile, instance role) and are never
logged. One client per store (one per daemon), closed with the store.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from contextlib import AsyncExitStack
from pathlib import Path
from typing import Any, TypeVar

import aiobotocore.session
import botocore.exceptions
from botocore.config import Config as BotoConfig

from pulsesync.errors import BucketNotFoundError, ConflictError, IntegrityError, StoreError
from pulsesync.progress import ProgressCallback, ProgressTracker
from pulsesync.store import base
from pulsesync.store.base import ObjectInfo, Store, TransferResult, check_key, oversized
from pulsesync.store.retry import RetryPolicy, TruncatedBodyError, call, log, translate_error

T = TypeVar("T")
MIN_PART_SIZE = 5 << 20  # S3's minimum for every part but the last


class S3Store(Store):
    """Objects under s3://bucket/prefix."""

    def __init__(
        self,
        bucket: str,
        prefix: str = "",
        *,
        endpoint_url: str | None = None,
        region: str | None = None,
        addressing_style: str = "auto",
        part_size: int = 8 << 20,
        concurrency: int = 8,
        retry: RetryPolicy | None = None,
        connect_timeout: float = 10.0,
        read_timeout: float = 60.0,
    ) -> None:
        self.bucket = bucket
        self.prefix = prefix.strip("/") + "/" if prefix.strip("/") else ""
        self.url = f"s3://{bucket}/{self.prefix}"
        self.endpoint_url = endpoint_url
        self.part_size = max(part_size, MIN_PART_SIZE)
        self.concurrency = concurrency
        self.retry = retry or RetryPolicy()
        self._boto_config = BotoConfig(
            region_name=region,
            retries={"total_max_attempts": 1, "mode": "standard"},  # botocore tries once; retry.call retries
            s3={"addressing_style": addressing_style},
            # R2, MinIO and SeaweedFS do not all implement the newer default checksums.
            request_checksum_calculation="when_required",
            response_checksum_validation="when_required",
            max_pool_connections=max(10, 2 * concurrency),
            connect_timeout=connect_timeout,
            read_timeout=read_timeout,
        )
        self._stack = AsyncExitStack()
        self._client: Any = None
        self._client_lock = asyncio.Lock()

    @property
    def location(self) -> str:
        """The URL, and the endpoint where one is set: two regions' buckets may share a name."""
        return f"{self.url} at {self.endpoint_url}" if self.endpoint_url else self.url

    async def _s3(self) -> Any:
        if self._client is None:
            async with self._client_lock:
                if self._client is None:
                    session = aiobotocore.session.get_session()
                    client = session.create_client("s3", endpoint_url=self.endpoint_url, config=self._boto_config)
                    self._client = await self._stack.enter_async_context(client)
        return self._client

    async def close(self) -> None:
        """Close the HTTP client (idempotent)."""
        await self._stack.aclose()
        self._client = None

    def _key(self, key: str) -> str:
        return self.prefix + check_key(key)

    async def _call(self, op: str, key: str, fn: Callable[[Any], Awaitable[T]]) -> T:
        async def once() -> T:
            return await fn(await self._s3())

        try:
            return await call(once, op, f"s3://{self.bucket}/{self.prefix}{key}", self.retry)
        except BucketNotFoundError as e:  # say where, and what to do
            where = self.endpoint_url or "AWS S3"
            raise BucketNotFoundError(
                f"bucket {self.bucket!r} does not exist at {where} ({op} {key!r}); create it first "
                f"(aws s3 mb s3://{self.bucket}, mc mb, or the R2 dashboard): pulsesync never creates buckets"
            ) from e

    # --- reads ---------------------------------------------------------------------------------
    async def _read_chunks(self, s3: Any, key: str, max_size: int | None = None, **kwargs: Any) -> list[bytes]:
        """The body as the chunks it arrived in (no joining copy), length-checked; stops past max_size."""
        return (await self._get_object(s3, key, max_size, **kwargs))[0]

    async def _get_object(
        self, s3: Any, key: str, max_size: int | None = None, **kwargs: Any
    ) -> tuple[list[bytes], dict[str, Any]]:
        """GetObject: the body's chunks (length-checked, stopped past max_size) and the response's fields."""
        resp = await s3.get_object(Bucket=self.bucket, Key=self._key(key), **kwargs)
        chunks, received = [], 0
        async with resp["Body"] as body:
            async for chunk in body.iter_chunks(1 << 20):
                chunks.append(chunk)
                received += len(chunk)
                if max_size is not None and received > max_size:  # a server that ignores the range
                    raise oversized(f"get s3://{self.bucket}/{self._key(key)}", max_size)
        if received != resp["ContentLength"]:
            raise TruncatedBodyError(f"got {received} of {resp['ContentLength']} bytes")
        return chunks, resp

    async def _read(self, s3: Any, key: str, max_size: int | None = None, **kwargs: Any) -> bytes:
        return b"".join(await self._read_chunks(s3, key, max_size, **kwargs))

    async def get(self, key: str, max_size: int | None = None) -> bytes:
        """Whole object; with max_size a ranged GET of max_size + 1 bytes (IntegrityError if they all come)."""
        if max_size is None:
            return await self._call("get", key, lambda s3: self._read(s3, key))

        async def bounded(s3: Any) -> bytes:
            try:  # _read_chunks refuses the (max_size + 1)-th byte
                return await self._read(s3, key, max_size, Range=f"bytes=0-{max_size}")
            except botocore.exceptions.ClientError as e:
                if e.response.get("Error", {}).get("Code") == "InvalidRange":  # 416: the object is empty
                    return b""
                raise

        return await self._call("get", key, bounded)

    async def get_if_changed(self, key: str, etag: str | None, max_size: int) -> tuple[bytes, str | None] | None:
        """One conditional GET (If-None-Match): None on 304, else the object (bounded) and its ETag."""

        async def once(s3: Any) -> tuple[bytes, str | None] | None:
            condition = {"IfNoneMatch": etag} if etag else {}
            try:
                chunks, resp = await self._get_object(s3, key, max_size, Range=f"bytes=0-{max_size}", **condition)
            except botocore.exceptions.ClientError as e:
                code = e.response.get("Error", {}).get("Code")
                if code in ("304", "NotModified"):
                    return None
                if code == "InvalidRange":  # 416: the object is empty
                    info = await self.head(key)
                    return (b"", info.etag) if info.etag != etag else None
                raise
            return b"".join(chunks), resp.get("ETag")

        return await self._call("get", key, once)

    async def get_range(self, key: str, start: int, end: int, etag: str | None = None) -> bytes:
        """Bytes [start, end), clamped to the object's size; with etag, only from that version."""
        if start < 0 or end < start:
            raise ValueError(f"bad range [{start}, {end})")
        if start == end:  # no bytes to ask for: only the object's existence to check
            await self.head(key)
            return b""
        extra = {"IfMatch": etag} if etag else {}

        async def once(s3: Any) -> bytes:
            try:  # S3 clamps a range that runs past the end itself
                return await self._read(s3, key, end - start, Range=f"bytes={start}-{end - 1}", **extra)
            except botocore.exceptions.ClientError as e:
                if e.response.get("Error", {}).get("Code") == "InvalidRange":  # 416: starts past the end
                    return b""
                raise

        return await self._call("get_range", key, once)

    async def stream(self, key: str, chunk_size: int = 1 << 20) -> AsyncIterator[bytes]:
        """Chunks as they arrive (the request is retried; a body cut mid-stream raises StoreError)."""
        resp = await self._call("stream", key, lambda s3: s3.get_object(Bucket=self.bucket, Key=self._key(key)))
        received = 0
        try:
            async with resp["Body"] as body:
                async for chunk in body.iter_chunks(chunk_size):
                    received += len(chunk)
                    yield chunk
        except Exception as e:
            raise translate_error(e, "stream", f"s3://{self.bucket}/{self._key(key)}") from e
        if received != resp["ContentLength"]:
            raise IntegrityError(f"stream s3://{self.bucket}/{self._key(key)}: body ended after {received} bytes")

    async def head(self, key: str) -> ObjectInfo:
        """Size and etag."""

        async def once(s3: Any) -> ObjectInfo:
            resp = await s3.head_object(Bucket=self.bucket, Key=self._key(key))
            return ObjectInfo(key, int(resp["ContentLength"]), resp.get("ETag"), resp.get("LastModified"))

        return await self._call("head", key, once)

    async def list(self, prefix: str = "", start_after: str | None = None) -> AsyncIterator[ObjectInfo]:
        """Every key under prefix after start_after, lexicographic, page by page (1000 a page)."""
        args: dict[str, Any] = {"Bucket": self.bucket, "Prefix": self.prefix + prefix}
        if start_after:
            args["StartAfter"] = self.prefix + start_after
        while True:
            request = dict(args)

            async def list_page(s3: Any, request: dict[str, Any] = request) -> dict[str, Any]:
                page: dict[str, Any] = await s3.list_objects_v2(**request)
                return page

            page = await self._call("list", prefix, list_page)
            for item in page.get("Contents", []):
                key = item["Key"][len(self.prefix) :]
                yield ObjectInfo(key, int(item["Size"]), item.get("ETag"), item.get("LastModified"))
            token = page.get("NextContinuationToken")
            if not page.get("IsTruncated") or not token:
                return
            args["ContinuationToken"] = token
            args.pop("StartAfter", None)

    # --- writes --------------------------------------------------------------------------------
    async def put(self, key: str, data: bytes) -> None:
        """Create or replace an object."""
        await self._call("put", key, lambda s3: s3.put_object(Bucket=self.bucket, Key=self._key(key), Body=data))

    async def put_if_absent(self, key: str, data: bytes) -> None:
        """Conditional create with If-None-Match: *; ConflictError if the key exists."""
        attempts = 0

        async def once(s3: Any) -> None:
            nonlocal attempts
            attempts += 1
            await s3.put_object(Bucket=self.bucket, Key=self._key(key), Body=data, IfNoneMatch="*")

        try:
            await self._call("put_if_absent", key, once)
        except ConflictError:
            # A retried request may find the object its own lost-reply first attempt created.
            if attempts > 1 and await self.get(key) == data:
                return
            raise

    async def delete_many(self, keys: Iterable[str]) -> None:
        """Delete in batches of 1000; keys already gone are fine."""
        full = [self._key(k) for k in keys]
        for i in range(0, len(full), 1000):
            batch = {"Objects": [{"Key": k} for k in full[i : i + 1000]], "Quiet": True}

            async def once(s3: Any, batch: dict[str, Any] = batch) -> None:
                resp = await s3.delete_objects(Bucket=self.bucket, Delete=batch)
                errors = [e for e in resp.get("Errors", []) if e.get("Code") != "NoSuchKey"]
                if errors:
                    first = errors[0]
                    raise StoreError(f"delete {first.get('Key')}: {first.get('Code')} ({len(errors)} keys failed)")

            await self._call("delete", full[i], once)

    # --- large objects -------------------------------------------------------------------------
    async def upload_file(self, key: str, path: Path, progress: ProgressCallback | None = None) -> TransferResult:
        """put_object for small files; else a multipart upload with `concurrency` parts in flight."""
        size = os.path.getsize(path)
        tracker = ProgressTracker(key, size, progress)
        sha = hashlib.sha256()
        if size <= self.part_size:
            data = await asyncio.to_thread(Path(path).read_bytes)
            sha.update(data)
            await self.put(key, data)
            tracker.add(size)
            return TransferResult(key, size, sha.hexdigest())
        created = await self._call(
            "create_multipart_upload",
            key,
            lambda s3: s3.create_multipart_upload(Bucket=self.bucket, Key=self._key(key)),
        )
        upload_id = created["UploadId"]
        slots = asyncio.Semaphore(self.concurrency)
        tasks: list[asyncio.Task[dict[str, Any]]] = []

        async def upload_part(number: int, body: bytes) -> dict[str, Any]:
            try:
                resp = await self._call(
                    f"upload_part {number}",
                    key,
                    lambda s3: s3.upload_part(
                        Bucket=self.bucket, Key=self._key(key), PartNumber=number, UploadId=upload_id, Body=body
                    ),
                )
                tracker.add(len(body))
                return {"ETag": resp["ETag"], "PartNumber": number}
            finally:
                slots.release()

        try:
            with open(path, "rb") as f:
                number = 0
                while True:
                    await slots.acquire()  # bounds memory: at most `concurrency` parts read ahead
                    body = await asyncio.to_thread(f.read, self.part_size)
                    if not body:
                        slots.release()
                        break
                    sha.update(body)
                    number += 1
                    tasks.append(asyncio.create_task(upload_part(number, body)))
            parts = await asyncio.gather(*tasks)
            await self._call(
                "complete_multipart_upload",
                key,
                lambda s3: s3.complete_multipart_upload(
                    Bucket=self.bucket, Key=self._key(key), UploadId=upload_id, MultipartUpload={"Parts": parts}
                ),
            )
        except BaseException:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            await self._abort(key, upload_id)
            raise
        return TransferResult(key, size, sha.hexdigest())

    async def _abort(self, key: str, upload_id: str) -> None:
        try:
            s3 = await self._s3()
            await s3.abort_multipart_upload(Bucket=self.bucket, Key=self._key(key), UploadId=upload_id)
        except Exception:  # best effort: a bucket lifecycle rule cleans up what this misses
            log.warning("abort_multipart_upload %s failed; the incomplete upload stays until cleaned up", key)

    async def download_file(
        self,
        key: str,
        path: Path,
        progress: ProgressCallback | None = None,
        expected_sha256: str | None = None,
        expected_size: int | None = None,
    ) -> TransferResult:
        """Parallel ranged GETs of one object version (If-Match), written in order while hashing."""
        info = await self.head(key)
        base.check_size(f"download s3://{self.bucket}/{self._key(key)}", info.size, expected_size)
        ranges = [(s, min(s + self.part_size, info.size)) for s in range(0, info.size, self.part_size)]
        tracker = ProgressTracker(key, info.size, progress)

        same_version = {"IfMatch": info.etag} if info.etag else {}  # never mix two versions of the object

        async def fetch(start: int, end: int) -> list[bytes]:
            def request(s3: Any) -> Awaitable[list[bytes]]:
                return self._read_chunks(s3, key, end - start, Range=f"bytes={start}-{end - 1}", **same_version)

            chunks = await self._call("get_range", key, request)
            tracker.add(end - start)
            return chunks

        async def chunks() -> AsyncIterator[list[bytes]]:
            window: list[asyncio.Task[list[bytes]]] = []
            pending = iter(ranges)
            try:
                for r in pending:
                    window.append(asyncio.create_task(fetch(*r)))
                    if len(window) >= self.concurrency:
                        yield await window.pop(0)
                while window:
                    yield await window.pop(0)
            finally:
                for task in window:
                    task.cancel()
                await asyncio.gather(*window, return_exceptions=True)

        return await base.write_atomically(key, Path(path), chunks(), info.size, expected_sha256)
