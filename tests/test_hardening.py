"""Issue 14 regressions: objects in the store are untrusted input, and no object or local fault stops a daemon.

Each test names the issue item it reproduces. Faults are made in the real stores (files written
on disk, objects put through the real S3 client into moto); the daemon tests run `Subscriber.run`.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from pulsesync.cli import main
from pulsesync.config import Config, load_config
from pulsesync.errors import (
    ConfigError,
    CorruptPatchError,
    ForeignStreamError,
    ManifestError,
    PulseSyncError,
    StoreError,
)
from pulsesync.protocol import layout
from pulsesync.protocol.manifest import verify_manifest
from pulsesync.publisher import AsyncPublisher
from pulsesync.publisher.config import PublisherConfig
from pulsesync.rebuild import apply_step
from pulsesync.store import RetryPolicy, S3Store, Store, StoreConfig
from pulsesync.subscriber import Subscriber
from tests.support.fault_proxy import FaultProxy
from tests.support.helpers import anchor_marker
from tests.support.servers import BUCKET
from tests.support.subscribing import assert_serving, publish, subscriber, wait_for


@pytest.fixture
async def daemon(store: Store, key: Ed25519PrivateKey) -> AsyncIterator[Subscriber]:
    """A subscriber daemon (`Subscriber.run`) polling every 50 ms; asserts at the end that it never exited."""
    sub = subscriber(store, key, poll_seconds=0.05)
    stop = asyncio.Event()
    task = asyncio.create_task(sub.run(stop))
    sub.task = task  # type: ignore[attr-defined]
    yield sub
    assert not task.done(), "the daemon exited"
    stop.set()
    await task


# --- item 2: stray keys under ready/ ------------------------------------------------------------
async def test_stray_keys_under_ready_do_not_blind_a_running_subscriber(
    store: Store, key: Ed25519PrivateKey, publisher: AsyncPublisher, daemon: Subscriber
) -> None:
    """Item 2: `ready/notes.txt` and `ready/_SUCCESS` sort after every marker; the daemon still sees new steps."""
    await wait_for(lambda: daemon.step == 8, "step 8", sub=daemon)
    await store.put("ready/notes.txt", b"hello")
    await store.put("ready/_SUCCESS", b"")
    await store.put("ready/999999999999.patch.json.tmp", b"{}")
    await asyncio.sleep(0.2)  # the daemon lists the stray keys
    await publish(publisher, range(9, 11))
    await wait_for(lambda: daemon.step == 10, "step 10 after stray keys", sub=daemon)
    assert_serving(daemon, 10)


def test_ready_keys_need_twelve_ascii_digits_and_nothing_after() -> None:
    """Item 2: Python's \\d takes Arabic-Indic digits, and $ matches before a final newline."""
    assert layout.parse_ready_key("ready/000000000007.patch.json") == layout.ReadyEntry(7, "patch")
    assert layout.parse_ready_key("ready/" + "\u0660" * 11 + "\u0661.patch.json") is None
    assert layout.parse_ready_key("ready/000000000007.patch.json\n") is None
    assert layout.step_of_payload("patches/000000000007/x.bin") == 7
    assert layout.step_of_payload("patches/" + "\u0660" * 12 + "/x.bin") is None


# --- item 3: malformed, unsigned markers ----------------------------------------------------------
@pytest.mark.parametrize(
    "body",
    [
        b"[" * 100_000 + b"]" * 100_000,  # RecursionError in json
        b'{"format_version": 1, "key_id": "k", "signature": "s", "step": NaN}',
        b'{"format_version": 1, "key_id": "k", "signature": "s", "step": 1e999}',
        b'{"format_version": 1, "key_id": "k", "signature": "s", "x": "\\ud800"}',  # lone surrogate
        b"\xff\xfe{}",
        b"{" + b" " * (1 << 20) + b"}",  # over the size cap
        b'{"format_version": ' + b"9" * 5000 + b"}",  # int too long to convert
    ],
    ids=["nested", "nan", "infinity", "surrogate", "not-utf8", "oversized", "huge-int"],
)
def test_every_malformed_manifest_is_a_manifest_error(body: bytes, key: Ed25519PrivateKey) -> None:
    """Item 3: deep nesting, NaN, a lone surrogate, a huge body: always ManifestError, never a crash."""
    from pulsesync.protocol import signing

    trusted = dict(signing.trusted_keys([key.public_key()]))
    trusted["k"] = key.public_key()  # a trusted key id: canonicalization is reached
    with pytest.raises(ManifestError):
        verify_manifest(body, trusted, name="ready/000000000001.patch.json")


