"""The S3 backend against the conformance suite on real S3 servers: moto (server mode) and SeaweedFS."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from pulsesync.store import S3Store
from pulsesync.store.testing import StoreConformance
from tests.support.servers import BUCKET, seaweedfs_server


@pytest.fixture(scope="session")
def seaweedfs_endpoint(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with seaweedfs_server(tmp_path_factory.mktemp("seaweedfs")) as endpoint:
        yield endpoint


async def _s3_store(endpoint: str) -> AsyncIterator[S3Store]:
    # A fresh prefix per test isolates tests inside one bucket.
    store = S3Store(BUCKET, f"t-{uuid.uuid4().hex[:12]}", endpoint_url=endpoint, part_size=8 << 20, concurrency=8)
    try:
        yield store
    finally:
        await store.close()


@pytest.mark.integration
class TestMotoStore(StoreConformance):
    @pytest.fixture
    async def store(self, moto_endpoint: str) -> AsyncIterator[S3Store]:
        async for store in _s3_store(moto_endpoint):
            yield store


@pytest.mark.integration
class TestSeaweedFSStore(StoreConformance):
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
