"""`pulsesync store ls|put|get` against a real S3 server (moto, server mode) and the filesystem."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import pytest

from pulsesync import progress
from pulsesync.cli import main
from tests.support.servers import BUCKET


def _round_trip(flags: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str], caplog, monkeypatch) -> None:
    monkeypatch.setattr(progress, "LOG_INTERVAL", 0.0)  # a line for each step of this short transfer
    data = os.urandom((11 << 20) + 3)  # above one 8 MiB part: multipart on S3
    src, dst = tmp_path / "in.bin", tmp_path / "out" / "copy.bin"
    src.write_bytes(data)
    sha = hashlib.sha256(data).hexdigest()
    assert main(["store", "put", str(src), "anchors/000000000000/model.safetensors", *flags]) == 0
    assert sha in capsys.readouterr().out
    assert any(r.getMessage().startswith("upload anchors/") and "(100%)" in r.getMessage() for r in caplog.records)
    assert main(["store", "ls", "anchors/", *flags]) == 0
    assert capsys.readouterr().out.split() == [f"{len(data):,}", "anchors/000000000000/model.safetensors"]
    assert main(["store", "get", "anchors/000000000000/model.safetensors", str(dst), "--sha256", sha, *flags]) == 0
    assert dst.read_bytes() == data
    assert main(["store", "get", "anchors/000000000000/model.safetensors", str(dst), "--sha256", "0" * 64, *flags]) == 7
    assert "IntegrityError" in capsys.readouterr().err
    assert main(["store", "get", "missing", str(dst), *flags]) == 5


@pytest.mark.integration
def test_store_commands_on_s3(moto_endpoint: str, tmp_path: Path, capsys, caplog, monkeypatch) -> None:
    flags = ["--store", f"s3://{BUCKET}/cli", "--endpoint-url", moto_endpoint]
    _round_trip(flags, tmp_path, capsys, caplog, monkeypatch)


def test_store_commands_on_the_filesystem(tmp_path: Path, capsys, caplog, monkeypatch) -> None:
    _round_trip(["--store", f"file://{tmp_path}/store"], tmp_path, capsys, caplog, monkeypatch)


def test_store_needs_a_store(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["store", "ls"]) == 3
    assert "no store configured" in capsys.readouterr().err


@pytest.mark.integration
def test_demo_on_s3_and_refusal_to_reuse_a_prefix(moto_endpoint: str, capsys: pytest.CaptureFixture[str]) -> None:
    flags = ["--store", f"s3://{BUCKET}/demo", "--endpoint-url", moto_endpoint]
    small = ["--steps", "5", "--anchor-interval", "2", "--hidden", "64", "--layers", "1"]
    assert main(["demo", *small, *flags]) == 0
    out = capsys.readouterr().out
    assert f"store s3://{BUCKET}/demo/" in out and "bitwise equal to the trainer" in out
    assert main(["store", "ls", "ready/", *flags]) == 0
    ready = capsys.readouterr().out.split()[1::2]
    assert ready == sorted(ready) and ready[-1] == "ready/000000000005.json"  # retention pruned the rest
    assert main(["demo", *small, *flags]) == 6  # ready markers are never overwritten
    assert "already holds published steps" in capsys.readouterr().err
