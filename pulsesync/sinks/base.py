"""What a sink receives: one complete, verified state. Sinks run in order after each update."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

from pulsesync.codec.changes import Changes
from pulsesync.digest import StateDigest
from pulsesync.verified import HoldsVerified, VerifiedState


@dataclass
class Update(HoldsVerified):
    """A verified state handed to sinks; `directory` is set once a directory sink has written it."""

    verified: VerifiedState
    previous_digest: StateDigest | None = None  # of the state served until now (None at the first)
    # What the patches applied since then changed; None when unknown (the first state, the slow
    # path): then every tensor whose digest changed counts as changed whole.
    changes: Changes | None = None
    directory: Path | None = None


class Sink(ABC):
    """Delivers verified states somewhere; raises EngineError (or another PulseSyncError) on failure."""

    name: str
    writes_first: ClassVar[bool] = False  # writes what other sinks read (a directory): built and run before them

    @classmethod
    def build(cls, config: Any, pinned: Callable[[], set[Path]]) -> Sink:
        """The sink of a config (`sinks.SINKS`); `pinned` answers which directories every sink's engine reads."""
        return cls(config)  # type: ignore[call-arg]  # every sink in SINKS is made from its config

    @abstractmethod
    async def deliver(self, update: Update) -> None:
        """Hand over one verified state."""

    async def holds(self, state: VerifiedState | None) -> bool:
        """Whether the engine behind this sink still holds `state`: a cheap read on every poll (a version string,
        never an RPC), so an engine restarted under a running subscriber is found. A sink with no engine of its own
        holds what it wrote. EngineError (or another PulseSyncError) when the engine cannot be asked: with `state`
        None (nothing served yet) the read only asks whether the engine answers."""
        return True

    def pinned(self) -> set[Path]:
        """Directories this sink's engine reads from, which a directory sink must keep."""
        return set()
