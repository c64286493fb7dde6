"""The publisher against real stores (filesystem and moto in server mode): objects, commit order, failures."""

from __future__ import annotations

import itertools
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from prometheus_client import REGISTRY

from pulsesync import state_cache
from pulsesync.errors import ConflictError, StoreError
from pulsesync.protocol import layout, signing
from pulsesync.protocol.chain import ChainClient
from pulsesync.protocol.manifest import AnchorManifest, PatchManifest, verify_manifest
from pulsesync.publisher import AsyncPublisher, Publisher
from pulsesync.publisher.config import PublisherConfig
from pulsesync.rebuild import apply_step, reconstruct
from pulsesync.store import FileStore, Store
from pulsesync.subscriber import Subscriber
from pulsesync.subscriber.config import SubscriberConfig
from tests.support.helpers import assert_states_equal, ready_kinds, trainer_states
from tests.support.helpers import publisher_config as config
from tests.support.recording_store import RecordingStore

ROOT = Path(__file__).parent.parent


def trusted(key: Ed25519PrivateKey) -> dict[str, object]:
    return dict(signing.trusted_keys([key.public_key()]))


async def publish_steps(
    store: Store, key: Ed25519PrivateKey, steps: range, cfg: PublisherConfig | None = None
) -> AsyncPublisher:
    publisher = AsyncPublisher(cfg or config(), store=store, signing_key=key)
    async with publisher:
        for step in steps:
            await publisher.publish(step, trainer_states(steps.stop)[step], {"config.json": b'{"model_type": "t"}'})
    return publisher


def marker_keys(kinds: dict[int, set[str]]) -> list[str]:
    """Where the publisher writes each marker: one commit key per step, an anchor of a patch step beside it."""
    keys = [layout.commit_key(s) for s in kinds]
    return keys + [layout.anchor_ready_key(s) for s, ks in kinds.items() if ks == {"patch", "anchor"}]


async def assert_every_step_rebuilds(store: Store, key: Ed25519PrivateKey, states: tuple[dict, ...]) -> None:
    reader = ChainClient(store, trusted(key))  # type: ignore[arg-type]
    for step in await reader.ready():
        rebuilt = await reconstruct(reader, step)
        assert_states_equal(rebuilt.state, states[step])


async def test_thirty_steps_make_exactly_the_expected_objects_and_every_step_rebuilds(
    store: Store, key: Ed25519PrivateKey
) -> None:
    publisher = await publish_steps(store, key, range(30))
    run = publisher.run_id
    kinds = {s: {"patch"} | ({"anchor"} if s % 10 == 0 else set()) for s in range(1, 30)} | {0: {"anchor"}}
    assert sorted([info.key async for info in store.list("ready")]) == sorted(marker_keys(kinds))
    keys = [info.key async for info in store.list()]
    patches = [layout.patch_key(s, run) for s in range(1, 30)]
    anchor_files = {"config.json", "model.safetensors.index.json"}
    anchors = {k for k in keys if k.startswith("anchors/")}
    assert {k.rsplit("/", 1)[0] + "/" for k in anchors} == {layout.anchor_dir(s, run) for s in (0, 10, 20)}
    for step in (0, 10, 20):
        names = {k.rsplit("/", 1)[1] for k in anchors if k.startswith(layout.anchor_dir(step, run))}
        # An anchor added to a patch step carries that patch's history (the reference of the next patch).
        history = {"patch-history-00000.safetensors.zst"} if step else set()
        shards = names - anchor_files - history
        assert anchor_files | history <= names and len(shards) >= 2 and all(n.startswith("model-0000") for n in shards)
    assert sorted(keys) == sorted([*patches, *anchors, *marker_keys(kinds), layout.POINTER_KEY])
    assert await store.get(layout.POINTER_KEY) == layout.pointer_body(29)  # the newest commit

    anchors_so_far = [0]
    for step in range(30):
        for kind in ("patch", "anchor"):
            if (step == 0 and kind == "patch") or (kind == "anchor" and step % 10):
                continue
            where = layout.anchor_ready_key(step) if kind == "anchor" and step else layout.commit_key(step)
            manifest = verify_manifest(await store.get(where), trusted(key))  # type: ignore[arg-type]
            assert manifest.step == step and manifest.key_id == signing.key_id(key.public_key())
            if isinstance(manifest, PatchManifest):
                assert manifest.base_step == step - 1 and manifest.anchor_step in anchors_so_far
                assert manifest.objects[0].key == layout.patch_key(step, run)
            else:
                assert isinstance(manifest, AnchorManifest) and manifest.codec.shards >= 2
                carried = [layout.anchor_dir(step, run) + "patch-history-00000.safetensors.zst"] if step else []
                assert manifest.histories == carried
                anchors_so_far.append(step)
    await assert_every_step_rebuilds(store, key, trainer_states(30))
    assert [r.step for r in publisher.reports if r.kind == "anchor"] == [0, 10, 20]


