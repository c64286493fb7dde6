"""A follower reads a run's next patch beside its ready marker (protocol/speculation.py).

One round trip less on the fast path, and nothing read early is trusted: the bytes are used only
when the verified manifest lists their key, size and SHA-256. Filesystem and S3 (moto) stores.
"""

from __future__ import annotations

import asyncio

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from pulsesync.protocol import layout
from pulsesync.publisher import AsyncPublisher
from pulsesync.publisher.config import PublisherConfig
from pulsesync.store import Store
from pulsesync.subscriber import Subscriber
from tests.support.recording_store import RecordingStore
from tests.support.subscribing import assert_serving, publish, subscriber


class Timeline(RecordingStore):
    """Logs when each GET starts and ends; a marker's GET takes a while, as from a store far away."""

    def __init__(self, inner: Store) -> None:
        super().__init__(inner)
        self.events: list[tuple[str, str]] = []

    async def get(self, key: str, max_size: int | None = None) -> bytes:
        self.events.append(("start", key))
        try:
            if key.startswith(layout.READY_PREFIX):
                await asyncio.sleep(0.05)
            return await super().get(key, max_size)
        finally:
            self.events.append(("end", key))


def _patch_key(sub: Subscriber, step: int) -> str:
    """The key of the patch object the verified manifest of `step` lists."""
    found = sub.stores.chain.verified_marker(step)
    assert found is not None and found[1].kind == "patch"
    return found[1].objects[0].key


async def test_a_follower_reads_the_next_patch_beside_its_marker(
    store: Store, key: Ed25519PrivateKey, publisher: AsyncPublisher
) -> None:
    timeline = Timeline(store)
    sub = subscriber(timeline, key)
    await sub.sync()  # step 8
    await publish(publisher, range(9, 10))
    timeline.events.clear()
    timeline.calls.clear()
    result = await sub.sync()
    assert (result.step, result.path) == (9, "fast")
    marker, patch = ("end", layout.commit_key(9)), ("start", _patch_key(sub, 9))
    assert timeline.events.index(patch) < timeline.events.index(marker)  # beside the marker, not after it
    assert timeline.calls == {"LIST": 1, "GET": 2}  # and read once
    assert_serving(sub, 9)
    await sub.close()


async def test_a_wrong_guess_costs_one_get_and_what_it_read_is_never_used(
    store: Store, key: Ed25519PrivateKey, publisher: AsyncPublisher
) -> None:
    """A restarted publisher names its patches anew; junk under the old run's next key is read, and dropped."""
    recording = RecordingStore(store)
    sub = subscriber(recording, key)
    await sub.sync()  # step 8, of the fixture's publisher run
    guessed = layout.next_patch_key(_patch_key(sub, 8), 9)
    assert guessed is not None
    await store.put(guessed, b"not a patch, and not listed by any manifest")
    config = PublisherConfig(anchor_interval=5, shard_size=256 << 10, on_backpressure="block", resume=True)
    async with AsyncPublisher(config, store=store, signing_key=key) as restarted:
        await publish(restarted, range(9, 10))
    assert _patch_key(sub, 8) != (listed := layout.patch_key(9, restarted.run_id))
    recording.calls.clear()
    recording.reads.clear()
    result = await sub.sync()
    assert (result.step, result.path) == (9, "fast")
    assert recording.reads.count(guessed) == 1 and recording.reads.count(listed) == 1
    assert recording.calls == {"LIST": 1, "GET": 3}
    assert_serving(sub, 9)
    await sub.close()


async def test_a_read_ahead_no_manifest_asked_for_is_stopped_at_close(
    store: Store, key: Ed25519PrivateKey, publisher: AsyncPublisher
) -> None:
    """A marker that does not verify leaves its patch being read ahead: close() stops the read."""

    class Stalling(RecordingStore):  # step 9's patch takes a minute to arrive
        async def get(self, key: str, max_size: int | None = None) -> bytes:
            if key.startswith(layout.patch_prefix(9)):
                await asyncio.sleep(60)
            return await super().get(key, max_size)

    sub = subscriber(Stalling(store), key)
    await sub.sync()  # step 8
    await publish(publisher, range(9, 10))
    marker = layout.commit_key(9)
    await store.put(marker, (await store.get(marker)).replace(b'"step":9', b'"step":7', 1))  # signature breaks
    result = await asyncio.wait_for(sub.sync(), 10)  # not held up by the read
    assert result.step == 8 and sub.status.rejected_markers == 1

    def reading() -> list[asyncio.Task[object]]:
        return [t for t in asyncio.all_tasks() if "_read_and_hash" in repr(t.get_coro())]

    assert reading()
    await sub.close()
    assert not reading()