async def test_a_malformed_marker_does_not_stop_the_daemon(
    store: Store, key: Ed25519PrivateKey, publisher: AsyncPublisher, daemon: Subscriber
) -> None:
    """Item 3: a nested-JSON marker at a newer step: the daemon keeps running and serves the next good step."""
    await wait_for(lambda: daemon.step == 8, "step 8", sub=daemon)
    await store.put(layout.commit_key(50), b"[" * 100_000)
    await wait_for(lambda: daemon.status.rejected_markers == 1, "the marker skipped", sub=daemon)
    assert "ManifestError" in (daemon.status.last_rejected or "")
    await publish(publisher, range(9, 11))  # the publisher skips it too
    await wait_for(lambda: daemon.step == 10, "step 10 past the bad marker", sub=daemon)
    assert_serving(daemon, 10)
    assert daemon.healthy()[0]


def test_subscribe_once_prints_one_line_for_a_malformed_marker(
    tmp_path: Path, key: Ed25519PrivateKey, capsys: pytest.CaptureFixture[str]
) -> None:
    """Item 3: `subscribe --once` on a store whose only marker is garbage: one line, exit code of its error."""
    from pulsesync.protocol import signing

    (tmp_path / "s" / "ready").mkdir(parents=True)
    (tmp_path / "s" / "ready" / "000000000001.anchor.json").write_bytes(b"[" * 100_000)
    _, pub, _ = signing.write_keypair(tmp_path / "keys")
    code = main(["subscribe", "--once", "--store", f"file://{tmp_path}/s", "--trusted-key", str(pub)])
    err = capsys.readouterr().err.strip().splitlines()
    assert code != 1 and len(err) == 1 and err[0].startswith("pulsesync: error:"), err


# --- item 13: the smaller ones -----------------------------------------------------------------
def test_md5_digest_algorithm_in_a_patch_header_is_a_corrupt_patch() -> None:
    """Item 13: `digest_algorithm: "md5"` in a (checksummed) patch header raises CorruptPatchError, not ValueError."""
    import struct

    import xxhash

    from pulsesync.codec import format as fmt
    from pulsesync.codec.parse import read_header

    header = {
        "value_coding": "raw",
        "zstd_level": 3,
        "chunk_elements": 1,
        "digest_algorithm": "md5",
        "base_digest": "a",
        "state_digest": "b",
        "records": 0,
        "decoded_bytes": 0,
        "changed_elements": 0,
        "dense_bytes": 0,
    }
    body = json.dumps(header).encode()
    head = fmt.PREAMBLE.pack(fmt.MAGIC, fmt.FORMAT_VERSION, 0, len(body)) + body
    patch = head + struct.pack("<Q", xxhash.xxh3_64_intdigest(head))
    with pytest.raises(CorruptPatchError, match="header is invalid"):
        read_header(patch)


@pytest.mark.parametrize("bad", ["a\x00b", "a\nb", "x/\ud800", "k" * 1100])
async def test_a_nul_or_control_character_in_a_key_is_a_store_error(store: Store, bad: str) -> None:
    """Item 13: a NUL byte in a (signed) object key raised a bare ValueError from open()."""
    with pytest.raises(StoreError, match="invalid key"):
        await store.get(bad)


def test_a_binary_config_file_is_a_config_error(tmp_path: Path) -> None:
    """Item 13: a binary config file gave a traceback (exit 1), not ConfigError."""
    path = tmp_path / "c.yaml"
    path.write_bytes(b"\xff\xfe\x00\x01binary")
    with pytest.raises(ConfigError, match="not UTF-8"):
        load_config(Config, path)


@pytest.mark.parametrize("url", ["file://data/../etc", "file://host/path"])
def test_a_file_url_with_a_host_is_refused(url: str) -> None:
    """Item 13: `file://data/../etc` silently became `/../etc`."""
    with pytest.raises(ValueError, match="names host"):
        StoreConfig(url=url)
    assert StoreConfig(url="file://localhost/tmp/x").url == "file://localhost/tmp/x"


