"""Retention against chains from the real publisher: every kept step still reconstructs, bit for bit.

The property test draws chains (anchor interval, anchors whose upload fails, steps never
published) and policies, runs retention any number of times (publishing more in between), and
rebuilds every ready step left from the store. Anchor failures are injected with RecordingStore
(in-process: a real store cannot fail exactly "the anchor of step 7").
"""

from __future__ import annotations

import asyncio
import datetime as dt
import json
import tempfile
import time
import uuid
from pathlib import Path

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from pulsesync.cli import main
from pulsesync.errors import StoreError
from pulsesync.protocol import layout, signing
from pulsesync.protocol.chain import ChainClient
from pulsesync.protocol.fleet import FleetStatus
from pulsesync.publisher import AsyncPublisher
from pulsesync.rebuild import reconstruct
from pulsesync.retention import RetentionWorker
from pulsesync.retention.policy import RetentionPolicy
from pulsesync.sinks import Sink, Update
from pulsesync.store import FileStore, S3Store, Store
from pulsesync.subscriber import Subscriber, daemon
from pulsesync.subscriber.config import SubscriberConfig
from tests.support.helpers import assert_states_equal, ready_kinds, trainer_states
from tests.support.helpers import publisher_config as config
from tests.support.recording_store import RecordingStore
from tests.support.servers import BUCKET

STATES = 40
KEY = Ed25519PrivateKey.generate()
TRUSTED = signing.trusted_keys([KEY.public_key()])


async def publish(pub: AsyncPublisher, steps: list[int]) -> None:
    for step in steps:
        await pub.publish(step, trainer_states(STATES)[step], {"config.json": b"{}"})
        await pub.flush()


async def ready_steps(store: Store) -> dict[int, set[str]]:
    return await ready_kinds(ChainClient(store, TRUSTED))


async def assert_every_ready_step_reconstructs(store: Store) -> None:
    reader = ChainClient(store, TRUSTED)
    for step in sorted(await reader.ready()):
        rebuilt = await reconstruct(reader, step)
        assert_states_equal(rebuilt.state, trainer_states(STATES)[step])


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    k=st.integers(1, 6),
    failing_anchors=st.sets(st.integers(0, 30), max_size=6),
    skipped=st.sets(st.integers(1, 30), max_size=8),
    policies=st.lists(
        st.tuples(st.integers(0, 6), st.integers(0, 3), st.integers(0, 6)), min_size=1, max_size=3
    ),  # (keep_patches, keep_anchors, steps published before the run)
)
def test_retention_never_breaks_a_kept_chain(
    k: int, failing_anchors: set[int], skipped: set[int], policies: list[tuple[int, int, int]]
) -> None:
    def fail_anchor(op: str, key: str) -> None:
        step = layout.step_of_payload(key)
        if key.startswith("anchors/") and step in failing_anchors and step != 0:
            raise StoreError(f"injected: anchor upload of step {step} fails")

    async def scenario(root: Path) -> None:
        store = RecordingStore(FileStore(root), fail_anchor)
        pub = AsyncPublisher(config(anchor_interval=k), store=store, signing_key=KEY)
        await pub.start()
        steps = [s for s in range(24) if s not in skipped]
        await publish(pub, steps[:8])
        published = 8
        for keep_patches, keep_anchors, more in policies:
            await publish(pub, steps[published : published + more])
            published += more
            before = await ready_steps(store)
            policy = RetentionPolicy(keep_patches=keep_patches, keep_anchors=keep_anchors, grace_seconds=0)
            worker = RetentionWorker(store, policy, TRUSTED)
            await worker.run_once()
            after = await ready_steps(store)
            newest = max(before)
            assert after[newest] == before[newest]  # the newest step is never affected
            assert len([s for s, kinds in after.items() if "patch" in kinds]) >= min(
                keep_patches, len([s for s, kinds in before.items() if "patch" in kinds])
            )
            await assert_every_ready_step_reconstructs(store)
            again = await RetentionWorker(store, policy, TRUSTED).plan()
            assert again.deleted_objects == 0  # a second run deletes nothing
        # Nothing the kept markers do not name is left behind (grace 0: payloads went at once).
        reader = ChainClient(store, TRUSTED)
        named = set()
        for step, kinds in (await ready_kinds(reader)).items():
            for kind in kinds:
                named |= {ref.key for ref in (await reader.manifest(step, kind)).objects}
        oldest = min(await reader.ready())
        left = {i.key async for i in store.list("patches/")} | {i.key async for i in store.list("anchors/")}
        assert {key for key in left - named if (layout.step_of_payload(key) or 0) < oldest} == set()
        assert [i.key async for i in store.list(layout.TOMBSTONE_PREFIX)] == []

    with tempfile.TemporaryDirectory(prefix="pulsesync-retention-") as tmp:
        asyncio.run(scenario(Path(tmp)))


