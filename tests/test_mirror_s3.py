"""`pulsesync mirror` through the CLI against SeaweedFS, killed at every phase of a copy; a subscriber on a real
replica (`weed filer.sync` between two SeaweedFS servers) that shows markers before their payloads."""

from __future__ import annotations

import asyncio
import hashlib
import os
import signal
import subprocess
import sys
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
import torch
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat

from pulsesync.protocol import layout, signing
from pulsesync.protocol.manifest import parse_manifest
from pulsesync.publisher import AsyncPublisher
from pulsesync.publisher.config import PublisherConfig
from pulsesync.store import S3Store, Store
from pulsesync.subscriber import Subscriber
from pulsesync.subscriber.config import SubscriberConfig
from pulsesync.subscriber.paths import SyncPath
from tests.support.fault_proxy import FaultProxy
from tests.support.helpers import assert_states_equal
from tests.support.servers import BUCKET, SeaweedFS, seaweedfs_cluster, weed_binary
from tests.support.subscribing import wait_for

pytestmark = pytest.mark.integration


def states(steps: int, elements: int = 6 << 20) -> list[dict[str, torch.Tensor]]:
    """bf16 states of `elements` (12 MiB: the anchor is a multipart upload), ~1% changed a step."""
    gen = torch.Generator().manual_seed(0)
    state = {"model.w": torch.randn(elements, generator=gen).to(torch.bfloat16)}
    out = []
    for _ in range(steps):
        out.append({k: v.clone() for k, v in state.items()})
        where = torch.randint(0, elements, (elements // 100,), generator=gen)
        state["model.w"][where] += torch.randn(where.numel(), generator=gen).to(torch.bfloat16) * 0.01
    return out


async def publish(store: Store, key: Ed25519PrivateKey, trained: list[dict[str, torch.Tensor]], steps: range) -> None:
    config = PublisherConfig(anchor_interval=100, shard_size=64 << 20, on_backpressure="block")
    async with AsyncPublisher(config, store=store, signing_key=key) as pub:
        for step in steps:
            await pub.publish(step, trained[step], {"config.json": b'{"model_type": "t"}'})
        await pub.flush()


async def markers(store: Store) -> dict[str, bytes]:
    found = {}
    for prefix in (layout.READY_PREFIX, layout.ANCHOR_READY_PREFIX):
        async for info in store.list(prefix):
            found[info.key] = await store.get(info.key)
    return found


async def assert_no_marker_without_its_payload(store: Store) -> dict[str, bytes]:
    """Every marker the store holds lists objects it holds, each of its size and SHA-256; returns the markers."""
    held = await markers(store)
    for key, data in held.items():
        for ref in parse_manifest(data, key).objects:
            body = await store.get(ref.key)
            assert (len(body), hashlib.sha256(body).hexdigest()) == (ref.size, ref.sha256), f"{key}: {ref.key}"
    return held


@pytest.fixture
async def proxy(seaweedfs_endpoint: str) -> AsyncIterator[FaultProxy]:
    proxy = FaultProxy(seaweedfs_endpoint)
    await proxy.start()
    yield proxy
    await proxy.stop()


async def test_a_mirror_killed_at_every_phase_converges_and_never_holds_a_marker_without_its_payload(
    seaweedfs_endpoint: str, proxy: FaultProxy, tmp_path: Path, key: Ed25519PrivateKey
) -> None:
    run = uuid.uuid4().hex[:8]
    origin = S3Store(BUCKET, f"origin-{run}", endpoint_url=seaweedfs_endpoint)
    target = S3Store(BUCKET, f"mirror-{run}", endpoint_url=seaweedfs_endpoint)
    trained = states(4)
    await publish(origin, key, trained, range(4))
    public = tmp_path / "publisher.pub"
    public.write_bytes(key.public_key().public_bytes(Encoding.PEM, PublicFormat.SubjectPublicKeyInfo))
    command = [
        *(sys.executable, "-m", "pulsesync", "mirror", "--once", "--trusted-key", str(public)),
        *("--store", f"s3://{BUCKET}/origin-{run}", "--endpoint-url", seaweedfs_endpoint),
        *("--to", f"s3://{BUCKET}/mirror-{run}", "--to-endpoint-url", proxy.endpoint),
    ]

    async def killed_when_held(**hold: tuple[str, ...]) -> None:
        """Run the mirror until the proxy holds a request of `hold`, then kill -9 it."""
        proxy.hang_paths, proxy.hang_queries = hold.get("paths", ()), hold.get("queries", ())
        proxy.hung = 0
        mirror = subprocess.Popen(command, start_new_session=True, stderr=subprocess.PIPE)
        try:
            await wait_for(lambda: proxy.hung > 0 or mirror.poll() is not None, f"the mirror to reach {hold}", 120)
            assert mirror.poll() is None, mirror.communicate()[1].decode()
        finally:
            os.killpg(mirror.pid, signal.SIGKILL)
            mirror.wait()

    # Inside the anchor's multipart upload (its second part), then between payloads and the marker.
    await killed_when_held(queries=("partNumber=2",))
    assert await assert_no_marker_without_its_payload(target) == {}
    await killed_when_held(paths=(f"/mirror-{run}/{layout.READY_PREFIX}",))
    assert await assert_no_marker_without_its_payload(target) == {}
    anchor = parse_manifest((await markers(origin))[layout.commit_key(0)], "origin")
    assert all([await target.exists(ref.key) for ref in anchor.objects])  # the payload is there, its marker not
    # Between the first step's marker and the pointer.
    await killed_when_held(paths=(f"/mirror-{run}/{layout.POINTER_KEY}",))
    assert set(await assert_no_marker_without_its_payload(target)) == {layout.commit_key(0)}

    proxy.hang_paths = proxy.hang_queries = ()
    done = await asyncio.create_subprocess_exec(*command, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    out, err = await asyncio.wait_for(done.communicate(), 120)  # the proxy answers on this event loop
    assert done.returncode == 0, err.decode()
    assert "copied steps 1..3" in out.decode()
    assert await assert_no_marker_without_its_payload(target) == await markers(origin)  # the same signed bytes

    sub = Subscriber(SubscriberConfig(), store=target, trusted=signing.trusted_keys([key.public_key()]))
    result = await sub.sync()
    assert result.step == 3 and sub.state is not None
    assert_states_equal(sub.state, trained[3])
    await origin.close()


@pytest.fixture
def clusters(tmp_path: Path) -> Iterator[tuple[SeaweedFS, SeaweedFS]]:
    """Two SeaweedFS servers, B a replica of A by `weed filer.sync` (which copies objects in any order)."""
    (tmp_path / "a").mkdir(), (tmp_path / "b").mkdir()
    with seaweedfs_cluster(tmp_path / "a") as a, seaweedfs_cluster(tmp_path / "b") as b:
        log = open(tmp_path / "filer-sync.log", "wb")  # noqa: SIM115 - closed below
        sync = subprocess.Popen(
            [str(weed_binary()), "filer.sync", f"-a={a.filer}", f"-b={b.filer}", "-isActivePassive"],
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        try:
            yield a, b
        finally:
            os.killpg(sync.pid, signal.SIGKILL)
            sync.wait()
            log.close()


async def test_a_subscriber_on_a_replica_that_keeps_no_order_waits_for_payloads_without_a_slow_path(
    clusters: tuple[SeaweedFS, SeaweedFS], key: Ed25519PrivateKey
) -> None:
    a, b = clusters
    # The replica's payloads arrive 1.5 s after a reader first asks for them: markers come first.
    late = FaultProxy(b.endpoint, late_paths=("/patches/",), late_seconds=1.5)
    await late.start()
    origin = S3Store(BUCKET, "run", endpoint_url=a.endpoint)
    replica = S3Store(BUCKET, "run", endpoint_url=late.endpoint)
    config = SubscriberConfig(poll_seconds=0.1, list_every_seconds=0.5, payload_wait_seconds=30, fleet_status=False)
    sub = Subscriber(config, store=replica, trusted=signing.trusted_keys([key.public_key()]))
    trained = states(8, elements=1 << 20)
    stop = asyncio.Event()
    daemon = asyncio.create_task(sub.run(stop))
    try:
        config_p = PublisherConfig(anchor_interval=100, shard_size=64 << 20, on_backpressure="block")
        async with AsyncPublisher(config_p, store=origin, signing_key=key) as pub:
            for step in range(8):
                await pub.publish(step, trained[step], {"config.json": b'{"model_type": "t"}'})
                await pub.flush()
                await wait_for(lambda s=step: sub.step == s, f"step {step} through the replica", 60, sub)  # type: ignore[misc]
    finally:
        stop.set()
        await daemon
        await late.stop()
    assert sub.state is not None
    assert_states_equal(sub.state, trained[7])
    assert late.late_served > 0  # markers were seen before their payloads
    assert sub.status.paths == {SyncPath.SLOW: 1, SyncPath.FAST: 7}  # the cold start only: no slow-path storm
    assert sub.status.fallbacks == {}
    await sub.close()
    await origin.close()