async def test_the_ready_marker_is_the_last_write_of_every_step(store: Store, key: Ed25519PrivateKey) -> None:
    store = RecordingStore(store)
    await publish_steps(store, key, range(12), config(anchor_interval=4))
    markers = [i for i, (_, k) in enumerate(store.writes) if k.startswith(("ready/", "ready-anchors/"))]
    assert len(markers) == 11 + 3  # patches 1..11, anchors 0, 4, 8
    for i in markers:
        op, marker = store.writes[i]
        assert op == "put_if_absent"
        manifest = json.loads(await store.get(marker))
        written_before = {k for _, k in store.writes[:i]}
        assert {o["key"] for o in manifest["objects"]} <= written_before, marker


async def test_an_anchor_also_follows_when_patch_bytes_exceed_the_budget(
    tmp_path: Path, key: Ed25519PrivateKey
) -> None:
    store = FileStore(tmp_path / "store")
    publisher = await publish_steps(store, key, range(10), config(anchor_interval=100, anchor_bytes_budget=20_000))
    patch_bytes = {r.step: r.wire_bytes for r in publisher.reports if r.kind == "patch"}
    kinds = await ready_kinds(ChainClient(store, trusted(key)))  # type: ignore[arg-type]
    anchors = sorted(s for s, of_step in kinds.items() if "anchor" in of_step)
    assert len(anchors) > 2 and anchors[0] == 0
    for previous, anchor in itertools.pairwise(anchors):  # never before the budget is exceeded
        assert sum(patch_bytes[s] for s in range(previous + 1, anchor + 1)) > 20_000
    await assert_every_step_rebuilds(store, key, trainer_states(10))


async def test_a_failed_marker_write_never_advances_the_baseline(store: Store, key: Ed25519PrivateKey) -> None:
    def fail_step_5(op: str, k: str) -> None:
        if k.startswith("ready/000000000005."):
            raise StoreError(f"injected: cannot write {k}")

    failures_before = REGISTRY.get_sample_value("pulsesync_publish_failures_total", {"kind": "patch"}) or 0
    recording = RecordingStore(store, fail_step_5)
    publisher = await publish_steps(recording, key, range(9))
    ready = await ready_kinds(ChainClient(store, trusted(key)))  # type: ignore[arg-type]
    assert 5 not in ready and set(ready) == {0, 1, 2, 3, 4, 6, 7, 8}
    # The payload went up, the marker did not: the step is invisible, the orphan is harmless.
    assert [k async for k in store.list(layout.patch_prefix(5))]
    patch6 = verify_manifest(await store.get(layout.commit_key(6)), trusted(key))  # type: ignore[arg-type]
    assert isinstance(patch6, PatchManifest) and patch6.base_step == 4
    # A subscriber at step 4 applies patch 6 cleanly and lands bitwise on the trainer's step 6.
    reader = ChainClient(store, trusted(key))  # type: ignore[arg-type]
    at4 = await reconstruct(reader, 4)
    digest = await apply_step(reader.fetcher, at4.state, at4.digest, patch6, reference=at4.history)
    assert digest.root == patch6.state_digest.root
    assert_states_equal(at4.state, trainer_states(9)[6])
    await assert_every_step_rebuilds(store, key, trainer_states(9))
    failed = [(r.step, r.kind) for r in publisher.reports if not r.ok]
    assert failed == [(5, "patch"), (5, "anchor")]  # the patch failed, then the anchor that replaces it
    assert REGISTRY.get_sample_value("pulsesync_publish_failures_total", {"kind": "patch"}) == failures_before + 1


