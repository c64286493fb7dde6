"""A mirror that offers another run's markers (signed with the same key) never chooses the run, on SeaweedFS.

The origin publishes run A; run B, published with the same key elsewhere, holds steps 1000 and
1001. A lying mirror holds B's markers under A's prefix: first only B's, then both runs'. A cold
subscriber reading [mirror, origin], with and without a cache dir, serves A's newest step every
time, and the mirror's B markers are counted against it. A chained mirror fed B's markers by its
upstream skips them and keeps copying A.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from pulsesync.mirror import Mirror, MirrorConfig
from pulsesync.protocol import layout, signing
from pulsesync.publisher import AsyncPublisher, PublisherConfig
from pulsesync.store import S3Store, Store
from pulsesync.subscriber import Subscriber
from tests.support.helpers import trainer_states
from tests.support.servers import BUCKET
from tests.support.subscribing import FAST_RETRY, STATES, assert_serving, publish

pytestmark = pytest.mark.integration


@pytest.fixture
async def stores(seaweedfs_endpoint: str) -> AsyncIterator[Callable[[str], Store]]:
    """Stores under prefixes of their own in the SeaweedFS bucket, closed at the end."""
    run, opened = uuid.uuid4().hex[:8], []

    def open_prefix(name: str) -> Store:
        opened.append(S3Store(BUCKET, f"{name}-{run}", endpoint_url=seaweedfs_endpoint))
        return opened[-1]

    yield open_prefix
    for store in opened:
        await store.close()


async def copy_all(source: Store, target: Store) -> None:
    """What a lying mirror does: every object of `source` put under the same key in `target`, verbatim."""
    async for info in source.list(""):
        await target.put(info.key, await source.get(info.key))


def subscriber(stores: list[Store], key: Ed25519PrivateKey, cache: Path | None = None) -> Subscriber:
    config = FAST_RETRY.model_copy(update={"payload_wait_seconds": 0.0, "cache_dir": cache, "fleet_status": False})
    return Subscriber(config, stores=stores, trusted=signing.trusted_keys([key.public_key()]))


async def assert_cold_subscribers_serve_the_origins_run(
    mirror: Store, origin: Store, key: Ed25519PrivateKey, cache: Path, step: int
) -> None:
    """Without a cache, with an empty one, and restarted on it: each serves `step` of run A."""
    for cache_dir in (None, cache, cache):
        sub = subscriber([mirror, origin], key, cache_dir)
        async with sub:
            await sub.sync()
            assert_serving(sub, step)
            assert sub.stores.sources[0].chain.stream_id == sub.stores.sources[1].chain.stream_id
            assert {layout.commit_key(1000), layout.commit_key(1001)} <= set(sub.stores.sources[0].chain.rejected)
            assert sub.status.stores[mirror.location]["rejected_markers"] >= 2


async def test_a_mirror_offering_another_runs_markers_never_chooses_the_run(
    stores: Callable[[str], Store], key: Ed25519PrivateKey, tmp_path: Path
) -> None:
    config = PublisherConfig(anchor_interval=5, shard_size=256 << 10, on_backpressure="block")
    origin, other = stores("origin"), stores("other")
    async with AsyncPublisher(config, store=other, signing_key=key) as run_b:
        for step in (1000, 1001):
            await run_b.publish(step, trainer_states(STATES)[step - 990])
    run_a = AsyncPublisher(config, store=origin, signing_key=key)
    await run_a.start()
    await publish(run_a, range(7))

    # The mirror holds only run B's markers.
    lying = stores("lying")
    await copy_all(other, lying)
    await assert_cold_subscribers_serve_the_origins_run(lying, origin, key, tmp_path / "cache", 6)

    # A chained mirror follows a regional mirror of run A.
    trusted = signing.trusted_keys([key.public_key()])
    regional, chained = stores("regional"), stores("chained")
    to_regional = Mirror(origin, regional, MirrorConfig(payload_wait_seconds=0), trusted)
    to_chained = Mirror(regional, chained, MirrorConfig(payload_wait_seconds=0), trusted)
    assert (await to_regional.run_once()).steps == [5, 6]
    assert (await to_chained.run_once()).steps == [5, 6]

    # Now both mirrors hold both runs' markers.
    await copy_all(origin, lying)
    await copy_all(other, regional)
    await assert_cold_subscribers_serve_the_origins_run(lying, origin, key, tmp_path / "cache", 6)

    # Run A goes on: the regional mirror and the chained one copy it, and skip run B's markers.
    await publish(run_a, range(7, 9))
    assert (await to_regional.run_once()).steps == [7, 8]
    copied = await to_chained.run_once()
    assert copied.steps == [7, 8]
    assert {layout.commit_key(1000), layout.commit_key(1001)} <= set(to_chained.skipped)
    held = [info.key async for info in chained.list(layout.READY_PREFIX)]
    assert layout.commit_key(8) in held and layout.commit_key(1000) not in held and layout.commit_key(1001) not in held

    # A subscriber of the chained mirror serves run A's newest step from it.
    sub = subscriber([chained, origin], key)
    async with sub:
        await sub.sync()
        assert_serving(sub, 8)
        assert sub.stores.sources[0].syncs == 1
    await run_a.close()
