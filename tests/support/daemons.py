"""Driving a daemon started as a subprocess: wait on its /healthz."""

from __future__ import annotations

import json
import subprocess
import time
import urllib.request
from typing import Any


def wait_for_health(port: int, proc: subprocess.Popen[bytes], ok: Any, seconds: float = 60) -> dict[str, Any]:
    """Poll the daemon's /healthz until ok(details); fail with its output if it exits or times out."""
    deadline = time.monotonic() + seconds
    last: dict[str, Any] = {}
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=2) as reply:
                last = json.loads(reply.read())
        except OSError as e:  # not serving yet, or 503 (urllib raises HTTPError, an OSError)
            body = getattr(e, "read", None)
            last = json.loads(body()) if body is not None else last
        if last and ok(last):
            return last
        time.sleep(0.1)
    proc.terminate()
    raise AssertionError(f"daemon: {last}; output: {proc.communicate(timeout=30)[0].decode()[-3000:]}")
