"""What a sink receives: one complete, verified state. Sinks run in order after each update."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path

import torch

from pulsesync.digest import StateDigest


@dataclass
class Update:
    """A verified state handed to sinks; `directory` is set once a directory sink has written it."""

    step: int
    state: dict[str, torch.Tensor]
    digest: StateDigest
    files: dict[str, bytes]
    previous: dict[str, torch.Tensor] | None = None  # the state served until now (None at the first)
    previous_digest: StateDigest | None = None
    directory: Path | None = None


class Sink(ABC):
    """Delivers verified states somewhere; raises EngineError (or another PulseSyncError) on failure."""

    name: str

    @abstractmethod
    async def deliver(self, update: Update) -> None:
        """Hand over one verified state."""
