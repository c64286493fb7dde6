"""Sinks: where a subscriber delivers verified states (directory, command, SGLang, vLLM; modules via Subscriber).

Each sink's settings live beside it; `SinkConfig` is the union a subscriber config lists.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

from pydantic import Field

from pulsesync.sinks.base import Sink, Update
from pulsesync.sinks.command import CommandSink, CommandSinkConfig
from pulsesync.sinks.directory import DirectorySink, DirectorySinkConfig
from pulsesync.sinks.sglang import SGLangSink, SGLangSinkConfig
from pulsesync.sinks.vllm import VLLMSink, VLLMSinkConfig

__all__ = [
    "CommandSink",
    "CommandSinkConfig",
    "DirectorySink",
    "DirectorySinkConfig",
    "SGLangSink",
    "SGLangSinkConfig",
    "Sink",
    "SinkConfig",
    "Update",
    "VLLMSink",
    "VLLMSinkConfig",
    "build_sinks",
]

SinkConfig = Annotated[
    DirectorySinkConfig | CommandSinkConfig | SGLangSinkConfig | VLLMSinkConfig, Field(discriminator="type")
]


def build_sinks(configs: list[SinkConfig]) -> list[Sink]:
    """Sinks for configs: directory sinks first (the others may read what they write), then in config order."""
    sinks: list[Sink] = []

    def pinned() -> set[Path]:
        return set().union(*(s.pinned() for s in sinks))

    sinks += [DirectorySink(c, pinned) for c in configs if isinstance(c, DirectorySinkConfig)]
    for c in configs:
        if isinstance(c, CommandSinkConfig):
            sinks.append(CommandSink(c))
        elif isinstance(c, SGLangSinkConfig):
            sinks.append(SGLangSink(c))
        elif isinstance(c, VLLMSinkConfig):
            sinks.append(VLLMSink(c))
    return sinks