async def test_a_patch_that_fails_after_retries_is_replaced_by_an_anchor(store: Store, key: Ed25519PrivateKey) -> None:
    def fail_patch_5(op: str, k: str) -> None:
        if k.startswith(layout.patch_prefix(5)):
            raise StoreError(f"injected: put {k} gave up after retries")

    await publish_steps(RecordingStore(store, fail_patch_5), key, range(9))
    ready = await ready_kinds(ChainClient(store, trusted(key)))  # type: ignore[arg-type]
    assert ready[5] == {"anchor"} and ready[6] == {"patch"}
    patch6 = verify_manifest(await store.get(layout.commit_key(6)), trusted(key))  # type: ignore[arg-type]
    assert isinstance(patch6, PatchManifest) and (patch6.base_step, patch6.anchor_step) == (5, 5)
    await assert_every_step_rebuilds(store, key, trainer_states(9))


async def test_a_step_whose_files_changed_is_an_anchor_and_subscribers_serve_the_new_files(
    store: Store, key: Ed25519PrivateKey
) -> None:
    """A patch carries no files: a changed adapter_config.json (a LoRA rank change) must reach subscribers."""
    states = trainer_states(6)
    old, new = {"adapter_config.json": b'{"r": 8}'}, {"adapter_config.json": b'{"r": 16}'}
    async with AsyncPublisher(config(), store=store, signing_key=key) as publisher:
        for step in range(6):
            await publisher.publish(step, states[step], old if step < 3 else new)
    ready = await ready_kinds(ChainClient(store, trusted(key)))  # type: ignore[arg-type]
    assert ready[3] == {"anchor"} and ready[2] == ready[4] == {"patch"}
    sub = Subscriber(SubscriberConfig(), store=store, trusted=trusted(key))  # type: ignore[arg-type]
    await sub.sync(2)
    assert sub.served.files == old
    await sub.sync(4)
    assert sub.served.files == new
    assert_states_equal(dict(sub.state or {}), states[4])


async def test_a_second_publisher_on_the_prefix_gets_conflict_and_overwrites_nothing(
    store: Store, key: Ed25519PrivateKey
) -> None:
    states = trainer_states(8)
    first = AsyncPublisher(config(), store=store, signing_key=key)
    await first.start()
    for step in range(4):
        await first.publish(step, states[step])
    await first.flush()
    before = {info.key: await store.get(info.key) async for info in store.list()}

    second = AsyncPublisher(config(), store=store, signing_key=key)  # a second copy of the same trainer
    await second.start()
    with pytest.raises(ConflictError, match="step 3 is not newer than step 3"):
        await second.publish(3, states[3])
    # The first publisher goes on; the second, not knowing, publishes the same next step.
    await first.publish(4, states[4])
    await first.flush()
    await second.publish(4, states[4])
    with pytest.raises(ConflictError, match=r"another publisher wrote step 4 to .*; stopping"):
        await second.flush()
    with pytest.raises(ConflictError):
        await second.publish(5, states[5])  # stopped for good
    after = {info.key: await store.get(info.key) async for info in store.list()}
    assert after.pop(layout.POINTER_KEY) == layout.pointer_body(4)  # the first publisher's step 4
    before.pop(layout.POINTER_KEY)
    assert {k: v for k, v in after.items() if k in before} == before
    assert not [
        k for k in after if k not in before and not k.startswith(("patches/000000000004/", "ready/000000000004"))
    ]
    await first.close()
    await assert_every_step_rebuilds(store, key, states)


