"""Issue 28 items 1-2: a prefix carries one publishing stream, and neither side lets another one in silently.

Item 1: a second publisher (another key, or this key and another stream) refuses a live prefix
with the conflict exit code and writes nothing, unless it takes the prefix over explicitly.
Item 2: a subscriber keeps the stream it learned (from its state cache or its config) whatever the
store's newest marker says; a run's markers copied into another run's prefix are skipped and counted.
Everything goes through the CLI, on SeaweedFS (item 1) and file stores (item 2).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import boto3
import pytest
from safetensors.torch import load_file

from pulsesync.cli import main
from pulsesync.protocol import layout, signing
from pulsesync.protocol.manifest import parse_manifest
from tests.support.daemons import wait_for_health
from tests.support.helpers import assert_states_equal, trainer_states, write_checkpoint
from tests.support.servers import BUCKET, free_port

pytestmark = pytest.mark.integration
STEPS = 8


def checkpoints(root: Path, seed: int, steps: range) -> dict[int, Path]:
    """Checkpoint directories of a synthetic trainer's steps (seed: which run)."""
    paths = {}
    for step in steps:
        paths[step] = root / f"run-{seed}" / f"checkpoint-{step}"
        write_checkpoint(paths[step], trainer_states(STEPS, seed)[step], {"config.json": '{"model_type": "t"}'})
    return paths


def keypair(root: Path, name: str) -> tuple[Path, Path, str]:
    """A keypair under root/name: private key, public key, key id."""
    return signing.write_keypair(root / name)


def etags(endpoint: str, prefix: str) -> dict[str, str]:
    """Every object under the prefix with its ETag, read with boto3 (not pulsesync's client)."""
    client = boto3.client("s3", endpoint_url=endpoint)
    listing = client.list_objects_v2(Bucket=BUCKET, Prefix=prefix + "/")
    return {o["Key"]: o["ETag"] for o in listing.get("Contents", [])}