def test_debug_logging_never_prints_the_aws_session_token(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, moto_endpoint: str
) -> None:
    """Item 13: `-vv` printed the session token from botocore's debug log."""
    import subprocess
    import sys

    token = "FwoGZXIvYXdzEXAMPLESESSIONTOKEN0123456789abcdef"
    env = {
        **__import__("os").environ,
        "AWS_SESSION_TOKEN": token,
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testingsecretvalue",
    }
    endpoint = ["--endpoint-url", moto_endpoint]
    out = subprocess.run(
        [sys.executable, "-m", "pulsesync", "store", "ls", "-vv", "--store", "s3://pulsesync-test/redact", *endpoint],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    logged = out.stdout + out.stderr
    assert "x-amz-security-token" in logged.lower(), logged[-2000:]  # the header was logged ...
    assert token not in logged and "testingsecretvalue" not in logged  # ... without its value


# --- item 4: a forged far-future marker -------------------------------------------------------------
async def test_a_copied_marker_at_a_far_future_step_is_skipped_by_subscribers_and_the_publisher(
    store: Store, key: Ed25519PrivateKey, publisher: AsyncPublisher, daemon: Subscriber
) -> None:
    """Item 4: a validly signed manifest copied to step 999999999999 froze the fleet (ReplayError, no publishing)."""
    await wait_for(lambda: daemon.step == 8, "step 8", sub=daemon)
    await store.put(layout.commit_key(layout.MAX_STEP), await store.get(layout.commit_key(3)))
    await wait_for(lambda: daemon.status.rejected_markers == 1, "the forged marker skipped", sub=daemon)
    health = daemon.healthy()
    assert health[0] and health[1]["rejected_markers"] == 1 and "ReplayError" in health[1]["last_rejected"]
    await publish(publisher, range(9, 11))  # the running publisher treats it as no publisher's
    await wait_for(lambda: daemon.step == 10, "step 10", sub=daemon)
    restarted = AsyncPublisher(publisher.config, store=store, signing_key=key)  # a restart is not frozen either
    await restarted.start()
    await publish(restarted, range(11, 12))
    await restarted.close()
    await wait_for(lambda: daemon.step == 11, "step 11 from the restarted publisher", sub=daemon)
    assert_serving(daemon, 11)


# --- item 8: a manifest of another stream ------------------------------------------------------------
async def test_a_signed_anchor_copied_from_another_run_is_never_served(tmp_path: Path, key: Ed25519PrivateKey) -> None:
    """Item 8: run B's anchor marker and objects copied into run A's prefix (same key) made A serve B's weights."""
    from pulsesync.publisher.config import PublisherConfig
    from pulsesync.store import FileStore
    from tests.support.helpers import assert_states_equal, trainer_states

    config = PublisherConfig(anchor_interval=5, shard_size=256 << 10, on_backpressure="block")
    run_a, run_b = FileStore(tmp_path / "a"), FileStore(tmp_path / "b")
    for store, seed, steps in ((run_a, 0, 9), (run_b, 1, 12)):
        pub = AsyncPublisher(config, store=store, signing_key=key)
        await pub.start()
        for step in range(steps):
            await pub.publish(step, trainer_states(steps, seed)[step])
        await pub.close()
    sub = subscriber(run_a, key)
    await sub.sync()
    assert sub.step == 8 and sub.status.stream_id
    async for info in run_b.list():
        if info.key.startswith(("anchors/000000000010/", "ready/000000000010", "ready-anchors/000000000010")):
            await run_a.put(info.key, await run_b.get(info.key))
    await sub.sync()
    assert sub.step == 8 and sub.status.rejected_markers == 1
    assert "ForeignStreamError" in (sub.status.last_rejected or "")
    assert sub.state is not None
    assert_states_equal(sub.state, trainer_states(9, 0)[8])
    pinned = subscriber(run_a, key, stream_id=sub.status.stream_id)  # a fresh subscriber, pinned in its config
    assert (await pinned.sync()).step == 8


# --- item 1: the state cache --------------------------------------------------------------------------
async def test_a_state_cache_keeps_its_own_stream_and_a_rewritten_one_is_discarded(
    store: Store, key: Ed25519PrivateKey, publisher: AsyncPublisher, tmp_path: Path
) -> None:
    """Item 1: a cache rewritten with a self-consistent digest was served at start.

    A cache of another run (its signed marker names that run's stream) keeps its stream (issue 28
    item 2: the pin a subscriber learned wins over the store's newest marker); `reset_stream`
    switches to the store's stream and discards it.
    """
    import shutil

    from pulsesync import state_cache
    from pulsesync.digest import state_digest
    from pulsesync.store import FileStore
    from pulsesync.verified import VerifiedState
    from tests.support.helpers import assert_states_equal, trainer_states

    other = FileStore(tmp_path / "other-run")
    pub = AsyncPublisher(publisher.config, store=other, signing_key=key)
    await pub.start()
    for step in range(9):
        await pub.publish(step, trainer_states(9, seed=1)[step])
    await pub.close()
    foreign = subscriber(other, key, cache_dir=tmp_path / "foreign-cache")
    await foreign.sync()
    assert foreign.step == 8
    shutil.copytree(tmp_path / "foreign-cache", tmp_path / "cache")
    restarted = subscriber(store, key, cache_dir=tmp_path / "cache")
    await restarted.start()
    assert restarted.status.stream_id == foreign.status.stream_id and restarted.state is not None
    assert_states_equal(restarted.state, trainer_states(9, seed=1)[8])
    with pytest.raises(ForeignStreamError):  # every marker in the store is another stream's: none to follow
        await restarted.sync()
    assert restarted.step == 8 and restarted.status.rejected_markers >= 1
    assert_states_equal(restarted.state, trainer_states(9, seed=1)[8])  # still serving its verified state
    switched = subscriber(store, key, cache_dir=tmp_path / "cache", reset_stream=True)
    await switched.start()
    assert switched.state is None  # its signed marker is another stream's than the store's newest
    assert (await switched.sync()).path == "slow"
    assert_serving(switched, 8)
    # Rewritten: other tensors with a digest that matches them, and no marker copy.
    forged = dict(trainer_states(9, seed=1)[8])
    state_cache.save(tmp_path / "cache", VerifiedState(8, forged, state_digest(forged), {}))
    again = subscriber(store, key, cache_dir=tmp_path / "cache")
    await again.start()
    assert again.state is None
    # A genuine cache still resumes.
    await subscriber(store, key, cache_dir=tmp_path / "genuine").sync()
    genuine = subscriber(store, key, cache_dir=tmp_path / "genuine")
    await genuine.start()
    assert_serving(genuine, 8)


@contextlib.asynccontextmanager
async def s3_behind_proxy(
    moto_endpoint: str, key: Ed25519PrivateKey, **store_options: Any
) -> AsyncIterator[tuple[FaultProxy, S3Store, AsyncPublisher]]:
    """A publisher on moto (steps 0 and 1 committed) and a store reaching the same prefix through the fault proxy."""
    proxy = FaultProxy(moto_endpoint)
    await proxy.start()
    prefix = f"proxied-{uuid.uuid4().hex[:8]}"
    direct = S3Store(BUCKET, prefix, endpoint_url=moto_endpoint)
    through_proxy = S3Store(BUCKET, prefix, endpoint_url=proxy.endpoint, **store_options)
    pub = AsyncPublisher(PublisherConfig(anchor_interval=100, on_backpressure="block"), store=direct, signing_key=key)
    await pub.start()
    await publish(pub, range(2))
    try:
        yield proxy, through_proxy, pub
    finally:
        await pub.close()
        await through_proxy.close()
        await direct.close()
        await proxy.stop()


# --- item 5: oversized objects ---------------------------------------------------------------------
async def test_an_oversized_patch_on_s3_is_cut_off_at_its_signed_size(
    moto_endpoint: str, key: Ed25519PrivateKey
) -> None:
    """Item 5: a patch replaced by a big object was read in full before the size check (RAM, then MemoryError)."""
    async with s3_behind_proxy(moto_endpoint, key) as (proxy, through_proxy, pub):
        sub = subscriber(through_proxy, key)
        await sub.sync()
        await publish(pub, range(2, 4))
        patch3 = (await sub.stores.chain.manifest(3, "patch")).objects[0]
        await pub.store.put(patch3.key, b"\x01" * (48 << 20))  # the real server now holds 48 MiB there
        proxy.bytes_sent = 0
        with pytest.raises(PulseSyncError):
            await sub.sync()  # fast path refused; the slow path has no anchor to fall back to
        assert sub.step == 1
        assert proxy.bytes_sent < patch3.size + (4 << 20), proxy.bytes_sent  # ranged GET of size + 1 bytes
        # A server that ignores the range (or a proxy that rewrites it): the client stops reading.
        proxy.oversize[patch3.key.rsplit("/", 1)[-1]] = 1 << 30
        proxy.bytes_sent = 0
        with pytest.raises(PulseSyncError):
            await sub.sync()
        assert proxy.bytes_sent < 64 << 20, proxy.bytes_sent


async def test_a_marker_that_is_a_symlink_to_dev_zero_or_a_fifo_is_no_object(
    tmp_path: Path, key: Ed25519PrivateKey
) -> None:
    """Items 5 and 6: on a file store a marker symlinked to /dev/zero killed the daemon; a FIFO hung it."""
    import os

    from pulsesync.errors import NotFoundError
    from pulsesync.store import FileStore

    store = FileStore(tmp_path / "s")
    (tmp_path / "s" / "ready").mkdir(parents=True)
    os.symlink("/dev/zero", tmp_path / "s" / "ready" / "000000000001.patch.json")
    os.mkfifo(tmp_path / "s" / "ready" / "000000000002.patch.json")
    (tmp_path / "outside").mkdir()
    (tmp_path / "outside" / "secret").write_bytes(b"x")
    os.symlink(tmp_path / "outside", tmp_path / "s" / "patches")
    assert [info.key async for info in store.list()] == []  # neither is listed
    for key_ in ("ready/000000000001.patch.json", "ready/000000000002.patch.json"):
        with pytest.raises(NotFoundError):
            await asyncio.wait_for(store.get(key_, max_size=1 << 20), 10)
    with pytest.raises(StoreError, match="outside the store root"):
        await store.get("patches/secret")
    await store.delete_many(["patches/secret"])  # left alone and counted (issue 28 item 5)
    assert (tmp_path / "outside" / "secret").exists()


# --- item 6: deadlines -----------------------------------------------------------------------------
async def test_a_trickling_or_silent_s3_endpoint_cannot_hang_the_daemon(
    moto_endpoint: str, key: Ed25519PrivateKey
) -> None:
    """Item 6: a body trickling a byte every 20 s hung a sync forever while /healthz said 200."""
    policy = RetryPolicy(attempts=2, initial_wait=0.05, attempt_timeout=1.0, max_total=2.5)
    async with s3_behind_proxy(moto_endpoint, key, retry=policy, read_timeout=30) as (proxy, through_proxy, pub):
        sub = subscriber(through_proxy, key, poll_seconds=0.05, unhealthy_after=2, sync_deadline_seconds=20)
        stop = asyncio.Event()
        sub.task = asyncio.create_task(sub.run(stop))  # type: ignore[attr-defined]
        try:
            await wait_for(lambda: sub.step == 1, "step 1", sub=sub)
            proxy.trickle_seconds = 5.0
            await publish(pub, range(2, 4))
            await wait_for(lambda: not sub.healthy()[0], "unhealthy while the body trickles", seconds=30, sub=sub)
            assert "deadline" in (sub.status.last_error or ""), sub.status.last_error
            assert sub.step == 1
            proxy.trickle_seconds = None
            proxy.hang = True  # an endpoint that never answers
            failures = sub.status.consecutive_failures
            await wait_for(lambda: sub.status.consecutive_failures > failures, "a failed sync while silent", sub=sub)
            proxy.hang = False
            await wait_for(lambda: sub.step == 3, "step 3 once the endpoint answers", seconds=60, sub=sub)
            assert_serving(sub, 3)
            assert sub.healthy()[0]
        finally:
            stop.set()
            await sub.task  # type: ignore[attr-defined]


async def test_a_pointer_read_or_fleet_write_that_never_answers_does_not_stall_the_daemon(
    moto_endpoint: str, key: Ed25519PrivateKey
) -> None:
    """CI of f46c065: one pointer GET hung for its try's whole 60 s, and the daemon with it; both are advisory."""
    async with s3_behind_proxy(moto_endpoint, key) as (proxy, through_proxy, pub):  # the default retry policy
        sub = subscriber(through_proxy, key, poll_seconds=0.05)
        stop = asyncio.Event()
        sub.task = asyncio.create_task(sub.run(stop))  # type: ignore[attr-defined]
        try:
            await wait_for(lambda: sub.step == 1, "step 1", sub=sub)
            proxy.hang_paths = ("/pointer", "/fleet/")  # read, never answered
            await publish(pub, range(2, 4))
            await wait_for(lambda: sub.step == 3, "step 3 past a silent pointer", seconds=20, sub=sub)
            assert_serving(sub, 3)
            assert any(path.endswith("/pointer") for _, path, _ in proxy.seen[-20:])  # it did ask
            stop.set()  # a status write still hanging is given up within the advisory deadline (5 s)
            await asyncio.wait_for(asyncio.shield(sub.task), 15)  # type: ignore[attr-defined]
            assert any("/fleet/" in path for _, path, _ in proxy.seen)
        finally:
            proxy.hang_paths = ()
            stop.set()
            await sub.task  # type: ignore[attr-defined]


async def test_a_sync_past_its_deadline_is_cut_off_and_reported_unhealthy(
    store: Store, key: Ed25519PrivateKey, publisher: AsyncPublisher
) -> None:
    """Item 6: the sync itself has a deadline; one that overruns it (its cut-off not taking) makes /healthz 503."""
    from pulsesync.errors import DeadlineError
    from pulsesync.sinks import Sink, Update

    cut_off = asyncio.Event()

    class Stuck(Sink):
        name = "stuck"

        async def deliver(self, update: Update) -> None:
            try:
                await asyncio.sleep(3600)
            except asyncio.CancelledError:  # ignores the cancellation for a while, as a hung call would
                cut_off.set()
                await asyncio.sleep(1.5)
                raise

    # The deadline leaves the sync time to reach the sink on a loaded machine (0.5 s did not, once, in
    # a full parallel run: the anchor's download was cut off instead, and the sync was over at 1 s).
    deadline = 2.0
    sub = subscriber(store, key, sync_deadline_seconds=deadline)
    sub.sinks[:] = [Stuck()]  # the list the delivery and the restart watch share
    sync = asyncio.create_task(sub.sync())
    await asyncio.wait_for(cut_off.wait(), 30)  # the deadline fired while the sink held the sync
    await asyncio.sleep(0.3)
    assert not sub.healthy()[0] and sub.healthy()[1]["sync_running_seconds"] > deadline
    with pytest.raises(DeadlineError, match="sync_deadline_seconds"):
        await sync
    assert sub.state is None and sub.healthy()[1]["sync_running_seconds"] is None


# --- item 7: a signed decompression bomb -------------------------------------------------------------
async def test_a_patch_that_decodes_far_beyond_the_held_state_is_refused_before_allocating(
    key: Ed25519PrivateKey, tmp_path: Path
) -> None:
    """Item 7: a small zstd frame declaring GiBs, with consistent declared sizes, was allocated in full."""
    import torch

    from pulsesync.codec import encode_patch
    from pulsesync.digest import state_digest
    from pulsesync.protocol.chain import ChainClient
    from pulsesync.protocol.manifest import ObjectRef, PatchManifest, Sizes
    from pulsesync.store import FileStore

    base = {"w": torch.zeros(1024, dtype=torch.bfloat16)}
    bomb = dict(base, big=torch.zeros(96 << 20, dtype=torch.bfloat16))  # 192 MiB of zeros: ~6 KB compressed
    data = encode_patch(base, bomb)
    assert len(data) < 1 << 20
    digest = state_digest(base)
    manifest = PatchManifest(
        step=1,
        base_step=0,
        anchor_step=0,
        base_digest=digest.root,
        objects=[ObjectRef.for_bytes("patches/000000000001/p.bin", data)],
        state_digest=state_digest(bomb),
        sizes=Sizes(dense_bytes=192 << 20, wire_bytes=len(data), changed_elements=96 << 20),
        created_at="2026-11-23T00:00:00Z",
        codec={"format_version": 1, "value_coding": "delta", "zstd_level": 3, "chunk_elements": 1 << 20},
    )
    chain = ChainClient(FileStore(tmp_path), {})
    with pytest.raises(CorruptPatchError, match="above the limit"):
        await apply_step(chain.fetcher, base, digest, manifest, data)
    assert set(base) == {"w"}


# --- item 10: a decode failure with several codec threads ------------------------------------------------
@pytest.mark.parametrize("path", ["batch", "per-record"])
def test_a_failing_record_with_codec_threads_leaves_nothing_applied_after_rollback(
    monkeypatch: pytest.MonkeyPatch, path: str
) -> None:
    """Item 10: the rollback ran while other records were still being applied on the pool.

    Both decoders: the batch kernel (records of 2-byte floats, decompressed on each thread) and
    the per-record one (every other record; here numba switched off).
    """
    import torch

    from pulsesync.codec import UndoLog, apply, encode_patch, jit
    from tests.support.helpers import assert_states_equal, clone_state

    gen = torch.Generator().manual_seed(0)
    base = {f"t{i:02d}": torch.randn(4096, generator=gen).to(torch.bfloat16) for i in range(16)}
    new = {n: t.clone() for n, t in base.items()}
    for t in new.values():
        t.view(torch.int16)[::3] += 1
    data = encode_patch(base, new)
    target = "decompress_payload" if path == "batch" else "decode_record"
    real = getattr(apply, target)

    def slow_or_failing(h: Any, payload: Any, *context: Any) -> Any:
        if h.name == "t01":
            raise CorruptPatchError("injected: record for t01 does not decode")
        time.sleep(0.05)  # the others are still running when t01 fails
        return real(h, payload, *context)

    monkeypatch.setattr(apply, target, slow_or_failing)
    if path == "per-record":
        monkeypatch.setattr(jit, "enabled", False)
    state, undo = clone_state(base), UndoLog()
    with pytest.raises(CorruptPatchError, match="injected"):
        apply.apply_patch(state, data, threads=None, undo=undo)  # the shared pool, one thread per core
    if path == "batch":
        assert undo.chunks, "the records before t01 on its thread and those of the other thread were applied"
    undo.rollback(state)
    time.sleep(0.5)  # anything still running would land now
    assert_states_equal(state, base)


# --- item 11: disk full -------------------------------------------------------------------------
async def test_disk_full_in_the_directory_sink_and_cache_keeps_the_daemon_serving(
    store: Store, key: Ed25519PrivateKey, publisher: AsyncPublisher, tmp_path: Path
) -> None:
    """Item 11: an OSError from a local write (ENOSPC/EFBIG) ended Subscriber.run."""
    import resource
    import signal

    from tests.support.helpers import assert_states_equal, trainer_states

    sub = subscriber(store, key, poll_seconds=0.05, cache_dir=tmp_path / "cache", out_dir=tmp_path / "out")
    await sub.sync()
    assert sub.step == 8
    await publish(publisher, range(9, 11))
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    previous = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # writes past the limit fail with EFBIG instead
    resource.setrlimit(resource.RLIMIT_FSIZE, (256 << 10, hard))
    stop = asyncio.Event()
    sub.task = asyncio.create_task(sub.run(stop))  # type: ignore[attr-defined]
    try:
        await wait_for(lambda: sub.status.consecutive_failures >= 2, "failed syncs while the disk is full", sub=sub)
        assert "LocalWriteError" in (sub.status.last_error or "")
        assert_serving(sub, 8)
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, previous)
    try:
        saved = lambda: sub.step == 10 and sub.cache is not None and not sub.cache.unsaved  # noqa: E731
        await wait_for(saved, "step 10 once there is room", sub=sub)
        assert_serving(sub, 10)
        assert (tmp_path / "out" / "current").resolve().name.endswith("10")
    finally:
        stop.set()
        await sub.task  # type: ignore[attr-defined]
    cached = subscriber(store, key, cache_dir=tmp_path / "cache")
    await cached.start()
    assert cached.state is not None
    assert_states_equal(cached.state, trainer_states(12)[10])


