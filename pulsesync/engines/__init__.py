"""Sinks: where a subscriber delivers verified weights (directory, command, SGLang, vLLM; modules via Subscriber)."""

from __future__ import annotations

from pulsesync.config import CommandSinkConfig, DirectorySinkConfig, SGLangSinkConfig, SinkConfig, VLLMSinkConfig
from pulsesync.engines.base import Sink, Update
from pulsesync.engines.command import CommandSink
from pulsesync.engines.directory import DirectorySink
from pulsesync.engines.sglang import SGLangSink
from pulsesync.engines.vllm import VLLMSink

__all__ = ["CommandSink", "DirectorySink", "SGLangSink", "Sink", "Update", "VLLMSink", "build_sinks"]


def build_sinks(configs: list[SinkConfig]) -> list[Sink]:
    """Sinks for configs: directory sinks first (the others may read what they write), then in config order."""
    sinks: list[Sink] = [DirectorySink(c) for c in configs if isinstance(c, DirectorySinkConfig)]
    for c in configs:
        if isinstance(c, CommandSinkConfig):
            sinks.append(CommandSink(c))
        elif isinstance(c, SGLangSinkConfig):
            sinks.append(SGLangSink(c))
        elif isinstance(c, VLLMSinkConfig):
            sinks.append(VLLMSink(c))
    return sinks
