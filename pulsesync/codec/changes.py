"""What applied patches changed, as the codec states it: per tensor the flat positions, or the whole tensor.

`apply_patch` and `apply_parts` record each chunk they write in an `UndoLog` (positions and old
bits); `Changes.of` reads those logs back as the explicit list a sparse engine update needs.
Positions are merged once, on first use: only sinks that send sparse updates ask for them.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import cached_property

import torch

from pulsesync.codec.apply import UndoLog


class Changes:
    """What one or more patches, applied in order, changed since the state they were applied to."""

    def __init__(self, logs: Sequence[UndoLog]) -> None:
        self._logs = list(logs)

    @classmethod
    def of(cls, logs: Sequence[UndoLog]) -> Changes | None:
        """The changes the logs record; None when there are none to read (a state not reached by patches)."""
        return cls(logs) if logs else None

    @cached_property
    def positions(self) -> dict[str, torch.Tensor | None]:
        """Per changed tensor its flat positions (ascending, each once), None where it changed whole."""
        merged: dict[str, list[torch.Tensor] | None] = {}
        for log in self._logs:
            for name, positions in log.changed().items():
                parts = merged.get(name, [])
                merged[name] = None if positions is None or parts is None else [*parts, positions]
        single = len(self._logs) == 1  # one patch's positions ascend already
        return {
            n: None if p is None else p[0] if single and len(p) == 1 else torch.unique(torch.cat(p))
            for n, p in merged.items()
        }
