"""Progress of long work: bars on a real terminal (a pty), log lines elsewhere, nothing for short work."""

from __future__ import annotations

import fcntl
import logging
import os
import select
import struct
import subprocess
import sys
import termios
import time
from pathlib import Path

import pytest

from pulsesync import progress
from pulsesync.cli import main
from pulsesync.progress import Phase, TransferProgress, describe, phase
from tests.support.helpers import trainer_states, write_checkpoint

# The real CLI in a process of its own; only the delay before a bar shows is 0, as the test's work is short.
CLI = "\n".join(
    ("import sys", "from pulsesync import progress", "progress.{setting}", "from pulsesync.cli import main")
)
CLI += "\nsys.exit(main(sys.argv[1:]))"


def _run_on_a_terminal(args: list[str], timeout: float = 180) -> tuple[int, str]:
    """Run the CLI with stdin, stdout and stderr on a pseudo-terminal 120 columns wide; its exit code and screen."""
    master, slave = os.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 120, 0, 0))
    code = CLI.format(setting="BAR_DELAY = 0.0")
    proc = subprocess.Popen([sys.executable, "-c", code, *args], stdin=slave, stdout=slave, stderr=slave)
    os.close(slave)
    screen = bytearray()
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            if not select.select([master], [], [], 1.0)[0]:
                continue
            try:
                data = os.read(master, 1 << 16)
            except OSError:  # EIO: the process and its children closed the terminal
                break
            if not data:
                break
            screen += data
        return proc.wait(timeout=10), screen.decode(errors="replace")
    finally:
        proc.kill()
        os.close(master)


def test_long_work_shows_bars_on_a_terminal(tmp_path: Path) -> None:
    """Anchor upload, the baseline rebuilt on resume, and a subscriber's slow path, each a bar with its size."""
    assert main(["-q", "keygen", "--out", str(tmp_path / "keys")]) == 0
    store = ["--store", f"file://{tmp_path / 'store'}"]
    states = trainer_states(3)
    for step, state in enumerate(states):
        write_checkpoint(tmp_path / f"ck{step}", state)

    def publish(step: int) -> str:
        args = ["publish", *store, "--signing-key", str(tmp_path / "keys" / "publisher.key")]
        code, screen = _run_on_a_terminal([*args, "--checkpoint", str(tmp_path / f"ck{step}"), "--step", str(step)])
        assert code == 0, screen
        return screen

    first = publish(0)
    assert "anchor 0: upload: 100%|" in first, first  # a tqdm bar: description, percent, bar
    assert "published step=0 kind=anchor" in first
    second = publish(1)
    assert "anchor 0: download: 100%|" in second, second  # the resume rebuilds step 0
    assert "published step=1 kind=patch" in second
    third = publish(2)
    assert "patches to step 1: fetch and apply: 100%|" in third, third
    args = ["subscribe", *store, "--trusted-key", str(tmp_path / "keys" / "publisher.pub")]
    code, screen = _run_on_a_terminal([*args, "--out-dir", str(tmp_path / "served"), "--once"])
    assert code == 0, screen
    assert "anchor 0: download: 100%|" in screen and "patches to step 2: fetch and apply: 100%|" in screen, screen
    assert "2/2 [" in screen  # the patch count, with its time
    assert '"step": 2' in screen


def test_long_work_logs_lines_off_a_terminal(tmp_path: Path) -> None:
    """Off a terminal the same work logs plain lines (no bar, no carriage return)."""
    assert main(["-q", "keygen", "--out", str(tmp_path / "keys")]) == 0
    write_checkpoint(tmp_path / "ck", trainer_states(1)[0])
    args = ["publish", "--store", f"file://{tmp_path / 'store'}"]
    args += ["--signing-key", str(tmp_path / "keys" / "publisher.key"), "--checkpoint", str(tmp_path / "ck")]
    code = CLI.format(setting="LOG_INTERVAL = 0.0")
    done = subprocess.run([sys.executable, "-c", code, *args, "--step", "0"], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert "pulsesync.progress: anchor 0: upload: " in done.stderr and "(100%)" in done.stderr, done.stderr
    assert "\r" not in done.stderr + done.stdout
    assert done.stdout.startswith("published step=0 kind=anchor")


def test_a_short_phase_logs_nothing_and_a_long_one_its_progress_and_end(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, "pulsesync.progress")
    clock = [0.0]  # a machine booted just now: lines are timed from the phase's start, not the clock's zero
    monkeypatch.setattr(progress.time, "monotonic", lambda: clock[0])
    with phase("short", 10) as shown:
        shown.advance(10)
    assert caplog.records == []
    with phase("long", 100) as shown:
        for _ in range(4):
            clock[0] += 3.0
            shown.advance(25)
    assert [r.getMessage() for r in caplog.records] == [
        "long: 50 B/100 B (50%) 8 B/s ETA 6s",  # 6 s in: the first line
        "long: 100 B/100 B (100%) 8 B/s ETA 0s, done in 12.0s",
    ]


def test_a_phase_adds_up_its_transfers_and_learns_the_size_of_a_single_one() -> None:
    several = Phase("two files", 300)
    several.transfer(TransferProgress("a", 100, 100, 1.0))
    several.transfer(TransferProgress("b", 50, 200, 1.0))
    several.transfer(TransferProgress("b", 200, 200, 2.0))
    assert (several.done, several.total) == (300, 300)
    single = Phase("one file", None)
    single.transfer(TransferProgress("a", 5, 40, 1.0))
    assert (single.done, single.total) == (5, 40)


def test_describe_says_rate_and_eta_in_binary_units() -> None:
    assert describe("k", 50 << 20, 200 << 20, 2.0) == "k: 50.0 MiB/200.0 MiB (25%) 25.0 MiB/s ETA 6s"
    assert describe("k", 3, None, 2.0, "patch") == "k: 3 patch 1.5 patch/s"
    assert describe("k", 0, 10, 0.0) == "k: 0 B/10 B (0%) 0 B/s ETA ?"
