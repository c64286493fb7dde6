"""Sinks: where a subscriber delivers verified weights (directory, command; in-process modules via Subscriber)."""

from __future__ import annotations

from pulsesync.config import CommandSinkConfig, DirectorySinkConfig, SinkConfig
from pulsesync.engines.base import Sink, Update
from pulsesync.engines.command import CommandSink
from pulsesync.engines.directory import DirectorySink

__all__ = ["CommandSink", "DirectorySink", "Sink", "Update", "build_sinks"]


def build_sinks(configs: list[SinkConfig]) -> list[Sink]:
    """Sinks for configs, directory sinks first (the others may read the directory they write)."""
    directories: list[Sink] = [DirectorySink(c) for c in configs if isinstance(c, DirectorySinkConfig)]
    others: list[Sink] = [CommandSink(c) for c in configs if isinstance(c, CommandSinkConfig)]
    return directories + others
