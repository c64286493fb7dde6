"""What a sink receives: one complete, verified state. Sinks run in order after each update."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path

import torch

from pulsesync.codec import UndoLog
from pulsesync.digest import StateDigest
from pulsesync.verified import VerifiedState


@dataclass
class Update(VerifiedState):
    """A verified state handed to sinks; `directory` is set once a directory sink has written it."""

    previous_digest: StateDigest | None = None  # of the state served until now (None at the first)
    undo: list[UndoLog] = field(default_factory=list)  # the patches applied since then, when known
    directory: Path | None = None

    @cached_property
    def changes(self) -> dict[str, torch.Tensor | None] | None:
        """Flat positions (sorted) each tensor changed at since the previous state, None for a whole tensor.

        None when unknown (the first state, the slow path): then every tensor whose digest changed
        counts as changed whole. Computed on first use: only sinks that send sparse updates need it.
        """
        if not self.undo:
            return None
        merged: dict[str, list[torch.Tensor] | None] = {}
        for log in self.undo:
            for name, positions in log.changed().items():
                parts = merged.get(name, [])
                merged[name] = None if positions is None or parts is None else [*parts, positions]
        single = len(self.undo) == 1  # one patch's chunks ascend already
        return {
            n: None if p is None else p[0] if single and len(p) == 1 else torch.unique(torch.cat(p))
            for n, p in merged.items()
        }


class Sink(ABC):
    """Delivers verified states somewhere; raises EngineError (or another PulseSyncError) on failure."""

    name: str

    @abstractmethod
    async def deliver(self, update: Update) -> None:
        """Hand over one verified state."""

    def pinned(self) -> set[Path]:
        """Directories this sink's engine reads from, which a directory sink must keep."""
        return set()
