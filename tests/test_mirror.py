"""`pulsesync mirror` and subscribers with a list of stores, on file stores: what is copied, in which order,
what is refused, and how a subscriber reads past a mirror that lags, withholds or lies."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from pulsesync.errors import StaleStoreError
from pulsesync.mirror import Mirror, MirrorConfig
from pulsesync.mirror.plan import to_copy
from pulsesync.protocol import layout, signing
from pulsesync.protocol.chain import ChainClient
from pulsesync.protocol.manifest import AnchorManifest, PatchManifest
from pulsesync.publisher import AsyncPublisher
from pulsesync.publisher.config import PublisherConfig
from pulsesync.retention import RetentionPolicy
from pulsesync.store import FileStore, Store
from pulsesync.subscriber import Subscriber
from pulsesync.subscriber.paths import SyncPath
from tests.support.subscribing import FAST_RETRY, assert_serving, publish


@pytest.fixture
async def origin(tmp_path: Path, key: Ed25519PrivateKey) -> AsyncPublisher:
    """A file-store origin with steps 0..8 committed (anchors at 0 and 5)."""
    config = PublisherConfig(anchor_interval=5, shard_size=256 << 10, on_backpressure="block")
    pub = AsyncPublisher(config, store=FileStore(tmp_path / "origin"), signing_key=key)
    await pub.start()
    await publish(pub, range(9))
    return pub


def mirror(origin: Store, target: Store, key: Ed25519PrivateKey, **settings: object) -> Mirror:
    return Mirror(origin, target, MirrorConfig.model_validate(settings), signing.trusted_keys([key.public_key()]))


def subscriber(stores: list[Store], key: Ed25519PrivateKey, **overrides: object) -> Subscriber:
    """A subscriber reading `stores` in order."""
    config = FAST_RETRY.model_copy(update={"payload_wait_seconds": 0.0, **overrides})
    return Subscriber(config, stores=stores, trusted=signing.trusted_keys([key.public_key()]))


async def manifest_of(store: Store, key: Ed25519PrivateKey, step: int) -> PatchManifest | AnchorManifest:
    chain = ChainClient(store, signing.trusted_keys([key.public_key()]))
    await chain.refresh()
    return await chain.commit_manifest(step)


async def keys(store: Store, prefix: str = "") -> list[str]:
    return [info.key async for info in store.list(prefix)]


def test_plan_copies_commits_in_step_order_and_added_anchors_after_their_commit() -> None:
    origin = {
        layout.commit_key(4): 4,
        layout.commit_key(5): 5,
        layout.anchor_ready_key(5): 5,
        layout.commit_key(6): 6,
        layout.anchor_ready_key(3): 3,
    }
    assert to_copy(origin, set(), start=5) == [layout.commit_key(5), layout.anchor_ready_key(5), layout.commit_key(6)]
    # An anchor added later to a step the target holds is copied; one of a step it does not hold is not.
    held = {layout.commit_key(5), layout.commit_key(6)}
    assert to_copy(origin, held, start=7) == [layout.anchor_ready_key(5)]


async def test_an_empty_target_gets_the_newest_anchor_and_every_step_after_it(
    origin: AsyncPublisher, tmp_path: Path, key: Ed25519PrivateKey
) -> None:
    target = FileStore(tmp_path / "mirror")
    run = await mirror(origin.store, target, key).run_once()
    assert run.steps == [5, 6, 7, 8] and not run.skipped
    for step in run.steps:  # the same bytes under the same keys, markers included
        assert await target.get(layout.commit_key(step)) == await origin.store.get(layout.commit_key(step))
    assert await target.get(layout.POINTER_KEY) == layout.pointer_body(8)
    assert (await mirror(origin.store, target, key).run_once()).steps == []  # nothing twice
    await publish(origin, range(9, 11))
    assert (await mirror(origin.store, target, key).run_once()).steps == [9, 10]

    sub = subscriber([target, origin.store], key)
    result = await sub.sync()
    assert (result.step, result.path) == (10, SyncPath.SLOW)
    assert_serving(sub, 10)
    assert [s.syncs for s in sub.stores.sources] == [1, 0]


async def test_the_mirror_copies_nothing_that_does_not_verify(
    origin: AsyncPublisher, tmp_path: Path, key: Ed25519PrivateKey
) -> None:
    target = FileStore(tmp_path / "mirror")
    await mirror(origin.store, target, key).run_once()
    await publish(origin, range(9, 11))
    manifest = await manifest_of(origin.store, key, 9)
    payload = manifest.objects[0].key
    data = bytearray(await origin.store.get(payload))
    data[len(data) // 2] ^= 0xFF
    await origin.store.put(payload, bytes(data))  # a swapped byte at the origin (or an upstream mirror)
    run = await mirror(origin.store, target, key).run_once()
    assert run.skipped == [layout.commit_key(9)] and run.steps == [10]
    assert not await target.exists(layout.commit_key(9)) and not await target.exists(payload)
    # Forged markers are not copied either.
    await origin.store.put(layout.commit_key(11), b'{"step": 11}')
    run = await mirror(origin.store, target, key).run_once()
    assert run.skipped == [layout.commit_key(11)] and not await target.exists(layout.commit_key(11))


async def test_a_payload_the_origin_does_not_hold_yet_stops_the_pass_not_the_order(
    origin: AsyncPublisher, tmp_path: Path, key: Ed25519PrivateKey
) -> None:
    target = FileStore(tmp_path / "mirror")
    await mirror(origin.store, target, key).run_once()
    await publish(origin, range(9, 11))
    payload = (await manifest_of(origin.store, key, 9)).objects[0]
    data = await origin.store.get(payload.key)
    await origin.store.delete_many([payload.key])  # the origin is a replica: step 9's marker came first
    run = await mirror(origin.store, target, key, payload_wait_seconds=0.2).run_once()
    assert run.steps == [] and not await target.exists(layout.commit_key(10))  # 10 waits for 9
    await origin.store.put(payload.key, data)
    assert (await mirror(origin.store, target, key).run_once()).steps == [9, 10]


async def test_mirrors_of_mirrors_and_the_targets_own_retention(
    origin: AsyncPublisher, tmp_path: Path, key: Ed25519PrivateKey
) -> None:
    first, second = FileStore(tmp_path / "first"), FileStore(tmp_path / "second")
    policy = RetentionPolicy(keep_patches=1, keep_anchors=1, grace_seconds=0, fleet_ttl_seconds=0)
    relay = mirror(first, second, key, retention=policy.model_dump())
    await mirror(origin.store, first, key).run_once()
    await relay.run_once()
    await publish(origin, range(9, 12))
    await mirror(origin.store, first, key).run_once()
    assert (await relay.run_once()).steps == [9, 10, 11]
    await relay.retention.run_once()  # type: ignore[union-attr]  # grace 0: the payloads go now
    kept = {layout.parse_ready_key(k).step for k in await keys(second, layout.READY_PREFIX)}  # type: ignore[union-attr]
    assert 11 in kept and 6 not in kept
    assert (await relay.run_once()).steps == []  # what retention pruned is not copied again
    sub = subscriber([second, origin.store], key)
    await sub.sync()
    assert_serving(sub, 11)
    assert [s.syncs for s in sub.stores.sources] == [1, 0]


async def test_a_mirror_that_lies_or_withholds_sends_the_step_to_the_next_store(
    origin: AsyncPublisher, tmp_path: Path, key: Ed25519PrivateKey
) -> None:
    target = FileStore(tmp_path / "mirror")
    await mirror(origin.store, target, key).run_once()
    sub = subscriber([target, origin.store], key)
    await sub.sync()
    assert_serving(sub, 8)

    # Lies: swapped bytes in the mirror's copy of step 9's patch. Taken from the origin, fast.
    await publish(origin, range(9, 10))
    await mirror(origin.store, target, key).run_once()
    payload = (await manifest_of(origin.store, key, 9)).objects[0].key
    data = bytearray(await target.get(payload))
    data[-1] ^= 1
    await target.put(payload, bytes(data))
    result = await sub.sync()
    assert (result.step, result.path) == (9, SyncPath.FAST)
    assert_serving(sub, 9)
    assert sub.stores.sources[0].fallbacks == {"IntegrityError": 1} and [s.syncs for s in sub.stores.sources] == [1, 1]

    # Withholds a link: step 10's marker is missing, 11's is there. The chain comes from the origin, no slow path.
    await publish(origin, range(10, 12))
    await mirror(origin.store, target, key).run_once()
    await target.delete_many([layout.commit_key(10)])
    result = await sub.sync()
    assert (result.step, result.path) == (11, SyncPath.CHAIN)
    assert sub.stores.sources[0].fallbacks == {"IntegrityError": 1, "NotFoundError": 1}

    # Each sync asked the mirror first (its fallbacks count them) and only the cold start took the slow path.
    assert_serving(sub, 11)
    assert sub.status.paths.get(SyncPath.SLOW) == 1  # the cold start only


async def test_a_lagging_mirror_is_passed_over_until_it_catches_up(
    origin: AsyncPublisher, tmp_path: Path, key: Ed25519PrivateKey
) -> None:
    target = FileStore(tmp_path / "mirror")
    await mirror(origin.store, target, key).run_once()
    sub = subscriber([target, origin.store], key, max_lag_seconds=2.0)  # manifests' times are to the second
    await sub.sync()
    await publish(origin, range(9, 10))  # the mirror does not copy it
    result = await sub.sync()  # within the bound: the mirror's newest is what is served
    assert result.path == SyncPath.UP_TO_DATE and sub.step == 8
    await asyncio.sleep(2.5)  # the mirror's newest is older than the bound: the origin's pointer is read, it moved
    result = await sub.sync()
    assert result.path == SyncPath.UP_TO_DATE and sub.step == 8
    await asyncio.sleep(2.2)  # and the mirror has not caught up within the bound since
    result = await sub.sync()
    assert (result.step, result.path) == (9, SyncPath.FAST)
    assert sub.stores.sources[0].fallbacks == {StaleStoreError.__name__: 1}
    await mirror(origin.store, target, key).run_once()
    await publish(origin, range(10, 11))
    await mirror(origin.store, target, key).run_once()
    result = await sub.sync()
    assert (result.step, result.path) == (10, SyncPath.FAST) and [s.syncs for s in sub.stores.sources] == [2, 1]


async def test_a_quiet_publisher_makes_no_store_stale(
    origin: AsyncPublisher, tmp_path: Path, key: Ed25519PrivateKey
) -> None:
    target = FileStore(tmp_path / "mirror")
    await mirror(origin.store, target, key).run_once()
    sub = subscriber([target, origin.store], key, max_lag_seconds=1.0)
    await sub.sync()
    for _ in range(3):  # the mirror's newest step ages past the bound; the origin's pointer names no newer one
        await asyncio.sleep(1.2)
        assert (await sub.sync()).path == SyncPath.UP_TO_DATE
    assert sub.stores.sources[0].fallbacks == {} and sub.stores.sources[0].syncs == 1


async def test_a_marker_seen_before_its_payload_is_waited_for_not_a_slow_path(
    origin: AsyncPublisher, tmp_path: Path, key: Ed25519PrivateKey
) -> None:
    replica = FileStore(tmp_path / "replica")
    await mirror(origin.store, replica, key).run_once()
    sub = subscriber([replica], key, payload_wait_seconds=10.0)
    await sub.sync()
    await publish(origin, range(9, 10))
    manifest = await manifest_of(origin.store, key, 9)
    # A replica that copies in any order: the marker has arrived, the payload arrives a second later.
    await replica.put(layout.commit_key(9), await origin.store.get(layout.commit_key(9)))
    payload = manifest.objects[0]

    async def arrive_late() -> None:
        await asyncio.sleep(1.0)
        await replica.put(payload.key, await origin.store.get(payload.key))

    late = asyncio.create_task(arrive_late())
    result = await sub.sync()
    await late
    assert (result.step, result.path) == (9, SyncPath.FAST)
    assert_serving(sub, 9)
    assert not sub.status.fallbacks


async def test_several_stores_in_config_and_on_the_command_line(tmp_path: Path) -> None:
    from pulsesync.cli import _with_fallback_stores, build_parser
    from pulsesync.config import load_config
    from pulsesync.errors import ConfigError
    from pulsesync.subscriber.config import SubscriberConfig

    config = load_config(SubscriberConfig, None, {"store.url": "s3://b/mirror", "store.endpoint_url": "http://m"})
    args = build_parser().parse_args(
        [
            "subscribe",
            "--store",
            "s3://b/mirror",
            "--fallback-store",
            "s3://b/origin",
            "--fallback-endpoint-url",
            "http://o",
        ]
    )
    both = _with_fallback_stores(config, args.fallback_store, args.fallback_endpoint_url)
    assert [(s.url, s.endpoint_url) for s in both.store_list] == [
        ("s3://b/mirror", "http://m"),
        ("s3://b/origin", "http://o"),
    ]
    with pytest.raises(ConfigError, match="not both"):
        load_config(SubscriberConfig, None, {"store.url": "s3://b/x", "stores": [{"url": "s3://b/y"}]})
    with pytest.raises(ConfigError, match="fallback-endpoint-url"):
        _with_fallback_stores(config, ["s3://b/1", "s3://b/2", "s3://b/3"], ["http://a", "http://b"])
