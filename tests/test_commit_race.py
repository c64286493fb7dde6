"""One commit key per step: of two publishers racing for a step exactly one commits; older prefixes still read.

A careless relaunch or a second copy of a training job can pass every check a publisher makes
before it commits at the same moment as the first. When a step had a key per kind, one could
commit a patch and the other an anchor, both put-if-absent writes succeeding: two different
states signed for one step. Here both publishers are held at their commit write by a barrier, so
each has checked the prefix before either writes.
"""

from __future__ import annotations

import contextlib
import threading
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from pulsesync.errors import ConflictError
from pulsesync.protocol import layout
from pulsesync.protocol.manifest import parse_manifest
from pulsesync.publisher import Publisher
from pulsesync.publisher.config import PublisherConfig
from pulsesync.rebuild import reconstruct
from pulsesync.retention import RetentionPolicy, RetentionWorker
from pulsesync.store import FileStore, S3Store, Store
from tests.support.helpers import assert_states_equal, trainer_states
from tests.support.recording_store import RecordingStore
from tests.support.servers import BUCKET
from tests.support.subscribing import subscriber

STEPS = 4


@pytest.fixture(params=["fs", pytest.param("seaweedfs", marks=pytest.mark.integration)])
def new_store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Callable[[], Store]]:
    """A maker of stores on one fresh prefix: each publisher gets its own client (its own event loop)."""
    if request.param == "fs":
        yield lambda: FileStore(tmp_path / "store")
        return
    endpoint, prefix = request.getfixturevalue("seaweedfs_endpoint"), f"race-{uuid.uuid4().hex[:12]}"
    yield lambda: S3Store(BUCKET, prefix, endpoint_url=endpoint)


def held_at_commit(store: Store, barrier: threading.Barrier) -> RecordingStore:
    """The store, with each commit write held until every racer reached its own."""

    def hook(op: str, key: str) -> None:
        if op == "put_if_absent" and key.startswith(layout.READY_PREFIX):
            barrier.wait(timeout=60)

    return RecordingStore(store, hook)


async def everything(store: Store) -> dict[str, bytes]:
    return {info.key: await store.get(info.key) async for info in store.list()}


async def test_two_publishers_racing_for_a_step_commit_exactly_one(
    new_store: Callable[[], Store], key: Ed25519PrivateKey
) -> None:
    make = new_store
    first = Publisher(PublisherConfig(anchor_interval=10), store=make(), signing_key=key)
    with first:
        for step in range(3):
            first.publish(step, trainer_states(STEPS)[step])

    # Both have listed steps 0-2 before either writes: the resumed one commits step 3 as a patch, the one
    # started without resuming (the default) commits it as an anchor, of another run's weights.
    barrier = threading.Barrier(2)
    racers = {
        "patch": Publisher(
            PublisherConfig(anchor_interval=10, resume=True), store=held_at_commit(make(), barrier), signing_key=key
        ),
        "anchor": Publisher(
            PublisherConfig(anchor_interval=10), store=held_at_commit(make(), barrier), signing_key=key
        ),
    }
    states = {"patch": trainer_states(STEPS)[3], "anchor": trainer_states(STEPS, seed=1)[3]}
    before = await everything(make())
    outcomes: dict[str, BaseException | None] = {}

    def race(kind: str) -> None:
        try:
            racers[kind].publish(3, states[kind])
            racers[kind].flush()
            outcomes[kind] = None
        except BaseException as e:
            outcomes[kind] = e

    threads = [threading.Thread(target=race, args=(kind,)) for kind in racers]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    for publisher in racers.values():
        with contextlib.suppress(ConflictError):  # the loser's close re-raises why it stopped
            publisher.close()
    after = await everything(make())
    step3 = [k for k in after if (e := layout.parse_ready_key(k)) is not None and e.step == 3]
    assert len(step3) == 1, f"step 3 committed {len(step3)} times: {step3}"
    winners = [kind for kind, error in outcomes.items() if error is None]
    losers = [error for error in outcomes.values() if error is not None]
    assert len(winners) == 1 and len(losers) == 1, outcomes
    assert isinstance(losers[0], ConflictError) and ConflictError.exit_code == 6
    assert "already exists" in str(losers[0])
    assert step3 == [layout.commit_key(3)]
    assert {k: v for k, v in after.items() if k in before and k != layout.POINTER_KEY} == {
        k: v for k, v in before.items() if k != layout.POINTER_KEY
    }  # nothing before the race changed
    assert after[layout.POINTER_KEY] == layout.pointer_body(3)
    added = {k for k in after if k.startswith(("ready", "retention/")) and k not in before}
    # The winner's commit, and an anchor beside it only if the winner committed a patch and an anchor was due.
    assert added - {layout.anchor_ready_key(3)} == {layout.commit_key(3)}
    assert winners == ["patch"] or layout.anchor_ready_key(3) not in added

    sub = subscriber(make(), key)
    assert (await sub.sync()).step == 3
    assert sub.state is not None
    assert_states_equal(sub.state, states[winners[0]])  # the winner's state, whichever won
    await sub.close()


def to_legacy_layout(root: Path) -> None:
    """Rename a file store's markers to the layout before the commit key: a key per kind under ready/."""
    for commit in sorted((root / "ready").iterdir()):
        kind = parse_manifest(commit.read_bytes()).kind
        commit.rename(root / layout.legacy_ready_key(int(commit.name[:12]), kind))
    for anchor in sorted((root / "ready-anchors").iterdir()):
        anchor.rename(root / layout.legacy_ready_key(int(anchor.name[:12]), "anchor"))
    (root / "ready-anchors").rmdir()


async def test_a_prefix_in_the_older_layout_is_followed_continued_and_pruned(
    tmp_path: Path, key: Ed25519PrivateKey
) -> None:
    root = tmp_path / "store"
    states = trainer_states(12)
    settings = PublisherConfig(anchor_interval=4, resume=True, on_backpressure="block")
    with Publisher(settings, store=FileStore(root), signing_key=key) as publisher:
        for step in range(8):
            publisher.publish(step, states[step])
    to_legacy_layout(root)
    assert sorted(p.name for p in (root / "ready").iterdir())[:3] == [
        "000000000000.anchor.json",
        "000000000001.patch.json",
        "000000000002.patch.json",
    ]
    sub = subscriber(FileStore(root), key)
    assert ((await sub.sync()).step, sub.step) == (7, 7)  # slow path: legacy anchor 4 + legacy patches
    assert_states_equal(sub.state, states[7])  # type: ignore[arg-type]

    with Publisher(settings, store=FileStore(root), signing_key=key) as publisher:  # resumes, then commit keys
        for step in range(8, 12):
            publisher.publish(step, states[step])
    assert (root / layout.commit_key(8)).exists() and (root / layout.anchor_ready_key(8)).exists()
    result = await sub.sync()
    assert (result.step, result.path) == (11, "chain")  # legacy patch 7's history, then the new patches
    assert_states_equal(sub.state, states[11])  # type: ignore[arg-type]
    await sub.close()

    policy = RetentionPolicy(keep_patches=2, keep_anchors=1, grace_seconds=0)
    plan = await RetentionWorker(
        FileStore(root), policy, subscriber(FileStore(root), key).stores.chain.trusted
    ).run_once()
    assert {p.marker_key for p in plan.unmark} >= {
        layout.legacy_ready_key(0, "anchor"),
        layout.legacy_ready_key(1, "patch"),
    }
    fresh = subscriber(FileStore(root), key)
    for step in (10, 11):
        rebuilt = await reconstruct(fresh.stores.chain, step)
        assert_states_equal(rebuilt.state, states[step])