async def test_a_marker_race_is_lost_cleanly_by_put_if_absent(tmp_path: Path, key: Ed25519PrivateKey) -> None:
    """Two publishers past the listing check at once: put-if-absent decides, the loser stops."""
    store = FileStore(tmp_path / "store")
    states = trainer_states(3)
    await publish_steps(store, key, range(2))
    late = AsyncPublisher(config(), store=store, signing_key=key)
    await late.start()
    intruder = await store.get(layout.commit_key(1))
    await store.put_if_absent(layout.commit_key(2), intruder)  # appears after late's listing
    late.rounds.chain.index.last_key = layout.commit_key(2)  # as if its listing ran just before the intruder wrote
    await late.publish(2, states[2])
    with pytest.raises(ConflictError, match="already exists: another publisher"):
        await late.flush()
    assert await store.get(layout.commit_key(2)) == intruder


async def test_steps_must_strictly_increase(tmp_path: Path, key: Ed25519PrivateKey) -> None:
    async with AsyncPublisher(config(), store=FileStore(tmp_path / "s"), signing_key=key) as publisher:
        await publisher.publish(5, trainer_states(2)[0])
        for stale in (5, 4):
            with pytest.raises(ConflictError, match=f"step {stale} is not newer than step 5"):
                await publisher.publish(stale, trainer_states(2)[1])


async def test_resume_uses_the_cache_when_its_digest_matches_else_rebuilds(
    tmp_path: Path, key: Ed25519PrivateKey
) -> None:
    store_dir, cache = tmp_path / "store", tmp_path / "cache"
    states = trainer_states(8)
    await publish_steps(FileStore(store_dir), key, range(4), config(cache_dir=cache))
    assert json.loads((cache / "state.json").read_text())["step"] == 3

    for case in ("cache", "corrupt-cache", "no-cache"):
        store = RecordingStore(FileStore(store_dir))
        if case == "corrupt-cache":
            data = bytearray((cache / "state.safetensors").read_bytes())
            data[-1] ^= 0x01
            (cache / "state.safetensors").write_bytes(bytes(data))
        if case == "no-cache":
            cache = tmp_path / "empty"
        step = {"cache": 4, "corrupt-cache": 5, "no-cache": 6}[case]
        publisher = AsyncPublisher(config(cache_dir=cache, resume=True), store=store, signing_key=key)
        async with publisher:
            await publisher.publish(step, states[step])
        assert [(r.step, r.kind, r.ok) for r in publisher.reports] == [(step, "patch", True)], case
        from_anchor = any(k.startswith("anchors/") for k in store.reads)
        assert from_anchor == (case != "cache"), case
    await assert_every_step_rebuilds(FileStore(store_dir), key, states)


