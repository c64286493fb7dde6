"""Sinks: where a subscriber delivers verified states (directory, command, SGLang, vLLM, a vLLM LoRA adapter).

The sinks' settings live in `config` (`SinkConfig`: the union a subscriber config lists), read without loading a sink.
"""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import TYPE_CHECKING

import lazy_loader
from pydantic import BaseModel

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
    from pulsesync.sinks.vllm.sidecar.lora import VLLMLoRASink as VLLMLoRASink
    from pulsesync.sinks.vllm.sidecar.sink import VLLMSink as VLLMSink

# The sinks load on first use: a subscriber config reads its `sinks:` without torch.
__getattr__, __dir__, _lazy = lazy_loader.attach(
    __name__,
    submod_attrs={
        "base": ["Sink", "Update"],
        "command": ["CommandSink"],
        "directory": ["DirectorySink"],
        "sglang": ["SGLangSink"],
        "vllm.sidecar.sink": ["VLLMSink"],
        "vllm.sidecar.lora": ["VLLMLoRASink"],
    },
)
__all__ = [
    *_lazy,
    "SINKS",
    "CommandSinkConfig",
    "DirectorySinkConfig",
    "SGLangSinkConfig",
    "SinkConfig",
    "VLLMLoRASinkConfig",
    "VLLMSinkConfig",
    "build_sinks",
    "sink_class",
]

# The sink of each config type, "module:Class", imported when one is built (as vLLM names its
# weight-transfer backends): a new sink is a config type and a line here.
SINKS: dict[type[BaseModel], str] = {
    DirectorySinkConfig: "pulsesync.sinks.directory:DirectorySink",
    CommandSinkConfig: "pulsesync.sinks.command:CommandSink",
    SGLangSinkConfig: "pulsesync.sinks.sglang:SGLangSink",
    VLLMSinkConfig: "pulsesync.sinks.vllm.sidecar.sink:VLLMSink",
    VLLMLoRASinkConfig: "pulsesync.sinks.vllm.sidecar.lora:VLLMLoRASink",
}


def sink_class(config: BaseModel) -> type[Sink]:
    """The Sink class a config builds (`SINKS`)."""
    module, _, name = SINKS[type(config)].partition(":")
    found: type[Sink] = getattr(importlib.import_module(module), name)
    return found


def build_sinks(configs: list[SinkConfig]) -> list[Sink]:
    """Sinks for configs: those that write what others read first (directories), then in config order."""
    sinks: list[Sink] = []

    def pinned() -> set[Path]:
        return set().union(*(s.pinned() for s in sinks))

    classes = [(config, sink_class(config)) for config in configs]
    for config, cls in sorted(classes, key=lambda each: not each[1].writes_first):  # stable: config order kept
        sinks.append(cls.build(config, pinned))
    return sinks
