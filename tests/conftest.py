"""Test configuration: Hypothesis profiles (HYPOTHESIS_PROFILE=thorough for long runs), shared servers and fixtures."""

import os
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from hypothesis import HealthCheck, settings

from pulsesync.publisher import AsyncPublisher
from pulsesync.publisher.config import PublisherConfig
from pulsesync.store import FileStore, RetryPolicy, S3Store, Store
from tests.support.servers import BUCKET, moto_server, seaweedfs_server
from tests.support.subscribing import publish

settings.register_profile("default", max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("thorough", parent=settings.get_profile("default"), max_examples=3000)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "default"))


@pytest.fixture(scope="session")
def moto_endpoint() -> Iterator[str]:
    """A moto S3 server (server mode) on 127.0.0.1 for the whole session."""
    with moto_server() as endpoint:
        yield endpoint


@pytest.fixture(scope="session")
def seaweedfs_endpoint(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A SeaweedFS S3 gateway on 127.0.0.1 for the whole session."""
    with seaweedfs_server(tmp_path_factory.mktemp("seaweedfs")) as endpoint:
        yield endpoint


@pytest.fixture(params=["fs", pytest.param("moto", marks=pytest.mark.integration)])
async def store(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[Store]:
    """A fresh, empty store: a directory, or a prefix of its own in the moto server's bucket."""
    if request.param == "fs":
        yield FileStore(tmp_path / "store")
        return
    # A try gets 15 s, not 60: CI once saw a GET to this local server go unanswered for a whole try
    # (issue 28's note); a request to 127.0.0.1 that takes 15 s is hung, and the retry gets through.
    endpoint, policy = request.getfixturevalue("moto_endpoint"), RetryPolicy(attempt_timeout=15.0)
    s3 = S3Store(BUCKET, f"t-{uuid.uuid4().hex[:12]}", endpoint_url=endpoint, retry=policy)
    yield s3
    await s3.close()


@pytest.fixture
def key() -> Ed25519PrivateKey:
    """A fresh publisher signing key."""
    return Ed25519PrivateKey.generate()


# Seconds each engine test module takes alone on CI's machine kind (one at a time, 2 cores): `-m engine -n 2`
# starts the longest first, so the two workers end together (longest processing time first).
ENGINE_SECONDS = {
    "test_vllm_transfer.py": 243,
    "test_vllm_tp.py": 230,  # its tied and untied cases, 263 s and 191 s
    "test_vllm_moe.py": 221,
    "test_vllm_engine.py": 213,
    "test_grpo_loop.py": 180,
    "test_vllm_inprocess.py": 161,
    "test_vllm_lora.py": 110,
    "test_docs.py": 97,
    "test_verl_vllm.py": 54,
}


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Engine tests longest first; the soak runs only when asked for (`-m soak`): it takes minutes."""
    engine_seconds = {id(i): ENGINE_SECONDS.get(i.path.name, 0) for i in items if "engine" in i.keywords}
    items.sort(key=lambda i: -engine_seconds.get(id(i), 0))
    if "soak" in (config.option.markexpr or ""):
        return
    skip = pytest.mark.skip(reason="the soak runs only with -m soak (SOAK_MINUTES, default 2)")
    for item in items:
        if "soak" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
async def publisher(store: Store, key: Ed25519PrivateKey) -> AsyncIterator[AsyncPublisher]:
    """A publisher with steps 0..8 committed, anchors at 0 and 5."""
    config = PublisherConfig(anchor_interval=5, shard_size=256 << 10, on_backpressure="block")
    pub = AsyncPublisher(config, store=store, signing_key=key)
    await pub.start()
    await publish(pub, range(9))
    yield pub
    await pub.flush()