@pytest.mark.parametrize("cache", [False, True], ids=["rebuilt-from-the-store", "from-cache_dir"])
async def test_a_publisher_restarted_every_step_writes_the_bytes_an_uninterrupted_one_does(
    tmp_path: Path, key: Ed25519PrivateKey, cache: bool
) -> None:
    """A checkpoint hook runs one publisher per step: each step must be coded as a long-lived publisher codes it,
    history coding included (from a cache_dir, the history of the cached step's patch is kept beside it)."""
    steps = 12
    states = trainer_states(steps)
    settings = config(anchor_interval=5, resume=True)
    whole = FileStore(tmp_path / "whole")
    await publish_steps(whole, key, range(steps), settings)
    restarted = FileStore(tmp_path / "restarted")
    each = settings.model_copy(update={"cache_dir": tmp_path / "cache" if cache else None})
    for step in range(steps):
        async with AsyncPublisher(each, store=restarted, signing_key=key) as publisher:
            await publisher.publish(step, states[step], {"config.json": b'{"model_type": "t"}'})  # unchanged files

    chains = [ChainClient(s, trusted(key)) for s in (whole, restarted)]  # type: ignore[arg-type]
    kinds = [await ready_kinds(c) for c in chains]
    assert kinds[0] == kinds[1]
    history_coded = 0
    for step in (s for s, of_step in kinds[0].items() if "patch" in of_step):
        patches = [await c.manifest(step, "patch") for c in chains]
        data = [await s.get(m.objects[0].key) for s, m in zip((whole, restarted), patches, strict=True)]
        assert data[0] == data[1], f"step {step}: {len(data[0])} bytes uninterrupted, {len(data[1])} restarted"
        history_coded += patches[0].reference is not None
    assert history_coded >= 3  # the case that differed: patches coded against the previous one
    await assert_every_step_rebuilds(restarted, key, states)


async def test_a_damaged_cached_history_is_not_coded_against(tmp_path: Path, key: Ed25519PrivateKey) -> None:
    """A publisher codes its next patch against the cached history: a damaged one is dropped, never used."""
    store, cache = FileStore(tmp_path / "store"), tmp_path / "cache"
    states = trainer_states(9)
    settings = config(anchor_interval=100, resume=True, cache_dir=cache)
    await publish_steps(store, key, range(8), settings)
    history = cache / state_cache.HISTORY_FILE
    data = bytearray(history.read_bytes())
    data[-1] ^= 0x01  # the last delta of the last chunk
    history.write_bytes(bytes(data))
    async with AsyncPublisher(settings, store=store, signing_key=key) as publisher:
        await publisher.publish(8, states[8])
    patch8 = verify_manifest(await store.get(layout.commit_key(8)), trusted(key))  # type: ignore[arg-type]
    assert isinstance(patch8, PatchManifest) and patch8.reference is None
    await assert_every_step_rebuilds(store, key, states)


async def test_backpressure_skip_publishes_the_newest_and_counts(tmp_path: Path, key: Ed25519PrivateKey) -> None:
    def slow_uploads(op: str, k: str) -> None:
        if k.startswith("patches/"):
            time.sleep(0.2)  # blocks the publisher's event loop: uploads fall behind the trainer

    store = RecordingStore(FileStore(tmp_path / "store"), slow_uploads)
    states = trainer_states(12)
    skipped_before = REGISTRY.get_sample_value("pulsesync_skipped_steps_total") or 0
    publisher = await publish_steps(store, key, range(12), config(on_backpressure="skip"))
    ready = await ready_kinds(ChainClient(store, trusted(key)))
    assert publisher.skipped > 0 and 11 in ready
    assert len(ready) + publisher.skipped == 12
    assert REGISTRY.get_sample_value("pulsesync_skipped_steps_total") == skipped_before + publisher.skipped
    await assert_every_step_rebuilds(store, key, states)


def test_blocking_api_returns_after_the_snapshot_and_publishes_in_the_background(
    tmp_path: Path, key: Ed25519PrivateKey
) -> None:
    states = trainer_states(5)
    with Publisher(config(), store=FileStore(tmp_path / "store"), signing_key=key) as publisher:
        for step, state in enumerate(states):
            live = {n: t.clone() for n, t in state.items()}
            publisher.publish(step, live)
            for t in live.values():  # the trainer overwrites its weights right after publish() returns
                t.view(torch.int16).add_(1)
        publisher.flush()
        assert [(r.step, r.ok) for r in publisher.reports] == [(s, True) for s in range(5)]
        line = publisher.reports[-1].log_line()
        assert line.startswith("published step=4 kind=patch ok=true") and "encode_s=" in line
    import asyncio

    asyncio.run(assert_every_step_rebuilds(FileStore(tmp_path / "store"), key, states))


