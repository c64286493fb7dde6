"""Every role beside hostile folder trees on a file:// store: a 1,100-level folder stops none of them.

Anyone who can write to the store's directory can nest folders deeper than Python's recursion limit
under a folder the roles list (`ready/`, `fleet/`, `patches/`, `anchors/`). Each command must then do
exactly what it does without the folder.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from safetensors.torch import load_file

from pulsesync.cli import main
from pulsesync.protocol import signing
from tests.support.daemons import wait_for_health
from tests.support.helpers import assert_states_equal, trainer_states, write_checkpoint
from tests.support.hostile import deep_folder, remove_deep_folder
from tests.support.servers import free_port

pytestmark = pytest.mark.integration
STEPS = 4
LISTED_FOLDERS = ("ready", "fleet", "patches", "anchors")


@pytest.fixture
def chain(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> Iterator[dict[str, Any]]:
    """Steps 1-2 published by one-shot `publish --checkpoint` runs; checkpoint 3 ready to publish."""
    key, pub, _ = signing.write_keypair(tmp_path / "k")
    store = tmp_path / "store"
    ckpts = {}
    for step in range(1, STEPS):
        ckpts[step] = tmp_path / "ckpts" / f"checkpoint-{step}"
        write_checkpoint(ckpts[step], trainer_states(STEPS, 0)[step], {"config.json": '{"model_type": "t"}'})
    publish = ["publish", "--store", store.as_uri(), "--signing-key", str(key), "--anchor-interval", "5"]
    for step in (1, 2):
        assert main([*publish, "--checkpoint", str(ckpts[step]), "--step", str(step)]) == 0
    capsys.readouterr()
    yield {"store": store, "key": key, "pub": pub, "ckpts": ckpts, "publish": publish}
    for folder in LISTED_FOLDERS:
        remove_deep_folder(store / folder / "d")


def run(args: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    code = main(args)
    return code, capsys.readouterr().out


def without_ages(inspected: tuple[int, str]) -> tuple[int, Any]:
    """`inspect --json` output less what changes as time passes (each row's age)."""
    code, out = inspected
    doc = json.loads(out)
    for row in doc["steps"]:
        row.pop("age_seconds")
    return code, doc


def test_every_role_behaves_beside_a_1100_level_folder(
    chain: dict[str, Any], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    store, pub = chain["store"], str(chain["pub"])
    url = store.as_uri()
    inspect = ["inspect", "--store", url, "--trusted-key", pub, "--json"]
    retain = ["retain", "--store", url, "--trusted-key", pub, "--keep-patches", "10", "--keep-anchors", "2", "--once"]

    def subscribe_once(name: str) -> tuple[int, str]:
        flags = ["--store", url, "--trusted-key", pub, "--cache-dir", str(tmp_path / name / "c")]
        return run(["subscribe", *flags, "--out-dir", str(tmp_path / name / "o"), "--once"], capsys)

    without = {"inspect": run(inspect, capsys), "retain": run(retain, capsys), "subscribe": subscribe_once("a")}
    assert without["inspect"][0] == without["retain"][0] == without["subscribe"][0] == 0

    for folder in LISTED_FOLDERS:
        deep_folder(store / folder / "d", 1100)
    (store / "pointer").touch()  # a changed pointer makes every poller list ready/

    assert without_ages(run(inspect, capsys)) == without_ages(without["inspect"])
    assert run(retain, capsys) == without["retain"]
    code, out = subscribe_once("b")
    assert (code, json.loads(out)["step"]) == (0, 2)

    config = tmp_path / "daemon.yaml"
    config.write_text("poll_seconds: 0.1\nscrub_interval_seconds: null\n")
    port = free_port()
    flags = ["--store", url, "--trusted-key", pub, "--cache-dir", str(tmp_path / "d" / "c")]
    flags += ["--out-dir", str(tmp_path / "d" / "o"), "--config", str(config), "--metrics-port", str(port)]
    daemon = subprocess.Popen(
        [sys.executable, "-m", "pulsesync", "subscribe", *flags],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        env=os.environ.copy(),
    )
    try:
        wait_for_health(port, daemon, lambda h: h["step"] == 2)
        assert run([*chain["publish"], "--checkpoint", str(chain["ckpts"][3]), "--step", "3"], capsys)[0] == 0
        health = wait_for_health(port, daemon, lambda h: h["step"] == 3)
        assert health["last_error"] is None
    finally:
        daemon.terminate()
        out = daemon.communicate(timeout=30)[0].decode()
    assert daemon.returncode == 0, out[-3000:]
    assert "RecursionError" not in out, out[-3000:]
    code, out = subscribe_once("b")
    assert (code, json.loads(out)["step"]) == (0, 3)
    served = load_file(str(tmp_path / "b" / "o" / "current" / "model.safetensors"))
    assert_states_equal(served, trainer_states(STEPS, 0)[3])
