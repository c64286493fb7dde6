"""The `command` sink: run a user command after each update (no shell).

Its environment carries PULSESYNC_STEP and PULSESYNC_DIR (the step's directory when a directory
sink runs before it, else empty). A non-zero exit or a timeout is an EngineError.
"""

from __future__ import annotations

import asyncio
import os

from pulsesync.deadlines import within
from pulsesync.errors import EngineError
from pulsesync.sinks.base import Sink, Update
from pulsesync.sinks.config import CommandSinkConfig


class CommandSink(Sink):
    """Runs argv with the step in its environment."""

    name = "command"

    def __init__(self, config: CommandSinkConfig) -> None:
        self.config = config

    async def deliver(self, update: Update) -> None:
        """Run the command; EngineError unless it exits 0 in time."""
        env = {**os.environ, "PULSESYNC_STEP": str(update.step), "PULSESYNC_DIR": str(update.directory or "")}
        argv = self.config.argv
        try:
            proc = await asyncio.create_subprocess_exec(*argv, env=env)
        except OSError as e:
            raise EngineError(f"command sink: cannot run {argv[0]!r} ({e.strerror or e})") from None
        try:
            code = await within(self.config.timeout_seconds, proc.wait())
        except asyncio.TimeoutError:
            proc.kill()
            await proc.wait()
            raise EngineError(
                f"command sink: {argv[0]!r} ran past {self.config.timeout_seconds:g}s at step {update.step}"
            ) from None
        if code != 0:
            raise EngineError(f"command sink: {argv[0]!r} exited with {code} at step {update.step}")