# --- item 1 ---------------------------------------------------------------------------------------
def test_a_publisher_with_another_key_refuses_a_live_prefix_and_writes_nothing(
    seaweedfs_endpoint: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Item 1: key B wrote an anchor beside key A's step 3 and exited 0; it must exit 6 and change nothing."""
    key_a, _, id_a = keypair(tmp_path, "a")
    key_b, pub_b, id_b = keypair(tmp_path, "b")
    ckpts = checkpoints(tmp_path, 0, range(1, 6))
    prefix = f"run-{uuid.uuid4().hex[:8]}"
    store = ["--store", f"s3://{BUCKET}/{prefix}", "--endpoint-url", seaweedfs_endpoint]

    def publish(key: Path, step: int, *extra: str) -> int:
        return main(
            [
                "publish",
                *store,
                "--signing-key",
                str(key),
                "--checkpoint",
                str(ckpts[step]),
                "--step",
                str(step),
                *extra,
            ]
        )

    for step in (1, 2, 3):
        assert publish(key_a, step) == 0
    capsys.readouterr()
    before = etags(seaweedfs_endpoint, prefix)
    assert {k for k in before if "/ready/" in k} >= {f"{prefix}/{layout.commit_key(3)}"}

    assert publish(key_b, 3) == 6
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "ConflictError" in err, err
    assert f"s3://{BUCKET}/{prefix}/" in err and id_a in err, err
    assert etags(seaweedfs_endpoint, prefix) == before  # no marker added or rewritten, no payload uploaded
    assert publish(key_b, 4) == 6  # a newer step is refused alike
    capsys.readouterr()
    assert etags(seaweedfs_endpoint, prefix) == before

    # Unparseable junk under ready/ stays a skip: the owner publishes on.
    junk = f"{prefix}/{layout.commit_key(7)}"
    boto3.client("s3", endpoint_url=seaweedfs_endpoint).put_object(Bucket=BUCKET, Key=junk, Body=b"\x00not json")
    assert publish(key_a, 4) == 0
    capsys.readouterr()

    # Taking over is explicit, and steps still only go forward past every well-formed marker.
    assert publish(key_b, 4, "--take-over-prefix") == 6
    assert "not newer than step 4" in capsys.readouterr().err
    owned = etags(seaweedfs_endpoint, prefix)
    assert publish(key_b, 5, "--take-over-prefix") == 0
    assert "step=5 kind=anchor ok=true" in capsys.readouterr().out
    after = etags(seaweedfs_endpoint, prefix)
    pointer = f"{prefix}/{layout.POINTER_KEY}"  # the one object every commit rewrites (a hint, unsigned)
    assert all(after[k] == tag for k, tag in owned.items() if k != pointer)  # nothing of A's was touched
    marker = boto3.client("s3", endpoint_url=seaweedfs_endpoint).get_object(
        Bucket=BUCKET, Key=f"{prefix}/{layout.commit_key(5)}"
    )
    taken = parse_manifest(marker["Body"].read())
    assert taken.key_id == id_b
    # A subscriber of B follows B's new stream from its anchor.
    code = main(["subscribe", *store, "--trusted-key", str(pub_b), "--once"])
    assert code == 0 and json.loads(capsys.readouterr().out)["step"] == 5


async def test_a_running_publisher_stops_when_another_key_commits_into_its_prefix(tmp_path: Path) -> None:
    """Item 1, at run time: a marker of another key that appears between two steps is a conflict."""
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    from pulsesync.errors import ConflictError
    from pulsesync.publisher import AsyncPublisher
    from pulsesync.store import FileStore
    from tests.support.helpers import publisher_config

    store = FileStore(tmp_path / "s")
    owner = AsyncPublisher(publisher_config(), store=store, signing_key=Ed25519PrivateKey.generate())
    await owner.start()
    for step in range(3):
        await owner.publish(step, trainer_states(STEPS)[step])
    await owner.flush()
    intruder = AsyncPublisher(
        publisher_config(), store=FileStore(tmp_path / "s"), signing_key=Ed25519PrivateKey.generate()
    )
    with pytest.raises(ConflictError, match="signed by key"):
        await intruder.start()
    other = AsyncPublisher(
        publisher_config(), store=FileStore(tmp_path / "other"), signing_key=Ed25519PrivateKey.generate()
    )
    await other.start()
    await other.publish(3, trainer_states(STEPS)[3])
    await other.close()
    marker = layout.commit_key(3)
    await store.put(marker, await FileStore(tmp_path / "other").get(marker))
    await owner.publish(4, trainer_states(STEPS)[4])
    with pytest.raises(ConflictError, match="signed by key"):
        await owner.flush()
    assert layout.commit_key(4) not in {i.key async for i in store.list(layout.READY_PREFIX)}
    with pytest.raises(ConflictError):
        await owner.close()


# --- item 2 ---------------------------------------------------------------------------------------
def copy_step(src: Path, dst: Path, step: int) -> None:
    """Copy a step's markers and anchor payload from one file-store prefix into another (an attacker's copy)."""
    for marker in (layout.commit_key(step), layout.anchor_ready_key(step)):
        if (src / marker).exists():
            (dst / marker).parent.mkdir(parents=True, exist_ok=True)
            (dst / marker).write_bytes((src / marker).read_bytes())
    for path in (src / "anchors").glob(f"{layout.step_name(step)}*"):
        shutil.copytree(path, dst / "anchors" / path.name)


def remove_step(root: Path, step: int) -> None:
    """Delete a step's markers and anchor payload from a file-store prefix."""
    for marker in (layout.commit_key(step), layout.anchor_ready_key(step)):
        (root / marker).unlink(missing_ok=True)
    for path in (root / "anchors").glob(f"{layout.step_name(step)}*"):
        shutil.rmtree(path)


def served_step(out_dir: Path) -> tuple[int, dict[str, Any]]:
    """The step the directory sink's `current` holds, and its tensors."""
    record = json.loads((out_dir / "current" / "pulsesync.json").read_text())
    return record["step"], load_file(str(out_dir / "current" / "model.safetensors"))


@pytest.fixture
def two_runs(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> dict[str, Any]:
    """Run A published steps 1-3 to store A; run B (same key, other weights) steps 1-6 to store B; 6 is an anchor."""
    key, pub, _ = keypair(tmp_path, "k")
    runs = {}
    for name, seed, last in (("a", 0, 3), ("b", 1, 6)):
        ckpts = checkpoints(tmp_path, seed, range(1, last + 1))
        root = tmp_path / f"store-{name}"
        for step in range(1, last + 1):
            flags = ["--store", root.as_uri(), "--signing-key", str(key), "--anchor-interval", "5"]
            assert main(["publish", *flags, "--checkpoint", str(ckpts[step]), "--step", str(step)]) == 0
        runs[name] = root
    assert (runs["b"] / layout.anchor_ready_key(6)).exists()
    capsys.readouterr()
    return {
        "a": runs["a"],
        "b": runs["b"],
        "pub": pub,
        "key": key,
        "ckpts_a": checkpoints(tmp_path / "more", 0, range(4, 5)),
    }


def test_subscribe_once_keeps_its_cached_stream_when_another_runs_marker_is_copied_in(
    two_runs: dict[str, Any], tmp_path: Path, capsys: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture
) -> None:
    """Item 2: with B's step-6 anchor copied into A's prefix, the same command discarded its cache and served B's 6."""
    store_a = two_runs["a"]
    once = ["subscribe", "--store", store_a.as_uri(), "--trusted-key", str(two_runs["pub"])]
    once += ["--cache-dir", str(tmp_path / "c"), "--out-dir", str(tmp_path / "o"), "--once"]
    assert main(once) == 0
    assert json.loads(capsys.readouterr().out)["step"] == 3
    copy_step(two_runs["b"], store_a, 6)

    assert main(once) == 0
    assert json.loads(capsys.readouterr().out)["step"] == 3
    assert "discarding the state cache" not in caplog.text
    assert "ForeignStreamError" in caplog.text  # B's marker: skipped and said so
    step, served = served_step(tmp_path / "o")
    assert step == 3
    assert_states_equal(served, trainer_states(STEPS, 0)[3])

    # A fresh subscriber with no cache and no pin has nothing to tell the streams apart by: it follows
    # the newest; an explicit pin in its config is how an operator chooses.
    pin = tmp_path / "pin.yaml"
    cached_stream = parse_manifest((tmp_path / "c" / "ready-marker.json").read_bytes()).stream_id
    pin.write_text(f"stream_id: {cached_stream}\n")
    pinned = ["subscribe", "--config", str(pin), "--store", store_a.as_uri(), "--trusted-key", str(two_runs["pub"])]
    assert main([*pinned, "--once"]) == 0
    assert json.loads(capsys.readouterr().out)["step"] == 3
    # Changing streams is explicit: --reset-stream drops the cache's pin and follows the store's newest stream.
    assert main([*once, "--reset-stream"]) == 0
    assert json.loads(capsys.readouterr().out)["step"] == 6


def test_the_subscribe_daemon_keeps_its_cached_stream_and_follows_it(
    two_runs: dict[str, Any], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Item 2, the daemon: restarted with B's marker in A's prefix, it serves A's 3, counts B's marker, then A's 4."""
    store_a = two_runs["a"]
    base = ["--store", store_a.as_uri(), "--trusted-key", str(two_runs["pub"]), "--cache-dir", str(tmp_path / "c")]
    base += ["--out-dir", str(tmp_path / "o")]
    assert main(["subscribe", *base, "--once"]) == 0
    capsys.readouterr()
    copy_step(two_runs["b"], store_a, 6)

    config = tmp_path / "daemon.yaml"
    config.write_text("poll_seconds: 0.1\nscrub_interval_seconds: null\n")
    port = free_port()
    cmd = [sys.executable, "-m", "pulsesync", "subscribe", "--config", str(config), *base, "--metrics-port", str(port)]
    daemon = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=os.environ.copy())
    try:
        health = wait_for_health(port, daemon, lambda h: h["step"] == 3 and h["rejected_markers"] >= 1)
        assert "ForeignStreamError" in health["last_rejected"]
        time.sleep(0.5)  # several polls: it stays on A's step 3
        assert served_step(tmp_path / "o")[0] == 3 and wait_for_health(port, daemon, lambda h: h["step"] == 3)
        flags = ["--store", store_a.as_uri(), "--signing-key", str(two_runs["key"])]
        publish_4 = ["publish", *flags, "--checkpoint", str(two_runs["ckpts_a"][4]), "--step", "4"]
        assert main(publish_4) == 6  # A's publisher will not write into a prefix holding B's stream either ...
        remove_step(store_a, 6)  # ... until the operator removes the copy
        assert main(publish_4) == 0
        wait_for_health(port, daemon, lambda h: h["step"] == 4)
        step, served = served_step(tmp_path / "o")
        assert step == 4
        assert_states_equal(served, trainer_states(STEPS, 0)[4])
    finally:
        daemon.terminate()
        out = daemon.communicate(timeout=30)[0].decode()
    assert daemon.returncode == 0, out[-3000:]
    assert "discarding the state cache" not in out, out[-3000:]