# --- item 12: odd engine replies -------------------------------------------------------------------------
@pytest.mark.parametrize(
    "replies",
    [
        {"/collective_rpc": (500, b"\xff\xfe boom")},
        {"/collective_rpc": (200, b"\xff\xfe\xfd")},
        {"/is_sleeping": (200, b"\xff\xfe")},
        {"/is_sleeping": (200, b"[1, 2]")},
        {"layout": (200, b'{"results": [{"w": 5}]}')},
        {"layout": (200, b'{"results": [{"aliases": ["a"]}]}')},
        {"/weight_info": (200, b"\xff\xfe")},
        {"/init_weight_transfer_engine": (500, b"\xff\xfe boom")},
        {"rank-0.json": (0, b"\xff\xfe")},
        {"rank-0.json": (0, b'{"session": "x", "verb": "init", "rank": 0, "world": 1}')},
        {"rank-0.json": (0, b"[" * 100_000)},
        {"rank-0.json": (0, b" " * ((64 << 20) + 1))},
    ],
    ids=[
        "500-binary", "200-binary", "sleeping-binary", "sleeping-list", "layout-shapes", "layout-bad-alias",
        "transfer-version-binary", "transfer-init-500", "transfer-reply-binary", "transfer-reply-other-session",
        "transfer-reply-deep", "transfer-reply-oversized",
    ],
)  # fmt: skip
async def test_odd_vllm_replies_are_engine_errors(
    replies: dict[str, tuple[int, bytes]],
    store: Store,
    key: Ed25519PrivateKey,
    publisher: AsyncPublisher,
    tmp_path: Path,
) -> None:
    """Item 12: a 500 or 200 with a non-UTF-8 body, or a shapes reply {"w": 5}, crashed the daemon."""
    from aiohttp import web

    from pulsesync.errors import EngineError
    from pulsesync.sinks.vllm.sidecar.sink import VLLMSink, VLLMSinkConfig

    extension = any(k in replies for k in ("/collective_rpc", "/is_sleeping", "layout"))
    updates = tmp_path / "u"

    async def handle(request: web.Request) -> web.Response:
        body = await request.read()
        path = "layout" if b"pulsesync_layout" in body else request.path
        if path in replies:
            status, payload = replies[path]
            return web.Response(status=status, body=payload)
        if request.path == "/init_weight_transfer_engine" and "rank-0.json" in replies:
            (updates / "rank-0.json").write_bytes(replies["rank-0.json"][1])  # what a broken backend leaves
        if request.path == "/collective_rpc":
            return web.json_response({"results": [{"digest": None}]})
        if request.path == "/weight_info":
            return web.json_response({"weight_version": "default"})
        return web.json_response({"is_sleeping": False} if request.path == "/is_sleeping" else {})

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", handle)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    api = "worker_extension" if extension else "weight_transfer"
    config = VLLMSinkConfig(url=f"http://127.0.0.1:{port}", update_dir=updates, timeout_seconds=10, engine_api=api)
    sink = VLLMSink(config)
    sub = subscriber(store, key)
    sub.sinks[:] = [sink]  # the list the delivery and the restart watch share
    try:
        with pytest.raises(EngineError):
            await sub.sync()
        assert sub.state is None
    finally:
        await runner.cleanup()


