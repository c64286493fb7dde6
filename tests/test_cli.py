"""The CLI: every command listed, errors as one stderr line with a documented exit code."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
from pathlib import Path

import pytest

from pulsesync.cli import main
from pulsesync.errors import ALL_ERRORS


def test_help_lists_every_command(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(["--help"])
    assert info.value.code == 0
    out = capsys.readouterr().out
    for command in ("keygen", "demo", "publish", "subscribe", "mirror", "retain", "inspect", "verify", "store"):
        assert command in out


@pytest.mark.parametrize(
    "command",
    [
        *("keygen", "demo", "publish", "subscribe", "mirror", "retain", "inspect", "verify"),
        *("store ls", "store put", "store get"),
    ],
)
def test_every_command_takes_the_common_flags(command: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main([*command.split(), "--help"])
    out = capsys.readouterr().out
    for flag in ("--config", "--store", "--endpoint-url"):
        assert flag in out


def test_exit_codes_are_distinct() -> None:
    codes = [e.exit_code for e in ALL_ERRORS]
    assert len(set(codes)) == len(codes)
    assert 0 not in codes and 2 not in codes  # 0 is success, 2 is argparse's usage error


def test_a_mirror_without_a_target_or_a_key_is_a_config_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    origin = f"file://{tmp_path / 'origin'}"
    assert main(["mirror", "--store", origin]) == 3
    assert "target.url" in capsys.readouterr().err
    assert main(["mirror", "--store", origin, "--to", f"file://{tmp_path / 'copy'}"]) == 3
    assert "trusted_keys" in capsys.readouterr().err


def test_keygen_then_conflict(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["keygen", "--out", str(tmp_path)]) == 0
    assert "key id" in capsys.readouterr().out
    assert main(["keygen", "--out", str(tmp_path)]) == 6
    err = capsys.readouterr().err
    assert err.startswith("pulsesync: error: ConflictError:") and err.count("\n") == 1


def test_config_error_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("codec:\n  zstd_level: 99\n  bogus: 1\n")
    assert main(["demo", "--config", str(bad)]) == 3
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "codec." in err


@pytest.mark.integration
def test_demo_small_run_on_the_embedded_s3_server_is_bit_exact(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["demo", "--steps", "6", "--anchor-interval", "3", "--hidden", "64", "--layers", "1"]) == 0
    out = capsys.readouterr().out
    assert "store s3://pulsesync-demo/" in out and "result: every subscriber bitwise equal to the trainer" in out
    step6 = next(line for line in out.splitlines() if line.split()[:1] == ["6"])
    assert "corrupted patch-" in step6 and step6.count("slow (fell back)") == 2  # detected, then recovered
    assert "IntegrityError x1" in out and "retention: " in out and "rebuilt from the store" in out


def test_a_command_run_in_process_leaves_the_loggers_as_it_found_them(tmp_path: Path) -> None:
    """main() in an embedding program (a test, a notebook) quiets or raises its loggers only while it runs."""
    names = ("pulsesync.subscriber", "pulsesync.retention", "pulsesync.progress", "pulsesync.publisher.steps")
    before = {name: (logging.getLogger(name).level, logging.getLogger(name).propagate) for name in names}
    assert main(["demo", "--steps", "2", "--hidden", "16", "--layers", "1", "--store", tmp_path.as_uri()]) == 0
    assert {name: (logging.getLogger(name).level, logging.getLogger(name).propagate) for name in names} == before


def test_console_script_exit_code(tmp_path: Path) -> None:
    run = subprocess.run(
        [sys.executable, "-m", "pulsesync", "demo", "--store", "ftp://nowhere"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 3
    assert run.stderr.strip().startswith("pulsesync: error: ConfigError:")
    assert run.stderr.count("\n") == 1


def test_subscribe_once_with_an_untrusted_key_fails_at_once_without_retrying(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture
) -> None:
    """A marker no trusted key signed does not verify on a second try: one attempt, one line, exit 12."""
    import asyncio

    from pulsesync.publisher import AsyncPublisher, PublisherConfig
    from pulsesync.store import FileStore
    from tests.support.helpers import trainer_states

    assert main(["keygen", "--out", str(tmp_path / "a")]) == 0
    assert main(["keygen", "--out", str(tmp_path / "b")]) == 0
    config = PublisherConfig(signing_key=tmp_path / "a" / "publisher.key")

    async def publish() -> None:
        async with AsyncPublisher(config, store=FileStore(tmp_path / "store")) as pub:
            await pub.publish(0, trainer_states(2)[0])

    asyncio.run(publish())
    capsys.readouterr()
    store, other = f"file://{tmp_path / 'store'}", str(tmp_path / "b" / "publisher.pub")
    assert main(["subscribe", "--once", "--store", store, "--trusted-key", other]) == 12
    err = capsys.readouterr().err
    assert err.startswith("pulsesync: error: UnknownKeyError:") and err.count("\n") == 1
    assert not [r for r in caplog.records if "sync failed" in r.getMessage()]  # not retried


def test_inspect_json_rows_carry_the_state_digest_the_publisher_computed(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Each row's state_digest is the root of the state published at that step, with its algorithm."""
    import asyncio
    import json

    from pulsesync.digest import state_digest
    from pulsesync.publisher import AsyncPublisher, PublisherConfig
    from pulsesync.store import FileStore
    from tests.support.helpers import trainer_states

    assert main(["keygen", "--out", str(tmp_path / "k")]) == 0
    states = trainer_states(4)
    config = PublisherConfig(signing_key=tmp_path / "k" / "publisher.key", on_backpressure="block", anchor_interval=2)

    async def publish() -> None:
        async with AsyncPublisher(config, store=FileStore(tmp_path / "store")) as pub:
            for step, state in enumerate(states):
                await pub.publish(step, state)

    asyncio.run(publish())
    capsys.readouterr()
    store, key = f"file://{tmp_path / 'store'}", str(tmp_path / "k" / "publisher.pub")
    assert main(["inspect", "--store", store, "--trusted-key", key, "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)["steps"]
    expected = {step: state_digest(state) for step, state in enumerate(states)}
    assert {r["kind"] for r in rows} == {"anchor", "patch"}
    for row in rows:
        assert row["state_digest"] == expected[row["step"]].root
        assert row["digest_algorithm"] == expected[row["step"]].algorithm == "mixsum-128"
    assert main(["inspect", "--store", store, "--trusted-key", key]) == 0
    table = capsys.readouterr().out
    assert f"mixsum-128:{expected[3].root[:16]}" in table


def test_inspect_with_a_key_that_verifies_nothing_prints_the_chain_and_fails(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Rows marked BAD are a verification failure: the table is printed, then one error line, exit 7."""
    import asyncio

    from pulsesync.publisher import AsyncPublisher, PublisherConfig
    from pulsesync.store import FileStore
    from tests.support.helpers import trainer_states

    assert main(["keygen", "--out", str(tmp_path / "a")]) == 0
    assert main(["keygen", "--out", str(tmp_path / "b")]) == 0

    async def publish() -> None:
        config = PublisherConfig(signing_key=tmp_path / "a" / "publisher.key", on_backpressure="block")
        async with AsyncPublisher(config, store=FileStore(tmp_path / "store")) as pub:
            for step, state in enumerate(trainer_states(3)):
                await pub.publish(step, state)

    asyncio.run(publish())
    capsys.readouterr()
    store = f"file://{tmp_path / 'store'}"
    assert main(["inspect", "--store", store, "--trusted-key", str(tmp_path / "a" / "publisher.pub")]) == 0
    assert " ok" in capsys.readouterr().out
    assert main(["inspect", "--store", store, "--trusted-key", str(tmp_path / "b" / "publisher.pub")]) == 7
    out, err = capsys.readouterr()
    assert out.count(" BAD") == 3
    assert err.startswith("pulsesync: error: IntegrityError:") and err.count("\n") == 1
    assert "3 of 3 ready markers" in err and "UnknownKeyError" in err


@pytest.mark.parametrize(
    ("args", "code", "says"),
    [
        (["--checkpoint", "{missing}", "--step", "3"], 5, "NotFoundError: checkpoint {missing}: no such file"),
        (["--watch", "{missing}", "--once"], 3, "ConfigError: --watch {missing}: no such directory"),
    ],
)
def test_publish_names_a_missing_checkpoint_or_watch_dir_before_touching_the_store(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], args: list[str], code: int, says: str
) -> None:
    """Checked first: the store here refuses connections, so reaching it would fail otherwise (StoreError)."""
    assert main(["keygen", "--out", str(tmp_path)]) == 0
    missing = str(tmp_path / "nope")
    store = ["--store", "s3://bucket/run", "--endpoint-url", "http://127.0.0.1:9"]
    key = ["--signing-key", str(tmp_path / "publisher.key")]
    capsys.readouterr()
    assert main(["publish", *store, *key, *[a.format(missing=missing) for a in args]]) == code
    err = capsys.readouterr().err
    assert err.startswith("pulsesync: error: " + says.format(missing=missing)) and err.count("\n") == 1


def test_a_one_shot_publish_of_a_step_the_store_holds_fails_before_rebuilding_the_baseline(tmp_path: Path) -> None:
    """The conflict is known from the markers alone: no anchor is downloaded, no patch applied, exit 6."""
    from tests.support.helpers import trainer_states, write_checkpoint

    assert main(["-q", "keygen", "--out", str(tmp_path / "keys")]) == 0
    for step, state in enumerate(trainer_states(2)):
        write_checkpoint(tmp_path / f"ck{step}", state)
    args = [sys.executable, "-m", "pulsesync", "-v", "publish", "--store", f"file://{tmp_path / 'store'}"]
    args += ["--signing-key", str(tmp_path / "keys" / "publisher.key")]
    for step in (0, 1):
        done = subprocess.run([*args, "--checkpoint", str(tmp_path / f"ck{step}"), "--step", str(step)], timeout=300)
        assert done.returncode == 0
    again = [*args, "--checkpoint", str(tmp_path / "ck1"), "--step", "1"]
    done = subprocess.run(again, capture_output=True, text=True, timeout=300)
    assert done.returncode == 6, done.stderr
    assert done.stderr.splitlines()[-1].startswith("pulsesync: error: ConflictError: step 1 is not newer than step 1")
    assert "resum" not in done.stderr, done.stderr  # neither "resuming ... rebuilding" nor "resumed at step"


@pytest.mark.parametrize("command", ["subscribe", "publish"])
def test_a_missing_bucket_is_named_with_its_endpoint_in_one_line(
    command: str, moto_endpoint: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Not 'no such object' three times and unclosed aiohttp sessions: the bucket, where, and what to do."""
    assert main(["keygen", "--out", str(tmp_path)]) == 0
    store = ["--store", "s3://no-such-bucket/run", "--endpoint-url", moto_endpoint]
    args = {
        "subscribe": ["subscribe", *store, "--once", "--trusted-key", str(tmp_path / "publisher.pub")],
        "publish": [
            "publish",
            *store,
            "--synthetic",
            "--max-steps",
            "1",
            "--signing-key",
            str(tmp_path / "publisher.key"),
        ],
    }[command]
    capsys.readouterr()
    code = subprocess.run([sys.executable, "-m", "pulsesync", *args], capture_output=True, text=True, timeout=120)
    assert code.returncode == 23, code.stderr
    expected = f"pulsesync: error: BucketNotFoundError: bucket 'no-such-bucket' does not exist at {moto_endpoint}"
    assert code.stderr.startswith(expected) and code.stderr.count("\n") == 1, code.stderr


@pytest.mark.parametrize(
    ("url", "hint"),
    [
        ("gs://bucket/run", "s3://bucket/prefix with --endpoint-url"),
        ("http://127.0.0.1:9000/bucket", "--store s3://bucket/prefix --endpoint-url http://127.0.0.1:9000"),
    ],
)
def test_a_store_url_of_another_kind_says_what_to_pass(url: str, hint: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["inspect", "--store", url]) == 3
    err = capsys.readouterr().err
    assert err.startswith("pulsesync: error: ConfigError:") and err.count("\n") == 1 and hint in err, err


def test_a_config_typo_names_the_key_meant_and_every_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "publisher.yaml"
    bad.write_text("anchor_intreval: 10\ncodec:\n  zstd_level: 99\n")
    assert main(["publish", "--config", str(bad), "--synthetic"]) == 3
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    assert "anchor_intreval: not a setting (did you mean anchor_interval?)" in err
    assert "codec.zstd_level:" in err and "more)" not in err


@pytest.mark.parametrize(
    "argv",
    [
        ["--help"],
        ["publish", "--help"],
        ["subscribe", "--bogus-flag"],
        *([command, "--store", "gs://bucket/run"] for command in ("demo", "inspect", "retain", "subscribe", "verify")),
        ["mirror", "--store", "file:///tmp/origin", "--to", "gs://bucket/run"],
        ["mirror", "--store", "file:///tmp/origin"],
        ["publish", "--store", "http://127.0.0.1:9000/bucket", "--synthetic"],
        ["store", "ls", "--store", "gs://bucket/run"],
        ["publish", "--config", "/nonexistent/publisher.yaml", "--synthetic"],
    ],
)
def test_help_usage_and_config_errors_import_no_heavy_module(argv: list[str]) -> None:
    """`--help`, a usage error and a config error answer at once: torch, the S3 client and numba load for work."""
    code = (
        "import sys\nfrom pulsesync.cli import main\ntry:\n    main(sys.argv[1:])\nexcept SystemExit:\n    pass\n"
        "print([m for m in ('torch', 'aiobotocore', 'numba') if m in sys.modules])"
    )
    done = subprocess.run([sys.executable, "-c", code, *argv], capture_output=True, text=True, timeout=60)
    assert done.stdout.strip().splitlines()[-1] == "[]", done.stdout + done.stderr


def test_log_flags_go_before_or_after_the_command_and_json_logs_are_one_object_a_line(tmp_path: Path) -> None:
    """-v/-q/--log-format on either side of the command; a publish prints each step once, on stdout."""
    assert main(["-q", "keygen", "--out", str(tmp_path / "k")]) == 0
    args = ["publish", "--synthetic", "--max-steps", "1", "--store", f"file://{tmp_path / 's'}"]
    args += ["--signing-key", str(tmp_path / "k" / "publisher.key")]
    done = subprocess.run(
        [sys.executable, "-m", "pulsesync", "-v", "--log-format", "json", *args],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    assert [line.split()[:3] for line in done.stdout.splitlines()] == [["published", "step=0", "kind=anchor"]]
    logged = [json.loads(line) for line in done.stderr.splitlines()]  # every stderr line is a JSON object
    assert logged and all({"time", "level", "logger", "message"} <= set(entry) for entry in logged)
    assert not [e for e in logged if e["message"].startswith("published step=")]  # not twice
