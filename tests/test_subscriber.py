"""The subscriber against chains from the real publisher, on the filesystem and moto (server mode).

Fault tests: each ends with the served state unchanged until a verified state is available, then
bitwise correct. Objects and manifests are damaged by rewriting them in the real store.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import sys
import time
import uuid
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any

import pytest
import torch
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from pulsesync.codec import encode_patch
from pulsesync.digest import state_digest
from pulsesync.errors import (
    EngineError,
    IntegrityError,
    NotFoundError,
    PulseSyncError,
    ReplayError,
    SignatureError,
    StoreError,
    UnknownKeyError,
)
from pulsesync.protocol import layout, signing
from pulsesync.protocol.manifest import ObjectRef, PatchManifest
from pulsesync.publisher import AsyncPublisher
from pulsesync.publisher.config import PublisherConfig
from pulsesync.sinks import CommandSinkConfig
from pulsesync.store import FileStore, RetryPolicy, S3Store, Store
from pulsesync.subscriber import Subscriber, daemon
from pulsesync.subscriber.config import SubscriberConfig
from tests.support.fault_proxy import FaultProxy
from tests.support.helpers import anchor_marker, assert_states_equal, flip_byte, trainer_states
from tests.support.recording_store import RecordingStore
from tests.support.servers import BUCKET
from tests.support.subscribing import STATES, assert_serving, publish, subscriber


async def test_fast_chain_slow_and_cold_start_paths_end_bitwise_equal(
    store: Store, key: Ed25519PrivateKey, publisher: AsyncPublisher
) -> None:
    cold = subscriber(store, key)
    assert (await cold.sync(3)).path == "slow"  # cold start: anchor 0 + patches 1..3
    assert_serving(cold, 3)
    assert (await cold.sync(4)).path == "fast"
    assert (await cold.sync(7)).path == "chain"
    assert_serving(cold, 7)
    assert (await cold.sync()).path == "fast"  # newest: 8
    assert (await cold.sync()).path == "up-to-date"
    assert_serving(cold, 8)
    late = subscriber(store, key)
    result = await late.sync()
    assert (result.path, result.step) == ("slow", 8)
    anchor5 = await late.stores.chain.manifest(5, "anchor")
    assert result.bytes_downloaded > anchor5.sizes.wire_bytes  # anchor 5 + patches 6..8, not anchor 0
    assert_serving(late, 8)
    assert late.served.files == {"config.json": b'{"model_type": "t"}'}


async def damage_object(store: Store, key: str, how: Callable[[bytes], bytes | None]) -> None:
    data = how(await store.get(key))
    if data is None:
        await store.delete_many([key])
    else:
        await store.put(key, data)


async def patch_object_key(store: Store, step: int) -> str:
    return json.loads(await store.get(layout.commit_key(step)))["objects"][0]["key"]


FaultSetup = Callable[[Store, Ed25519PrivateKey], Coroutine[Any, Any, None]]


async def _flipped_patch(store: Store, key: Ed25519PrivateKey) -> None:
    await damage_object(store, await patch_object_key(store, 7), flip_byte)


async def _truncated_patch(store: Store, key: Ed25519PrivateKey) -> None:
    await damage_object(store, await patch_object_key(store, 7), lambda d: d[: len(d) // 2])


async def _deleted_patch(store: Store, key: Ed25519PrivateKey) -> None:
    await damage_object(store, await patch_object_key(store, 7), lambda d: None)


async def _unknown_key(store: Store, key: Ed25519PrivateKey) -> None:
    manifest = PatchManifest.model_validate_json(await store.get(layout.commit_key(7)))
    forged = manifest.signed(Ed25519PrivateKey.generate())
    await store.put(layout.commit_key(7), forged.to_bytes())


async def _tampered_manifest(store: Store, key: Ed25519PrivateKey) -> None:
    raw = json.loads(await store.get(layout.commit_key(7)))
    raw["sizes"]["changed_elements"] += 1
    await store.put(layout.commit_key(7), json.dumps(raw).encode())


async def _replayed_manifest(store: Store, key: Ed25519PrivateKey) -> None:
    await store.put(layout.commit_key(7), await store.get(layout.commit_key(6)))


async def _wrong_base(store: Store, key: Ed25519PrivateKey) -> None:
    """A correctly signed patch 7 computed against another state than step 6: its base digest differs."""
    states = trainer_states(STATES)
    wrong_base, new = states[3], states[7]
    base_digest, new_digest = state_digest(wrong_base), state_digest(new)
    patch = encode_patch(wrong_base, new, base_digest=base_digest, new_digest=new_digest)
    object_key = layout.patch_key(7, "forged")
    await store.put(object_key, patch)
    manifest = PatchManifest.model_validate_json(await store.get(layout.commit_key(7)))
    manifest = manifest.model_copy(
        update={"base_digest": base_digest.root, "objects": [ObjectRef.for_bytes(object_key, patch)]}
    )
    await store.put(layout.commit_key(7), manifest.signed(key).to_bytes())


async def _wrong_result_digest(store: Store, key: Ed25519PrivateKey) -> None:
    """A correctly signed manifest 7 promising another state digest: found only after the patch is applied."""
    manifest = PatchManifest.model_validate_json(await store.get(layout.commit_key(7)))
    manifest = manifest.model_copy(update={"state_digest": state_digest(trainer_states(STATES)[8])})
    await store.put(layout.commit_key(7), manifest.signed(key).to_bytes())


FAULTS: dict[str, tuple[FaultSetup, type[PulseSyncError]]] = {
    "flipped-byte-in-patch": (_flipped_patch, IntegrityError),
    "truncated-patch": (_truncated_patch, IntegrityError),
    "deleted-patch-404": (_deleted_patch, NotFoundError),
    "manifest-by-unknown-key": (_unknown_key, UnknownKeyError),
    "tampered-manifest": (_tampered_manifest, SignatureError),
    "replayed-older-manifest": (_replayed_manifest, ReplayError),
    "patch-with-wrong-base-digest": (_wrong_base, IntegrityError),
    "patch-with-wrong-result-digest": (_wrong_result_digest, IntegrityError),  # rolled back after writing
}


@pytest.mark.parametrize("fault", list(FAULTS))
async def test_a_bad_link_is_never_served_and_the_next_anchor_recovers(
    store: Store, key: Ed25519PrivateKey, publisher: AsyncPublisher, fault: str, tmp_path: Path
) -> None:
    setup, error = FAULTS[fault]
    sub = subscriber(store, key, out_dir=tmp_path / "out")
    await sub.sync(6)
    await setup(store, key)
    with pytest.raises(error):
        await daemon.sync_with_retries(sub, 2)  # fast path fails, slow path (anchor 5 + 6, 7, 8) hits it too
    assert_serving(sub, 6)  # unchanged: nothing unverified is ever served
    assert (tmp_path / "out" / "current").resolve().name == "step-000000000006"
    tries = 1 if error is UnknownKeyError else 2  # a bounded retry stops at an error another try meets again
    assert sum(sub.status.fallbacks.values()) == tries and sub.status.consecutive_failures == tries
    await publish(publisher, range(9, 11))  # step 10 comes with an anchor: a verified state again
    result = await sub.sync()
    assert (result.path, result.step) == ("slow", 10)
    assert_serving(sub, 10)
    assert (tmp_path / "out" / "current").resolve().name == "step-000000000010"
    # Healthy the moment it serves a verified state, not once the daemon's loop gets back to it
    # (a /healthz read in between said unhealthy: the hardening test's deadline case saw it).
    assert sub.status.consecutive_failures == 0


async def test_a_sink_failure_on_the_fast_path_rolls_the_state_back(
    store: Store, key: Ed25519PrivateKey, publisher: AsyncPublisher, tmp_path: Path
) -> None:
    refuse = tmp_path / "refuse"
    script = f"import os, sys; sys.exit(3 if os.path.exists({str(refuse)!r}) else 0)"
    sub = subscriber(store, key, sinks=[CommandSinkConfig(argv=[sys.executable, "-c", script])])
    await sub.sync(6)
    refuse.touch()
    with pytest.raises(EngineError, match="exited with 3 at step 7"):
        await sub.sync(7)  # patch 7 was applied in place and verified, then the sink refused it
    assert_serving(sub, 6)
    refuse.unlink()
    assert (await sub.sync(8)).path == "chain"
    assert_serving(sub, 8)


async def test_a_corrupted_newest_anchor_is_passed_for_the_anchor_before_it(
    store: Store, key: Ed25519PrivateKey, publisher: AsyncPublisher
) -> None:
    """A damaged newest anchor does not block cold starts until the next one: anchor 0 + patches 1-7 serve."""
    anchor = json.loads(await store.get(await anchor_marker(store, 5)))
    shard = next(o["key"] for o in anchor["objects"] if o["key"].endswith(".safetensors"))
    await damage_object(store, shard, flip_byte)
    sub = subscriber(store, key)
    result = await sub.sync(7)
    assert (result.step, result.path) == (7, "slow")
    assert_serving(sub, 7)


async def test_corrupted_anchors_are_never_served(
    store: Store, key: Ed25519PrivateKey, publisher: AsyncPublisher
) -> None:
    for step in (0, 5):
        anchor = json.loads(await store.get(await anchor_marker(store, step)))
        shard = next(o["key"] for o in anchor["objects"] if o["key"].endswith(".safetensors"))
        await damage_object(store, shard, flip_byte)
    sub = subscriber(store, key)
    with pytest.raises(IntegrityError, match="SHA-256"):
        await sub.sync(7)
    assert sub.state is None and not sub.healthy()[0]
    await publish(publisher, range(9, 11))
    assert (await sub.sync()).step == 10
    assert_serving(sub, 10)


async def test_a_fast_path_step_costs_one_list_and_two_gets(
    store: Store, key: Ed25519PrivateKey, publisher: AsyncPublisher
) -> None:
    """The listing is not repeated and a verified manifest is not read twice (2 LISTs and 3 GETs before)."""
    recording = RecordingStore(store)
    sub = subscriber(recording, key)
    await sub.sync()
    await publish(publisher, range(9, 10))
    recording.calls.clear()
    result = await sub.sync()
    assert (result.step, result.path) == (9, "fast")
    assert recording.calls == {"LIST": 1, "GET": 2}  # the new markers, the manifest, the patch; no HEAD
    assert_serving(sub, 9)


async def test_restart_resumes_from_the_persisted_state_without_an_anchor(
    store: Store, key: Ed25519PrivateKey, publisher: AsyncPublisher, tmp_path: Path
) -> None:
    first = subscriber(store, key, cache_dir=tmp_path / "cache")
    await first.sync(7)
    restarted = subscriber(store, key, cache_dir=tmp_path / "cache")
    await restarted.start()
    assert_serving(restarted, 7)
    result = await restarted.sync()
    assert (result.path, result.step) == ("fast", 8)
    patch8 = await restarted.stores.chain.manifest(8, "patch")
    assert result.bytes_downloaded < 4 * patch8.sizes.wire_bytes  # manifests + one patch, no anchor
    assert_serving(restarted, 8)
    # A damaged cache is discarded: the next start takes the slow path.
    tensors = tmp_path / "cache" / "state.safetensors"
    tensors.write_bytes(flip_byte(tensors.read_bytes()))
    fresh = subscriber(store, key, cache_dir=tmp_path / "cache")
    await fresh.start()
    assert fresh.state is None
    assert (await fresh.sync()).path == "slow"


async def test_store_unreachable_for_30s_then_back(moto_endpoint: str, key: Ed25519PrivateKey, tmp_path: Path) -> None:
    proxy = FaultProxy(moto_endpoint)
    await proxy.start()
    prefix = f"outage-{uuid.uuid4().hex[:8]}"
    direct = S3Store(BUCKET, prefix, endpoint_url=moto_endpoint)
    through_proxy = S3Store(
        BUCKET, prefix, endpoint_url=proxy.endpoint, retry=RetryPolicy(attempts=3, initial_wait=0.05, max_wait=0.1)
    )
    config = PublisherConfig(anchor_interval=5, on_backpressure="block")
    pub = AsyncPublisher(config, store=direct, signing_key=key)
    await pub.start()
    await publish(pub, range(4))
    sub = subscriber(through_proxy, key, poll_seconds=0.1, unhealthy_after=3, retry_max_seconds=0.5)
    stop = asyncio.Event()
    daemon = asyncio.create_task(sub.run(stop))
    try:
        while sub.step != 3:
            await asyncio.sleep(0.05)
        proxy.down = True
        await publish(pub, range(4, 7))
        outage_end = time.monotonic() + 30
        while time.monotonic() < outage_end:
            assert_serving(sub, 3)  # the last good state, all along
            await asyncio.sleep(1)
        assert not sub.healthy()[0] and sub.status.consecutive_failures >= 3
        proxy.down = False
        deadline = time.monotonic() + 30
        while sub.step != 6:
            assert time.monotonic() < deadline, sub.status
            await asyncio.sleep(0.1)
        assert_serving(sub, 6)
        healthy, details = sub.healthy()
        assert healthy and details["last_error"] is None, details  # not the outage's, while serving step 6
    finally:
        stop.set()
        await daemon
        await pub.close()
        await through_proxy.close()
        await proxy.stop()


async def test_a_daemon_started_before_the_first_publish_waits_at_its_poll_interval(
    tmp_path: Path, key: Ed25519PrivateKey, caplog: pytest.LogCaptureFixture
) -> None:
    """An empty prefix is the normal start of a run: one INFO line, polls every poll_seconds, no backoff."""
    store = FileStore(tmp_path / "store")
    config = SubscriberConfig(poll_seconds=0.2)  # the default backoff: 1 s doubling to 60 s on failures
    sub = Subscriber(config, store=store, trusted=signing.trusted_keys([key.public_key()]))
    stop = asyncio.Event()
    caplog.set_level("INFO", logger="pulsesync")
    daemon = asyncio.create_task(sub.run(stop))
    pub = AsyncPublisher(PublisherConfig(anchor_interval=5), store=store, signing_key=key)
    try:
        await asyncio.sleep(4)  # the backoff would be at 1 + 2 s by now, waiting 4 s more
        assert sub.status.consecutive_failures == 0 and sub.status.last_error is None
        await pub.start()
        await publish(pub, range(1))
        published = time.monotonic()
        while sub.step != 0:
            assert time.monotonic() - published < 2.0, "step 0 waited longer than a few polls"
            await asyncio.sleep(0.02)
        assert_serving(sub, 0)
    finally:
        stop.set()
        await daemon
        await pub.close()
    waiting = [r for r in caplog.records if "no step published" in r.getMessage()]
    assert [r.levelname for r in waiting] == ["INFO"]
    assert not [r for r in caplog.records if r.levelname == "ERROR"]


async def test_apply_to_overwrites_a_module_bit_exactly(
    store: Store, key: Ed25519PrivateKey, publisher: AsyncPublisher
) -> None:
    sub = subscriber(store, key)
    await sub.sync()
    module = torch.nn.Module()
    for name, t in trainer_states(STATES)[0].items():
        module.register_buffer(name.replace(".", "_"), torch.zeros_like(t))
    with pytest.raises(PulseSyncError, match="has no tensor"):
        sub.apply_to(module)
    module = torch.nn.ParameterDict({n.replace(".", "_"): torch.zeros_like(t) for n, t in sub.state.items()})  # type: ignore[union-attr]
    renamed = {n.replace(".", "_"): t for n, t in sub.state.items()}  # type: ignore[union-attr]
    sub.held.served = dataclasses.replace(sub.held.served, state=renamed)  # type: ignore[type-var]
    sub.apply_to(module)
    assert_states_equal({n: p.data for n, p in module.items()}, renamed)


async def test_daemon_serves_metrics_and_healthz(
    store: Store, key: Ed25519PrivateKey, publisher: AsyncPublisher
) -> None:
    import aiohttp

    from tests.support.servers import free_port

    port = free_port()
    sub = subscriber(store, key, poll_seconds=0.05, metrics_port=port)
    stop = asyncio.Event()
    daemon = asyncio.create_task(sub.run(stop))
    try:
        async with aiohttp.ClientSession() as http:
            deadline = time.monotonic() + 30
            while sub.step != 8:
                assert time.monotonic() < deadline and not daemon.done()
                await asyncio.sleep(0.05)
            async with http.get(f"http://127.0.0.1:{port}/healthz") as r:
                health = await r.json()
                assert r.status == 200 and health["healthy"] and health["step"] == 8
                assert health["paths"] == {"slow": 1}
            async with http.get(f"http://127.0.0.1:{port}/metrics") as r:
                text = await r.text()
            assert 'pulsesync_sync_seconds_count{path="slow"}' in text and "pulsesync_lag_seconds" in text
            await publish(publisher, range(9, 10))
            while sub.step != 9:
                assert time.monotonic() < deadline
                await asyncio.sleep(0.05)
            async with http.get(f"http://127.0.0.1:{port}/healthz") as r:
                assert (await r.json())["paths"] == {"slow": 1, "fast": 1}
    finally:
        stop.set()
        await daemon


async def test_an_idle_daemon_polls_the_pointer_not_the_listing_and_a_bad_pointer_changes_nothing_served(
    moto_endpoint: str, key: Ed25519PrivateKey
) -> None:
    store = S3Store(BUCKET, f"pointer-{uuid.uuid4().hex[:8]}", endpoint_url=moto_endpoint)
    pointer_fails = False

    def hook(op: str, target: str) -> None:  # a publisher that dies between its marker and its pointer
        if pointer_fails and target == layout.POINTER_KEY:
            raise StoreError("put pointer: connection reset")

    writing = RecordingStore(store, hook)
    pub = AsyncPublisher(PublisherConfig(anchor_interval=5, on_backpressure="block"), store=writing, signing_key=key)
    await pub.start()
    await publish(pub, range(2))
    assert await store.get(layout.POINTER_KEY) == layout.commit_key(1).encode()
    counted = RecordingStore(store)
    sub = subscriber(counted, key, poll_seconds=0.05, list_every_seconds=3600)
    stop = asyncio.Event()
    daemon = asyncio.create_task(sub.run(stop))

    async def polls(n: int) -> None:  # wait for n more pointer reads
        target = counted.calls["GET"] + n
        while counted.calls["GET"] < target:
            assert not daemon.done(), daemon.exception()
            await asyncio.sleep(0.01)

    async def serves(step: int) -> None:
        deadline = time.monotonic() + 30
        while sub.step != step:
            assert time.monotonic() < deadline, sub.status
            await asyncio.sleep(0.02)
        assert_serving(sub, step)

    try:
        await serves(1)
        await polls(2)
        counted.calls.clear()
        await polls(20)  # idle: one conditional GET per poll, answered 304 (one may be in flight); nothing else
        assert set(counted.calls) == {"GET", "NOT_MODIFIED"}
        assert counted.calls["GET"] - counted.calls["NOT_MODIFIED"] <= 1

        await publish(pub, range(2, 3))  # a new step: the pointer changed, so one LIST finds it
        await serves(2)
        for forged in (layout.pointer_body(999), b"\xff junk", layout.pointer_body(0)):
            counted.calls.clear()
            await store.put(layout.POINTER_KEY, forged)
            await polls(3)
            assert counted.calls["LIST"] >= 1  # a pointer that changed means a LIST, never a step
            assert_serving(sub, 2)

        pointer_fails = True
        await publish(pub, range(3, 4))  # committed; the pointer still names what it named: 304s
        counted.calls.clear()
        await polls(10)
        assert counted.calls["LIST"] == 0
        assert_serving(sub, 2)
        assert sub.poll is not None
        sub.poll.list_every_seconds = 0.2  # the LIST that a frozen pointer cannot prevent
        await serves(3)

        await store.delete_many([layout.POINTER_KEY])  # no pointer: a LIST every poll, as without one
        assert counted.calls["NOT_MODIFIED"] >= 10
        counted.calls.clear()
        sub.poll.list_every_seconds = 3600
        await polls(5)
        assert counted.calls["LIST"] >= 3
        assert_serving(sub, 3)
    finally:
        stop.set()
        await daemon
        await pub.close()
        await store.close()


async def test_a_daemon_is_healthy_as_soon_as_a_sync_succeeds_however_long_its_fleet_status_write_takes(
    tmp_path: Path, key: Ed25519PrivateKey
) -> None:
    class Flaky(RecordingStore):  # listings fail on cue; fleet status writes wait for `release`
        failing = False
        release = asyncio.Event()

        def list(self, prefix: str = "", start_after: str | None = None) -> Any:
            if self.failing:
                raise StoreError(f"list {prefix}: connection refused")
            return super().list(prefix, start_after)

        async def put(self, key: str, data: bytes) -> None:
            if key.startswith("fleet/"):
                await self.release.wait()
            await super().put(key, data)

    inner = FileStore(tmp_path / "store")
    pub = AsyncPublisher(PublisherConfig(anchor_interval=5, on_backpressure="block"), store=inner, signing_key=key)
    await pub.start()
    await publish(pub, range(2))
    store = Flaky(inner)
    store.release.set()
    sub = subscriber(store, key, poll_seconds=0.02, poll_pointer=False, unhealthy_after=1, retry_max_seconds=0.1)
    stop = asyncio.Event()
    daemon = asyncio.create_task(sub.run(stop))

    async def until(condition: Callable[[], bool]) -> None:
        deadline = time.monotonic() + 20
        while not condition():
            assert time.monotonic() < deadline and not daemon.done(), sub.status
            await asyncio.sleep(0.01)

    try:
        await until(lambda: sub.step == 1)
        store.failing = True
        await until(lambda: not sub.healthy()[0])
        store.release.clear()  # the next fleet status write hangs
        await publish(pub, range(2, 3))
        store.failing = False
        await until(lambda: sub.step == 2)
        await asyncio.sleep(0.1)
        assert sub.healthy()[0], sub.status  # not waiting on the advisory write
    finally:
        store.release.set()
        stop.set()
        await daemon
        await pub.close()
