"""Issue 14 regressions: objects in the store are untrusted input, and no object or local fault stops a daemon.

Each test names the issue item it reproduces. Faults are made in the real stores (files written
on disk, objects put through the real S3 client into moto); the daemon tests run `Subscriber.run`.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from pulsesync.cli import main
from pulsesync.config import Config, load_config
from pulsesync.errors import ConfigError, CorruptPatchError, ManifestError, StoreError
from pulsesync.protocol import layout
from pulsesync.protocol.manifest import verify_manifest
from pulsesync.publisher import AsyncPublisher
from pulsesync.store import Store, StoreConfig
from pulsesync.subscriber import Subscriber
from tests.test_subscriber import assert_serving, publish, publisher, subscriber

__all__ = ["publisher"]  # the fixture, shared with test_subscriber


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


async def wait_for(condition: Callable[[], bool], what: str, seconds: float = 30, sub: Any = None) -> None:
    """Poll until condition holds; fail naming `what` (and the daemon's last error) after `seconds`."""
    deadline = time.monotonic() + seconds
    while not condition():
        if time.monotonic() > deadline or (sub is not None and sub.task.done()):
            raise AssertionError(f"timed out waiting for {what}; status {sub.status if sub else None}")
        await asyncio.sleep(0.02)


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
    await store.put(layout.ready_key(9, "patch"), b"[" * 100_000)
    await wait_for(lambda: daemon.status.consecutive_failures > 0 or daemon.status.skipped_markers > 0, "a failure")
    await publish(publisher, range(9, 11))  # the publisher takes step 9's patch slot as taken: anchors go on
    await wait_for(lambda: daemon.step == 10, "step 10 past the bad marker", sub=daemon)
    assert_serving(daemon, 10)


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