def test_kill_9_between_payload_and_marker_leaves_no_step_and_the_next_run_continues(
    tmp_path: Path, key: Ed25519PrivateKey
) -> None:
    store_dir, key_file, flag = tmp_path / "store", tmp_path / "publisher.key", tmp_path / "stalled"
    signing.write_keypair(tmp_path)
    key = signing.load_private_key(key_file)
    run = [sys.executable, "-m", "tests.support.publisher_proc", str(store_dir), str(key_file)]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen([*run, "0", "9", "6", str(flag)], cwd=ROOT, env=env)
    try:
        deadline = time.monotonic() + 120
        while not flag.exists():
            assert proc.poll() is None, "the publisher exited before reaching the stall point"
            assert time.monotonic() < deadline
            time.sleep(0.05)
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.wait()
    store = FileStore(store_dir)
    import asyncio

    ready = asyncio.run(ready_kinds(ChainClient(store, trusted(key))))
    assert set(ready) == {0, 1, 2, 3, 4, 5}  # step 6's payload is there, its marker is not
    assert asyncio.run(store.exists(layout.commit_key(6))) is False
    assert any(p.name.startswith("patch-") for p in (store_dir / layout.patch_prefix(6)).iterdir())

    subprocess.run([*run, "6", "12"], cwd=ROOT, env=env, check=True, timeout=300)
    assert set(asyncio.run(ready_kinds(ChainClient(store, trusted(key))))) == set(range(13))
    asyncio.run(assert_every_step_rebuilds(store, key, trainer_states(13)))


def test_host_copy_pool_recycles_only_released_buffers() -> None:
    from pulsesync.publisher.host_copy import HostCopyPool

    pool = HostCopyPool(keep=1)
    a, b = trainer_states(2)
    first = pool.copy(a)
    assert_states_equal(first, a)
    pool.retain(first)
    pool.release(first)  # still held once
    second = pool.copy(b)
    assert second is not first
    pool.release(first)
    third = pool.copy(b)
    assert third is first  # the released buffers took the copy
    assert_states_equal(third, b)
    assert_states_equal(second, b)
    other_shape = {"x": torch.zeros(3, dtype=torch.bfloat16)}
    pool.release(third)
    assert pool.copy(other_shape) is not third  # a different layout never reuses them


def test_host_copy_pool_keeps_no_buffers_of_a_layout_it_no_longer_copies() -> None:
    """After the state's tensors change (a tensor added, a sharded rank's new pieces), the free buffers of
    the old ones go: the host holds a baseline and the next copy's buffers, not also those of before."""
    from pulsesync.publisher.host_copy import HostCopyPool

    pool = HostCopyPool(keep=1)
    (before,) = trainer_states(1)
    pool.release(pool.copy(before))
    assert pool.free_bytes == sum(t.numel() * t.element_size() for t in before.values())
    grown = before | {"grown": torch.zeros(4, dtype=torch.bfloat16)}
    pool.release(pool.copy(grown))
    assert pool.free_bytes == sum(t.numel() * t.element_size() for t in grown.values())


async def test_resume_publishes_an_anchor_when_the_chain_cannot_be_rebuilt(
    tmp_path: Path, key: Ed25519PrivateKey, caplog: pytest.LogCaptureFixture
) -> None:
    store = FileStore(tmp_path / "store")
    states = trainer_states(5)
    await publish_steps(store, key, range(3))
    await store.delete_many([layout.commit_key(0)])  # e.g. pruned or lost: step 2 has no anchor
    publisher = AsyncPublisher(config(resume=True), store=store, signing_key=key)
    async with publisher:
        await publisher.publish(3, states[3])
    assert "cannot rebuild step 2" in caplog.text
    assert [(r.step, r.kind, r.ok) for r in publisher.reports] == [(3, "anchor", True)]
    rebuilt = await reconstruct(ChainClient(store, trusted(key)), 3)  # type: ignore[arg-type]
    assert_states_equal(rebuilt.state, states[3])