async def test_grace_period_keeps_payloads_then_dry_run_and_second_run(tmp_path: Path) -> None:
    store = FileStore(tmp_path / "store")
    pub = AsyncPublisher(config(anchor_interval=5), store=store, signing_key=KEY)
    await pub.start()
    await publish(pub, list(range(12)))
    policy = RetentionPolicy(keep_patches=2, keep_anchors=1, grace_seconds=1.0)
    dry = await RetentionWorker(store, policy, TRUSTED).run_once(dry_run=True)
    assert dry.unmark and not dry.purge
    assert dry.lines()[0] == "remove ready marker ready/000000000000.json"
    assert len(await ready_steps(store)) == 12  # a dry run deletes nothing
    worker = RetentionWorker(store, policy, TRUSTED)
    first = await worker.run_once()
    assert sorted(p.entry for p in first.unmark) == sorted(
        [(0, "anchor"), (5, "anchor")] + [(s, "patch") for s in range(1, 10)]
    )
    # Patch 10 rebuilds from its own anchor, so the chain below it goes.
    assert await ready_steps(store) == {10: {"patch", "anchor"}, 11: {"patch"}}
    removed_payload = first.unmark[0].objects[0][0]
    assert await store.exists(removed_payload)  # still there for readers in flight
    assert (await worker.run_once()).deleted_objects == 0
    time.sleep(1.1)
    purge = await worker.run_once()
    assert len(purge.purge) == len(first.unmark) and purge.freed_bytes > 0
    assert not await store.exists(removed_payload)
    assert (await worker.run_once()).deleted_objects == 0
    await assert_every_ready_step_reconstructs(store)


class CheckingSink(Sink):
    """Records every state delivered and checks it against the trainer's state of that step."""

    name = "checking"

    def __init__(self) -> None:
        self.steps: list[int] = []

    async def deliver(self, update: Update) -> None:
        assert_states_equal(update.state, trainer_states(STATES)[update.step])
        self.steps.append(update.step)


@pytest.mark.integration
async def test_subscriber_converges_while_retention_deletes_under_it(moto_endpoint: str) -> None:
    store = S3Store(BUCKET, f"ret-{uuid.uuid4().hex[:12]}", endpoint_url=moto_endpoint)
    pub = AsyncPublisher(config(anchor_interval=5), store=store, signing_key=KEY)
    await pub.start()
    await publish(pub, list(range(20)))
    fast_retry = SubscriberConfig(retry_initial_seconds=0.01, retry_max_seconds=0.05)
    sinks = {name: CheckingSink() for name in ("racing", "stale")}
    subs = {name: Subscriber(fast_retry, store=store, trusted=TRUSTED, sinks=[sink]) for name, sink in sinks.items()}
    for sub in subs.values():
        await sub.sync(2)  # holds step 2: reaching 19 takes the chain 3..19, which retention prunes to 16..19
    worker = RetentionWorker(store, RetentionPolicy(keep_patches=2, keep_anchors=1, grace_seconds=0), TRUSTED)
    done = asyncio.Event()

    async def prune() -> None:  # runs again and again while the subscriber reads
        while not done.is_set():
            await worker.run_once()
            await asyncio.sleep(0)

    async def follow() -> None:
        try:
            await daemon.sync_with_retries(subs["racing"], 20)
        finally:
            done.set()

    await asyncio.gather(prune(), follow())  # real concurrency over HTTP: either outcome is fine...
    # ...and a subscriber whose listing predates the pruning finds its chain gone and falls back.
    result = await daemon.sync_with_retries(subs["stale"], 20)
    assert result.path == "slow" and subs["stale"].status.fallbacks == {"NotFoundError": 1}
    for name, sub in subs.items():
        assert sub.step == 19 and sinks[name].steps == [2, 19]  # only verified states were delivered
        assert_states_equal(sub.state or {}, trainer_states(STATES)[19])
    assert set(await ready_steps(store)) == {15, 16, 17, 18, 19}
    await store.close()


