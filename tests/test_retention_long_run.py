"""Retention over a long run: 50,000 signed steps; what a run costs follows what it deletes, not the run's history.

The steps are published straight into a MemoryStore (tiny payloads, real signed manifests), a
retention run after every batch, as a daemon on an interval would. Each run publishes and
deletes the same number of steps, so a run late in the history must cost what an early one did:
the same requests and bytes read, about the same peak memory, and caches bounded by what the
store holds. Requests and bytes are counted (RecordingStore), memory traced (tracemalloc):
nothing here is a timing.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import tracemalloc
from dataclasses import dataclass

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from pulsesync.digest import StateDigest, TensorDigest
from pulsesync.protocol import layout, signing
from pulsesync.protocol.manifest import AnchorFormat, AnchorManifest, ObjectRef, PatchCodec, PatchManifest, Sizes
from pulsesync.retention import RetentionPolicy, RetentionWorker
from pulsesync.store.memory import MemoryStore
from tests.support.recording_store import RecordingStore

STEPS = 50_000
BATCH = 1_000  # steps published between two retention runs
ANCHOR_EVERY = 500
POLICY = RetentionPolicy(keep_patches=100, keep_anchors=2, grace_seconds=0)
EARLY, LATE = 5, STEPS // BATCH - 1  # compared runs, 44 runs apart


@dataclass
class RunCost:
    requests: dict[str, int]
    bytes_read: int
    peak_memory: int
    deleted: int


def _signed_steps(key: Ed25519PrivateKey, start: int, stop: int, anchor_every: int = ANCHOR_EVERY) -> dict[str, bytes]:
    """The objects and ready markers of steps [start, stop): an anchor every `anchor_every` steps, else a patch."""
    digest = StateDigest(
        algorithm="mixsum-128",
        root="0" * 32,
        tensors={"w": TensorDigest(dtype="BF16", shape=(4,), digest="0" * 32)},
    )
    common = {"state_digest": digest, "sizes": Sizes(dense_bytes=8, wire_bytes=1, changed_elements=1)}
    created = dt.datetime.now(dt.timezone.utc).isoformat()
    objects: dict[str, bytes] = {}
    for step in range(start, stop):
        if step % anchor_every == 0:
            ref = ObjectRef(key=f"{layout.anchor_dir(step, 'run')}model.safetensors", size=1, sha256="0" * 64)
            manifest: PatchManifest | AnchorManifest = AnchorManifest(
                step=step, objects=[ref], created_at=created, codec=AnchorFormat(shards=1), **common
            )
        else:
            ref = ObjectRef(key=layout.patch_key(step, "run"), size=1, sha256="0" * 64)
            codec = PatchCodec(format_version=2, value_coding="delta", zstd_level=3, chunk_elements=1 << 22)
            manifest = PatchManifest(
                step=step,
                objects=[ref],
                created_at=created,
                base_step=step - 1,
                anchor_step=step - step % anchor_every,
                base_digest="0" * 32,
                codec=codec,
                **common,
            )
        objects[ref.key] = b"x"
        objects[layout.commit_key(step)] = manifest.signed(key).to_bytes()
    return objects


async def _costs_of_a_long_run() -> tuple[list[RunCost], RetentionWorker]:
    key = Ed25519PrivateKey.generate()
    memory = MemoryStore()
    store = RecordingStore(memory)
    worker = RetentionWorker(store, POLICY, signing.trusted_keys([key.public_key()]))
    costs: list[RunCost] = []
    for run, start in enumerate(range(0, STEPS, BATCH)):
        for name, data in _signed_steps(key, start, start + BATCH).items():
            await memory.put(name, data)
        store.calls.clear()
        store.bytes_read = 0
        traced = run in (EARLY, LATE)
        if traced:
            tracemalloc.start()
        todo = await worker.run_once()
        peak = tracemalloc.get_traced_memory()[1] if traced else 0
        tracemalloc.stop()
        costs.append(RunCost(dict(store.calls), store.bytes_read, peak, todo.deleted_objects))
        store.reads.clear()
        store.writes.clear()
    return costs, worker


async def test_a_retention_run_costs_what_it_deletes_not_the_runs_history() -> None:
    costs, worker = await _costs_of_a_long_run()
    a, b = costs[EARLY], costs[LATE]
    assert a.deleted == b.deleted > BATCH  # the same work: each run removes a batch of steps
    assert b.requests == a.requests, (a.requests, b.requests)
    assert b.bytes_read <= a.bytes_read * 1.01
    assert b.peak_memory <= a.peak_memory * 1.2, (a.peak_memory, b.peak_memory)
    # A run reads each new marker once and each removed one again for its tombstone: O(deleted).
    assert costs[LATE].requests["GET"] <= 2 * BATCH + 10
    # What the worker holds is what the store holds: the kept markers, never the history.
    kept = len(worker._manifests)
    assert kept <= POLICY.keep_patches + ANCHOR_EVERY + POLICY.keep_anchors
    assert len(worker.chain.listed) <= kept and len(worker.chain.published_at) <= 16
    store = worker.store
    assert isinstance(store, RecordingStore) and isinstance(store.inner, MemoryStore)
    assert len(store.inner.objects) <= 2 * kept


def test_markers_and_tombstones_are_read_once_and_what_is_gone_is_forgotten() -> None:
    key = Ed25519PrivateKey.generate()
    memory = MemoryStore()
    store = RecordingStore(memory)
    policy = RetentionPolicy(keep_patches=2, keep_anchors=1, grace_seconds=3600)
    worker = RetentionWorker(store, policy, signing.trusted_keys([key.public_key()]))
    for name, data in _signed_steps(key, 0, 20, anchor_every=5).items():
        asyncio.run(memory.put(name, data))

    first = asyncio.run(worker.run_once())  # reads 20 markers, re-reads the 15 it removes
    assert first.keep == [(15, "anchor"), (16, "patch"), (17, "patch"), (18, "patch"), (19, "patch")]
    assert len(first.unmark) == 15 and store.calls["GET"] == 20 + 15
    store.calls.clear()
    asyncio.run(memory.delete_many([layout.commit_key(19)]))  # removed by someone else
    second = asyncio.run(worker.run_once())  # the 15 tombstones read once; the removed marker forgotten
    assert store.calls["GET"] == 15 and not second.unmark and not second.purge
    assert second.keep == [(15, "anchor"), (16, "patch"), (17, "patch"), (18, "patch")]
    store.calls.clear()
    third = asyncio.run(worker.run_once())  # nothing new: nothing read
    assert store.calls["GET"] == 0 and not third.unmark and not third.purge
