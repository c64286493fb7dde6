"""Sinks: where a subscriber delivers verified states (directory, command, SGLang, vLLM, a vLLM LoRA adapter).

The sinks' settings live in `config` (`SinkConfig`: the union a subscriber config lists), read without loading a sink.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import lazy_loader

from pulsesync.sinks.config import (
    CommandSinkConfig,
    DirectorySinkConfig,
    SGLangSinkConfig,
    SinkConfig,
    VLLMLoRASinkConfig,
    VLLMSinkConfig,
)

if TYPE_CHECKING:
    from pulsesync.sinks.base import Sink as Sink
    from pulsesync.sinks.base import Update as Update
    from pulsesync.sinks.command import CommandSink as CommandSink
    from pulsesync.sinks.directory import DirectorySink as DirectorySink
    from pulsesync.sinks.sglang import SGLangSink as SGLangSink
    from pulsesync.sinks.vllm import VLLMSink as VLLMSink
    from pulsesync.sinks.vllm_lora import VLLMLoRASink as VLLMLoRASink

# The sinks load on first use: a subscriber config reads its `sinks:` without torch.
__getattr__, __dir__, _lazy = lazy_loader.attach(
    __name__,
    submod_attrs={
        "base": ["Sink", "Update"],
        "command": ["CommandSink"],
        "directory": ["DirectorySink"],
        "sglang": ["SGLangSink"],
        "vllm": ["VLLMSink"],
        "vllm_lora": ["VLLMLoRASink"],
    },
)
__all__ = [
    *_lazy,
    "CommandSinkConfig",
    "DirectorySinkConfig",
    "SGLangSinkConfig",
    "SinkConfig",
    "VLLMLoRASinkConfig",
    "VLLMSinkConfig",
    "build_sinks",
]


def build_sinks(configs: list[SinkConfig]) -> list[Sink]:
    """Sinks for configs: directory sinks first (the others may read what they write), then in config order."""
    from pulsesync.sinks.command import CommandSink
    from pulsesync.sinks.directory import DirectorySink
    from pulsesync.sinks.sglang import SGLangSink
    from pulsesync.sinks.vllm import VLLMSink
    from pulsesync.sinks.vllm_lora import VLLMLoRASink

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
        elif isinstance(c, VLLMLoRASinkConfig):
            sinks.append(VLLMLoRASink(c))
    return sinks
