"""The one record of "a verified state at a step", shared by every component that holds weights.

Verified means its digest was checked against a signed manifest (subscriber, cache, rebuild) or
computed by the publisher from the copy it committed. The publisher's baseline, the subscriber's
staged and served state and a rebuild from the store hold this record; a state read back from
the cache becomes one only through verification (`state_cache.CachedState.verified_by`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from pulsesync.codec.history import StepHistory
from pulsesync.digest import StateDigest


@dataclass
class VerifiedState:
    """Tensors at a step, their checked digest, the non-weight files (config.json, tokenizer) that go with them,
    and the history of the patch that produced them (the reference of the next, history-coded patch; None after
    an anchor, or where it is not kept)."""

    step: int
    state: dict[str, torch.Tensor]
    digest: StateDigest
    files: dict[str, bytes] = field(default_factory=dict)
    history: StepHistory | None = None


class HoldsVerified:
    """What holds a `verified` record answers for its fields (the staged state, a rebuild, a sink's update)."""

    verified: VerifiedState

    @property
    def step(self) -> int:
        """The step verified."""
        return self.verified.step

    @property
    def state(self) -> dict[str, torch.Tensor]:
        """Its tensors."""
        return self.verified.state

    @property
    def digest(self) -> StateDigest:
        """Its checked digest."""
        return self.verified.digest

    @property
    def files(self) -> dict[str, bytes]:
        """Its non-weight files (config.json, tokenizer)."""
        return self.verified.files

    @property
    def history(self) -> StepHistory | None:
        """The history of the patch that produced it."""
        return self.verified.history
