"""The ways a sync reaches its target, each staging a verified state for the sinks.

Fast (one patch) and chain (several) patch the held state in place, each patch under an undo log,
and roll it back bit for bit on any failure; slow builds its state in a buffer of its own from the
nearest anchor on the target's chain. A staged state reaches the sinks only when complete.
"""

from __future__ import annotations

import json
import logging
from dataclasses import asdict, dataclass, field
from enum import Enum

from pulsesync.codec import UndoLog
from pulsesync.errors import NotFoundError
from pulsesync.protocol.chain import ChainClient
from pulsesync.protocol.manifest import PatchManifest
from pulsesync.rebuild import apply_chain, reconstruct
from pulsesync.subscriber.held import HeldState
from pulsesync.verified import HoldsVerified, VerifiedState

log = logging.getLogger("pulsesync.subscriber")


class SyncPath(str, Enum):
    """How a sync reached the state it serves (JSON, metrics and logs carry the value)."""

    UP_TO_DATE = "up-to-date"  # nothing newer than the held step
    FAST = "fast"  # one patch from the held step, in place
    CHAIN = "chain"  # several patches from the held step, in place
    SLOW = "slow"  # an anchor and the patches after it
    CACHE = "cache"  # the state cache, at start

    def __str__(self) -> str:
        return str(self.value)


@dataclass
class SyncResult:
    """Outcome of one sync, as `pulsesync subscribe --once` prints it; what poll and fleet reports observe."""

    step: int
    path: SyncPath
    digest: str
    seconds: float
    bytes_downloaded: int

    def to_json(self) -> str:
        """One JSON line."""
        return json.dumps(asdict(self) | {"seconds": round(self.seconds, 3)})


@dataclass
class Staged(HoldsVerified):
    """A verified state on its way to the sinks, and the path that produced it."""

    verified: VerifiedState
    path: SyncPath = SyncPath.SLOW
    undo: list[UndoLog] = field(default_factory=list)  # set when the state is the held one, patched in place
    patches: list[tuple[PatchManifest, bytes]] = field(default_factory=list)  # applied in place, for the journal

    def rollback(self) -> None:
        """Undo in-place patches, newest first."""
        for log_ in reversed(self.undo):
            log_.rollback(self.verified.state)
        self.undo.clear()


async def incremental(chain: ChainClient, held: HeldState, target: int) -> Staged | None:
    """Fast or chain path: patches from the held step to target, or None when they do not connect.

    Patches the held state in place (inside the caller's `held.patching()` scope), each patch
    under an undo log; on failure it is rolled back before the error leaves.
    """
    served = held.served
    assert served is not None and held.patched
    walk, links = await chain.walk(target, lambda s: s <= served.step, newer_than=served.step)
    if not walk.complete or walk.end != served.step:
        return None  # a gap (pruned, or an anchor in place of a failed patch), or another chain
    path = SyncPath.FAST if len(links) == 1 else SyncPath.CHAIN
    undo: list[UndoLog] = []
    applied: list[tuple[PatchManifest, bytes]] = []
    try:
        digest, history = await apply_chain(
            chain.fetcher, served.state, served.digest, links, undo=undo, reference=served.history, applied=applied
        )
    except BaseException:
        for log_ in reversed(undo):
            log_.rollback(served.state)
        raise
    return Staged(VerifiedState(target, served.state, digest, served.files, history), path, undo, applied)


async def slow(chain: ChainClient, target: int, around_withheld: bool = False) -> Staged:
    """Slow path: the nearest anchor on the target's chain, then its patches.

    With `around_withheld` (a follower, no step asked for), a chain that misses an object (a
    payload deleted, or pruned under the listing) is left for the newest ready step, when a newer
    one is listed now: its own anchor, or a chain that does not pass the withheld object.
    """
    try:
        rebuilt = await reconstruct(chain, target)
    except NotFoundError as withheld:
        newest = await chain.newest_verified() if around_withheld else None
        if newest is None or newest <= target:
            raise
        log.warning("step %d: %s; rebuilding the newest step, %d, instead", target, withheld, newest)
        rebuilt = await reconstruct(chain, newest)
    return Staged(rebuilt.verified, SyncPath.SLOW)
