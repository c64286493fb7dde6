"""The state cache as a journal: a fast-path step writes about its patch; a restart replays, verified."""

from __future__ import annotations

from pathlib import Path

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from pulsesync import state_cache
from pulsesync.publisher import AsyncPublisher
from pulsesync.store import Store
from tests.support.helpers import flip_byte
from tests.support.recording_store import RecordingStore
from tests.support.subscribing import assert_serving, subscriber

pytestmark = pytest.mark.parametrize("store", ["fs"], indirect=True)


async def _follow(store: Store, key: Ed25519PrivateKey, cache: Path, steps: range, **overrides: object) -> int:
    """Sync a cached subscriber through `steps` (the first from the anchor); the cache bytes written after that."""
    sub = subscriber(store, key, cache_dir=cache, **overrides)
    await sub.sync(steps[0])
    first = sub.cache.bytes_written
    for step in steps[1:]:
        assert (await sub.sync(step)).path == "fast"
    await sub.close()
    return sub.cache.bytes_written - first


async def test_a_fast_path_step_journals_its_patch_not_the_state(
    store: Store, key: Ed25519PrivateKey, publisher: AsyncPublisher, tmp_path: Path
) -> None:
    cache = tmp_path / "cache"
    written = await _follow(store, key, cache, range(5, 9))
    base = (cache / state_cache.STATE_FILE).stat()
    patches = [await publisher.rounds.chain.manifest(s, "patch") for s in (6, 7, 8)]
    entries = state_cache.journal_entries(cache)
    assert [e.step for e in entries] == [6, 7, 8]
    # Exactly each patch and its signed manifest: no state was rewritten.
    assert written == sum(p.objects[0].size + len(p.to_bytes()) for p in patches)
    assert (cache / state_cache.STATE_FILE).stat().st_mtime_ns == base.st_mtime_ns
    # A restart replays the journal, verified, and downloads no anchor (no shard, no patch).
    recording = RecordingStore(store)
    restarted = subscriber(recording, key, cache_dir=cache)
    await restarted.start()
    assert_serving(restarted, 8)
    assert not [k for k in recording.reads if k.startswith(("anchors/", "patches/"))]
    assert (await restarted.sync()).path == "up-to-date"


@pytest.mark.parametrize("damage", ["patch", "manifest", "foreign key"])
async def test_a_damaged_journal_entry_stops_the_replay_there(
    store: Store, key: Ed25519PrivateKey, publisher: AsyncPublisher, tmp_path: Path, damage: str
) -> None:
    cache = tmp_path / "cache"
    await _follow(store, key, cache, range(5, 9))
    entry = {e.step: e for e in state_cache.journal_entries(cache)}[7]
    if damage == "patch":
        entry.patch_path.write_bytes(flip_byte(entry.patch_path.read_bytes()))
    elif damage == "manifest":
        entry.manifest_path.write_bytes(entry.manifest_path.read_bytes().replace(b'"step":7', b'"step":9'))
    else:  # validly signed, by a key the subscriber does not trust
        manifest = await publisher.rounds.chain.manifest(7, "patch")
        entry.manifest_path.write_bytes(manifest.signed(Ed25519PrivateKey.generate()).to_bytes())
    restarted = subscriber(store, key, cache_dir=cache)
    await restarted.start()
    assert_serving(restarted, 6)  # verified up to the damaged entry
    assert [e.step for e in state_cache.journal_entries(cache)] == [6]
    result = await restarted.sync()
    assert (result.step, result.path) == (8, "chain")
    assert_serving(restarted, 8)


async def test_past_its_budget_the_journal_is_compacted_into_a_new_base(
    store: Store, key: Ed25519PrivateKey, publisher: AsyncPublisher, tmp_path: Path
) -> None:
    cache = tmp_path / "cache"
    await _follow(store, key, cache, range(5, 9), cache_journal_ratio=0.0)
    assert state_cache.journal_entries(cache) == []
    restarted = subscriber(store, key, cache_dir=cache)
    await restarted.start()
    assert_serving(restarted, 8)