def test_retain_inspect_and_verify_commands(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from cryptography.hazmat.primitives import serialization

    async def publish_chain() -> None:
        pub = AsyncPublisher(config(anchor_interval=4), store=FileStore(tmp_path / "store"), signing_key=KEY)
        await pub.start()
        await publish(pub, list(range(10)))
        await pub.close()

    asyncio.run(publish_chain())
    pub_file = tmp_path / "publisher.pub"
    pub_file.write_bytes(
        KEY.public_key().public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)
    )
    url = (tmp_path / "store").as_uri()
    assert main(["inspect", "--store", url, "--trusted-key", str(pub_file)]) == 0
    table = capsys.readouterr().out.splitlines()
    assert table[0].split()[:4] == ["step", "kind", "from", "chain"] and len(table) == 1 + 12 + 1 + 1
    assert table[-2].startswith("9 patches") and all(" ok " in line for line in table[1:-2])
    assert table[-1] == "fleet: no subscriber status objects"
    assert main(["inspect", "--store", url, "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)["steps"]
    assert [(r["step"], r["kind"], r["chains_from"]) for r in rows if r["step"] in (6, 8)] == [
        (6, "patch", 4),
        (8, "anchor", None),
        (8, "patch", 4),
    ]
    trust = ["--trusted-key", str(pub_file)]
    assert main(["retain", "--store", url, "--keep-patches", "1", "--keep-anchors", "1", "--dry-run", *trust]) == 0
    plan = capsys.readouterr().out.splitlines()
    assert plan[0] == "remove ready marker ready/000000000000.json" and plan[-1].startswith("would have: ")
    flags = ["--store", url, "--keep-patches", "1", "--keep-anchors", "1", "--grace-seconds", "0", "--once", *trust]
    assert main(["retain", *flags]) == 0
    assert "kept 2 ready markers; removed 10 markers" in capsys.readouterr().out  # patch 9 + anchor 8 stay
    assert main(["retain", *flags]) == 0
    assert "deleted 0 objects" in capsys.readouterr().out
    assert main(["verify", "--store", url, "--trusted-key", str(pub_file)]) == 0
    report = json.loads(capsys.readouterr().out)
    assert (report["step"], report["anchor_step"], report["patches_applied"]) == (9, 8, 1)
    assert main(["verify", "--store", url, "--trusted-key", str(pub_file), "--step", "5"]) == 5
    assert "NotFoundError" in capsys.readouterr().err
    assert main(["verify", "--store", url]) == 3
    (tmp_path / "store" / "ready" / "000000000009.json").write_text("{")
    assert main(["retain", *flags]) == 0  # a marker it cannot read is skipped: it keeps and deletes nothing
    assert "deleted 0 objects" in capsys.readouterr().out
    assert (tmp_path / "store" / "ready" / "000000000009.json").exists()
    assert any((tmp_path / "store" / "patches" / "000000000009").iterdir())
    assert main(["retain", *flags[:-2]]) == 3  # no trusted key: a configuration error


async def test_retention_runs_inside_the_publisher(tmp_path: Path) -> None:
    policy = RetentionPolicy(keep_patches=2, keep_anchors=1, grace_seconds=0, interval_seconds=0.05)
    store = FileStore(tmp_path / "store")
    pub = AsyncPublisher(config(anchor_interval=5, retention=policy), store=store, signing_key=KEY)
    await pub.start()
    await publish(pub, list(range(12)))
    await asyncio.sleep(0.3)  # a few retention runs
    await pub.close()
    assert await ready_steps(FileStore(tmp_path / "store")) == {10: {"patch", "anchor"}, 11: {"patch"}}


_JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(max_size=30),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.sampled_from(["marker", "removed_at", "x"]), inner),
)