# --- item 9: retention trusts only what verifies ------------------------------------------------------
async def _published_with_retention_state(store: Store, key: Ed25519PrivateKey) -> None:
    from pulsesync.publisher.config import PublisherConfig
    from tests.support.helpers import trainer_states

    pub = AsyncPublisher(PublisherConfig(anchor_interval=5, on_backpressure="block"), store=store, signing_key=key)
    await pub.start()
    for step in range(12):
        await pub.publish(step, trainer_states(12)[step])
    await pub.close()


def trusted(key: Ed25519PrivateKey) -> Any:
    from pulsesync.protocol import signing

    return signing.trusted_keys([key.public_key()])


async def _payload_keys(store: Store, step: int, kind: str) -> list[str]:
    folder = layout.anchor_prefix(step) if kind == "anchor" else layout.patch_prefix(step)
    return [info.key async for info in store.list(folder)]


async def test_a_forged_tombstone_or_unsigned_marker_deletes_nothing_live(store: Store, key: Ed25519PrivateKey) -> None:
    """Item 9: a forged tombstone deleted the newest live anchor's shards; a forged old marker did the same."""

    from pulsesync.protocol import signing
    from pulsesync.retention import RetentionWorker
    from pulsesync.retention.policy import RetentionPolicy

    await _published_with_retention_state(store, key)
    live = await _payload_keys(store, 10, "anchor")
    assert live
    objects = [[k, 1] for k in live]
    old = "2000-01-01T00:00:00+00:00"
    # The old (unsigned) tombstone format, naming the live anchor's shards, long due.
    await store.put(
        layout.tombstone_key(3, "anchor"),
        json.dumps({"step": 3, "kind": "anchor", "objects": objects, "removed_at": old}).encode(),
    )
    # A copy of the live anchor's own signed marker as a tombstone of another step.
    anchor10 = await anchor_marker(store, 10)
    await store.put(
        layout.tombstone_key(4, "anchor"),
        json.dumps({"marker": (await store.get(anchor10)).decode(), "removed_at": old}).encode(),
    )
    # A naive timestamp, and a NUL byte in a key it names: malformed, skipped, never a crash.
    await store.put(layout.tombstone_key(6, "patch"), json.dumps({"marker": "{}", "removed_at": "2000-01-01"}).encode())
    nul = {"step": 7, "kind": "patch", "objects": [["patches/000000000007/a\x00b", 1]], "removed_at": old}
    await store.put(layout.tombstone_key(7, "patch"), json.dumps(nul).encode())
    # An unsigned old marker that lists the live shards.
    forged = json.loads(await store.get(layout.commit_key(0)))
    forged["objects"] = [{"key": k, "size": 1, "sha256": "0" * 64} for k in live]
    forged["signature"] = ""
    await store.put(layout.commit_key(0), json.dumps(forged).encode())
    worker = RetentionWorker(
        store,
        RetentionPolicy(keep_patches=1, keep_anchors=1, grace_seconds=0),
        signing.trusted_keys([key.public_key()]),
    )
    for _ in range(2):
        await worker.run_once()
    assert await _payload_keys(store, 10, "anchor") == live
    assert len(worker.skipped) >= 3
    cold = subscriber(store, key)
    await cold.sync()
    assert_serving(cold, 11)


