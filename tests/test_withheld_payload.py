"""A payload deleted under a running daemon: waited for once, then gone around to the next intact step.

An adversary with write access deletes the payload of a committed step. The daemon's fast path
waits `payload_wait_seconds` for it once (a replica that keeps no order shows markers early);
the slow path does not wait for the same object again, and rebuilds the newest step instead of
the withheld one when a newer one is ready. The next intact step is served within
`poll_seconds` + one wait + one delivery, on a file store and on SeaweedFS.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from pulsesync.protocol import signing
from pulsesync.protocol.chain import ChainClient
from pulsesync.publisher import AsyncPublisher, PublisherConfig
from pulsesync.store import FileStore, S3Store, Store
from tests.support.servers import BUCKET
from tests.support.subscribing import assert_serving, publish, subscriber, wait_for

WAIT = 3.0  # payload_wait_seconds
POLL = 0.2
DELIVERY = 1.5  # a slow-path rebuild of the small test state, with room for a loaded CI machine


@pytest.fixture(params=["fs", pytest.param("seaweedfs", marks=pytest.mark.integration)])
async def store(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[Store]:
    if request.param == "fs":
        yield FileStore(tmp_path / "store")
        return
    endpoint = request.getfixturevalue("seaweedfs_endpoint")
    s3 = S3Store(BUCKET, f"withheld-{uuid.uuid4().hex[:12]}", endpoint_url=endpoint)
    yield s3
    await s3.close()


async def test_a_deleted_payload_is_waited_for_once_and_the_next_intact_step_is_served(
    store: Store, key: Ed25519PrivateKey
) -> None:
    config = PublisherConfig(anchor_interval=3, shard_size=256 << 10, on_backpressure="block")
    pub = AsyncPublisher(config, store=store, signing_key=key)
    await pub.start()
    await publish(pub, range(5))  # anchors at 0 and 3
    sub = subscriber(store, key, poll_seconds=POLL, payload_wait_seconds=WAIT, fleet_status=False)
    stop = asyncio.Event()
    sub.task = asyncio.create_task(sub.run(stop))  # type: ignore[attr-defined]
    try:
        await wait_for(lambda: sub.step == 4, "step 4 served", sub=sub)
        # Step 5 is committed, then its payload deleted before the daemon reads it.
        await publish(pub, range(5, 6))
        chain = ChainClient(store, signing.trusted_keys([key.public_key()]))
        await chain.refresh()
        (payload,) = (await chain.commit_manifest(5)).objects
        await store.delete_many([payload.key])
        await asyncio.sleep(POLL * 3)  # the daemon has seen step 5 and is waiting for its payload
        assert sub.step == 4
        await publish(pub, range(6, 7))  # step 6: an anchor, intact
        committed = time.monotonic()
        await wait_for(lambda: sub.step == 6, "step 6 served", seconds=4 * WAIT, sub=sub)
        took = time.monotonic() - committed
        assert took <= POLL + WAIT + DELIVERY, f"step 6 served {took:.1f} s after its commit"
        assert_serving(sub, 6)
        assert "anchor" in (await sub.stores.chain.ready())[6]
    finally:
        stop.set()
        await sub.task  # type: ignore[attr-defined]
        await sub.close()
        await pub.close()