@settings(max_examples=300, deadline=None)
@example(body=b'{"marker": "{}"}')  # no removed_at: a KeyError before
@example(body=b"[" * 100_000)  # a RecursionError before
@given(body=st.binary(max_size=200) | _JSON.map(lambda v: json.dumps(v).encode()))
def test_a_tombstone_body_parses_or_raises_value_error(body: bytes) -> None:
    """Tombstone.parse on any bytes: the signed marker and an aware time, or ValueError, never another exception."""
    from pulsesync.retention import Tombstone

    try:
        marker, removed_at = Tombstone.parse(body)
    except ValueError:
        return
    assert isinstance(marker, bytes) and removed_at.tzinfo is not None


async def test_retention_keeps_what_a_lagging_subscriber_needs_and_inspect_shows_the_fleet(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    store = FileStore(tmp_path / "store")
    pub = AsyncPublisher(config(anchor_interval=10), store=store, signing_key=KEY)
    await pub.start()
    await publish(pub, list(range(26)))
    await pub.close()
    sub = Subscriber(
        SubscriberConfig(step=12, subscriber_id="lagging", poll_seconds=0.05), store=store, trusted=TRUSTED
    )
    stop = asyncio.Event()
    daemon = asyncio.create_task(sub.run(stop))
    status_key = "fleet/lagging.json"
    while not await store.exists(status_key):
        await asyncio.sleep(0.02)
    stop.set()
    await daemon
    now = dt.datetime.now(dt.timezone.utc)
    old = FleetStatus(subscriber="gone", step=3, updated_at=now - dt.timedelta(days=1))
    await store.put(old.key, old.to_bytes())  # seen a day ago: no longer kept for
    await store.put("fleet/junk.json", b"{not json")
    await store.put("fleet/misplaced.json", FleetStatus(subscriber="other", step=1, updated_at=now).to_bytes())
    await store.put("fleet/big.json", b" " * 5000)

    assert await asyncio.to_thread(main, ["inspect", "--store", tmp_path.joinpath("store").as_uri(), "--json"]) == 0
    fleet = {f["subscriber"]: f for f in json.loads(capsys.readouterr().out)["fleet"]}
    assert set(fleet) == {"lagging", "gone"}  # junk, misplaced and oversized objects are skipped
    assert (fleet["lagging"]["step"], fleet["lagging"]["lag"], fleet["lagging"]["gone"]) == (12, 13, False)
    assert fleet["gone"]["gone"] is True
    html = tmp_path / "chain.html"
    assert await asyncio.to_thread(main, ["inspect", "--store", store.root.as_uri(), "--html", str(html)]) == 0
    page = html.read_text()
    assert '<table id="fleet">' in page and ">lagging</td><td>12</td><td>13</td>" in page

    policy = RetentionPolicy(keep_patches=2, keep_anchors=1, grace_seconds=0)
    plan = await RetentionWorker(store, policy, TRUSTED).run_once(dry_run=True)
    assert plan.lines()[0] == "keep 13 patches after step 12 for subscriber lagging (fleet status)"
    removed = [line.removeprefix("remove ready marker ") for line in plan.lines() if line.startswith("remove ready")]
    assert removed and not {layout.commit_key(s) for s in range(13, 26)} & set(removed)
    capped = RetentionPolicy(keep_patches=2, keep_anchors=1, grace_seconds=0, fleet_max_lag=12)
    assert (await RetentionWorker(store, capped, TRUSTED).plan()).for_fleet == []  # too far behind: slow path
    await RetentionWorker(store, policy, TRUSTED).run_once()
    assert (await sub.sync(25)).path == "chain"  # it catches up from the patches kept for it
    assert_states_equal(sub.state or {}, trainer_states(STATES)[25])