async def test_retention_never_deletes_through_a_symlinked_step_folder(tmp_path: Path, key: Ed25519PrivateKey) -> None:
    """Item 9: on a file store a symlinked step folder plus a tombstone deleted a file outside the store root."""
    import os

    from pulsesync.protocol import signing
    from pulsesync.retention import RetentionWorker
    from pulsesync.retention.policy import RetentionPolicy
    from pulsesync.store import FileStore

    store = FileStore(tmp_path / "s")
    await _published_with_retention_state(store, key)
    (tmp_path / "outside").mkdir()
    (tmp_path / "outside" / "victim.bin").write_bytes(b"precious")
    os.symlink(tmp_path / "outside", tmp_path / "s" / "anchors" / "000000000003")
    victim = [["anchors/000000000003/victim.bin", 8]]
    stone = {"step": 3, "kind": "anchor", "objects": victim, "removed_at": "2000-01-01T00:00:00+00:00"}
    await store.put(layout.tombstone_key(3, "anchor"), json.dumps(stone).encode())
    worker = RetentionWorker(
        store,
        RetentionPolicy(keep_patches=1, keep_anchors=1, grace_seconds=0),
        signing.trusted_keys([key.public_key()]),
    )
    await worker.run_once()
    await worker.run_once()
    assert (tmp_path / "outside" / "victim.bin").read_bytes() == b"precious"


async def test_a_symlinked_key_in_a_delete_batch_is_skipped_alone_and_counted(tmp_path: Path) -> None:
    """Issue 28 item 5: one key under a symlinked folder failed the whole delete_many batch."""
    import os

    from prometheus_client import REGISTRY

    from pulsesync.store import FileStore

    store = FileStore(tmp_path / "s")
    for key in ("patches/a.bin", "patches/b.bin", "keep/c.bin"):
        await store.put(key, b"x")
    (tmp_path / "outside").mkdir()
    (tmp_path / "outside" / "victim.bin").write_bytes(b"precious")
    os.symlink(tmp_path / "outside", tmp_path / "s" / "linked")
    refused = REGISTRY.get_sample_value("pulsesync_store_deletes_refused_total") or 0.0
    await store.delete_many(["patches/a.bin", "linked/victim.bin", "patches/b.bin"])
    assert [i.key async for i in store.list()] == ["keep/c.bin"]
    assert (tmp_path / "outside" / "victim.bin").read_bytes() == b"precious"
    assert REGISTRY.get_sample_value("pulsesync_store_deletes_refused_total") == refused + 1
    assert (tmp_path / "outside" / "victim.bin").exists()
