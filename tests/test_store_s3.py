"""The S3 backend against the conformance suite on real S3 servers: moto (server mode) and SeaweedFS."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import aiobotocore.session
import pytest

from pulsesync.store import S3Store, Store
from pulsesync.store.testing import StoreConformance
from tests.support.servers import BUCKET


async def _s3_store(endpoint: str) -> AsyncIterator[S3Store]:
    # A fresh prefix per test isolates tests inside one bucket.
    store = S3Store(BUCKET, f"t-{uuid.uuid4().hex[:12]}", endpoint_url=endpoint, part_size=8 << 20, concurrency=8)
    try:
        yield store
    finally:
        await store.close()


class S3Conformance(StoreConformance):
    """Raw access through a separate aiobotocore client, beside the S3Store under test."""

    async def raw_put(self, store: Store, key: str, data: bytes) -> None:
        assert isinstance(store, S3Store)
        async with aiobotocore.session.get_session().create_client("s3", endpoint_url=store.endpoint_url) as s3:
            await s3.put_object(Bucket=store.bucket, Key=store.prefix + key, Body=data)

    async def raw_get(self, store: Store, key: str) -> bytes | None:
        assert isinstance(store, S3Store)
        async with aiobotocore.session.get_session().create_client("s3", endpoint_url=store.endpoint_url) as s3:
            try:
                reply = await s3.get_object(Bucket=store.bucket, Key=store.prefix + key)
            except s3.exceptions.NoSuchKey:
                return None
            async with reply["Body"] as body:
                data: bytes = await body.read()
                return data


@pytest.mark.integration
class TestMotoStore(S3Conformance):
    @pytest.fixture
    async def store(self, moto_endpoint: str) -> AsyncIterator[S3Store]:
        async for store in _s3_store(moto_endpoint):
            yield store


@pytest.mark.integration
class TestSeaweedFSStore(S3Conformance):
    @pytest.fixture
    async def store(self, seaweedfs_endpoint: str) -> AsyncIterator[S3Store]:
        async for store in _s3_store(seaweedfs_endpoint):
            yield store


@pytest.mark.integration
async def test_256_mib_multipart_and_parallel_download_through_moto(moto_endpoint: str, tmp_path: Path) -> None:
    import hashlib
    import os

    data = os.urandom(256 << 20)
    src, dst = tmp_path / "src.bin", tmp_path / "dst.bin"
    src.write_bytes(data)
    async for store in _s3_store(moto_endpoint):
        up = await store.upload_file("weights/model.safetensors", src)
        down = await store.download_file("weights/model.safetensors", dst, expected_sha256=up.sha256)
    assert up.sha256 == down.sha256 == hashlib.sha256(data).hexdigest()
    assert dst.read_bytes() == data
